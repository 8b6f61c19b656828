"""What a weight-sync buffer costs when the stage before emptied the cache (issue 33, one GPU).

Every stage of the staged loop ends with `empty_cache()`, so the trainer's bucket buffer of each
sync is a fresh cudaMalloc. At 7B over two cards with one TP-2 engine the sync waited 18.5 ms for
its bucket (docs/weight-sync-figures.md), and the send alone took 11.3 ms warm: the gap is read
as that allocation, not measured. This times, for each buffer size, a bf16 buffer filled from an
fp32 source (the trainer's cast) three ways, with the device synchronized after each:

- `cold`: right after `empty_cache()` (a cudaMalloc, as in the loop);
- `warm`: the same size freed just before (torch's cache hands the block back);
- `held`: the buffer kept from the last time (no allocation at all);

and the cudaMalloc's host time alone (`alloc_cold`), and `empty_cache()` with that block cached.

    python bench/alloc_probe.py --out DIR     # one GPU, torch only, under a minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

GB = 1e9
# 1.13 GB: what crosses between the ranks a sync at 7B TP 2 (bf16); 2.26 GB: the buffer with the
# own blocks read as stored; 8.75 GB: the buffer with the own blocks in it; 15.2 GB: 7B in bf16.
SIZES_GB = (1.13, 2.26, 8.75, 15.23)


def timed(work: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def probe(size_bytes: int, repeats: int) -> dict[str, float]:
    elements = size_bytes // 2
    source = torch.randn(elements, dtype=torch.float32, device="cuda")
    kept: list[torch.Tensor] = []
    seconds: dict[str, list[float]] = {
        k: [] for k in ("cold", "warm", "held", "alloc_cold", "empty_cache")
    }

    def fill_new() -> None:
        kept[:] = [torch.empty(elements, dtype=torch.bfloat16, device="cuda")]
        kept[0].copy_(source)

    for _ in range(repeats):
        kept.clear()
        torch.cuda.empty_cache()
        seconds["cold"].append(timed(fill_new))
        seconds["held"].append(timed(lambda: kept[0].copy_(source)))
        kept.clear()  # the block goes back to torch's cache
        seconds["warm"].append(timed(fill_new))
        kept.clear()
        seconds["empty_cache"].append(timed(torch.cuda.empty_cache))
        seconds["alloc_cold"].append(
            timed(lambda: kept.append(torch.empty(elements, dtype=torch.bfloat16, device="cuda")))
        )
    kept.clear()
    return {f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    timed(lambda: torch.ones(1, device="cuda"))  # the context, once
    sizes: dict[str, dict[str, float]] = {}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": sizes}
    for size in SIZES_GB:
        row = probe(int(size * GB), args.repeats)
        torch.cuda.empty_cache()
        sizes[f"{size:.2f} GB"] = row
        print(
            f"{size:6.2f} GB bf16 buffer: " + ", ".join(f"{k} {v}" for k, v in row.items()),
            flush=True,
        )
    (args.out / "alloc_probe.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
