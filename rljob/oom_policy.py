"""The OOM policy and plan admission as pure functions: an attempt's outcome in, the next
attempt's knobs (or the reason to stop) out; a spec and its plan in, MemoryPlanFits out.

The operator is the shell (it reads the RayJob and status.oomEvents, creates the next RayJob,
writes status.attempts and Events); nothing here does I/O or imports kopf or torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from rljob.api import (
    AUTO,
    MAX_NAME_LENGTH,
    AttemptKnobs,
    MisfitAction,
    RLJobSpec,
    WakeUp,
    _quantity,
)
from rljob.plan import (
    AUTO_BUCKET_FALLBACK_MEGABYTES,
    AutoChoice,
    AutoRefused,
    GiB,
    ModePlan,
    auto_choice,
    is_auto,
    mode_plan,
    rollout_is_auto,
    shape_for,
)
from rljob.report import Stage

REASON_RETRIES_EXHAUSTED = "OOMRetriesExhausted"
REASON_OOM_RETRY = "OOMRetry"
REASON_HOST_OOM = "OOMKilled"
MEMORY_PLAN_FITS = "MemoryPlanFits"
REASON_PLAN_FITS = "PlanFits"
REASON_PLAN_MISFIT = "PlanMisfit"
REASON_PLAN_UNKNOWN = "PlanUnknown"

OutcomeKind = Literal["CUDAOutOfMemory", "OOMKilled", "Failed", "Succeeded"]


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, as the operator observed it."""

    kind: OutcomeKind
    stage: Stage | None = None
    rank: int | None = None
    pod: str = ""
    limit_bytes: int | None = None
    # A CUDA OOM as measured (the allocator's request and the device's free bytes at the OOM),
    # with the card and the plan's peak of that stage for the attempt that failed: together
    # the measured overshoot a retry under rollout Auto raises the margin by.
    requested_bytes: int | None = None
    free_bytes: int | None = None
    capacity_bytes: int | None = None
    planned_peak_bytes: int | None = None

    @property
    def overshoot_bytes(self) -> int | None:
        """How far the stage went past its plan: it held capacity - free and asked for
        requested more, where the plan said planned_peak. None where a number is missing."""
        known = (self.requested_bytes, self.free_bytes, self.capacity_bytes)
        if self.planned_peak_bytes is None or any(v is None for v in known):
            return None
        assert self.requested_bytes is not None and self.free_bytes is not None
        assert self.capacity_bytes is not None
        needed = self.capacity_bytes - self.free_bytes + self.requested_bytes
        return needed - self.planned_peak_bytes


@dataclass(frozen=True)
class Decision:
    """The policy's answer: retry with `knobs`, or stop with `reason` (None: nothing to do)."""

    retry: bool
    knobs: AttemptKnobs | None
    reason: str | None
    message: str
    why: str = ""  # for status.attempts[].changed, after the knobs changed: the measurement

    def changed(self, before: AttemptKnobs, spec: RLJobSpec) -> str:
        """status.attempts[].changed of the retry: the knobs it changes and, where measured,
        why by that much."""
        if self.knobs is None:
            return ""
        text = changed_text(before, self.knobs, spec)
        return (f"{text}: {self.why}" if self.why else text)[:512]


def first_knobs(spec: RLJobSpec) -> AttemptKnobs:
    """Attempt 1's knobs: the spec's; under rollout Auto with its margin explicit, the number
    each OOM retry raises (the knobs keep "Auto": the driver resolves it on the card)."""
    return AttemptKnobs(
        mem_fraction_static=spec.rollout.mem_fraction_static,
        wake_up=spec.rollout.wake_up,
        margin=spec.memory_plan.margin if is_auto(spec) else None,
    )


# Stages that run while the engine's weights and KV cache are released: an OOM there is the
# training state's and activations', which no engine knob can make smaller.
TRAINING_STAGES = (Stage.TRAIN, Stage.CHECKPOINT, Stage.OFFLOAD_OPTIMIZER)


def knobs_text(knobs: AttemptKnobs) -> str:
    """The knobs one attempt ran with, as the messages name them."""
    text = f"memFractionStatic {knobs.mem_fraction_static}, wakeUp {knobs.wake_up}"
    if knobs.margin is not None:
        text += f", memoryPlan.margin {knobs.margin}"
    if knobs.micro_batch_size is not None:
        text += f", microBatchSize {knobs.micro_batch_size}"
    if knobs.gradient_checkpointing is not None:
        text += f", gradientCheckpointing {str(knobs.gradient_checkpointing).lower()}"
    if knobs.weight_sync_bucket_megabytes is not None:
        text += f", weightSyncBucketMegabytes {knobs.weight_sync_bucket_megabytes}"
    return text


def changed_text(before: AttemptKnobs, after: AttemptKnobs, spec: RLJobSpec) -> str:
    """Which knobs `after` changes from `before`: 'rollout.wakeUp single -> staged'."""
    old, new = before.apply(spec), after.apply(spec)
    pairs = (
        ("rollout.wakeUp", old.rollout.wake_up, new.rollout.wake_up),
        (
            "rollout.memFractionStatic",
            old.rollout.mem_fraction_static,
            new.rollout.mem_fraction_static,
        ),
        ("training.microBatchSize", old.training.micro_batch_size, new.training.micro_batch_size),
        (
            "training.gradientCheckpointing",
            str(old.training.gradient_checkpointing).lower(),
            str(new.training.gradient_checkpointing).lower(),
        ),
        ("memoryPlan.margin", old.memory_plan.margin, new.memory_plan.margin),
        (
            "rollout.weightSyncBucketMegabytes",
            old.rollout.weight_sync_bucket_megabytes,
            new.rollout.weight_sync_bucket_megabytes,
        ),
    )
    return ", ".join(f"{name} {a} -> {b}" for name, a, b in pairs if a != b)


def rayjob_name(job: str, attempt: int) -> str:
    """Attempt 1 keeps the RLJob's name; later ones get '-aN', the name cut to stay within
    KubeRay's 47 characters."""
    if attempt == 1:
        return job
    suffix = f"-a{attempt}"
    return job[: MAX_NAME_LENGTH - len(suffix)].rstrip("-") + suffix


def _engine_candidates(spec: RLJobSpec, knobs: AttemptKnobs) -> list[AttemptKnobs]:
    """An engine-stage OOM: wakeUp single becomes staged first (switchToStaged), then
    memFractionStatic drops by fractionStep, never below minFraction."""
    policy = spec.oom_policy
    candidates: list[AttemptKnobs] = []
    if knobs.wake_up is WakeUp.SINGLE and policy.switch_to_staged:
        candidates.append(knobs.model_copy(update={"wake_up": WakeUp.STAGED}))
    wake_up = WakeUp.STAGED if candidates else knobs.wake_up
    fraction = Decimal(str(knobs.mem_fraction_static))
    step, floor = Decimal(str(policy.fraction_step)), Decimal(str(policy.min_fraction))
    while (fraction := fraction - step) >= floor and fraction > 0:
        candidates.append(
            knobs.model_copy(update={"mem_fraction_static": float(fraction), "wake_up": wake_up})
        )
    return candidates


# A retry under Auto raises the margin by the measured overshoot, and by at least one step of
# the plan's fraction grid, so the next choice is lower even where the overshoot was tiny.
AUTO_MIN_MARGIN_STEP = 0.01
AUTO_MAX_MARGIN = 0.49  # MemoryPlanSpec.margin < 0.5


def _auto_retry(spec: RLJobSpec, knobs: AttemptKnobs, outcome: Outcome) -> tuple[float, str]:
    """(the next margin, why) after an engine-stage OOM under memFractionStatic Auto."""
    margin = spec.memory_plan.margin if knobs.margin is None else knobs.margin
    over = outcome.overshoot_bytes
    if over is None or not outcome.capacity_bytes:
        step = spec.oom_policy.fraction_step
        why = (
            f"the overshoot of {outcome.stage or '?'} was not measured (no plan or free bytes "
            f"for this attempt), so spec.oomPolicy.fractionStep={step}"
        )
    else:
        step = max(over / outcome.capacity_bytes, AUTO_MIN_MARGIN_STEP)
        why = (
            f"{outcome.stage} needed {over / GiB:.2f} GiB over its plan "
            f"({outcome.planned_peak_bytes} bytes; requested {outcome.requested_bytes} with "
            f"{outcome.free_bytes} free of {outcome.capacity_bytes}), "
            f"{over / outcome.capacity_bytes:.2%} of the GPU"
            + (f", at least {AUTO_MIN_MARGIN_STEP}" if step > over / outcome.capacity_bytes else "")
        )
    return round(margin + step, 4), why


def _training_candidates(spec: RLJobSpec, knobs: AttemptKnobs) -> list[AttemptKnobs]:
    """A training-stage OOM: microBatchSize halves down to minMicroBatchSize (the gradient is
    the same: the step accumulates over micro-batches), then gradient checkpointing goes on."""
    policy = spec.oom_policy
    training = knobs.apply(spec).training
    candidates: list[AttemptKnobs] = []
    micro = training.micro_batch_size
    while micro > policy.min_micro_batch_size:
        micro = max(micro // 2, policy.min_micro_batch_size)
        candidates.append(knobs.model_copy(update={"micro_batch_size": micro}))
    if policy.gradient_checkpointing and not training.gradient_checkpointing:
        last = candidates[-1] if candidates else knobs
        candidates.append(last.model_copy(update={"gradient_checkpointing": True}))
    return candidates


def next_attempt(
    spec: RLJobSpec,
    knobs: AttemptKnobs,
    attempts_made: int,
    outcome: Outcome,
    fits: Callable[[AttemptKnobs], bool | None] = lambda _k: None,
) -> Decision:
    """After attempt number `attempts_made` (run with `knobs`) ended in `outcome`.

    A CUDA OOM retries while spec.oomPolicy.maxRetries allows, changing the knob that can help
    the stage that failed: in train or offload_optimizer (TRAINING_STAGES, the engine released)
    a smaller micro-batch, then gradient checkpointing; in an engine stage staged wake-up, then
    a lower memFractionStatic, past values `fits` says will not fit (None: no plan, no veto). A
    container OOMKilled (host memory) is never retried: no GPU knob helps it.
    """
    policy = spec.oom_policy
    if outcome.kind == "OOMKilled":
        limit = outcome.limit_bytes
        if limit is None:
            limit = int(_quantity(spec.resources.memory))
        return Decision(
            False,
            None,
            REASON_HOST_OOM,
            f"container OOMKilled (host memory) in pod {outcome.pod or '?'}: the pod memory "
            f"limit is {limit} bytes (spec.resources.memory={spec.resources.memory}); raise it "
            "(the OOM policy changes GPU memory knobs only, so this is not retried)",
        )
    if outcome.kind != "CUDAOutOfMemory":
        return Decision(False, None, None, "")
    where = (
        f"stage {outcome.stage or '?'}, rank {outcome.rank if outcome.rank is not None else '?'}"
    )
    failed = f"CUDA OOM in {where} on attempt {attempts_made} ({knobs_text(knobs)})"
    retries_used = attempts_made - 1
    if retries_used >= policy.max_retries:
        return Decision(
            False,
            None,
            REASON_RETRIES_EXHAUSTED,
            f"{failed}; {retries_used} of spec.oomPolicy.maxRetries={policy.max_retries} "
            "retries used",
        )
    training = outcome.stage in TRAINING_STAGES
    # Under the bucket's Auto an engine-stage retry runs the smallest bucket Auto takes, fixed:
    # the room a lower fraction or a raised margin frees never goes to a larger bucket.
    fixed_bucket: dict[str, int] = {}
    if not training and knobs.apply(spec).rollout.weight_sync_bucket_megabytes == AUTO:
        fixed_bucket = {"weight_sync_bucket_megabytes": AUTO_BUCKET_FALLBACK_MEGABYTES}
    if knobs.mem_fraction_static == AUTO and not training:
        margin, why = _auto_retry(spec, knobs, outcome)
        if margin > AUTO_MAX_MARGIN:
            return Decision(
                False,
                None,
                REASON_RETRIES_EXHAUSTED,
                f"{failed}; no knobs left: rollout Auto's margin would be {margin} (at most "
                f"{AUTO_MAX_MARGIN}): {why}",
            )
        candidate = knobs.model_copy(update={"margin": margin, **fixed_bucket})
        return Decision(
            True,
            candidate,
            REASON_OOM_RETRY,
            f"{failed}; attempt {attempts_made + 1} runs with "
            f"{changed_text(knobs, candidate, spec)} ({why})",
            why,
        )
    candidates = _training_candidates(spec, knobs) if training else _engine_candidates(spec, knobs)
    candidates = [c.model_copy(update=fixed_bucket) for c in candidates]
    for candidate in candidates:
        if training or fits(candidate) is not False:
            return Decision(
                True,
                candidate,
                REASON_OOM_RETRY,
                f"{failed}; attempt {attempts_made + 1} runs with "
                f"{changed_text(knobs, candidate, spec)}",
            )
    left = (
        f"training.microBatchSize is at spec.oomPolicy.minMicroBatchSize="
        f"{policy.min_micro_batch_size} and gradient checkpointing is on or not allowed "
        "(the engine is released in this stage, so its memory knobs cannot help)"
        if training
        else f"memFractionStatic would go below spec.oomPolicy.minFraction={policy.min_fraction} "
        "or to a value the memory plan says will not fit"
    )
    return Decision(False, None, REASON_RETRIES_EXHAUSTED, f"{failed}; no knobs left: {left}")


# -- admission by plan -----------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """The MemoryPlanFits condition and whether the job may start."""

    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    start: bool
    plan: ModePlan | None = None


def plan_for_knobs(
    spec: RLJobSpec, knobs: AttemptKnobs | None = None, capacity_bytes: int | None = None
) -> ModePlan | None:
    """The operator's plan: builtin models or spec.model.shape (it reads no files), on GPUs of
    `capacity_bytes` (what the ranks measured on the card they got) or else
    spec.memoryPlan.gpuMemory; None where neither is known, or the job runs on CPU."""
    if capacity_bytes is None and spec.memory_plan.gpu_memory is not None:
        capacity_bytes = int(_quantity(spec.memory_plan.gpu_memory))
    if spec.resources.gpus_per_worker == 0 or not capacity_bytes:
        return None
    shape = shape_for(spec, read_config=False)
    if shape is None:
        return None
    if knobs is not None:
        spec = knobs.apply(spec)
    if is_auto(spec):
        # What the driver will choose on a card of this size (AutoRefused: nothing fits).
        return _auto(spec.model_dump_json(), capacity_bytes).chosen
    return mode_plan(spec, shape, capacity_bytes)


@functools.lru_cache(maxsize=256)
def _auto(spec_json: str, capacity_bytes: int) -> AutoChoice:
    """auto_choice, memoised: it plans ~200 candidates (~0.2 s), and the operator admits on
    every reconcile of a job whose spec and card have not changed."""
    spec = RLJobSpec.model_validate_json(spec_json)
    shape = shape_for(spec, read_config=False)
    assert shape is not None  # plan_for_knobs checked it
    return auto_choice(spec, shape, capacity_bytes)


def plan_fits(
    spec: RLJobSpec, knobs: AttemptKnobs, capacity_bytes: int | None = None
) -> bool | None:
    """The plan's veto on a retry's knobs (OOM policy `fits`): None where it cannot plan."""
    try:
        planned = plan_for_knobs(spec, knobs, capacity_bytes)
    except AutoRefused:
        return False
    return None if planned is None else planned.fits


# A spec's gpuMemory this far from the card the ranks measured is said so (status, Event).
CAPACITY_TOLERANCE = 0.01


def capacity_note(spec: RLJobSpec, capacity_bytes: int | None) -> str:
    """'' unless the ranks reported a card whose capacity differs from spec.memoryPlan.gpuMemory
    by more than CAPACITY_TOLERANCE: then what the retry was planned on, and by how much."""
    if capacity_bytes is None or spec.memory_plan.gpu_memory is None:
        return ""
    declared = int(_quantity(spec.memory_plan.gpu_memory))
    apart = abs(capacity_bytes - declared) / max(declared, 1)
    if apart <= CAPACITY_TOLERANCE:
        return ""
    return (
        f" (planned on the card the ranks measured, {capacity_bytes} bytes; "
        f"spec.memoryPlan.gpuMemory={spec.memory_plan.gpu_memory} is {apart:.0%} off)"
    )


def admit(spec: RLJobSpec, knobs: AttemptKnobs | None = None) -> Admission:
    reject = spec.memory_plan.on_misfit is MisfitAction.REJECT
    try:
        m = plan_for_knobs(spec, knobs)
    except AutoRefused as refused:
        return Admission(
            "False",
            REASON_PLAN_MISFIT,
            str(refused)
            + (
                "; not started (spec.memoryPlan.onMisfit=Reject)"
                if reject
                else "; started anyway (onMisfit=Warn): the driver plans again on the real GPU"
            ),
            not reject,
        )
    if m is None:
        return Admission(
            "Unknown",
            REASON_PLAN_UNKNOWN,
            "no plan before the job runs: it needs a GPU job with spec.memoryPlan.gpuMemory and "
            "a builtin model or spec.model.shape (the driver plans on the real GPU)",
            True,
        )
    worst = m.worst
    applied = knobs.apply(spec) if knobs else spec
    rollout = applied.rollout
    chose = "Auto chose " if rollout_is_auto(applied) else ""
    bucket = ""
    if rollout.weight_sync_bucket_megabytes == AUTO and spec.memory_plan.gpu_memory is not None:
        capacity = int(_quantity(spec.memory_plan.gpu_memory))
        chosen_mb = _auto(applied.model_dump_json(), capacity).bucket_megabytes
        bucket = f", {'' if chose else 'Auto chose '}weight-sync bucket {chosen_mb} MiB"
    if m.fits:
        return Admission(
            "True",
            REASON_PLAN_FITS,
            f"predicted peak {worst.peak_bytes} bytes ({worst.fraction:.3f}) in {worst.stage}, "
            f"{chose}wakeUp {m.wake_up} at memFractionStatic {m.mem_fraction_static}{bucket}"
            + (" (the driver chooses again on the real GPU)" if is_auto(applied) else ""),
            True,
            m,
        )
    return Admission(
        "False",
        REASON_PLAN_MISFIT,
        f"wakeUp {m.wake_up} at memFractionStatic {m.mem_fraction_static}: {m.misfit_text()}"
        + (
            "; not started (spec.memoryPlan.onMisfit=Reject)"
            if reject
            else "; started anyway (onMisfit=Warn)"
        ),
        not reject,
        m,
    )
