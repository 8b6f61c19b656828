"""The link between the cards alone: what a weight sync over more than one rank must move (issue 33).

With one engine per card, each rank's engine needs the whole model, so each rank receives the
other ranks' shards over the GPUs' link (NVLink) before its engine can load them: bytes the HBM
floor does not count. This times that link two ways, each with nothing else on the cards:

- `all_gather`: torch.distributed's flat all-gather (the call sync_send.gather_full makes) of a
  receive buffer of each size in `--mb`, one process per rank as the loop's ranks run;
- `peer_copy` (CUDA only, two or more visible cards, from rank 0's process): a copy of what one
  rank receives in a 2-rank all-gather of that size (half of it) from card 1 to card 0 (copy
  engines, no kernel), then `peer_copy_both_ways`, one such copy each way at once. Their bytes
  are the bytes copied (both ways: both copies). The first stored run
  (bench/results/raw/link-probe-h200x2/) counted the all-gather's receive buffer there
  instead: twice the bytes one copy moved.

Figures per size: median seconds of `--repeats` after a warm-up, the algorithm bandwidth
(receive bytes / seconds) and the bus bandwidth (what each rank took in over the link per
second: algbw x (world - 1) / world, as nccl-tests reports it). NCCL reads its environment
(NCCL_MIN_NCHANNELS, NCCL_PROTO, ...) when the group starts: run the probe once per setting.

    python bench/link_probe.py --ranks 2 --mb 512 4096 --out DIR/link.json
On the CPU (`--backend gloo`) the same code runs over host memory: the figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawned import run_spawned_ranks


def _timed(work: Any, repeats: int, device: torch.device, barrier: bool) -> float:
    work()  # warm-up (NCCL's first call also builds its channels)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if barrier:
            dist.barrier()
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _row(kind: str, nbytes: int, seconds: float, world: int) -> dict[str, Any]:
    """An all-gather's row: `nbytes` is its receive buffer. A copy's (world 1): what it copied,
    so both bandwidths are the bytes that crossed the link per second."""
    algbw = nbytes / seconds
    return {
        "kind": kind,
        "bytes": nbytes,
        "seconds": seconds,
        "algbw_bytes_per_second": algbw,
        "busbw_bytes_per_second": algbw * (world - 1) / world if world > 1 else algbw,
    }


def probe_rank(rank: int, world: int, init_method: str, backend: str, sizes_mb: list[int],
               repeats: int) -> list[dict[str, Any]]:  # fmt: skip
    """This rank's part: the all-gather of each size (every rank calls it); rank 0's rows."""
    from rljob_worker.sync_send import flat_all_gather

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            **kwargs)  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        for mb in sizes_mb:
            elements = (mb << 20) // 2 // world  # bf16, as the sync sends
            send = torch.ones(elements, dtype=torch.bfloat16, device=device) * rank
            receive = torch.empty(world * elements, dtype=torch.bfloat16, device=device)
            seconds = _timed(
                lambda send=send, receive=receive: flat_all_gather(receive, send),
                repeats, device, barrier=True,
            )  # fmt: skip
            # Every rank's part arrived, in rank order.
            got = [float(c[0]) for c in receive.view(world, elements)]
            if got != [float(r) for r in range(world)]:
                raise RuntimeError(f"all-gather of {mb} MiB gave {got}")
            rows.append(_row("all_gather", receive.numel() * 2, seconds, world))
            del send, receive
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
        if rank == 0 and device.type == "cuda" and torch.cuda.device_count() > 1:
            rows += _peer_copies(sizes_mb, repeats)
    finally:
        dist.destroy_process_group()
    return rows


def _peer_copies(sizes_mb: list[int], repeats: int) -> list[dict[str, Any]]:
    """Card 1 to card 0 by the copy engines (one process sees both), then both ways at once."""
    rows = []
    for mb in sizes_mb:
        half = (mb << 20) // 2  # each rank's share of a 2-rank receive buffer, as above
        rows += _peer_copy_rows(half, repeats)
        torch.cuda.empty_cache()
    return rows


def _peer_copy_rows(size: int, repeats: int) -> list[dict[str, Any]]:
    zero, one = torch.device("cuda", 0), torch.device("cuda", 1)
    a0, b0 = (torch.empty(size, dtype=torch.uint8, device=zero) for _ in range(2))
    a1, b1 = (torch.empty(size, dtype=torch.uint8, device=one) for _ in range(2))
    s0, s1 = torch.cuda.Stream(zero), torch.cuda.Stream(one)

    def one_way() -> None:
        a0.copy_(a1, non_blocking=True)
        torch.cuda.synchronize(zero)
        torch.cuda.synchronize(one)

    def both_ways() -> None:
        with torch.cuda.stream(s0):
            b0.copy_(a1, non_blocking=True)
        with torch.cuda.stream(s1):
            b1.copy_(a0, non_blocking=True)
        s0.synchronize()
        s1.synchronize()

    return [
        _row("peer_copy", size, _timed(one_way, repeats, zero, False), 1),
        _row("peer_copy_both_ways", 2 * size, _timed(both_ways, repeats, zero, False), 1),
    ]


def probe(world: int, backend: str, sizes_mb: list[int], repeats: int) -> list[dict[str, Any]]:
    """Rank 0's rows, the ranks run in their own processes (spawned)."""
    return list(run_spawned_ranks(probe_rank, world, (backend, sizes_mb, repeats), 600))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--mb", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    rows = probe(args.ranks, args.backend, args.mb, args.repeats)
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    device = torch.cuda.get_device_name(0) if args.backend == "nccl" else "cpu"
    result = {"device": device, "ranks": args.ranks, "backend": args.backend,
              "torch": torch.__version__, "nccl_env": nccl_env, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"{row['kind']:>20} {row['bytes'] / 2**20:8.0f} MiB: {row['seconds'] * 1e3:8.2f} ms, "
              f"algbw {row['algbw_bytes_per_second'] / 1e9:7.1f} GB/s, "
              f"busbw {row['busbw_bytes_per_second'] / 1e9:7.1f} GB/s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
