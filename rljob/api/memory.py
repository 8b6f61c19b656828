"""spec.memoryPlan, spec.offload, spec.oomPolicy: what the memory plan may decide and how a job
retries after a CUDA out-of-memory.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from rljob.api._base import PositiveQuantity, _Spec


class MisfitAction(StrEnum):
    REJECT = "Reject"
    WARN = "Warn"


# The plan's largest |error| per stage peak on the current tree's GPU runs is 2.79% (and that one
# an over-prediction); every stored run's, 4.88%, came from trees since fixed (the cuBLAS
# workspace pinning freed training memory): bench/results/plan-accuracy.md.
DEFAULT_PLAN_MARGIN = 0.015


class MemoryPlanSpec(_Spec):
    """What to do when the memory plan (rljob/plan/) says the job will not fit its GPUs."""

    on_misfit: MisfitAction = Field(
        default=MisfitAction.WARN,
        description="Reject: a job predicted not to fit is not started (no RayJob; phase "
        "Failed). Warn: it starts, with condition MemoryPlanFits=False and a Warning Event.",
    )
    gpu_memory: PositiveQuantity | None = Field(
        default=None,
        description="Memory of one GPU (e.g. 80Gi, or 85017493504) for the operator's plan "
        "before any pod runs; the driver reads the real GPU and plans again before starting.",
    )
    margin: float = Field(
        default=DEFAULT_PLAN_MARGIN,
        ge=0,
        lt=0.5,
        description="For rollout Auto: the share of the GPU every stage's predicted peak leaves "
        "free (the plan's error). The default 0.015 covers the largest amount by which a stage "
        "needed more than planned in every stored GPU run, 1.25% of the GPU "
        "(docs/zero-tuning.md). An OOM retry raises it by the overshoot it measured.",
    )


class OffloadMode(StrEnum):
    AUTO = "Auto"
    ALWAYS = "Always"


class OOMPolicySpec(_Spec):
    """Retries after a CUDA out-of-memory in a stage, each a new RayJob with adjusted knobs."""

    max_retries: int = Field(
        default=0, ge=0, le=20, description="New attempts after a CUDA OOM; 0 never retries."
    )
    fraction_step: float = Field(
        default=0.05,
        gt=0,
        lt=1,
        description="How much each retry lowers rollout.memFractionStatic.",
    )
    min_fraction: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="A retry never lowers memFractionStatic below this.",
    )
    switch_to_staged: bool = Field(
        default=True,
        description="A job in wakeUp single retries first as staged (same fraction).",
    )
    min_micro_batch_size: int = Field(
        default=1,
        ge=1,
        description="A CUDA OOM in train or offload_optimizer (the engine is released then, so "
        "its fraction cannot help) halves training.microBatchSize, never below this.",
    )
    gradient_checkpointing: bool = Field(
        default=True,
        description="Once training.microBatchSize is at minMicroBatchSize, a training-stage OOM "
        "retries with gradient checkpointing on (slower, far fewer activations).",
    )
