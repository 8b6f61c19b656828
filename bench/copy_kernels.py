"""How fast the weight sync's two copies run on a GPU, by the way they are launched (issue 33).

The sync at 3B in one bucket has two copies of the whole model on the card: the sender's cast
(the trainer's fp32 shards into the send buffer in bf16: the HBM floor the issue counts) and the
loader's copy (that buffer into sglang's bf16 weights). Both run over the model's 434 tensors of
very different sizes (a 2048-element norm beside a 11008 x 2048 projection). This times each
copy, on the tensors of a Qwen2.5 shape, launched four ways:

- foreach: one torch._foreach_copy_ over every pair (what the send plan and the loader's plan
  did before weight_sync.copy_pairs);
- per_tensor: one copy_ per pair;
- hybrid: weight_sync.copy_pairs with its threshold at --large-bytes (destination bytes): a
  copy_ for each pair at or above it, one _foreach_copy_ for the rest (what they do now, at
  32 MiB);
- flat: one copy_ between two contiguous buffers of the same total size (what the memory
  traffic alone costs; not a way the sync can run, as the shards are separate tensors).

For each: the host time to launch, the GPU time (CUDA events) and the wall time to the end of
the copies, medians of --repeats, beside the floor (bytes read and written over the card's
bandwidth, measured here with one large copy). Needs torch and a CUDA card only.

    python bench/copy_kernels.py --out results/raw/copy-kernels-h200/
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

# Qwen2.5-3B (the bench's 3B shape): hidden 2048, MLP 11008, 36 layers, 16 query heads and 2 KV
# heads of 128, vocabulary 151936, tied embeddings.
SHAPE = {"hidden": 2048, "mlp": 11008, "layers": 36, "q": 2048, "kv": 256, "vocab": 151936}


def shapes(s: dict[str, int]) -> list[tuple[int, ...]]:
    h, m = s["hidden"], s["mlp"]
    layer = [
        (s["q"], h), (s["q"],), (s["kv"], h), (s["kv"],), (s["kv"], h), (s["kv"],),
        (h, s["q"]), (m, h), (m, h), (h, m), (h,), (h,),
    ]  # fmt: skip
    return [(s["vocab"], h), *layer * s["layers"], (h,)]


def ways(
    sources: list[torch.Tensor], dests: list[torch.Tensor], flat_src: torch.Tensor,
    flat_dst: torch.Tensor, large: int,
) -> dict[str, Any]:  # fmt: skip
    from rljob_worker.weight_sync import copy_pairs, split_copies

    split = split_copies([d.numel() * d.element_size() for d in dests], large)

    def foreach() -> None:
        torch._foreach_copy_(dests, sources)

    def per_tensor() -> None:
        for d, s in zip(dests, sources, strict=True):
            d.copy_(s)

    def hybrid() -> None:
        copy_pairs(dests, sources, split)

    def flat() -> None:
        flat_dst.copy_(flat_src)

    return {"foreach": foreach, "per_tensor": per_tensor, "hybrid": hybrid, "flat": flat,
            "large_tensors": len(split[0])}  # fmt: skip


def time_way(fn: Any, repeats: int) -> dict[str, float]:
    host, gpu, wall = [], [], []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        t1 = time.perf_counter()
        end.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        gpu.append(start.elapsed_time(end) / 1e3)
        wall.append(t2 - t0)
    keep = slice(2, None)  # the first two warm the kernels and the allocator
    return {
        "host_s": statistics.median(host[keep]),
        "gpu_s": statistics.median(gpu[keep]),
        "wall_s": statistics.median(wall[keep]),
    }


def copy_bandwidth() -> float:
    """Bytes read plus written per second by one 4 GiB device-to-device copy."""
    a = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)

    def copy() -> None:
        b.copy_(a)

    runs = [time_way(copy, 5)["gpu_s"] for _ in range(3)]
    return 2 * a.numel() * a.element_size() / min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=SHAPE["layers"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--large-bytes", type=int, nargs="+", default=[1 << 20, 32 << 20])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = {**SHAPE, "layers": args.layers}
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    tensor_shapes = shapes(shape)
    numel = sum(int(torch.Size(s).numel()) for s in tensor_shapes)
    rows: list[dict[str, Any]] = []
    copies = {
        # The sender's cast: fp32 shards (separate tensors) into one bf16 send buffer.
        "cast fp32->bf16": (torch.float32, torch.bfloat16),
        # The loader's copy: the bf16 buffer into the engine's bf16 weights (separate tensors).
        "copy bf16->bf16": (torch.bfloat16, torch.bfloat16),
    }
    for copy_name, (src_dtype, dst_dtype) in copies.items():
        if src_dtype == torch.float32:
            sources = [torch.randn(s, dtype=src_dtype, device="cuda") for s in tensor_shapes]
            flat_dst = torch.empty(numel, dtype=dst_dtype, device="cuda")
            dests = list(torch.split(flat_dst, [t.numel() for t in sources]))
            dests = [d.view(s.shape) for d, s in zip(dests, sources, strict=True)]
            flat_src = torch.randn(numel, dtype=src_dtype, device="cuda")
        else:
            flat_src = torch.randn(numel, dtype=src_dtype, device="cuda")
            sources = [
                p.view(s)
                for p, s in zip(
                    torch.split(flat_src, [int(torch.Size(s).numel()) for s in tensor_shapes]),
                    tensor_shapes,
                    strict=True,
                )
            ]
            dests = [torch.empty(s, dtype=dst_dtype, device="cuda") for s in tensor_shapes]
            flat_dst = torch.empty(numel, dtype=dst_dtype, device="cuda")
        moved = numel * (src_dtype.itemsize + dst_dtype.itemsize)
        floor = moved / bandwidth
        for large in args.large_bytes:
            fns = ways(sources, dests, flat_src, flat_dst, large)
            for way in ("foreach", "per_tensor", "hybrid", "flat"):
                if way != "hybrid" and large != args.large_bytes[0]:
                    continue  # the same as at the first threshold
                timed = time_way(fns[way], args.repeats)
                rows.append({
                    "copy": copy_name, "way": way,
                    "large_bytes": large if way == "hybrid" else None,
                    "large_tensors": fns["large_tensors"] if way == "hybrid" else None,
                    "tensors": len(sources), "bytes_moved": moved, "floor_s": floor, **timed,
                })  # fmt: skip
                r = rows[-1]
                label = f"{way}" + (f" (>= {large} B: {r['large_tensors']})" if r["large_bytes"] else "")  # fmt: skip
                print(
                    f"{copy_name:16s} {label:30s} host {r['host_s'] * 1e3:7.2f} ms  "
                    f"gpu {r['gpu_s'] * 1e3:7.2f} ms  wall {r['wall_s'] * 1e3:7.2f} ms  "
                    f"floor {floor * 1e3:.2f} ms ({r['wall_s'] / floor:.2f}x)",
                    flush=True,
                )
        del sources, dests, flat_src, flat_dst
        torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bandwidth_read_write_bytes_per_s": bandwidth,
        "tensors": len(tensor_shapes),
        "elements": numel,
        "rows": rows,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "copy_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
