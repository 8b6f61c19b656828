"""The plan of one job (MemoryPlan, plan): both wake-up modes with Auto resolved, and what a
rank takes from it: its own plan (rank_plan), the spec it runs and the offload it stages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rljob.api import AUTO, AutoStatus, OffloadMode, PlannedStage, PlanStatus, RLJobSpec, WakeUp
from rljob.plan.auto import AutoChoice, AutoRefused, auto_choice
from rljob.plan.knobs import (
    AUTO_BUCKET_FALLBACK_MEGABYTES,
    _with,
    _with_bucket,
    is_auto,
    resolved_rollout,
)
from rljob.plan.model_shape import MixtureOfExperts, ModelShape, shape_for
from rljob.plan.stages import ModePlan, largest_fitting_fraction, mode_plan
from rljob.plan.weight_sync import with_process_switches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one job: per mode, per stage, on one rank (the largest shard, rank 0)."""

    capacity_bytes: int
    world_size: int
    shape: ModelShape
    requested: WakeUp
    modes: dict[WakeUp, ModePlan] = field(default_factory=dict)
    auto: AutoChoice | None = None

    @property
    def chosen(self) -> ModePlan:
        return self.modes[self.requested]

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacityBytes": self.capacity_bytes,
            "worldSize": self.world_size,
            "shape": self.shape.__dict__,
            "parameters": self.shape.parameters,
            "requested": str(self.requested),
            "auto": (
                self.auto.to_status().model_dump(by_alias=True, mode="json")
                if self.auto is not None
                else None
            ),
            "modes": {
                str(mode): {
                    "memFractionStatic": m.mem_fraction_static,
                    "fits": m.fits,
                    "offloadOptimizer": m.offload_optimizer,
                    "offloadParams": m.offload_params,
                    "largestFittingFraction": m.largest_fitting_fraction,
                    "kvTokens": m.parts.kv_tokens,
                    "parts": m.parts.as_dict(),
                    "load": m.load.to_dict() if m.load is not None else None,
                    "stages": [
                        {
                            "name": str(s.stage),
                            "peakBytes": s.peak_bytes,
                            "fraction": round(s.fraction, 4),
                            "headroomBytes": s.headroom_bytes,
                            "fits": s.fits,
                        }
                        for s in m.stages
                    ],
                }
                for mode, m in self.modes.items()
            },
        }

    def to_status(self, auto: AutoStatus | None = None) -> PlanStatus:
        m = self.chosen
        return PlanStatus(
            auto=auto or (self.auto.to_status() if self.auto is not None else None),
            capacity_bytes=self.capacity_bytes,
            wake_up=m.wake_up,
            mem_fraction_static=m.mem_fraction_static,
            fits=m.fits,
            offload_optimizer=m.offload_optimizer,
            offload_params=m.offload_params,
            stages=[
                PlannedStage(
                    name=s.stage, peak_bytes=s.peak_bytes, peak_fraction=round(s.fraction, 4)
                )
                for s in m.stages
            ],
            largest_fitting_fraction={
                str(k): v.largest_fitting_fraction for k, v in self.modes.items()
            },
            load=m.load.to_status() if m.load is not None else None,
        )


def plan(
    spec: RLJobSpec, shape: ModelShape, capacity_bytes: int, world: int | None = None
) -> MemoryPlan:
    """Both wake-up modes at the spec's fraction, each with its largest fitting fraction."""
    world = world or spec.world_size
    auto = None
    # The modes' tables: under the bucket's Auto, at the smallest bucket it takes (the size it
    # chose fits the chosen mode only; Auto's own row replaces that mode's below).
    tables = spec
    if spec.rollout.weight_sync_bucket_megabytes == AUTO:
        tables = _with_bucket(spec, AUTO_BUCKET_FALLBACK_MEGABYTES)
    if is_auto(spec):
        auto = auto_choice(spec, shape, capacity_bytes, world)
        spec = auto.resolve(spec)
        tables = _with(tables, auto.chosen.wake_up, auto.chosen.mem_fraction_static)
    requested, fraction = resolved_rollout(spec)
    modes = {}
    for mode in (WakeUp.STAGED, WakeUp.SINGLE):
        m = mode_plan(_with(tables, mode, fraction), shape, capacity_bytes, world)
        best = largest_fitting_fraction(tables, shape, capacity_bytes, mode, world)
        modes[mode] = replace(m, largest_fitting_fraction=best)
    if auto is not None:
        # The mode Auto chose, with the offload it chose under the margin's limit.
        modes[requested] = replace(
            auto.chosen, largest_fitting_fraction=modes[requested].largest_fitting_fraction
        )
    return MemoryPlan(capacity_bytes, world, shape, requested, modes, auto)


def resolved_spec(spec: RLJobSpec, memory_plan: MemoryPlan | None) -> RLJobSpec:
    """The spec the ranks run: Auto replaced by the plan's choice (unchanged without Auto)."""
    if not is_auto(spec):
        return spec
    if memory_plan is None or memory_plan.auto is None:
        raise AutoRefused(
            "rollout Auto (wakeUp, memFractionStatic or weightSyncBucketMegabytes) needs the "
            "memory plan: the model's shape (a builtin model, "
            "spec.model.shape or a config.json) and the GPU's memory (on CPU: "
            "spec.memoryPlan.gpuMemory or the host's)"
        )
    return memory_plan.auto.resolve(spec)


def rank_plan(
    spec: RLJobSpec,
    capacity_bytes: int | None,
    world: int,
    model_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> MemoryPlan | None:
    """The plan a rank makes before starting its engine: its real GPU's memory (or, on CPU,
    spec.memoryPlan.gpuMemory), the shape from builtin, spec or config.json; None without.
    `environ`: the rank's environment, where the weight sync's switches are read
    (with_process_switches); without it, the spec's env."""
    from rljob.api import _quantity  # the manifest's quantity parser (no kubernetes client)

    if capacity_bytes is None and spec.memory_plan.gpu_memory is not None:
        capacity_bytes = int(_quantity(spec.memory_plan.gpu_memory))
    try:
        shape = shape_for(spec)
        config = Path(model_path) / "config.json" if model_path is not None else None
        if shape is None and config is not None and config.is_file():
            shape = ModelShape.from_config(json.loads(config.read_text()))
    except MixtureOfExperts as error:
        # No plan, as for a shape it cannot read: the job runs with the knobs it names (offload
        # flags, a fixed memFractionStatic); a knob only the plan picks (Auto) says it needs one.
        log.warning("no memory plan: %s", error)
        return None
    if shape is None or capacity_bytes is None:
        return None
    if environ is not None:
        spec = with_process_switches(spec, environ)
    return plan(spec, shape, capacity_bytes, world)


def offload_choice(spec: RLJobSpec, memory_plan: MemoryPlan | None) -> tuple[bool, bool]:
    """(offload optimizer, offload params) for the stage machine: Always, or no plan, is what
    training.offloadOptimizer/offloadParams say; Auto is the plan's least offload that fits."""
    allowed = (spec.training.offload_optimizer, spec.training.offload_params)
    if spec.offload is OffloadMode.ALWAYS or memory_plan is None:
        return allowed
    chosen = memory_plan.chosen
    return chosen.offload_optimizer, chosen.offload_params
