"""A user's reward function in its own process: loaded from a file or a module, ended on a
timeout, and every failure either ends the job naming the row and the response or, with
onError Zero, scores 0 and is counted."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rljob.api import RewardOnError, RewardSpec
from rljob_worker.reward import RewardError, RewardLoadError, Scorer
from rljob_worker.task import Problem

REWARD_FILE = """
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError("cannot grade this\\nsecond line")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "text":
        return "1.0"
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "pid":
        return float(os.getpid())
    print("graded", solution_str)  # a print goes to the rank's output, not the protocol
    return {"score": float(solution_str == ground_truth), "source_ok": data_source == "src",
            "index": extra_info["index"]}
"""


def _problem(index: int = 0, answer: str = "42") -> Problem:
    return Problem("q", answer, f"train.parquet row {index}", "src", {"index": index})


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.fixture
def scorer(reward_file: Path) -> Iterator[Scorer]:
    scorer = Scorer(RewardSpec(function=f"{reward_file}:compute_score", timeout_seconds=1))
    yield scorer
    scorer.close()


def test_a_function_from_a_file_gets_verls_arguments(scorer: Scorer) -> None:
    batch = scorer([_problem(0), _problem(1)], ["42", "41"])
    assert (batch.scores, batch.errors) == ([1.0, 0.0], 0)


def test_a_function_from_a_module_on_the_ranks_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "team_rewards"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "gsm8k.py").write_text("def score(d, s, g, e):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # as the image's site-packages would
    scorer = Scorer(RewardSpec(function="team_rewards.gsm8k:score"))
    try:
        assert scorer([_problem()], ["x"]).scores == [0.5]
    finally:
        scorer.close()


@pytest.mark.parametrize(
    ("function", "match"),
    [
        ("/nowhere/reward.py:f", "no such file in the pod"),
        ("no_such_package.rewards:f", "no module 'no_such_package' in the image"),
        ("{file}:missing", r"has no function 'missing' \(it defines: compute_score\)"),
        ("json:loads_nothing", "has no function 'loads_nothing'"),
    ],
)
def test_a_function_that_does_not_load_fails_at_start(
    reward_file: Path, function: str, match: str
) -> None:
    with pytest.raises(RewardLoadError, match=match):
        Scorer(RewardSpec(function=function.format(file=reward_file)))


@pytest.mark.parametrize(
    ("response", "error"),
    [
        ("raise", "ValueError: cannot grade this second line"),
        ("text", r"returned '1.0' \(str\); a reward function returns a finite number"),
        ("hang", r"timed out after 1 s \(spec.reward.timeoutSeconds\)"),
        ("exit", "the reward process exited with code 3"),
    ],
)
def test_a_failing_call_ends_the_job_naming_row_response_and_error(
    scorer: Scorer, response: str, error: str
) -> None:
    with pytest.raises(RewardError) as info:
        scorer([_problem(0), _problem(7)], ["42", response])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"spec.reward.function {scorer.spec.function} failed on train.parquet row 7, "
        f"response '{response}': "
    )
    assert re.search(error, message), message
    assert message.endswith("(spec.reward.onError: Zero would score it 0 and count it)")


def test_a_timeout_ends_the_call_within_its_deadline_and_the_next_call_gets_a_new_process(
    reward_file: Path,
) -> None:
    spec = RewardSpec(
        function=f"{reward_file}:compute_score", timeout_seconds=1, on_error=RewardOnError.ZERO
    )
    scorer = Scorer(spec)
    try:
        began = time.monotonic()
        batch = scorer([_problem()] * 4, ["pid", "hang", "42", "pid"])
        assert time.monotonic() - began < 10  # 1 s deadline + a restart, not the 60 s sleep
    finally:
        scorer.close()
    before, hung, after_timeout, after = batch.scores
    assert (hung, after_timeout, batch.errors) == (0.0, 1.0, 1)
    assert after != before  # the hung process was ended and replaced


def test_on_error_zero_scores_every_failure_0_and_counts_them(reward_file: Path) -> None:
    scorer = Scorer(
        RewardSpec(
            function=f"{reward_file}:compute_score", timeout_seconds=1, on_error=RewardOnError.ZERO
        )
    )
    try:
        batch = scorer([_problem()] * 5, ["42", "raise", "text", "exit", "42"])
    finally:
        scorer.close()
    assert batch.scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert batch.errors == 3


def test_a_builtin_with_an_unreadable_truth_fails_like_a_user_function() -> None:
    scorer = Scorer(RewardSpec(function="numeric"))
    with pytest.raises(RewardError, match=r"row 3, response '#### 7': ValueError: ground truth"):
        scorer([_problem(3, answer="seven")], ["#### 7"])


PEERS_FILE = """
import os
import time
from pathlib import Path

def peers(data_source, solution_str, ground_truth, extra_info=None):
    # Counts the calls running beside this one: each leaves its mark, then waits (up to 5 s)
    # for `ground_truth` marks in all. Calls run one after another each see only themselves
    # and those before them.
    if solution_str == "hang":
        time.sleep(60)
    marks = Path(extra_info["dir"])
    (marks / f"{os.getpid()}-{solution_str}").touch()
    deadline = time.monotonic() + 5
    while len(list(marks.iterdir())) < int(ground_truth) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"score": float(len(list(marks.iterdir()))), "pid": float(os.getpid())}
"""


def test_parallel_calls_score_that_many_responses_at_once_each_in_its_own_process(
    tmp_path: Path,
) -> None:
    path = tmp_path / "peers.py"
    path.write_text(PEERS_FILE)
    (tmp_path / "marks").mkdir()
    scorer = Scorer(RewardSpec(function=f"{path}:peers", parallel_calls=4))
    try:
        assert len(scorer.callers) == 4
        problems = [Problem("q", "4", f"row {i}", "src", {"dir": str(tmp_path / "marks")})
                    for i in range(4)]  # fmt: skip
        batch = scorer(problems, ["a", "b", "c", "d"])
    finally:
        scorer.close()
    # One after another the first call would see 1 mark after its 5 s, the second 2, ...
    assert (batch.scores, batch.errors) == ([4.0] * 4, 0)
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "marks").iterdir()) == list("abcd")
    assert len({p.name.split("-")[0] for p in (tmp_path / "marks").iterdir()}) == 4


def test_a_hanging_call_holds_one_process_and_the_others_go_on_in_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "peers.py"
    path.write_text(PEERS_FILE)
    spec = RewardSpec(
        function=f"{path}:peers", parallel_calls=2, timeout_seconds=2, on_error=RewardOnError.ZERO
    )
    scorer = Scorer(spec)
    try:
        rows = []
        for i in range(5):
            (tmp_path / f"marks{i}").mkdir()
            rows.append(Problem("q", "1", f"row {i}", "src", {"dir": str(tmp_path / f"marks{i}")}))
        batch = scorer(rows, ["a", "hang", "b", "c", "d"])
        # The hung process was ended and replaced: the next batch is scored as before.
        again = scorer(rows[:1], ["e"])
    finally:
        scorer.close()
    assert (batch.scores, batch.errors) == ([1.0, 0.0, 1.0, 1.0, 1.0], 1)
    assert (again.scores, again.errors) == ([2.0], 0)  # marks0 holds a's mark and e's


def test_a_function_that_does_not_load_in_one_of_its_processes_fails_at_start(
    tmp_path: Path,
) -> None:
    with pytest.raises(RewardLoadError, match="no such file in the pod"):
        Scorer(RewardSpec(function=f"{tmp_path}/nowhere.py:f", parallel_calls=3))


MARKING_FILE = """
import time
from pathlib import Path

def marking(data_source, solution_str, ground_truth, extra_info=None):
    (Path(extra_info["dir"]) / solution_str).touch()  # this call was made
    if solution_str == "raise":
        raise ValueError("cannot grade this")
    time.sleep(1)
    return 1.0
"""


@pytest.mark.parametrize(
    ("parallel_calls", "responses", "row", "made_at_most"),
    [
        (1, ["a", "raise", "b", "c", "d", "e"], 1, {"a", "raise"}),
        # The failure ends first; the other process is inside a 1 s call, and at most one more
        # call begins before the rest are cancelled.
        (2, ["raise", "a", "b", "c", "d", "e", "f", "g"], 0, {"raise", "a", "b"}),
    ],
)
def test_with_on_error_fail_the_first_failure_ends_the_batch_before_the_calls_left(
    tmp_path: Path, parallel_calls: int, responses: list[str], row: int, made_at_most: set[str]
) -> None:
    path = tmp_path / "marking.py"
    path.write_text(MARKING_FILE)
    (tmp_path / "marks").mkdir()
    scorer = Scorer(RewardSpec(function=f"{path}:marking", parallel_calls=parallel_calls))
    problems = [
        Problem("q", "1", f"row {i}", "src", {"dir": str(tmp_path / "marks")})
        for i in range(len(responses))
    ]
    try:
        with pytest.raises(RewardError, match=rf"failed on row {row}, response 'raise': "):
            scorer(problems, responses)
    finally:
        scorer.close()
    made = {p.name for p in (tmp_path / "marks").iterdir()}
    assert "raise" in made and made <= made_at_most, made  # every call was made before
