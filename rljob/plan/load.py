"""The memory plan's start-up row: one rank's device peak and its worker's host bytes while the
models are built and loaded, before iteration 0 (LoadPeak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rljob.api import PlannedLoad, RLJobSpec
from rljob.plan.costs import (
    ALLOCATOR_SLACK_BYTES,
    DTYPE_BYTES,
    MASTER_BYTES,
    TRAIN_RESIDUAL_BYTES,
    GiB,
)
from rljob.plan.model_shape import ModelShape
from rljob.plan.rank_parts import Parts

# -- start-up: building and loading the models ---------------------------------------------------


@dataclass(frozen=True)
class LoadPeak:
    """Start-up (train.Trainer with sharded_load.py): policy and reference built on the meta
    device and sharded, then each rank's rows read from the files one tensor at a time.

    Device: the CUDA context, NCCL and the engine's bytes outside its regions (it started
    first and released them), every shard of this rank, and one slice cast to fp32. Host, per
    rank beyond the process's own: the largest slice as stored plus its fp32 cast; per node,
    times the worker's ranks. The files' pages are page cache (the model once per node, shared
    by the ranks and by policy and reference): reclaimable, not counted.
    """

    device_bytes: int
    capacity_bytes: int
    host_bytes_per_rank: int
    ranks_per_node: int
    host_limit_bytes: int  # the worker pod's memory (spec.resources.memory)

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_rank * self.ranks_per_node

    @property
    def fraction(self) -> float:
        return self.device_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def host_fits(self) -> bool:
        """The worker's host bytes within the pod's memory (spec.resources.memory)."""
        return self.host_bytes_per_node <= self.host_limit_bytes

    def fits_under(self, limit_bytes: int) -> bool:
        return self.device_bytes + ALLOCATOR_SLACK_BYTES <= limit_bytes and self.host_fits

    @property
    def fits(self) -> bool:
        return self.fits_under(self.capacity_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peakBytes": self.device_bytes,
            "fraction": round(self.fraction, 4),
            "hostBytesPerRank": self.host_bytes_per_rank,
            "hostBytesPerNode": self.host_bytes_per_node,
            "ranksPerNode": self.ranks_per_node,
            "hostLimitBytes": self.host_limit_bytes,
            "fits": self.fits,
        }

    def to_status(self) -> PlannedLoad:
        return PlannedLoad(
            peak_bytes=self.device_bytes,
            peak_fraction=round(self.fraction, 4),
            host_bytes_per_node=self.host_bytes_per_node,
        )

    def misfit_text(self) -> str:
        over = []
        if self.device_bytes + ALLOCATOR_SLACK_BYTES > self.capacity_bytes:
            over.append(
                f"load needs {self.device_bytes / GiB:.2f} GiB of {self.capacity_bytes / GiB:.2f}"
                f" GiB ({(self.device_bytes + ALLOCATOR_SLACK_BYTES - self.capacity_bytes) / GiB:.2f}"
                " GiB over)"
            )
        if not self.host_fits:
            over.append(self.host_misfit_text())
        return "; ".join(over)

    def host_misfit_text(self) -> str:
        return (
            f"load needs {self.host_bytes_per_node / GiB:.2f} GiB of host memory per worker "
            f"pod, spec.resources.memory is {self.host_limit_bytes / GiB:.2f} GiB"
        )


def load_peak(
    spec: RLJobSpec, shape: ModelShape, p: Parts, capacity_bytes: int, world: int
) -> LoadPeak:
    """The start-up peak of one rank (rank 0 holds the largest shard) and its worker's host."""
    from rljob.api import _quantity  # the manifest's quantity parser (no kubernetes client)

    # The largest rank slice of any tensor, in elements (FSDP2's dim-0 chunk of the largest).
    slice_elements = max(math.ceil(size / world) for _, size in shape.named_sizes())
    stored = DTYPE_BYTES[spec.model.dtype]  # checkpoints are stored in the engine's dtype
    return LoadPeak(
        device_bytes=p.context
        - TRAIN_RESIDUAL_BYTES
        + p.train_params
        + slice_elements * MASTER_BYTES,
        capacity_bytes=capacity_bytes,
        host_bytes_per_rank=slice_elements * (stored + MASTER_BYTES),
        ranks_per_node=min(spec.resources.ranks_per_worker, world),
        host_limit_bytes=int(_quantity(spec.resources.memory)),
    )
