"""The memory plan's stages: each stage's peak in a steady iteration, and the plan of one
wake-up mode and fraction with the least offload that fits (ModePlan, mode_plan); the bench's hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rljob.api import OffloadMode, OverlapStaging, RLJobSpec, WakeUp
from rljob.plan.costs import ALLOCATOR_SLACK_BYTES, GiB
from rljob.plan.knobs import _with, resolved_rollout
from rljob.plan.load import LoadPeak, load_peak
from rljob.plan.model_shape import ModelShape
from rljob.plan.rank_parts import Parts, parts
from rljob.report import Stage

# -- the stages -----------------------------------------------------------------------------------


def stage_peaks(
    p: Parts,
    wake_up: WakeUp,
    offload_optimizer: bool,
    offload_params: bool,
    checkpoint: bool = False,
    overlap: bool = False,
) -> dict[Stage, int]:
    """Device-wide peak per stage of a steady iteration (1+), following stages.py. A stage's
    peak includes what it started with (the bench samples at the boundary), and memory freed
    into torch's cache stays counted until the next empty_cache().

    `overlap` (spec.training.overlapStaging, stages.StagingOrder): the offloaded moments come
    back during train (which held them already), so sleep no longer holds them; sleep brings the
    params back once the KV cache is released, with the engine's weights still mapped; staged
    only, the moments leave while the weight sync runs, so wake_weights and offload_train (which
    frees them) hold them beside the engine's weights."""
    optimizer = 0 if offload_optimizer else p.optimizer
    params = 0 if offload_params else p.train_params
    single = wake_up is WakeUp.SINGLE
    # The moments on the device during the weight sync: leaving behind it (overlap, staged).
    syncing_optimizer = p.optimizer if overlap and not single else optimizer
    peaks: dict[Stage, int] = {}
    # The higher of the optimizer step (its temporary and the cached logits) and backward (the
    # micro-batch's activations, all live): at the bench's 768-token micro-batches the step.
    train = (
        p.context
        + p.train_params
        + p.optimizer
        + p.grads
        + max(p.step_temp + p.step_cache, p.activations)
        + p.fsdp_buffers
    )
    peaks[Stage.TRAIN] = train
    if checkpoint:
        # The same as train: it starts with train's cache and state, frees nothing, and the
        # save copies one tensor at a time to host memory (docs/checkpoints.md).
        peaks[Stage.CHECKPOINT] = train
    peaks[Stage.OFFLOAD_OPTIMIZER] = train  # starts with train's cache; frees after
    resident = p.context + p.train_params + syncing_optimizer
    kv = p.kv_pool + p.single_wake_extra if single else 0
    wake = resident + p.engine_weights + kv + p.gather
    peaks[Stage.WAKE_WEIGHTS] = wake
    peaks[Stage.OFFLOAD_TRAIN] = wake  # starts with the sync's buckets cached
    serving = p.context + params + optimizer + p.engine_weights + p.kv_pool
    serving += p.single_wake_extra if single else 0
    if wake_up is WakeUp.STAGED:
        peaks[Stage.WAKE_KV_CACHE] = serving
    peaks[Stage.ROLLOUT] = serving + p.rollout_workspace
    # Starts with the pool mapped. Without overlap it ends with the whole training state back;
    # with it, the params come back while the engine's weights are still mapped (the KV cache
    # released first) and the moments only in train.
    back = p.context + p.train_params
    back += optimizer + p.engine_weights if overlap else p.optimizer
    peaks[Stage.SLEEP] = max(peaks[Stage.ROLLOUT], back)
    return peaks


@dataclass(frozen=True)
class StagePeak:
    stage: Stage
    peak_bytes: int
    capacity_bytes: int

    @property
    def fraction(self) -> float:
        return self.peak_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= ALLOCATOR_SLACK_BYTES


@dataclass(frozen=True)
class ModePlan:
    """One wake-up mode at the spec's memFractionStatic."""

    wake_up: WakeUp
    mem_fraction_static: float
    offload_optimizer: bool
    offload_params: bool
    stages: tuple[StagePeak, ...]
    parts: Parts
    largest_fitting_fraction: float | None = None
    load: LoadPeak | None = None  # start-up, before iteration 0 (None: not planned)

    @property
    def fits(self) -> bool:
        return (
            all(s.fits for s in self.stages)
            and (self.load is None or self.load.fits)
            and self.kv_holds_rollout
        )

    @property
    def kv_holds_rollout(self) -> bool:
        """The KV pool holds one full-length request, and in mode multiTurn
        maxConcurrentConversations full-length trajectories (rank_parts.rollout_kv_tokens)."""
        return self.parts.kv_tokens >= self.parts.kv_tokens_needed

    def fits_under(self, limit_bytes: int) -> bool:
        """Every stage's peak and the start-up's, plus the allocator's slack, within
        `limit_bytes` (and the start-up's host bytes within the worker pod's memory, and in mode
        the KV pool large enough for the rollout: kv_holds_rollout)."""
        return (
            self.kv_holds_rollout
            and self.stages_fit_under(limit_bytes)
            and (self.load is None or self.load.fits_under(limit_bytes))
        )

    def stages_fit_under(self, limit_bytes: int) -> bool:
        """Every stage of the iteration, plus the allocator's slack, within `limit_bytes`: the
        one condition of fits_under that the offload changes."""
        return all(s.peak_bytes + ALLOCATOR_SLACK_BYTES <= limit_bytes for s in self.stages)

    @property
    def host_short(self) -> bool:
        """The start-up's host bytes pass the worker pod's memory (spec.resources.memory)."""
        return self.load is not None and not self.load.host_fits

    @property
    def worst(self) -> StagePeak:
        return max(self.stages, key=lambda s: s.peak_bytes)

    def misfit_text(self) -> str:
        """'wake_weights needs 81.02 GiB of 79.18 GiB (1.84 GiB over)' for each misfit."""
        misfits = [self.load.misfit_text()] if self.load is not None and not self.load.fits else []
        misfits += [
            f"{s.stage} needs {s.peak_bytes / GiB:.2f} GiB of {s.capacity_bytes / GiB:.2f} GiB "
            f"({(s.peak_bytes + ALLOCATOR_SLACK_BYTES - s.capacity_bytes) / GiB:.2f} GiB over)"
            for s in self.stages
            if not s.fits
        ]
        if not self.kv_holds_rollout:
            misfits.append(f"{self.kv_shortfall_text()} ({self.kv_knobs_text()}, or raise "
                           "memFractionStatic)")  # fmt: skip
        return "; ".join(misfits)

    def kv_shortfall_text(self) -> str:
        """What the pool holds against what the rollout needs at once."""
        if self.parts.kv_conversations:
            needs = (
                f"the multi-turn rollout's {self.parts.kv_conversations} concurrent full-length "
                "trajectories need"
            )
        else:
            needs = "one full-length request (data.maxPromptLength + maxResponseLength) needs"
        return f"the KV cache holds {self.parts.kv_tokens} tokens, {needs} {self.parts.kv_tokens_needed}"

    def kv_knobs_text(self, prefix: str = "") -> str:
        """The spec's fields that lower what the rollout needs of the KV pool (`prefix`: "spec."
        where the text names the spec's fields in full)."""
        if self.parts.kv_conversations:
            return (
                f"lower {prefix}rollout.multiTurn.maxConcurrentConversations or maxResponseLength"
            )
        return f"lower {prefix}data.maxPromptLength or maxResponseLength"


def _offload_choices(spec: RLJobSpec) -> list[tuple[bool, bool]]:
    """(optimizer, params) offloads to try, fewest bytes moved first; Always: the flags."""
    allowed = (spec.training.offload_optimizer, spec.training.offload_params)
    if spec.offload is OffloadMode.ALWAYS:
        return [allowed]
    # Params (policy + reference) are usually as large as the moments; either order is
    # one offload, so try optimizer first (it is the one that leaves the device at train end).
    choices = [(False, False), (True, False), (False, True), (True, True)]
    return [c for c in choices if (not c[0] or allowed[0]) and (not c[1] or allowed[1])]


def mode_plan(
    spec: RLJobSpec,
    shape: ModelShape,
    capacity_bytes: int,
    world: int | None = None,
    limit_bytes: int | None = None,
    reference_dtype: str | None = None,
) -> ModePlan:
    """The spec's own mode and fraction; with offload Auto the least offload that fits (under
    `limit_bytes`, default the capacity; when none fits, see _least_harmful)."""
    wake_up, fraction = resolved_rollout(spec)
    world = world or spec.world_size
    p = parts(spec, shape, capacity_bytes, world, reference_dtype)
    load = load_peak(spec, shape, p, capacity_bytes, world)
    choices = _offload_choices(spec)
    plans = []
    for optimizer, params in choices:
        peaks = stage_peaks(
            p,
            wake_up,
            optimizer,
            params,
            checkpoint=spec.checkpoint is not None,
            overlap=overlaps_staging(spec),
        )
        stages = tuple(StagePeak(s, b, capacity_bytes) for s, b in peaks.items())
        plans.append(ModePlan(wake_up, fraction, optimizer, params, stages, p, load=load))
    limit = capacity_bytes if limit_bytes is None else limit_bytes
    fitting = [m for m in plans if m.fits_under(limit)]
    return fitting[0] if fitting else _least_harmful(plans, limit)


def _least_harmful(plans: list[ModePlan], limit_bytes: int) -> ModePlan:
    """None of `plans` (fewest bytes moved first) fits: the least offload whose every stage fits,
    where what is short is one offload cannot fix (the multi-turn KV cache, the same pool at
    every offload; the start-up's device bytes); none of them, everything the flags allow (the
    least device bytes). Never an offload when host memory is short: it pins host copies."""
    if plans[0].host_short:
        return plans[0]
    return next((m for m in plans if m.stages_fit_under(limit_bytes)), plans[-1])


def overlaps_staging(spec: RLJobSpec) -> bool:
    """Whether the plan counts the overlapped staging order: On, or Auto (On on CUDA, which is
    what the plan is for: a GPU's memory)."""
    return spec.training.overlap_staging is not OverlapStaging.OFF


def largest_fitting_fraction(
    spec: RLJobSpec,
    shape: ModelShape,
    capacity_bytes: int,
    wake_up: WakeUp,
    world: int | None = None,
    step: float = 0.01,
    reference_dtype: str | None = None,
) -> float | None:
    """The largest memFractionStatic (on a grid of `step`) at which every stage fits."""
    for i in range(round(1 / step) - 1, 0, -1):
        fraction = round(i * step, 4)
        candidate = _with(spec, wake_up, fraction)
        if mode_plan(candidate, shape, capacity_bytes, world, reference_dtype=reference_dtype).fits:
            return fraction
    return None


def plan_for_point(
    spec: RLJobSpec,
    config: Mapping[str, Any],
    capacity_bytes: int,
    ranks: int,
    reference_dtype: str | None = None,
) -> ModePlan:
    """The bench's hook (bench/colocate.py): the plan of one (mode, fraction) point, for a
    model given by its config.json fields, on `ranks` GPUs of `capacity_bytes`; a stored run's
    `reference_dtype` where it differs from the engine's (see MASTER_BYTES)."""
    shape = ModelShape.from_config({"model_type": "qwen2", **config})
    return mode_plan(spec, shape, capacity_bytes, ranks, reference_dtype=reference_dtype)


def plan_line(spec: RLJobSpec, config: Mapping[str, Any], capacity_bytes: int, ranks: int) -> str:
    """One line for the bench to print beside a measured point: the plan's per-stage peaks."""
    m = plan_for_point(spec, config, capacity_bytes, ranks)
    peaks = ", ".join(f"{s.stage}: {s.peak_bytes / GiB:.2f}" for s in m.stages)
    verdict = "fits" if m.fits else f"misfit ({m.misfit_text()})"
    return (
        f"plan {m.wake_up} {m.mem_fraction_static:.2f}: {verdict}, KV {m.parts.kv_tokens} "
        f"tokens, peaks {{{peaks}}} GiB"
    )
