"""Drivers' aggregation: rank events in, IterationReports and the driver-owned status out."""

from __future__ import annotations

from dataclasses import replace

from rljob.report import OOMRecord, Stage, StageSample
from rljob_worker.driver import driver_status, iteration_reports
from rljob_worker.loop import RankIteration
from rljob_worker.rewards import FORMAT_CREDIT, exact_match_reward
from rljob_worker.task import ArithmeticTask


def _sample(rank: int, iteration: int, stage: Stage, peak: int) -> StageSample:
    return StageSample(
        iteration=iteration, rank=rank, stage=stage, kind="cuda", device="gpu",
        start_seconds=float(iteration * 10 + list(Stage).index(stage)), seconds=1.0,
        peak_allocated_bytes=peak, peak_reserved_bytes=peak, allocated_bytes=0, reserved_bytes=0,
        device_used_bytes=peak, device_peak_used_bytes=peak, device_total_bytes=1000,
    )  # fmt: skip


def _done(rank: int, iteration: int, reward_sum: float, kl: float | None) -> RankIteration:
    return RankIteration(rank, iteration, (), reward_sum, 4, kl, None, 64)


def test_reward_is_the_mean_over_all_ranks_responses() -> None:
    (report,) = iteration_reports([], [_done(0, 1, 4.0, 0.1), _done(1, 1, 0.0, 0.3)])
    assert report.reward_mean == 0.5
    assert report.kl_mean == 0.2


def test_reward_errors_scored_zero_are_summed_over_the_ranks() -> None:
    ranks = [
        replace(_done(r, 1, 1.0, None), reward_errors=errors) for r, errors in ((0, 2), (1, 1))
    ]
    (report,) = iteration_reports([], ranks)
    assert report.reward_errors == 3


def test_status_iteration_is_the_last_one_every_rank_finished() -> None:
    samples = [_sample(r, i, Stage.TRAIN, 100 * (r + 1)) for r in (0, 1) for i in (1, 2)]
    iterations = [_done(0, 1, 1, None), _done(1, 1, 1, None), _done(0, 2, 1, None)]
    oom = OOMRecord(time="2026-01-01T00:00:00Z", kind="CUDAOutOfMemory", stage=Stage.TRAIN, rank=1)
    status = driver_status(iteration_reports(samples, iterations), iterations, [oom], world_size=2)
    assert status.iteration == 1
    assert status.memory is not None and status.memory.iteration == 2
    assert [(s.name, s.peak_bytes, s.rank) for s in status.memory.stages] == [(Stage.TRAIN, 200, 1)]
    assert [(e.stage, e.rank) for e in status.oom_events] == [(Stage.TRAIN, 1)]
    assert status.oom_counts == {"CUDAOutOfMemory": 1}


def test_exact_answer_scores_one_and_digits_only_get_format_credit() -> None:
    assert exact_match_reward(" 46\nmore", "46") == 1.0
    assert exact_match_reward("45", "46") == FORMAT_CREDIT
    assert exact_match_reward("ab", "46") == 0.0
    assert exact_match_reward("", "46") == 0.0


def test_arithmetic_problems_are_reproducible_and_correct() -> None:
    task = ArithmeticTask(seed=3)
    problems = task.sample(20, salt=5)
    assert problems == ArithmeticTask(seed=3).sample(20, salt=5)
    assert problems != task.sample(20, salt=6)
    for problem in problems:
        expression = problem.prompt.removesuffix("=")
        a, b = (int(x) for x in expression.replace("-", "+").split("+"))
        assert problem.answer == str(a + b if "+" in expression else a - b)
        assert int(problem.answer) >= 0
