"""Drivers run one colocated worker per rank and gather what the ranks report (local.py: processes).

The aggregation here is shared by every driver: rank events in, IterationReports and the
driver-owned part of RLJob status (iteration, rewardMean, klMean, memory, metrics, oomEvents)
out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TypeVar

from rljob.api import (
    CheckpointFailure,
    CheckpointStatus,
    ExportStatus,
    OOMEvent,
    RLJobStatus,
)
from rljob.report import (
    MAX_METRICS,
    METRIC_DIGITS,
    IterationReport,
    MultiTurnFigures,
    OOMRecord,
    StageSample,
    ValidationFigures,
    metrics_with,
    summarize,
    summarize_load,
)
from rljob_worker.agentic.driver import RolloutCounts
from rljob_worker.checkpoint import ModelExported, SavedCheckpoint
from rljob_worker.loop import RankIteration, RolloutStats, ValidationStats
from rljob_worker.train import TrainStats

# status.oomEvents keeps the latest few; status.oomCounts counts them all.
MAX_OOM_EVENTS = 10


_Record = TypeVar("_Record", bound=OOMRecord)


def newest_ooms(ooms: Iterable[_Record]) -> list[_Record]:
    """The OOM entries status keeps: the last MAX_OOM_EVENTS by time (then rank)."""
    return sorted(ooms, key=lambda o: (o.time, o.rank or 0))[-MAX_OOM_EVENTS:]


def iteration_reports(
    samples: Iterable[StageSample], iterations: Iterable[RankIteration]
) -> list[IterationReport]:
    """One report per iteration that any rank sampled; reward and KL are means over all ranks."""
    by_iteration: dict[int, IterationReport] = {}
    for sample in sorted(samples, key=lambda s: (s.iteration, s.rank, s.start_seconds)):
        by_iteration.setdefault(sample.iteration, IterationReport(iteration=sample.iteration))
        by_iteration[sample.iteration].samples.append(sample)
    ranks: dict[int, list[RankIteration]] = {}
    for item in iterations:
        ranks.setdefault(item.iteration, []).append(item)
    for iteration, items in ranks.items():
        report = by_iteration.setdefault(iteration, IterationReport(iteration=iteration))
        count = sum(i.reward_count for i in items)
        report.reward_mean = sum(i.reward_sum for i in items) / count if count else None
        report.reward_errors = sum(i.reward_errors for i in items)
        kls = [i.kl_mean for i in items if i.kl_mean is not None]
        report.kl_mean = sum(kls) / len(kls) if kls else None
        rollouts = [i.rollout for i in items if i.rollout is not None]
        if rollouts:
            _add_rollout(report, rollouts)
        trains = [i.train for i in items if i.train is not None]
        if trains:
            _add_train(report, trains)
        validations = [i.validation for i in items if i.validation is not None]
        if validations:
            report.validation = validation_figures(validations)
    return [by_iteration[i] for i in sorted(by_iteration)]


def _rounded(value: float) -> float:
    """As status.metrics rounds its own floats (a bounded width)."""
    return float(f"{value:.{METRIC_DIGITS}g}")


def validation_figures(parts: list[ValidationStats]) -> ValidationFigures:
    """The ranks' validation shares as one iteration's figures: means over every answer of
    every rank; seconds of the slowest rank (the others wait for it at the next collective)."""
    responses = sum(p.responses for p in parts)

    def share(total: float) -> float | None:
        return _rounded(total / responses) if responses else None

    return ValidationFigures(
        prompts=sum(p.prompts for p in parts),
        reward_mean=share(sum(p.reward_sum for p in parts)),
        correct_share=share(sum(p.correct for p in parts)),
        response_length_mean=share(sum(p.response_tokens for p in parts)),
        truncated_share=share(sum(p.truncated for p in parts)),
        reward_errors=sum(p.reward_errors for p in parts),
        seconds=_rounded(max(p.seconds for p in parts)),
    )


def combined_variance(parts: Iterable[tuple[int, float, float]]) -> tuple[int, float, float]:
    """(count, mean, sum of squared deviations) of the union of parts given as the same triple
    (Chan, Golub and LeVeque's pairwise update: exact, no cancellation of large sums)."""
    count, mean, m2 = 0, 0.0, 0.0
    for n, part_mean, part_m2 in parts:
        if n == 0:
            continue
        total = count + n
        delta = part_mean - mean
        mean += delta * n / total
        m2 += part_m2 + delta**2 * count * n / total
        count = total
    return count, mean, m2


def _add_rollout(report: IterationReport, rollouts: list[RolloutStats]) -> None:
    count, _, m2 = combined_variance((r.responses, r.reward_mean, r.reward_m2) for r in rollouts)
    report.reward_std = (m2 / count) ** 0.5
    report.reward_min = min(r.reward_min for r in rollouts)
    report.reward_max = max(r.reward_max for r in rollouts)
    report.correct_share = sum(r.correct for r in rollouts) / count
    report.response_length_mean = sum(r.response_tokens for r in rollouts) / count
    report.response_length_max = max(r.response_length_max for r in rollouts)
    report.truncated_share = sum(r.truncated for r in rollouts) / count
    turns = [r.multi_turn for r in rollouts if r.multi_turn is not None]
    if turns:
        _add_multi_turn(report, turns)


def _add_multi_turn(report: IterationReport, counts: list[RolloutCounts]) -> None:
    conversations = sum(c.conversations for c in counts) or 1
    cached = [c for c in counts if c.cached_tokens is not None]
    sent = sum(c.prompt_tokens for c in cached)
    hit = sum(c.cached_tokens or 0 for c in cached) / sent if cached and sent else None
    report.multi_turn = MultiTurnFigures(
        turns_mean=_rounded(sum(c.turns for c in counts) / conversations),
        tool_calls=sum(c.tool_calls for c in counts),
        tool_errors=sum(c.tool_errors for c in counts),
        tool_timeouts=sum(c.tool_timeouts for c in counts),
        cut_off=sum(c.cut_off for c in counts),
        answer_from_tool=sum(c.answer_from_tool for c in counts),
        prefix_cache_hit_rate=None if hit is None else _rounded(hit),
        resumed=sum(c.resumed for c in counts),
        paused=sum(c.paused for c in counts),
    )


def _add_train(report: IterationReport, trains: list[TrainStats]) -> None:
    # Token-weighted over ranks: each rank's sums over its tokens, divided by all ranks' tokens.
    token_steps = sum(t.token_steps for t in trains) or 1
    report.policy_loss = sum(t.policy_loss_sum for t in trains) / token_steps
    kls = [t.kl_sum for t in trains if t.kl_sum is not None]
    report.kl_mean = sum(kls) / token_steps if kls else None
    report.entropy_mean = sum(t.entropy_sum for t in trains) / token_steps
    report.clip_fraction = sum(t.clipped_tokens for t in trains) / token_steps
    # The same on every rank (a global norm; one learning rate): any rank's.
    report.grad_norm = trains[0].grad_norm
    report.learning_rate = trains[0].learning_rate
    report.optimizer_steps = trains[0].optimizer_steps
    report.skipped_steps = trains[0].skipped_steps or None
    mismatches = [t.logprob_mismatch_sum for t in trains if t.logprob_mismatch_sum is not None]
    if mismatches:
        tokens = sum(t.response_tokens for t in trains) or 1
        report.logprob_mismatch_mean = sum(mismatches) / tokens


def driver_status(
    reports: list[IterationReport],
    iterations: Iterable[RankIteration],
    ooms: list[OOMRecord],
    world_size: int,
    checkpoint_failures: Iterable[CheckpointFailure] = (),
    checkpoints: Iterable[SavedCheckpoint] = (),
    exports: Iterable[ModelExported] = (),
) -> RLJobStatus:
    """The fields of RLJob status the job's driver owns, computed from what the ranks reported.

    `iteration` is the last iteration every rank finished; memory is that of the latest sampled
    iteration (after an OOM: the one that failed, with the stages it reached); metrics are
    those of the finished iterations, the newest MAX_METRICS.
    """
    iterations = list(iterations)
    ranks_done: dict[int, set[int]] = {}
    for item in iterations:
        ranks_done.setdefault(item.iteration, set()).add(item.rank)
    finished = [r for r in reports if len(ranks_done.get(r.iteration, ())) == world_size]
    last = finished[-1] if finished else None
    memory = summarize(reports[-1]) if reports else None
    if memory is not None:  # the start-up, measured once per rank, travels with every summary
        memory.load = summarize_load([i.load for i in iterations if i.load is not None])
    return RLJobStatus(
        checkpoint=checkpoint_status(iterations, world_size, checkpoints),
        export=export_status(iterations, exports),
        resumed_from=next((i.resume_point for i in iterations if i.resume_point), None),
        # Every rank reports the same agreed failure (checkpoint._agreed): the first of them.
        checkpoint_failure=next(iter(checkpoint_failures), None),
        iteration=last.iteration if last else None,
        reward_mean=last.reward_mean if last else None,
        kl_mean=next((r.kl_mean for r in reversed(finished) if r.kl_mean is not None), None),
        memory=memory,
        metrics=metrics_with([], finished),
        oom_events=[OOMEvent.model_validate(o) for o in newest_ooms(ooms)],
        oom_counts=dict(Counter(o.kind for o in ooms)),
        # Rank 0's plan (with rollout Auto's choice), as the cluster's status.plan has it.
        plan=next((i.plan for i in iterations if i.plan is not None), None),
    )


def checkpoint_status(
    iterations: Iterable[RankIteration], world_size: int, alone: Iterable[SavedCheckpoint] = ()
) -> CheckpointStatus | None:
    """status.checkpoint: the newest checkpoint every rank saved (rank 0 wrote its marker, so
    it is complete); bytes of all ranks' parts, seconds of the slowest rank. An asynchronous
    save is reported by the iteration in which the ranks agreed it was complete (a later one):
    grouped by the checkpoint's own iteration. `alone`: parts sent without an iteration's
    report (that iteration failed after the agreement)."""
    by_iteration: dict[int, list[SavedCheckpoint]] = {}
    parts_sent = [item.checkpoint for item in iterations if item.checkpoint is not None]
    for part in [*parts_sent, *alone]:
        by_iteration.setdefault(part.iteration, []).append(part)
    done = [i for i, parts in by_iteration.items() if len(parts) == world_size]
    if not done:
        return None
    parts = by_iteration[max(done)]
    first = next(p for p in parts if p.completed_at)
    blocked = [p.blocked_seconds for p in parts if p.blocked_seconds is not None]
    return CheckpointStatus(
        iteration=first.iteration,
        path=first.path,
        completed_at=first.completed_at or "",
        bytes=sum(p.bytes for p in parts),
        seconds=max(p.seconds for p in parts),
        blocked_seconds=max(blocked) if blocked else None,
    )


def export_status(
    iterations: Iterable[RankIteration], alone: Iterable[ModelExported] = ()
) -> ExportStatus | None:
    """status.export: the newest export (rank 0 writes it and reports its path, with its
    iteration's report or, `alone`, after that iteration failed)."""
    exports = [(i.iteration, i.export_path) for i in iterations if i.export_path]
    exports += [(e.iteration, e.path) for e in alone]
    if not exports:
        return None
    iteration, path = max(exports)
    return ExportStatus(path=path, iteration=iteration)


# What an earlier driver of the job wrote that stays true for the next one (continued()).
CONTINUED_FIELDS = ("checkpoint", "export", "metrics")


def continued(status: RLJobStatus, earlier: RLJobStatus) -> RLJobStatus:
    """This driver's `status` with what an earlier driver of the job (a run KubeRay started
    again after a lost pod, an earlier attempt) wrote that is still true: the newest checkpoint
    and export until this run has its own (the files stay; a run resumed at the last iteration
    saves none), and the metrics of the iterations before this run's (from the first iteration
    it ran or resumed at, its own values stand: no iteration twice). Under server-side apply
    with one field manager, what this driver's apply leaves out is deleted.

    Not continued: what describes the current run only and is written by it (iteration, reward,
    memory, plan, resumedFrom), and checkpointFailure: KubeRay runs a job again after a failed
    save (backoffLimit), and an earlier run's failure carried into this one would have the
    operator call the running job Failed."""
    redone = [m.iteration for m in status.metrics]
    if status.resumed_from is not None:
        redone.append(status.resumed_from.iteration)
    first = min(redone, default=None)
    before = [m for m in earlier.metrics if first is None or m.iteration < first]
    return status.model_copy(
        update={
            "checkpoint": status.checkpoint or earlier.checkpoint,
            "export": status.export or earlier.export,
            "metrics": [*before, *status.metrics][-MAX_METRICS:],
        }
    )
