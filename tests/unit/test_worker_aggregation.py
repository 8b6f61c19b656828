"""Drivers' aggregation: rank events in, IterationReports and the driver-owned status out."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.samples import done as _done
from support.samples import sample as _sample

from rljob.report import OOMRecord, Stage
from rljob_worker.driver import driver_status, iteration_reports
from rljob_worker.loop import RankIteration, RolloutStats
from rljob_worker.rewards import FORMAT_CREDIT, exact_match, exact_match_reward, first_char_reward
from rljob_worker.task import ArithmeticTask, DigitTask
from rljob_worker.train import TrainStats


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


def test_rollout_and_update_figures_combine_over_ranks() -> None:
    # Rank 0: rewards {1, 0}, lengths 2 and 4 (the 4 cut at maxResponseLength); rank 1: rewards
    # {1, 1, 0.1}, lengths 1, 1, 2. All 5: mean 3.1 / 5 = 0.62, squared deviations
    # 0.1444 * 3 + 0.3844 + 0.2704 = 1.088 -> std sqrt(1.088 / 5) = 0.466476; 3 correct of 5;
    # lengths 10 / 5 = 2, max 4, 1 truncated of 5.
    rollouts = [
        RolloutStats(2, 0.5, 0.5, 0.0, 1.0, 1, 6, 4, 1),
        RolloutStats(3, 0.7, 0.54, 0.1, 1.0, 2, 4, 2, 0),
    ]
    # Token sums: rank 0 has 6 tokens x 2 steps, rank 1 has 4 x 2: 20 token-steps. Loss
    # (-3 + 1) / 20 = -0.1, KL (0.2 + 0.3) / 20 = 0.025, entropy (10 + 6) / 20 = 0.8, clip
    # (2 + 3) / 20 = 0.25; mismatch over the 6 + 4 tokens of one pass: (0.06 + 0.04) / 10 = 0.01.
    trains = [
        TrainStats(6, 12, -3.0, 0.2, 10.0, 2, 0.06, 1.5, 1e-3, 2, skipped_steps=1),
        TrainStats(4, 8, 1.0, 0.3, 6.0, 3, 0.04, 1.5, 1e-3, 2, skipped_steps=1),
    ]
    items = [
        RankIteration(
            rank, 1, (), 0.0, 0, None, None, 64, rollout=rollouts[rank], train=trains[rank]
        )
        for rank in (0, 1)
    ]
    (report,) = iteration_reports([], items)
    assert report.reward_std == pytest.approx(0.466476, abs=1e-6)
    assert (report.reward_min, report.reward_max, report.correct_share) == (0.0, 1.0, 0.6)
    assert (report.response_length_mean, report.response_length_max) == (2.0, 4)
    assert report.truncated_share == 0.2
    assert report.policy_loss == pytest.approx(-0.1)
    assert report.kl_mean == pytest.approx(0.025)
    assert report.entropy_mean == pytest.approx(0.8)
    assert report.clip_fraction == pytest.approx(0.25)
    assert report.logprob_mismatch_mean == pytest.approx(0.01)
    assert (report.grad_norm, report.learning_rate, report.optimizer_steps) == (1.5, 1e-3, 2)
    assert report.skipped_steps == 1  # global: every rank skipped the same step


@pytest.mark.parametrize(
    ("response", "reward"),
    [("7", 1.0), (" 72", 1.0), ("3", FORMAT_CREDIT), ("x7", 0.0), ("", 0.0)],
)
def test_digit_reward_scores_the_first_character(response: str, reward: float) -> None:
    assert first_char_reward(response, "7") == reward


def test_digit_task_names_the_digit_it_asks_for() -> None:
    problems = DigitTask(seed=3).sample(20, salt=1)
    assert all(p.prompt == f"say {p.answer}:" and p.answer.isdigit() for p in problems)
    assert problems == DigitTask(seed=3).sample(20, salt=1)
    # The builtin exactMatch scores builtin:digit by its first character, other sources by line.
    assert exact_match("builtin:digit", "7 and more", "7", None) == 1.0
    assert exact_match("builtin:arithmetic", "7 and more", "7", None) == exact_match_reward(
        "7 and more", "7"
    )
