"""What ranks report, built small for unit tests of the drivers' aggregation and of status."""

from __future__ import annotations

from rljob.report import Stage, StageSample
from rljob_worker.loop import RankIteration


def sample(rank: int, iteration: int, stage: Stage, peak: int) -> StageSample:
    """One stage of one rank: 1 s long, `peak` bytes of a 1000-byte device."""
    return StageSample(
        iteration=iteration, rank=rank, stage=stage, kind="cuda", device="gpu",
        start_seconds=float(iteration * 10 + list(Stage).index(stage)), seconds=1.0,
        peak_allocated_bytes=peak, peak_reserved_bytes=peak, allocated_bytes=0, reserved_bytes=0,
        device_used_bytes=peak, device_peak_used_bytes=peak, device_total_bytes=1000,
    )  # fmt: skip


def done(rank: int, iteration: int, reward_sum: float, kl: float | None = None) -> RankIteration:
    """A rank's finished iteration: 4 responses scoring `reward_sum` in all."""
    return RankIteration(rank, iteration, (), reward_sum, 4, kl, None, 64)
