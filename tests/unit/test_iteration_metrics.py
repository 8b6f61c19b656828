"""Unit tests of status.metrics: one entry per finished iteration, rounded and bounded, written by
the driver (driver_fields), and the table and learning curve drawn from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console
from support.samples import done, sample

from rljob.api import RLJobStatus
from rljob.curves import metrics_table, plot_learning_curve
from rljob.kubectl_plugin import curve, describe
from rljob.report import (
    MAX_METRICS,
    IterationMetrics,
    IterationReport,
    MultiTurnFigures,
    Stage,
    ValidationFigures,
    metrics_with,
)
from rljob_worker.driver import driver_status, iteration_reports
from rljob_worker.publish import driver_fields

# The most digits a float can carry: what a bounded entry must survive.
LONG = 0.1234567890123456789


def report(iteration: int, reward: float = 0.5) -> IterationReport:
    return IterationReport(
        iteration=iteration, reward_mean=reward, reward_std=LONG, reward_min=0.0, reward_max=1.0,
        correct_share=LONG, response_length_mean=LONG * 100, response_length_max=4096,
        truncated_share=LONG, policy_loss=-LONG, kl_mean=LONG / 1e6, entropy_mean=LONG * 10,
        clip_fraction=LONG, grad_norm=LONG * 1e3, learning_rate=1e-6, optimizer_steps=8,
        logprob_mismatch_mean=LONG / 1e3, reward_errors=12345,
        samples=[sample(0, iteration, Stage.TRAIN, 100), sample(1, iteration, Stage.ROLLOUT, 50)],
    )  # fmt: skip


def test_an_entry_keeps_the_learning_figures_rounded_and_the_stages_seconds() -> None:
    entry = IterationMetrics.of(report(3))
    assert entry.iteration == 3 and entry.reward_mean == 0.5
    assert entry.policy_loss == -0.12346 and entry.kl_mean == 1.2346e-07
    assert entry.response_length_max == 4096 and entry.reward_errors == 12345
    # train (rank 0) and rollout (rank 1), 1 s each: the iteration's worst-rank stages summed.
    assert entry.seconds == 2.0


def test_metrics_keep_one_entry_per_iteration_and_the_newest_hundred() -> None:
    metrics: list[IterationMetrics] = []
    for iteration in range(MAX_METRICS + 20):
        metrics = metrics_with(metrics, [report(iteration)])
    metrics = metrics_with(metrics, [report(MAX_METRICS + 19, reward=0.75)])
    assert [m.iteration for m in metrics] == list(range(20, MAX_METRICS + 20))
    assert metrics[-1].reward_mean == 0.75


def test_a_full_metrics_list_stays_far_below_etcds_limit() -> None:
    """MAX_METRICS entries with every field at its widest, a multiTurn job's and a validation's
    figures included: under 96 KB of JSON, each entry under 900 bytes (81.4 KB and 812 measured; etcd's object limit is 1.5 MiB).
    Without the nested blocks the list is 48.5 KB; unrounded, each entry is ~100 bytes longer."""
    widest = [
        report(10**9 + i).model_copy(
            update={
                # Nested figures come rounded from the driver (validation_figures).
                "multi_turn": MultiTurnFigures(
                    turns_mean=0.12346, tool_calls=10**6, tool_errors=10**6,
                    tool_timeouts=10**6, cut_off=10**6, answer_from_tool=10**6,
                    prefix_cache_hit_rate=0.12346,
                ),
                "validation": ValidationFigures(
                    prompts=10**5, reward_mean=0.12346, correct_share=0.12346,
                    response_length_mean=1234.6, truncated_share=0.12346, reward_errors=10**6,
                    seconds=1234.6,
                ),
            }
        )
        for i in range(MAX_METRICS)
    ]  # fmt: skip
    metrics = metrics_with([], widest)
    document = RLJobStatus(metrics=metrics).model_dump(mode="json", by_alias=True)["metrics"]
    assert len(document) == MAX_METRICS
    assert len(json.dumps(document)) < 96_000
    assert max(len(json.dumps(entry)) for entry in document) < 900


def test_status_refuses_more_entries_than_the_bound() -> None:
    entries = [IterationMetrics(iteration=i) for i in range(MAX_METRICS + 1)]
    with pytest.raises(ValidationError, match="metrics"):
        RLJobStatus(metrics=entries)


def test_driver_status_lists_only_iterations_every_rank_finished() -> None:
    samples = [sample(r, i, Stage.TRAIN, 100) for r in (0, 1) for i in (0, 1, 2)]
    iterations = [done(r, i, 2.0 * (i + 1)) for r in (0, 1) for i in (0, 1)] + [done(0, 2, 8.0)]
    status = driver_status(iteration_reports(samples, iterations), iterations, [], world_size=2)
    assert [(m.iteration, m.reward_mean) for m in status.metrics] == [(0, 0.5), (1, 1.0)]


def test_driver_fields_carry_metrics_camel_case_without_nulls() -> None:
    status = RLJobStatus(iteration=1, metrics=metrics_with([], [report(0), report(1)]))
    fields = driver_fields(status, [])
    assert [m["iteration"] for m in fields["metrics"]] == [0, 1]
    entry = fields["metrics"][1]
    assert entry["rewardMean"] == 0.5 and entry["policyLoss"] == -0.12346
    assert "optimizerSteps" not in entry  # a report's field status does not keep
    bare = driver_fields(RLJobStatus(iteration=0, metrics=[IterationMetrics(iteration=0)]), [])
    assert bare["metrics"] == [{"iteration": 0, "rewardErrors": 0}]


def test_the_table_shows_reward_loss_kl_entropy_of_the_newest_rows() -> None:
    metrics = metrics_with([], [report(i, reward=i / 100) for i in range(30)])
    console = Console(record=True, width=200)
    console.print(metrics_table(metrics, "job", rows=5))
    text = console.export_text()
    assert "the last 5 of 30" in text
    assert "0.290" in text and "0.250" in text and "0.240" not in text
    assert "-0.1235" in text and "1.23e-07" in text and "1.235" in text


def test_the_learning_curve_is_a_png_and_needs_a_reward(tmp_path: Path) -> None:
    out = tmp_path / "curve.png"
    plot_learning_curve(metrics_with([], [report(i) for i in range(5)]), out, "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < out.stat().st_size < 200_000
    with pytest.raises(ValueError, match="no iteration has reported a reward"):
        plot_learning_curve([IterationMetrics(iteration=0)], tmp_path / "x.png", "title")


def test_kubectl_rljob_describes_the_latest_metrics_and_draws_the_curve(tmp_path: Path) -> None:
    status = RLJobStatus(
        iteration=9, metrics=metrics_with([], [report(i, i / 10) for i in range(10)])
    )
    console = Console(record=True, width=200)
    describe("job", status, console)
    text = console.export_text()
    assert "the last 5 of 10" in text and "0.900" in text and "0.400" not in text
    curve("job", status, 1, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match=r"no status\.metrics"):
        curve("new", RLJobStatus(), 1, tmp_path / "y.png")
