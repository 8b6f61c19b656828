"""bench/writer_stalls.py: a checkpoint writer's stalls of a loop of round trips to another
process. On the CPU with a small state: every mode measures round trips, the writer modes last
as long as their write, and a run's stalls are the round trips over 5 ms, summed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import writer_stalls  # noqa: E402

pytestmark = pytest.mark.worker


def test_each_mode_measures_round_trips_while_it_lasts(tmp_path: Path) -> None:
    out = tmp_path / "stalls.json"
    code = writer_stalls.main(["--gigabytes", "0.5", "--repeats", "1", "--baseline-seconds",
                               "0.5", "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["runs"]] == ["none", "thread", "process"]
    for row in result["runs"]:
        assert row["round_trips"] > 10 and row["median_ms"] > 0
        assert 0 <= row["stall_seconds"] <= row["seconds"]
        assert row["max_ms"] >= row["median_ms"]
    none = result["runs"][0]
    assert 0.5 <= none["seconds"] < 2


def test_a_stall_is_a_round_trip_over_five_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    trips = [0.001, 0.006, 0.002, 0.050]
    monkeypatch.setattr(writer_stalls, "_round_trips", lambda alive: list(trips))
    row = writer_stalls.run("none", 0.1, 0.0)
    assert row["stall_seconds"] == pytest.approx(0.056)
    assert row["max_ms"] == pytest.approx(50.0) and row["round_trips"] == 4
