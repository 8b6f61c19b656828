"""status.plan: the memory plan the driver computed (per-stage peaks, the start-up, and
what rollout Auto chose and why).
"""

from __future__ import annotations

from pydantic import Field

from rljob.api._base import _Spec
from rljob.api.rollout import WakeUp
from rljob.report import Stage


class PlannedStage(_Spec):
    """One stage of `status.plan`: the predicted device peak of the worst rank."""

    name: Stage
    peak_bytes: int = Field(ge=0)
    peak_fraction: float = Field(ge=0)


class PlannedLoad(_Spec):
    """`status.plan.load`: the predicted start-up peak (models built and loaded, before
    iteration 0) of the worst rank, and the host bytes loading takes per worker pod."""

    peak_bytes: int = Field(ge=0)
    peak_fraction: float = Field(ge=0)
    host_bytes_per_node: int = Field(
        ge=0, description="Per worker pod: its ranks' slice buffers while they read the files."
    )


class PlanCandidate(_Spec):
    """One (wakeUp, memFractionStatic) the Auto choice planned."""

    wake_up: WakeUp
    mem_fraction_static: float
    worst_stage: Stage
    peak_bytes: int = Field(ge=0, description="The worst stage's predicted peak.")
    kv_tokens: int = Field(ge=0)
    kv_pool_bytes: int = Field(ge=0)
    fits: bool = Field(description="Every stage within the limit (capacity less the margin).")


MAX_PLAN_CANDIDATES = 8


class AutoStatus(_Spec):
    """What rollout Auto chose, against what, and why (rljob/plan/auto.py auto_choice)."""

    margin: float = Field(description="spec.memoryPlan.margin as this attempt ran it.")
    limit_bytes: int = Field(ge=0, description="Capacity less the margin: no stage may pass it.")
    planned: int = Field(ge=0, description="Candidates planned (wakeUp modes x fractions).")
    reason: str = Field(default="", max_length=1024)
    candidates: list[PlanCandidate] = Field(
        default_factory=list,
        max_length=MAX_PLAN_CANDIDATES,
        description="Per wakeUp mode the chosen or best fitting candidate and the next one up "
        "that does not fit (bounded).",
    )
    weight_sync_bucket_megabytes: int | None = Field(
        default=None,
        ge=1,
        description="Where spec.rollout.weightSyncBucketMegabytes is Auto: the bucket chosen.",
    )
    rollout: bool = Field(
        default=True,
        description="Whether wakeUp or memFractionStatic was Auto (false: only the bucket was; "
        "then no candidates of mode and fraction were compared).",
    )


class PlanStatus(_Spec):
    """`status.plan`, written by the job's driver before iteration 1 (rljob/plan/memory_plan.py)."""

    capacity_bytes: int = Field(ge=0)
    wake_up: WakeUp
    mem_fraction_static: float
    fits: bool
    offload_optimizer: bool
    offload_params: bool
    stages: list[PlannedStage]
    largest_fitting_fraction: dict[str, float | None] = Field(
        default_factory=dict, description="wakeUp mode -> largest memFractionStatic that fits."
    )
    auto: AutoStatus | None = Field(
        default=None, description="Where rollout Auto chose the mode or fraction: how and why."
    )
    attempt: int | None = Field(
        default=None,
        ge=1,
        description="The OOM policy's attempt this plan was made for (a retry's overshoot is "
        "measured against its own attempt's plan only).",
    )
    load: PlannedLoad | None = Field(
        default=None, description="The start-up: policy and reference built and loaded."
    )
