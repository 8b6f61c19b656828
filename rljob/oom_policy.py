"""The OOM policy and plan admission as pure functions: an attempt's outcome in, the next
attempt's knobs (or the reason to stop) out; a spec and its plan in, MemoryPlanFits out.

The operator is the shell (it reads the RayJob and status.oomEvents, creates the next RayJob,
writes status.attempts and Events); nothing here does I/O or imports kopf or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from rljob.api import MAX_NAME_LENGTH, AttemptKnobs, MisfitAction, RLJobSpec, WakeUp, _quantity
from rljob.plan import ModePlan, mode_plan, shape_for
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


@dataclass(frozen=True)
class Decision:
    """The policy's answer: retry with `knobs`, or stop with `reason` (None: nothing to do)."""

    retry: bool
    knobs: AttemptKnobs | None
    reason: str | None
    message: str


def first_knobs(spec: RLJobSpec) -> AttemptKnobs:
    return AttemptKnobs(
        mem_fraction_static=spec.rollout.mem_fraction_static, wake_up=spec.rollout.wake_up
    )


def rayjob_name(job: str, attempt: int) -> str:
    """Attempt 1 keeps the RLJob's name; later ones get '-aN', the name cut to stay within
    KubeRay's 47 characters."""
    if attempt == 1:
        return job
    suffix = f"-a{attempt}"
    return job[: MAX_NAME_LENGTH - len(suffix)].rstrip("-") + suffix


def next_attempt(
    spec: RLJobSpec,
    knobs: AttemptKnobs,
    attempts_made: int,
    outcome: Outcome,
    fits: Callable[[AttemptKnobs], bool | None] = lambda _k: None,
) -> Decision:
    """After attempt number `attempts_made` (run with `knobs`) ended in `outcome`.

    A CUDA OOM retries while spec.oomPolicy.maxRetries allows: wakeUp single becomes staged
    first (switchToStaged), else memFractionStatic drops by fractionStep, never below
    minFraction, and past values `fits` says will not fit (None: no plan, no veto). A container
    OOMKilled (host memory) is never retried: lowering the GPU fraction does not help it.
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
            "(the OOM policy lowers GPU memory only, so this is not retried)",
        )
    if outcome.kind != "CUDAOutOfMemory":
        return Decision(False, None, None, "")
    where = (
        f"stage {outcome.stage or '?'}, rank {outcome.rank if outcome.rank is not None else '?'}"
    )
    retries_used = attempts_made - 1
    if retries_used >= policy.max_retries:
        return Decision(
            False,
            None,
            REASON_RETRIES_EXHAUSTED,
            f"CUDA OOM in {where} on attempt {attempts_made} "
            f"(memFractionStatic {knobs.mem_fraction_static}, wakeUp {knobs.wake_up}); "
            f"{retries_used} of spec.oomPolicy.maxRetries={policy.max_retries} retries used",
        )
    candidates: list[AttemptKnobs] = []
    if knobs.wake_up is WakeUp.SINGLE and policy.switch_to_staged:
        candidates.append(
            AttemptKnobs(mem_fraction_static=knobs.mem_fraction_static, wake_up=WakeUp.STAGED)
        )
    wake_up = WakeUp.STAGED if candidates else knobs.wake_up
    fraction = Decimal(str(knobs.mem_fraction_static))
    step, floor = Decimal(str(policy.fraction_step)), Decimal(str(policy.min_fraction))
    while (fraction := fraction - step) >= floor and fraction > 0:
        candidates.append(AttemptKnobs(mem_fraction_static=float(fraction), wake_up=wake_up))
    for candidate in candidates:
        if fits(candidate) is not False:
            return Decision(
                True,
                candidate,
                REASON_OOM_RETRY,
                f"CUDA OOM in {where} on attempt {attempts_made} (memFractionStatic "
                f"{knobs.mem_fraction_static}, wakeUp {knobs.wake_up}); attempt "
                f"{attempts_made + 1} runs with memFractionStatic "
                f"{candidate.mem_fraction_static}, wakeUp {candidate.wake_up}",
            )
    return Decision(
        False,
        None,
        REASON_RETRIES_EXHAUSTED,
        f"CUDA OOM in {where} on attempt {attempts_made}; no knobs left: memFractionStatic "
        f"would go below spec.oomPolicy.minFraction={policy.min_fraction} or to a value the "
        "memory plan says will not fit",
    )


# -- admission by plan -----------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """The MemoryPlanFits condition and whether the job may start."""

    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    start: bool
    plan: ModePlan | None = None


def plan_for_knobs(spec: RLJobSpec, knobs: AttemptKnobs | None = None) -> ModePlan | None:
    """The operator's plan: builtin models or spec.model.shape (it reads no files), on GPUs of
    spec.memoryPlan.gpuMemory; None where either is missing or the job runs on CPU."""
    gpu_memory = spec.memory_plan.gpu_memory
    if spec.resources.gpus_per_worker == 0 or gpu_memory is None:
        return None
    shape = shape_for(spec, read_config=False)
    if shape is None:
        return None
    if knobs is not None:
        rollout = spec.rollout.model_copy(
            update={"mem_fraction_static": knobs.mem_fraction_static, "wake_up": knobs.wake_up}
        )
        spec = spec.model_copy(update={"rollout": rollout})
    return mode_plan(spec, shape, int(_quantity(gpu_memory)))


def admit(spec: RLJobSpec, knobs: AttemptKnobs | None = None) -> Admission:
    m = plan_for_knobs(spec, knobs)
    if m is None:
        return Admission(
            "Unknown",
            REASON_PLAN_UNKNOWN,
            "no plan before the job runs: it needs a GPU job with spec.memoryPlan.gpuMemory and "
            "a builtin model or spec.model.shape (the driver plans on the real GPU)",
            True,
        )
    worst = m.worst
    if m.fits:
        return Admission(
            "True",
            REASON_PLAN_FITS,
            f"predicted peak {worst.peak_bytes} bytes ({worst.fraction:.3f}) in {worst.stage}, "
            f"wakeUp {m.wake_up} at memFractionStatic {m.mem_fraction_static}",
            True,
            m,
        )
    reject = spec.memory_plan.on_misfit is MisfitAction.REJECT
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
