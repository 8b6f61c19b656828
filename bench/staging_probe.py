"""Does host-side work make a side-stream copy finish early? (issue 33 part 3, one GPU, ~15 s)

The overlap (docs/performance.md, "Staging behind compute") issues the training state's copies
on a side CUDA stream and goes on. Some host calls wait for the whole device: `empty_cache()`
(cudaFree), a fresh cudaMalloc. If one runs right after a copy starts, the copy ends inside that
stage and overlaps nothing. Each line starts a 4 GiB device-to-pinned-host copy on a side
stream, runs one thing on the host, and says whether the copy was already done when it
returned; `nothing` is the baseline.

    python bench/staging_probe.py > staging_probe.txt
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

GIB = 1 << 30


def main() -> None:
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    source = torch.empty(4 * GIB, dtype=torch.uint8, device=device)
    target = torch.empty(4 * GIB, dtype=torch.uint8).pin_memory()
    kept: list[torch.Tensor] = []

    def probe(what: str, prepare: Callable[[], None], work: Callable[[], object]) -> None:
        prepare()
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            target.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
        start = time.perf_counter()
        work()
        seconds = time.perf_counter() - start
        print(f"{what}: host {seconds:.3f} s, side-stream copy already done: {done.query()}",
              flush=True)  # fmt: skip
        done.synchronize()

    def cache_one_gib() -> None:
        block = torch.empty(GIB, dtype=torch.uint8, device=device)
        del block

    def matmul() -> object:
        return torch.randn(8192, 8192, device=device) @ torch.randn(8192, 8192, device=device)

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    probe("nothing", lambda: None, lambda: None)
    probe("empty_cache with 1 GiB cached", cache_one_gib, torch.cuda.empty_cache)
    probe("cudaMalloc 1 GiB", torch.cuda.empty_cache,
          lambda: kept.append(torch.empty(GIB, dtype=torch.uint8, device=device)))  # fmt: skip
    probe("matmul on the current stream", lambda: None, matmul)


if __name__ == "__main__":
    main()
