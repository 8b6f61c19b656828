"""Unit tests of the shared memory report: worst rank per stage, capacity, stage order."""

from __future__ import annotations

import pytest

from rljob.report import (
    STAGE_ORDER,
    IterationReport,
    LoadSample,
    Stage,
    StageSample,
    summarize,
    summarize_load,
)

GIB = 1 << 30


def sample(stage: Stage, rank: int, peak_gib: float, total_gib: float = 80) -> StageSample:
    return StageSample(
        iteration=3,
        rank=rank,
        stage=stage,
        kind="cuda",
        device="NVIDIA H100 80GB HBM3",
        start_seconds=0.0,
        seconds=1.5 + rank,
        peak_allocated_bytes=0,
        peak_reserved_bytes=0,
        allocated_bytes=0,
        reserved_bytes=0,
        device_used_bytes=0,
        device_peak_used_bytes=int(peak_gib * GIB),
        device_total_bytes=int(total_gib * GIB),
    )


def test_stage_names_are_the_designs_canonical_order() -> None:
    assert [s.value for s in STAGE_ORDER] == [
        "train",
        "checkpoint",
        "offload_optimizer",
        "wake_weights",
        "offload_train",
        "wake_kv_cache",
        "rollout",
        "sleep",
    ]


def test_summary_keeps_the_worst_rank_of_each_stage_in_stage_order() -> None:
    report = IterationReport(
        iteration=3,
        samples=[
            sample(Stage.ROLLOUT, 0, 70),
            sample(Stage.ROLLOUT, 1, 72),
            sample(Stage.TRAIN, 0, 40),
            sample(Stage.TRAIN, 1, 30),
        ],
    )
    summary = summarize(report)
    assert summary is not None
    assert [s.name for s in summary.stages] == [Stage.TRAIN, Stage.ROLLOUT]
    train, rollout = summary.stages
    assert (train.rank, train.peak_bytes) == (0, 40 * GIB)
    assert (rollout.rank, rollout.peak_bytes) == (1, 72 * GIB)
    assert rollout.peak_fraction == pytest.approx(0.9)
    assert summary.worst_fraction == pytest.approx(0.9)
    assert summary.capacity_bytes == 80 * GIB


@pytest.mark.parametrize("totals", [(80, 80), (80, 79)])
def test_capacity_is_the_smallest_device_seen(totals: tuple[int, int]) -> None:
    report = IterationReport(
        iteration=0,
        samples=[sample(Stage.TRAIN, 0, 10, totals[0]), sample(Stage.SLEEP, 1, 10, totals[1])],
    )
    summary = summarize(report)
    assert summary is not None
    assert summary.capacity_bytes == min(totals) * GIB


def test_empty_iteration_has_no_summary() -> None:
    assert summarize(IterationReport(iteration=0)) is None


def test_wire_names_are_camel_case() -> None:
    summary = summarize(IterationReport(iteration=1, samples=[sample(Stage.TRAIN, 0, 8)]))
    assert summary is not None
    wire = summary.model_dump(by_alias=True, mode="json")
    assert set(wire) == {"iteration", "kind", "device", "capacityBytes", "stages", "load"}
    assert wire["load"] is None  # the driver adds the start-up (summarize_load)
    assert set(wire["stages"][0]) == {"name", "peakBytes", "peakFraction", "seconds", "rank"}


def test_load_summary_is_the_worst_rank_by_device_peak() -> None:
    samples = [
        LoadSample(rank=r, kind="cuda", device="H100", seconds=s, peak_allocated_bytes=a,
                   device_peak_used_bytes=d, device_total_bytes=100, host_peak_bytes=h)
        for r, s, a, d, h in [(0, 2.0, 30, 40, 7), (1, 3.0, 31, 45, 5)]
    ]  # fmt: skip
    load = summarize_load(samples)
    assert load is not None
    assert (load.rank, load.peak_bytes, load.peak_fraction) == (1, 45, 0.45)
    assert (load.peak_allocated_bytes, load.host_peak_bytes, load.seconds) == (31, 7, 3.0)
    assert summarize_load([]) is None
