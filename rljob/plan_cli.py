"""`rljob plan MANIFEST`: the memory plan of an RLJob manifest as a per-stage table or JSON.

The shell around rljob/plan/: reads the manifest and the GPU's memory (given, or read from
the local GPU through torch when it is installed), prints; the arithmetic is all in rljob/plan/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rljob.api import _quantity, load_manifest
from rljob.plan import AutoRefused, GiB, MemoryPlan, auto_lines, plan, shape_for

# A GPU's memory, not a host's: the largest GPUs have a few hundred GiB.
MAX_GPU_BYTES = 16 * 2**40


def parse_bytes(text: str) -> int:
    """'85017493504', '80Gi', '80G' (a Kubernetes quantity) -> bytes, of one GPU."""
    try:
        value = int(_quantity(text.strip()))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count or quantity") from error
    if not 0 < value <= MAX_GPU_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: one GPU's memory is more than 0 and at most 16Ti"
        )
    return value


def local_gpu_bytes() -> int | None:
    """The first local GPU's total memory, where torch and a GPU are there."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[1])


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 10**8 else f"{n / 1e6:.3f} M"


def _fraction(x: float) -> str:
    return f"{x:.2f}" if round(x, 2) == x else f"{x:g}"


def table(name: str, memory_plan: MemoryPlan) -> str:
    capacity = memory_plan.capacity_bytes
    lines = [
        f"RLJob {name}: {_count(memory_plan.shape.parameters)} params, "
        f"{memory_plan.world_size} rank(s), GPU {capacity / GiB:.2f} GiB ({capacity} bytes); "
        f"per rank (rank 0, the largest shard): the start-up load, then a steady iteration",
    ]
    if memory_plan.auto is not None:
        lines += ["", *auto_lines(memory_plan.to_status())]
    for mode, m in memory_plan.modes.items():
        chosen = (
            ""
            if mode != memory_plan.requested
            else " (Auto's choice)"
            if memory_plan.auto is not None
            else " (the spec's)"
        )
        lines += [
            "",
            f"wakeUp {mode}{chosen} at memFractionStatic {_fraction(m.mem_fraction_static)}: "
            f"{'fits' if m.fits else 'DOES NOT FIT: ' + m.misfit_text()}; KV pool "
            f"{m.parts.kv_tokens} tokens; offload optimizer {m.offload_optimizer}, "
            f"params {m.offload_params}",
            f"  {'stage':<18}{'predicted GiB':>14}{'fraction':>10}{'headroom GiB':>14}",
        ]
        if m.load is not None:  # the start-up, once, before iteration 0
            load = m.load
            lines.append(
                f"  {'load':<18}{load.device_bytes / GiB:>14.2f}{load.fraction:>10.3f}"
                f"{(capacity - load.device_bytes) / GiB:>14.2f}{'' if load.fits else '  over'}"
                f"  (host {load.host_bytes_per_node / GiB:.2f} GiB per worker pod: "
                f"{load.ranks_per_node} x {load.host_bytes_per_rank / GiB:.2f})"
            )
        for s in m.stages:
            lines.append(
                f"  {s.stage!s:<18}{s.peak_bytes / GiB:>14.2f}{s.fraction:>10.3f}"
                f"{s.headroom_bytes / GiB:>14.2f}{'' if s.fits else '  over'}"
            )
        best = m.largest_fitting_fraction
        lines.append(
            f"  largest memFractionStatic that fits: {best:.2f}"
            if best is not None
            else "  no memFractionStatic fits"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rljob plan", description="Predict per-stage GPU memory of an RLJob manifest."
    )
    parser.add_argument("manifest", type=Path)
    parser.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        help="bytes of one GPU (85017493504, 80Gi); default spec.memoryPlan.gpuMemory, then "
        "the local GPU",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        name, spec = load_manifest(args.manifest)
    except (OSError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        print(f"rljob plan: {error}", file=sys.stderr)
        return 2
    try:
        shape = shape_for(spec)
    except ValueError as error:  # a config.json the plan cannot size (a mixture of experts)
        print(f"rljob plan: RLJob {name}: {error}", file=sys.stderr)
        return 2
    if shape is None:
        parser.error(
            f"RLJob {name}: no model shape for spec.model.path={spec.model.path!r}: give "
            "spec.model.shape, or a local directory with config.json"
        )
    capacity = args.gpu_memory
    if capacity is None and spec.memory_plan.gpu_memory is not None:
        capacity = int(_quantity(spec.memory_plan.gpu_memory))
    capacity = capacity or local_gpu_bytes()
    if capacity is None:
        parser.error(
            "no GPU memory: pass --gpu-memory (e.g. 80Gi) or set spec.memoryPlan.gpuMemory"
        )
    try:
        memory_plan = plan(spec, shape, capacity)
    except AutoRefused as refused:
        print(f"rljob plan: RLJob {name}: {refused}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"name": name, **memory_plan.to_dict()}, indent=2))
    else:
        print(table(name, memory_plan))
    return 0 if memory_plan.chosen.fits else 1
