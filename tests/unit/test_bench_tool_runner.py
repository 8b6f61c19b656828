"""bench/tool_runner.py: both runners answer every call of a round with its own answer (the
bench refuses a round with a wrong one), so its calls/s count answers, not errors."""

from __future__ import annotations

import asyncio

import pytest
from support.scripts import bench_module

from rljob_worker.agentic.tools import calculate


@pytest.mark.parametrize("runner", ["spawn", "pool"])
def test_a_round_checks_every_answer_and_counts_calls_per_second(runner: str) -> None:
    bench = bench_module("tool_runner.py", "bench_tool_runner")
    row = bench.measure(runner, calls=6, repeats=2, timeout_seconds=60.0)
    assert row["runner"] == runner and row["calls"] == 6
    assert 0 < row["median_calls_per_second"] <= row["best_calls_per_second"]
    assert row["busy_awaits_per_second"] > 0


def test_a_wrong_answer_fails_the_round() -> None:
    bench = bench_module("tool_runner.py", "bench_tool_runner")

    async def off_by_one(arguments: dict[str, str], timeout_seconds: float) -> str:
        return str(calculate(arguments["expression"]) + 1)

    with pytest.raises(RuntimeError, match="6 of 6 answers wrong"):
        asyncio.run(bench._round(off_by_one, 6, 10.0))
