"""Checkpoint cost on a GPU: synchronous dcp.save against dcp.async_save, beside the disk's floor.

`python bench/checkpoint_gpu.py --model-dir /tmp/rljob-bench-models/qwen2.5-1.5b` builds the
training state a rank holds at the checkpoint stage (fp32 master weights sharded by FSDP2 and
AdamW's two moments, on the GPU, one rank), then saves it `--repeats` times each way:

- **sync**: `torch.distributed.checkpoint.save`, the GPU idle until every byte is written;
- **async**: `torch.distributed.checkpoint.async_save`, timed until it returns (the state is
  staged to host memory; the GPU may go on from here) and until its future resolves (written).

Beside them, in the same run: the disk's own write bandwidth (the same number of bytes written
with `os.write` and fsync'd, as DCP's writer fsyncs its files), and pinned device-to-host
bandwidth, the floors of the two paths. It prints one JSON line per measurement and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def disk_write_bandwidth(directory: Path, total: int, chunk: int = 64 << 20) -> float:
    """Bytes/s of writing `total` bytes in `chunk`-sized writes, then fsync (the floor)."""
    buffer = os.urandom(chunk)
    path = directory / "floor.bin"
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < total:
            written += os.write(fd, buffer[: min(chunk, total - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return total / seconds


def d2h_pinned_bandwidth(nbytes: int = 1 << 30) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=Path, default=None, help="where to write (a disk)")
    parser.add_argument("--out", type=Path, default=None, help="a JSON summary file")
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from rljob_worker.model import load_causal_lm
    from rljob_worker.train import _move, _shard

    root = Path(tempfile.mkdtemp(prefix="rljob-ckpt-bench-", dir=args.target))
    store = root / "store"
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", init_method=f"file://{store}", rank=0, world_size=1
    )
    torch.cuda.set_device(0)
    model = load_causal_lm(args.model_dir, torch.float32)
    _move(model, torch.device("cuda"))
    _shard(model, init_device_mesh("cuda", (1,)), torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, 1000, (1, 16), device="cuda")
    model(ids).logits.float().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
    torch.cuda.synchronize()
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    written_bytes = 0
    for index in range(args.repeats):
        for kind in ("sync", "async"):
            target = root / f"{kind}-{index}"
            started = time.perf_counter()
            if kind == "sync":
                dcp.save(state, checkpoint_id=str(target))
                returned = done = time.perf_counter() - started
            else:
                future = dcp.async_save(state, checkpoint_id=str(target))
                returned = time.perf_counter() - started
                # torch 2.11 returns a Future; an AsyncSaveResponse holds it as upload_completion.
                result: Any = getattr(future, "upload_completion", future)
                result.result()
                done = time.perf_counter() - started
            written_bytes = _dir_bytes(target)
            row = {"returned_seconds": returned, "written_seconds": done, "bytes": written_bytes}
            results[kind].append(row)
            print(json.dumps({"kind": kind, "repeat": index, **row}), flush=True)
            shutil.rmtree(target)
    disk = disk_write_bandwidth(root, written_bytes)
    d2h = d2h_pinned_bandwidth()
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model_dir": str(args.model_dir),
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes_per_rank": written_bytes,
        "disk_write_bytes_per_second": disk,
        "d2h_pinned_bytes_per_second": d2h,
        "floor_write_seconds": written_bytes / disk,
        "floor_stage_seconds": written_bytes / d2h,
        **{
            f"{kind}_median_{key}": statistics.median(r[f"{key}_seconds"] for r in rows)
            for kind, rows in results.items()
            for key in ("returned", "written")
        },
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "runs": results}, indent=2) + "\n")
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
