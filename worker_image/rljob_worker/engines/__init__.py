"""Rollout engines behind one small interface (see base.py): `torch` (reference) and `sglang`.

`make_engine` is the one place that maps the spec's engine name to an implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rljob.api import EngineName, RLJobSpec
from rljob.plan import resolved_rollout
from rljob_worker.engines.base import RolloutEngine

if TYPE_CHECKING:
    from rljob_worker.saver import MemorySaver

__all__ = ["RolloutEngine", "cuda_index", "make_engine"]


def cuda_index(device: str) -> int:
    """The GPU index of a device string: 'cuda' -> 0, 'cuda:3' -> 3; anything else is refused."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"{device!r} is not a CUDA device (expected 'cuda' or 'cuda:N')")
    return int(index or 0)


def make_engine(
    spec: RLJobSpec,
    *,
    device: str,
    saver: MemorySaver | None = None,
    eos_token_ids: list[int] | None = None,
    node: str = "",
) -> RolloutEngine:
    """Build the rollout engine that spec.rollout.engine names, on `device`.

    The model is spec.model.path, resolved as training resolves it (builtin models are built
    into the local cache). For sglang with tensorParallelSize > 1 this is collective: every rank
    of the job calls it with its node's name, and each group of ranks gets one engine spanning
    its GPUs (engines/tensor_parallel.py). `saver` is the torch engine's memory saver (default:
    the one for `device`); sglang brings its own.
    """
    # Imported here: resolving a builtin model imports transformers, and each engine module
    # imports its own heavy dependencies (torch, sglang) only when chosen.
    from rljob_worker.model import resolve_model_path

    rollout = spec.rollout
    fraction = resolved_rollout(spec)[1]  # the driver resolved Auto on the card (loop.py)
    model_path = str(resolve_model_path(spec.model.path))
    if rollout.engine is EngineName.SGLANG:
        from rljob_worker.engines import sglang_engine, tensor_parallel

        def build(
            tp_size: int, base_gpu_id: int, handoff: sglang_engine.TensorHandoff | None = None
        ) -> sglang_engine.SGLangEngine:
            return sglang_engine.SGLangEngine(
                model_path=model_path,
                dtype=spec.model.dtype,
                mem_fraction_static=fraction,
                tp_size=tp_size,
                base_gpu_id=base_gpu_id,
                seed=spec.algorithm.seed,
                handoff=handoff,
            )

        if rollout.tensor_parallel_size == 1:
            return build(1, cuda_index(device))
        # One decision of how buckets travel (direct or not) for the group and its engine.
        handoff = sglang_engine.load_tensor_handoff()
        return tensor_parallel.make_tensor_parallel_engine(
            tp_size=rollout.tensor_parallel_size,
            device=device,
            node=node,
            # The leader sees the group's GPUs in rank order: its engine starts at the first.
            build=lambda tp_size: build(tp_size, 0, handoff),
            handoff=handoff,
        )
    if rollout.engine is EngineName.TORCH:
        if rollout.tensor_parallel_size != 1:
            raise ValueError(
                f"spec.rollout.tensorParallelSize={rollout.tensor_parallel_size}: the torch "
                "engine runs on one device; use 1, or rollout.engine=sglang"
            )
        from rljob_worker.engines.torch_engine import TorchEngine

        return TorchEngine(
            model_path,
            device=device,
            dtype=spec.model.dtype,
            mem_fraction_static=fraction,
            eos_token_ids=eos_token_ids,
            saver=saver,
        )
    raise ValueError(f"spec.rollout.engine={rollout.engine!r} has no engine")
