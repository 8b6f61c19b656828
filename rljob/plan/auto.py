"""rollout Auto: the mode and fraction with the largest KV cache whose every stage fits within
the margin (auto_choice), weightSyncBucketMegabytes Auto (auto_bucket), and their record as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rljob.api import (
    AUTO,
    MAX_PLAN_CANDIDATES,
    AutoStatus,
    PlanCandidate,
    PlanStatus,
    RLJobSpec,
    WakeUp,
)
from rljob.plan.costs import ALLOCATOR_SLACK_BYTES, GiB
from rljob.plan.knobs import (
    AUTO_BUCKET_FALLBACK_MEGABYTES,
    AUTO_BUCKET_MEGABYTES,
    _with,
    _with_bucket,
    rollout_is_auto,
)
from rljob.plan.model_shape import ModelShape
from rljob.plan.stages import ModePlan, StagePeak, mode_plan
from rljob.plan.weight_sync import whole_model_megabytes

# -- rollout Auto: the largest KV cache that fits within the margin -----------------------------

# The fractions Auto tries: the plan's grid (largest_fitting_fraction's), 0.01 to 0.99.
AUTO_FRACTION_STEP = 0.01


class AutoRefused(ValueError):
    """No candidate fits: the message names the closest one's stage and the bytes it is short."""


def auto_candidates(spec: RLJobSpec) -> list[tuple[WakeUp, float]]:
    """(wakeUp, memFractionStatic) pairs Auto plans: each Auto knob over all its values, the
    other as the spec says."""
    wake_up, fraction = spec.rollout.wake_up, spec.rollout.mem_fraction_static
    modes = [WakeUp.STAGED, WakeUp.SINGLE] if wake_up == AUTO else [WakeUp(wake_up)]
    steps = round(1 / AUTO_FRACTION_STEP)
    fractions = (
        [round(i * AUTO_FRACTION_STEP, 4) for i in range(1, steps)]
        if fraction == AUTO
        else [float(fraction)]
    )
    return [(m, f) for m in modes for f in fractions]


def _short_bytes(m: ModePlan, limit_bytes: int) -> tuple[StagePeak, int]:
    """The worst stage of `m` and the bytes it passes the limit by (<= 0: it fits)."""
    worst = m.worst
    return worst, worst.peak_bytes + ALLOCATOR_SLACK_BYTES - limit_bytes


def _usable(m: ModePlan, limit_bytes: int) -> bool:
    # A candidate without one KV token would fit a card smaller than the weights: the engine
    # could not serve a request, so it is never chosen.
    return m.parts.kv_tokens > 0 and m.fits_under(limit_bytes)


def choose(candidates: Sequence[ModePlan], limit_bytes: int) -> ModePlan:
    """The candidate with the largest KV pool whose every stage fits under `limit_bytes`; on a
    tie staged (its peaks are lower), then the lower fraction (more headroom). None fitting:
    AutoRefused naming the condition that fails and the knob to change (_refusal)."""
    fitting = [m for m in candidates if _usable(m, limit_bytes)]
    if fitting:
        return max(
            fitting,
            key=lambda m: (m.parts.kv_tokens, m.wake_up is WakeUp.STAGED, -m.mem_fraction_static),
        )
    if not candidates:
        raise AutoRefused("rollout Auto: no candidate to plan")
    raise AutoRefused(_refusal(candidates, limit_bytes))


def _refusal(candidates: Sequence[ModePlan], limit_bytes: int) -> str:
    """Why no candidate fits, in the order a user would fix it: the worker pod's host memory
    (the same at every candidate), else the multi-turn KV cache where some candidate's device
    fits and only its pool is short, else the closest candidate's stage and the bytes it is
    short."""
    limit = f"{limit_bytes / GiB:.2f} GiB (the GPU less spec.memoryPlan.margin)"
    first = candidates[0]
    if first.load is not None and not first.load.host_fits:
        return (
            f"rollout Auto: no candidate fits: {first.load.host_misfit_text()}, at every wakeUp "
            "and memFractionStatic; raise spec.resources.memory"
        )
    kv_short = [
        m
        for m in candidates
        if m.parts.kv_tokens > 0
        and not m.kv_holds_rollout
        and m.stages_fit_under(limit_bytes)
        and (m.load is None or m.load.fits_under(limit_bytes))
    ]
    if kv_short:
        largest = max(kv_short, key=lambda m: m.parts.kv_tokens)
        return (
            f"rollout Auto: no KV cache that fits {limit} holds the rollout: at wakeUp "
            f"{largest.wake_up}, memFractionStatic {largest.mem_fraction_static:.2f} (the "
            f"largest that fits) {largest.kv_shortfall_text()}; "
            f"{largest.kv_knobs_text('spec.')}, or use more GPUs"
        )
    closest = min(candidates, key=lambda m: _short_bytes(m, limit_bytes)[1])
    stage, short = _short_bytes(closest, limit_bytes)
    text = (
        f"rollout Auto: nothing fits {limit}; closest: wakeUp {closest.wake_up} at "
        f"memFractionStatic {closest.mem_fraction_static:.2f}, where {stage.stage} needs "
        f"{stage.peak_bytes / GiB:.2f} GiB ({max(short, 0) / GiB:.2f} GiB short)"
    )
    if closest.parts.kv_tokens <= 0:
        text += (
            f" and the engine's weights ({closest.parts.engine_weights / GiB:.2f} GiB) leave no "
            "KV cache"
        )
    return (
        text + "; use more GPUs (FSDP shards training state), offload, a smaller "
        "micro-batch or gradient checkpointing, or a lower spec.memoryPlan.margin"
    )


@dataclass(frozen=True)
class AutoChoice:
    """What rollout Auto chose on one card, from which candidates, under which limit."""

    chosen: ModePlan
    margin: float
    capacity_bytes: int
    limit_bytes: int
    candidates: tuple[ModePlan, ...]
    # weightSyncBucketMegabytes Auto's choice (auto_bucket); None where the spec gave a size.
    bucket_megabytes: int | None = None
    # Whether the rollout's mode or fraction was Auto (False: only the bucket was).
    rollout_auto: bool = True

    def resolve(self, spec: RLJobSpec) -> RLJobSpec:
        """`spec` with the chosen mode, fraction and bucket in place of Auto (what the ranks
        run)."""
        spec = _with(spec, self.chosen.wake_up, self.chosen.mem_fraction_static)
        if self.bucket_megabytes is not None:
            spec = _with_bucket(spec, self.bucket_megabytes)
        return spec

    @property
    def reason(self) -> str:
        m = self.chosen
        stage = m.worst
        under = (
            f"under {self.limit_bytes / GiB:.2f} GiB (margin {self.margin:.1%} of "
            f"{self.capacity_bytes / GiB:.2f} GiB); worst stage {stage.stage} at "
            f"{stage.peak_bytes / GiB:.2f} GiB"
        )
        bucket = (
            f"weight-sync bucket {self.bucket_megabytes} MiB, the largest that keeps every stage "
            "under the limit with the same offload"
            if _usable(m, self.limit_bytes)
            else f"weight-sync bucket {self.bucket_megabytes} MiB, the smallest: the plan at this "
            "mode and fraction passes the limit"
        )
        if not self.rollout_auto:
            return f"{bucket}: {under}"
        text = (
            f"the largest KV cache ({m.parts.kv_tokens} tokens) of {len(self.candidates)} "
            f"candidates whose every stage stays {under}"
        )
        return text if self.bucket_megabytes is None else f"{text}; {bucket}"

    def recorded(self) -> list[ModePlan]:
        """The bounded record: per mode, the chosen or best fitting candidate and the next
        fraction up that does not fit (why Auto stopped there)."""
        out: list[ModePlan] = []
        for mode in (WakeUp.STAGED, WakeUp.SINGLE):
            mine = [m for m in self.candidates if m.wake_up is mode]
            fitting = [m for m in mine if _usable(m, self.limit_bytes)]
            best = (
                self.chosen
                if self.chosen.wake_up is mode
                else (choose(fitting, self.limit_bytes) if fitting else None)
            )
            above = [
                m
                for m in mine
                if not _usable(m, self.limit_bytes)
                and (best is None or m.mem_fraction_static > best.mem_fraction_static)
            ]
            if best is not None:
                out.append(best)
            if above:
                out.append(min(above, key=lambda m: m.mem_fraction_static))
        return out[:MAX_PLAN_CANDIDATES]

    def to_status(self) -> AutoStatus:
        return AutoStatus(
            weight_sync_bucket_megabytes=self.bucket_megabytes,
            rollout=self.rollout_auto,
            margin=self.margin,
            limit_bytes=self.limit_bytes,
            planned=len(self.candidates),
            reason=self.reason[:1024],
            candidates=[
                PlanCandidate(
                    wake_up=m.wake_up,
                    mem_fraction_static=m.mem_fraction_static,
                    worst_stage=m.worst.stage,
                    peak_bytes=m.worst.peak_bytes,
                    kv_tokens=m.parts.kv_tokens,
                    kv_pool_bytes=m.parts.kv_pool,
                    fits=_usable(m, self.limit_bytes),
                )
                for m in self.recorded()
            ],
        )


def auto_lines(plan_status: PlanStatus) -> list[str]:
    """rollout Auto's choice as text lines (rljob run, kubectl rljob describe, rljob plan):
    what it chose and why, then the recorded candidates; [] where Auto was not used."""
    auto = plan_status.auto
    if auto is None:
        return []
    if not auto.rollout:  # only the bucket was Auto: no candidates of mode and fraction
        return [
            f"weightSyncBucketMegabytes Auto chose {auto.weight_sync_bucket_megabytes} MiB "
            f"at wakeUp {plan_status.wake_up}, memFractionStatic "
            f"{plan_status.mem_fraction_static:.2f}: {auto.reason}"
        ]
    lines = [
        f"rollout Auto chose wakeUp {plan_status.wake_up}, memFractionStatic "
        f"{plan_status.mem_fraction_static:.2f}: {auto.reason}",
        f"  {'wakeUp':<8}{'fraction':>9}{'worst stage':>16}{'peak GiB':>10}{'KV tokens':>11}"
        f"{'KV GiB':>8}  fits",
    ]
    for c in auto.candidates:
        lines.append(
            f"  {c.wake_up!s:<8}{c.mem_fraction_static:>9.2f}{c.worst_stage!s:>16}"
            f"{c.peak_bytes / GiB:>10.2f}{c.kv_tokens:>11}{c.kv_pool_bytes / GiB:>8.2f}  "
            f"{'yes' if c.fits else 'no'}"
        )
    return lines


def auto_limit_bytes(capacity_bytes: int, margin: float) -> int:
    """No stage's predicted peak may pass this: the card less `margin` of it."""
    return int(capacity_bytes * (1 - margin))


def auto_choice(
    spec: RLJobSpec, shape: ModelShape, capacity_bytes: int, world: int | None = None
) -> AutoChoice:
    """Plan every Auto candidate on a card of `capacity_bytes` and choose (see `choose`);
    AutoRefused when none fits. Pure: every rank given the same inputs chooses the same."""
    margin = spec.memory_plan.margin
    limit = auto_limit_bytes(capacity_bytes, margin)
    planned = tuple(
        mode_plan(_with(spec, mode, fraction), shape, capacity_bytes, world, limit)
        for mode, fraction in auto_candidates(spec)
    )
    rollout_auto = rollout_is_auto(spec)
    # Only the bucket Auto: the spec's mode and fraction planned as with the fixed smallest
    # bucket (its offload chosen as a fixed bucket's is, fitting or not: the plan reports a
    # misfit as it would there, and the bucket's Auto never refuses a job).
    if rollout_auto:
        chosen = choose(planned, limit)
    else:
        fixed = _with_bucket(spec, AUTO_BUCKET_FALLBACK_MEGABYTES)
        chosen = mode_plan(fixed, shape, capacity_bytes, world)
    bucket = None
    if spec.rollout.weight_sync_bucket_megabytes == AUTO:
        resolved = _with(spec, chosen.wake_up, chosen.mem_fraction_static)
        bucket, chosen = auto_bucket(resolved, shape, capacity_bytes, world, limit, chosen)
    return AutoChoice(chosen, margin, capacity_bytes, limit, planned, bucket, rollout_auto)


def auto_bucket(
    spec: RLJobSpec,
    shape: ModelShape,
    capacity_bytes: int,
    world: int | None,
    limit_bytes: int,
    smallest: ModePlan,
) -> tuple[int, ModePlan]:
    """weightSyncBucketMegabytes Auto, the mode and fraction already chosen (`smallest`: their
    plan at the smallest bucket): the largest of the whole model in the engine's dtype and
    AUTO_BUCKET_MEGABYTES whose plan fits under `limit_bytes` with `smallest`'s offload and KV
    cache, and that plan; none (or `smallest` not fitting), the smallest. A larger bucket is
    never bought with an offload the smallest did not need, nor with KV cache. Fewer, larger
    buckets measured the faster sync (docs/weight-sync.md): fewer requests, and on more than
    one rank no gather running beside the engine's load (two processes on one GPU take turns)."""
    whole = whole_model_megabytes(spec, shape)
    same = (smallest.offload_optimizer, smallest.offload_params, smallest.parts.kv_tokens)
    if _usable(smallest, limit_bytes):
        sizes = {whole, *(m for m in AUTO_BUCKET_MEGABYTES if m < whole)}
        for megabytes in sorted(sizes, reverse=True):
            if megabytes <= AUTO_BUCKET_FALLBACK_MEGABYTES:
                break
            m = mode_plan(_with_bucket(spec, megabytes), shape, capacity_bytes, world, limit_bytes)
            kept = (m.offload_optimizer, m.offload_params, m.parts.kv_tokens) == same
            if kept and _usable(m, limit_bytes):
                return megabytes, m
    return AUTO_BUCKET_FALLBACK_MEGABYTES, smallest
