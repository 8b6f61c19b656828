"""<checkpoint.path>/metrics.jsonl: the driver writes each iteration every rank finished, a
resumed run continues the history of its checkpoint, and `rljob curve FILE` draws it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from support.samples import done

from rljob.cli import main as rljob_main
from rljob.metrics_file import METRICS_FILE, MetricsFileError, read_metrics
from rljob.report import IterationReport
from rljob_worker.driver.local import LocalRun
from rljob_worker.driver.metrics_log import MetricsLog


def lines(directory: Path) -> list[dict[str, Any]]:
    text = (directory / METRICS_FILE).read_text()
    return [json.loads(line) for line in text.splitlines()]


def write_lines(directory: Path, entries: list[dict[str, Any]]) -> None:
    (directory / METRICS_FILE).write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_the_driver_writes_an_iteration_once_every_rank_finished_it(tmp_path: Path) -> None:
    run = LocalRun(world_size=2, device="cpu", metrics_log=MetricsLog(tmp_path))
    run.add(done(0, 0, 3.0))
    assert not (tmp_path / METRICS_FILE).exists()  # rank 1 is still at it
    run.add(done(1, 0, 1.0))
    # 4 responses a rank: (3 + 1) / 8.
    assert lines(tmp_path) == [{"iteration": 0, "rewardMean": 0.5, "rewardErrors": 0}]
    run.add(done(1, 1, 4.0))
    run.add(done(0, 1, 4.0))
    assert [(e["iteration"], e["rewardMean"]) for e in lines(tmp_path)] == [(0, 0.5), (1, 1.0)]


def earlier_run() -> list[dict[str, Any]]:
    """What an earlier attempt wrote: iterations 0-4, the train figures from iteration 1 on."""
    return [
        {"iteration": i, "rewardMean": i / 10, **({"policyLoss": -i / 100} if i else {})}
        for i in range(5)
    ]


def test_a_resumed_run_keeps_the_lines_before_its_checkpoint_and_redoes_the_rest(
    tmp_path: Path,
) -> None:
    """Resumed from iteration 2's checkpoint: 0 and 1 stay as they were; 2's train stage is in
    the checkpoint, so its line keeps the earlier policy loss beside the new rollout's reward;
    3 is this run's; 4 (finished after the checkpoint, then lost) is gone until redone."""
    write_lines(tmp_path, earlier_run())
    log = MetricsLog(tmp_path)
    log.record(IterationReport(iteration=2, reward_mean=0.9), resumed_from=2)
    assert lines(tmp_path) == [
        {"iteration": 0, "rewardMean": 0.0},
        {"iteration": 1, "rewardMean": 0.1, "policyLoss": -0.01},
        {"iteration": 2, "rewardMean": 0.9, "policyLoss": -0.02, "rewardErrors": 0},
    ]
    log.record(IterationReport(iteration=3, reward_mean=0.8, policy_loss=-0.5), resumed_from=2)
    assert [(e["iteration"], e["rewardMean"], e.get("policyLoss")) for e in lines(tmp_path)] == [
        (0, 0.0, None), (1, 0.1, -0.01), (2, 0.9, -0.02), (3, 0.8, -0.5),
    ]  # fmt: skip


def test_a_run_that_starts_at_iteration_zero_starts_the_file_anew(tmp_path: Path) -> None:
    write_lines(tmp_path, earlier_run())
    MetricsLog(tmp_path).record(IterationReport(iteration=0, reward_mean=0.25), resumed_from=None)
    assert lines(tmp_path) == [{"iteration": 0, "rewardMean": 0.25, "rewardErrors": 0}]


def test_an_unreadable_file_is_moved_aside_and_not_continued(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / METRICS_FILE).write_text('{"iteration": 0}\n{"iteration": 1, "rewardMe\n')
    with caplog.at_level(logging.ERROR):
        MetricsLog(tmp_path).record(IterationReport(iteration=2, reward_mean=0.5), resumed_from=2)
    aside = tmp_path / f"{METRICS_FILE}.unreadable"
    assert aside.read_text().startswith('{"iteration": 0}')  # the user's lines are not lost
    assert [e["iteration"] for e in lines(tmp_path)] == [2]
    assert f"{METRICS_FILE} line 2: not JSON" in caplog.text


def test_a_failed_write_is_logged_and_the_next_one_has_every_iteration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "ckpt"
    blocked.write_text("a file where the directory should be")  # even root cannot mkdir it
    log = MetricsLog(blocked)
    with caplog.at_level(logging.ERROR):
        log.record(IterationReport(iteration=0, reward_mean=0.5), resumed_from=None)
    assert "iteration 0's metrics not written" in caplog.text
    blocked.unlink()
    log.record(IterationReport(iteration=1, reward_mean=0.75), resumed_from=None)
    assert [(e["iteration"], e["rewardMean"]) for e in lines(blocked)] == [(0, 0.5), (1, 0.75)]
    assert not list(blocked.glob(".*.tmp"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"iteration": 0}\nnot json\n', "line 2: not JSON"),
        ('{"iteration": 0}\n\n[1, 2]\n', "line 3: not an iteration's metrics"),
        ('{"iteration": "0"}\n', "line 1: not an iteration's metrics"),
        (
            '{"iteration": 0, "rewardMean": "high"}\n',
            "line 1: rewardMean: Input should be a valid number",
        ),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text(text)
    with pytest.raises(MetricsFileError, match=message) as caught:
        read_metrics(path)
    assert str(path) in str(caught.value)


def test_rljob_curve_draws_every_iteration_of_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 150 iterations: more than status.metrics keeps (MAX_METRICS); a later line of an
    # iteration replaces an earlier one.
    write_lines(tmp_path, [{"iteration": i, "rewardMean": i / 150} for i in range(150)])
    with (tmp_path / METRICS_FILE).open("a") as handle:
        handle.write('{"iteration": 3, "rewardMean": 1.0}\n')
    metrics = read_metrics(tmp_path / METRICS_FILE)
    assert [m.iteration for m in metrics] == list(range(150))
    assert metrics[3].reward_mean == 1.0
    out = tmp_path / "curve.png"
    assert rljob_main(["curve", str(tmp_path / METRICS_FILE), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "iterations 0-149" in capsys.readouterr().out


def test_rljob_curve_names_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nothing.jsonl"
    assert rljob_main(["curve", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text('{"iteration": 0}\n')  # no reward: nothing to draw
    assert rljob_main(["curve", str(tmp_path / METRICS_FILE)]) == 2
    assert "no iteration has reported a reward" in capsys.readouterr().err
