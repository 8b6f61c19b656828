"""`rljob run` on the user's side of issue 29: a Parquet file in verl's layout and a reward file,
2 ranks x 2 iterations on the CPU; and a reward that raises ends the run naming the row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rljob_worker.cli_run import main

REPO = Path(__file__).resolve().parents[2]
RANKS = 2

# Records every call (pid and arguments) in a file next to itself: which process scored what.
REWARD = """
import json, os, pathlib

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    log = pathlib.Path(__file__).with_name("calls.jsonl")
    with log.open("a") as out:
        out.write(json.dumps({"pid": os.getpid(), "source": data_source, "truth": ground_truth,
                              "index": extra_info["index"]}) + "\\n")
    if os.environ.get("RLJOB_TEST_REWARD_RAISES") and extra_info["index"] >= 0:
        raise KeyError("no grader for this")
    return {"score": 0.25, "length": len(solution_str)}
"""


def _manifest(tmp_path: Path, **reward: Any) -> Path:
    rows = [
        {
            "data_source": "test/sums",
            "prompt": [{"role": "user", "content": f"{i}+{i}="}],
            "reward_model": {"ground_truth": str(2 * i)},
            "extra_info": {"index": i},
        }
        for i in range(6)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sums.parquet")
    (tmp_path / "reward.py").write_text(REWARD)
    doc = yaml.safe_load((REPO / "examples" / "custom-reward.yaml").read_text())
    doc["spec"]["data"].update(source=str(tmp_path / "sums.parquet"), maxResponseLength=4)
    doc["spec"]["reward"] = {"function": f"{tmp_path / 'reward.py'}:compute_score", **reward}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_parquet_rows_and_a_reward_file_run_two_iterations_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main([str(_manifest(tmp_path)), "--out", str(out), "--ranks", str(RANKS)]) == 0
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["iteration"] == 2
    assert status["rewardMean"] == 0.25  # the file's function scored every response
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # 3 rollouts (iteration 0 and 2 trained ones) x 2 ranks x 2 prompts x groupSize 4.
    assert len(calls) == 3 * RANKS * 2 * 4
    # One reward process per rank (the preflight's own only loads the file).
    assert len({c["pid"] for c in calls}) == RANKS
    assert {c["source"] for c in calls} == {"test/sums"}
    assert all(c["truth"] == str(2 * c["index"]) for c in calls)  # reward_model.ground_truth


def test_a_reward_that_raises_fails_the_run_naming_the_row_and_the_response(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLJOB_TEST_REWARD_RAISES", "1")  # the rank processes inherit it
    out = tmp_path / "out"
    assert main([str(_manifest(tmp_path)), "--out", str(out), "--ranks", str(RANKS)]) == 1
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Failed"
    cause = status["cause"]
    assert "RewardError: spec.reward.function " in cause, cause
    assert f"failed on {tmp_path / 'sums.parquet'} row " in cause, cause
    assert ", response '" in cause and "KeyError: 'no grader for this'" in cause, cause
