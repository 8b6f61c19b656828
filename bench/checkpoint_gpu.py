"""Checkpoint cost on a GPU: synchronous dcp.save, dcp.async_save and rljob's own asynchronous
save (host copies the offloads reuse, a writer thread), beside the disk's floor.

`python bench/checkpoint_gpu.py --model-dir /tmp/rljob-bench-models/qwen2.5-1.5b` builds the
training state a rank holds at the checkpoint stage the way the loop does (train.Trainer: fp32
master weights sharded by FSDP2, loaded from the model's files, and AdamW's two moments after
one step, on the GPU, one rank), then saves it `--repeats` times each way (`--modes`):

- **sync**: `torch.distributed.checkpoint.save`, the GPU idle until every byte is written;
- **async**: `torch.distributed.checkpoint.async_save`, timed until it returns (the state is
  staged to host memory; the GPU may go on from here) and until its future resolves (written);
- **pinned**: `checkpoint.Keeper.save` with `spec.checkpoint.mode: Async`, the checkpoint stage
  as the loop runs it: the state copied into the pinned host buffers the offloads use, the
  files written by a thread from them; timed until the stage returns (blocked) and until the
  marker is written (`Keeper.finish`: durable). Then the offloads that follow the stage, which
  now only free the device memory (`offload_after_seconds`). Its first save also pins the
  buffers (reported apart: `pinned_first`);
- **pinned-sync**: the same with `mode: Sync` (the stage waits for the writer);
- **pinned-before**: `pinned` with the writer as it was before issue 30's writer fix: dcp's
  FileSystemWriter (torch.save's CRC32 of every record) given views of the one host
  allocation (which dcp clones before writing), for a before/after on the same card.

`--busy python|torch`: while a `pinned*` writer runs, the main thread does not wait idle but
runs a loop (pure Python, or CUDA matmuls with a synchronize every 8, as training's thread),
polling the writer between chunks as the stage machine does at its boundaries: the writer
beside a busy main thread. The first save (it pins the buffers) always runs idle.

Beside them, in the same run: the disk's own write bandwidth (the same number of bytes written
with `os.write` and fsync'd, as DCP's writer fsyncs its files), and pinned device-to-host
bandwidth, the floors of the two paths. It prints one JSON line per measurement and a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
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


MODES = ("sync", "async", "pinned", "pinned-sync", "pinned-before")
BUSY = ("idle", "python", "torch")


def _busy_chunk(busy: str, state: dict[str, Any]) -> None:
    """About a millisecond or more of the main thread's work (`busy`: python or torch)."""
    if busy == "python":
        total = 0
        for i in range(20_000):
            total += i * i
    else:
        a = state.setdefault("a", torch.randn(1024, 1024, device="cuda") / 32)
        for _ in range(8):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
        state["a"] = a


@contextlib.contextmanager
def _writer_before(before: bool) -> Iterator[None]:
    """The writer as it was before the fix (CRC32 on, dcp cloning every view), or as it is."""
    from torch.distributed.checkpoint import FileSystemWriter

    import rljob_worker.checkpoint as checkpoint
    import rljob_worker.checkpoint_writer as checkpoint_writer

    if not before:
        yield
        return
    saved = checkpoint.FileWriter, checkpoint_writer.own_storage
    checkpoint.FileWriter = FileSystemWriter  # type: ignore[misc,assignment]
    checkpoint_writer.own_storage = lambda tensor: tensor
    try:
        yield
    finally:
        checkpoint.FileWriter, checkpoint_writer.own_storage = saved  # type: ignore[misc]


def _spec(model_dir: Path, checkpoints: Path, mode: str) -> Any:
    from rljob.api import parse_manifest

    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "checkpoint-bench"},
        "spec": {
            "model": {"path": str(model_dir)},
            "algorithm": {"klCoef": 0.0},  # no reference: the checkpoint holds none anyway
            "data": {"source": "builtin:digit"},
            "rollout": {"engine": "torch"},
            "resources": {"workers": 1, "gpusPerWorker": 1},
            "checkpoint": {"path": str(checkpoints), "keep": 1, "mode": mode},
        },
    }
    return parse_manifest(doc)[1]


def _pinned(trainer: Any, spec: Any, model_dir: Path | str, iteration: int,
            busy: str = "idle", before: bool = False) -> dict[str, float]:  # fmt: skip
    """One checkpoint stage as the loop runs it (the main thread `busy` while the writer
    writes), then the offloads that follow it."""
    from rljob_worker.checkpoint import Keeper

    keeper = Keeper(spec, trainer.model, trainer.optimizer, model_dir, host=trainer)
    chunks, scratch = 0, dict[str, torch.Tensor]()
    with _writer_before(before):
        started = time.perf_counter()
        keeper.save(iteration)
        returned = time.perf_counter() - started
        taken: tuple[Any, ...] = ()
        while busy != "idle" and not taken:
            _busy_chunk(busy, scratch)
            chunks += 1
            keeper.poll()  # a stage boundary
            taken, _ = keeper.take()
        keeper.finish()
        done = time.perf_counter() - started
    if not taken:
        taken, _ = keeper.take()
    saved = taken[-1]
    offloading = time.perf_counter()
    trainer.offload_optimizer()
    trainer.offload_params()
    offload_after = time.perf_counter() - offloading
    trainer.load_params()
    trainer.load_optimizer()
    shutil.rmtree(saved.path)  # one checkpoint on the disk at a time (3B: 37 GB each)
    return {
        "returned_seconds": returned,
        "written_seconds": done,
        "bytes": saved.bytes,
        "keeper_blocked_seconds": saved.blocked_seconds or 0.0,
        "keeper_seconds": saved.seconds,
        "offload_after_seconds": offload_after,
        "busy_chunks_per_second": chunks / max(done - returned, 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)}")
    parser.add_argument("--busy", choices=BUSY, default="idle", help="the main thread, beside")
    parser.add_argument("--target", type=Path, default=None, help="where to write (a disk)")
    parser.add_argument("--out", type=Path, default=None, help="a JSON summary file")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: {sorted(unknown)} not among {MODES}")

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rljob_worker.model import resolve_model_path
    from rljob_worker.train import Trainer

    root = Path(tempfile.mkdtemp(prefix="rljob-ckpt-bench-", dir=args.target))
    store = root / "store"
    # Without a GPU: a smoke run of the same code (CPU figures say nothing about a GPU's).
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    model_dir = resolve_model_path(str(args.model_dir))
    specs = {m: _spec(args.model_dir, root / m, "Sync" if m.endswith("sync") else "Async")
             for m in ("pinned", "pinned-sync", "pinned-before")}  # fmt: skip
    trainer = Trainer(specs["pinned"], model_dir, device, pad_id=0)
    model, optimizer = trainer.model, trainer.optimizer
    ids = torch.randint(0, 100, (1, 16), device=device)
    model(ids).logits.float().sum().backward()
    # One tensor at a time: the foreach step's temporaries (a sqrt of every second moment) do
    # not fit beside a whole 7B state on one card (139.8 GiB H200: out of memory at 7B).
    for group in optimizer.param_groups:
        group["foreach"] = False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
    if cuda:
        torch.cuda.synchronize()
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    first: dict[str, float] | None = None
    if any(m.startswith("pinned") for m in modes):
        first = _pinned(trainer, specs["pinned"], model_dir, 1)  # pins the host buffers
        print(json.dumps({"kind": "pinned_first", **first}), flush=True)
    written_bytes = 0
    for index in range(args.repeats):
        for kind in modes:
            target = root / f"{kind}-{index}"
            started = time.perf_counter()
            if kind == "sync":
                dcp.save(state, checkpoint_id=str(target))
                returned = done = time.perf_counter() - started
            elif kind == "async":
                future = dcp.async_save(state, checkpoint_id=str(target))
                returned = time.perf_counter() - started
                # torch 2.11 returns a Future; an AsyncSaveResponse holds it as upload_completion.
                result: Any = getattr(future, "upload_completion", future)
                result.result()
                done = time.perf_counter() - started
            if kind in ("sync", "async"):
                written_bytes = _dir_bytes(target)
                row = {"returned_seconds": returned, "written_seconds": done,
                       "bytes": written_bytes}  # fmt: skip
                shutil.rmtree(target)
            else:
                row = _pinned(trainer, specs[kind], model_dir, 2 + index, args.busy,
                              before=kind == "pinned-before")  # fmt: skip
                written_bytes = int(row["bytes"])
            results[kind].append(row)
            print(json.dumps({"kind": kind, "repeat": index, **row}), flush=True)
    disk = disk_write_bandwidth(root, written_bytes)
    d2h = d2h_pinned_bandwidth() if cuda else float("nan")
    summary = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke run)",
        "torch": torch.__version__,
        "model_dir": str(args.model_dir),
        "busy": args.busy,
        "parameters": sum(p.numel() for p in model.parameters()),
        "pinned_first": first,
        "bytes_per_rank": written_bytes,
        "disk_write_bytes_per_second": disk,
        "d2h_pinned_bytes_per_second": d2h,
        "floor_write_seconds": written_bytes / disk,
        "floor_stage_seconds": written_bytes / d2h,
        **{
            f"{kind}_median_{key}": statistics.median(r[f"{key}_seconds"] for r in rows)
            for kind, rows in results.items()
            for key in ("returned", "written")
            if rows
        },
        **{
            f"{kind}_median_offload_after_seconds": statistics.median(
                r["offload_after_seconds"] for r in rows
            )
            for kind, rows in results.items()
            if rows and kind.startswith("pinned")
        },
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "runs": results}, indent=2) + "\n")
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
