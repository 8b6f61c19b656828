"""spec.training: FSDP training of the policy and what it offloads during rollout."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from rljob.api._base import _Spec


class OverlapStaging(StrEnum):
    AUTO = "Auto"
    ON = "On"
    OFF = "Off"


class TrainingSpec(_Spec):
    """FSDP training of the policy (verl: actor_rollout_ref.actor)."""

    strategy: Literal["fsdp2"] = Field(
        default="fsdp2", description="torch.distributed.fsdp.fully_shard over all ranks."
    )
    micro_batch_size: int = Field(
        default=2,
        ge=1,
        description="Sequences per forward/backward per rank at the rollout's longest "
        "(verl: actor.ppo_micro_batch_size_per_gpu); shorter ones are packed by length up to "
        "the same padded tokens (verl: use_dynamic_bsz), so memory is bounded as for this many "
        "sequences of the longest.",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward."
    )
    offload_optimizer: bool = Field(
        default=True,
        description="Move optimizer state to pinned CPU memory during rollout "
        "(verl: actor.fsdp_config.optimizer_offload).",
    )
    offload_params: bool = Field(
        default=True,
        description="Move training parameters to CPU during rollout "
        "(verl: actor.fsdp_config.param_offload). Staged wake-up frees them before the "
        "KV cache is resumed.",
    )
    overlap_staging: OverlapStaging = Field(
        default=OverlapStaging.OFF,
        description="Move the offloaded training state over PCIe behind other work "
        "(docs/performance.md, 'Staging behind compute'): the optimizer state comes back while "
        "the first micro-batches run (the optimizer step waits for it), goes out while the "
        "weight sync runs (staged wake-up), and the params come back while the engine's "
        "weights are released. Results are bit-identical either way; the memory plan counts "
        "the optimizer state in wake_weights (staged) and no longer in sleep. "
        "Auto: On where the worker has CUDA. Off (the default: at a realistic 3B workload on "
        "one H200, On took 0.9 s out of the staging stages of a 74 s iteration and did not "
        "make the iteration shorter): each copy completes in its own stage.",
    )
