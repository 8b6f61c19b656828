"""Checkpoint cost on the CPU: seconds and bytes per rank of each synchronous save, tiny model.

`python bench/checkpoint_cpu.py [--ranks 2] [--iterations 3]` runs examples/checkpoint-resume.yaml
(paths moved to a temporary directory) with the local driver and prints, per rank and
iteration, the checkpoint stage's seconds and the bytes that rank wrote, with the machine.
`--async-compare` instead times, in this one process (world 1, gloo), dcp.save against
dcp.async_save (until it returns, and until its future resolves) on the same sharded model.
`--writer-compare` times the asynchronous checkpoint's writer (GB/s) alone and beside a busy
main thread (a Python loop, a torch op loop), as it was, as it is, with dcp's writer options,
as torch's writer process, and the os.write floor (docs/checkpoint-figures.md, "Why the writer was
slow"); `--target` a disk instead of /dev/shm.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.distributed.checkpoint.staging import AsyncStager

from rljob.api import parse_manifest
from rljob.report import Stage
from rljob_worker.driver.local import run_local

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--async-compare", action="store_true")
    parser.add_argument("--writer-compare", action="store_true")
    parser.add_argument("--target", type=Path, default=Path("/dev/shm"), help="--writer-compare")
    parser.add_argument("--mib", type=int, default=512, help="--writer-compare: bytes written")
    parser.add_argument("--tensors", type=int, default=48, help="--writer-compare")
    parser.add_argument("--repeats", type=int, default=3, help="--writer-compare")
    parser.add_argument("--writers", default=",".join(WRITERS), help=f"of {', '.join(WRITERS)}")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"of {', '.join(LOADS)}")
    args = parser.parse_args()
    if args.async_compare:
        compare_async()
        return
    if args.writer_compare:
        writers, loads = args.writers.split(","), args.loads.split(",")
        if unknown := (set(writers) - set(WRITERS)) | (set(loads) - set(LOADS)):
            parser.error(f"unknown writers or loads: {sorted(unknown)}")
        compare_writers(args.target, args.mib, args.tensors, args.repeats, writers, loads)
        return
    doc = yaml.safe_load((REPO / "examples" / "checkpoint-resume.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        doc["spec"]["checkpoint"]["path"] = f"{tmp}/ckpt"
        doc["spec"]["export"]["path"] = f"{tmp}/export"
        doc["spec"]["algorithm"]["iterations"] = args.iterations
        spec = parse_manifest(doc)[1]
        run = run_local(spec, args.ranks, "cpu")
        assert run.ok, run.errors
    print(f"machine: {_machine()}, torch {torch.__version__}, {args.ranks} ranks on gloo, "
          "1 thread per rank")  # fmt: skip
    stage = {(s.rank, s.iteration): s.seconds for s in run.samples if s.stage is Stage.CHECKPOINT}
    print("iteration rank stage_seconds save_seconds bytes")
    for item in sorted(run.iterations, key=lambda i: (i.iteration, i.rank)):
        if item.checkpoint is not None:
            saved = item.checkpoint
            print(
                f"{item.iteration:9d} {item.rank:4d} {stage[(item.rank, item.iteration)]:13.3f} "
                f"{saved.seconds:12.3f} {saved.bytes:d}"
            )


def _machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.machine(),
    )
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def compare_async(repeats: int = 5) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rljob_worker.model import load_causal_lm, resolve_model_path

    path = resolve_model_path("builtin:tiny-qwen2")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        model = load_causal_lm(path, torch.float32)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
        print(f"machine: {_machine()}, torch {torch.__version__}, 1 rank, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
        for kind in ("sync", "async"):
            returned, done = [], []
            for index in range(repeats):
                started = time.perf_counter()
                target = f"{tmp}/{kind}-{index}"
                if kind == "sync":
                    dcp.save(state, checkpoint_id=target)
                    returned.append(time.perf_counter() - started)
                else:
                    future = dcp.async_save(state, checkpoint_id=target)
                    returned.append(time.perf_counter() - started)
                    assert isinstance(future, Future)  # without async staging options
                    future.result()
                done.append(time.perf_counter() - started)
            print(f"{kind:5s} median returned {sorted(returned)[repeats // 2]:.4f} s, "
                  f"median written {sorted(done)[repeats // 2]:.4f} s")  # fmt: skip
        dist.destroy_process_group()


# -- the writer beside a busy main thread (--writer-compare) ---------------------------------

WRITERS = ("thread", "thread-exact", "thread-exact-nocrc", "thread-exact-nocrc-0.5ms",
           "thread-tc2", "thread-files", "thread-nosync", "process-exact", "process-exact-nocrc",
           "floor")  # fmt: skip
LOADS = ("idle", "python", "torch")


def _host_state(
    total_bytes: int, tensors: int, shared: bool
) -> tuple[torch.Tensor, dict[str, Any]]:
    """`tensors` fp32 tensors that are views of one host allocation, as host_copies._HostCopies
    holds the offload's copies (`shared`: the allocation in shared memory, for a child)."""
    host = torch.empty(total_bytes, dtype=torch.uint8)
    if shared:
        host.share_memory_()
    host.view(torch.float32).normal_()
    size = total_bytes // tensors // 4 * 4
    views = {f"t{i}": host[i * size : (i + 1) * size].view(torch.float32) for i in range(tensors)}
    return host, views


def _writer_once(kind: str, state: dict[str, Any], target: Path) -> None:
    """One save of `state` (or, `floor`, its bytes) into `target`, in the calling thread."""
    import torch.distributed.checkpoint as dcp

    from rljob_worker.checkpoint_writer import own_storage

    if kind == "floor":
        target.mkdir()
        fd = os.open(target / "floor.bin", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for tensor in state.values():
                os.write(fd, tensor.numpy().data)  # no copy: the buffer's own memory
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    chosen: dict[str, dict[str, Any]] = {
        "thread-tc2": {"thread_count": 2},
        "thread-files": {"single_file_per_rank": False},
        "thread-nosync": {"sync_files": False},
    }
    options = chosen.get(kind, {})
    if "exact" in kind:
        state = {name: own_storage(tensor) for name, tensor in state.items()}
    writer = dcp.FileSystemWriter(str(target), **options)
    # Both process-wide (one save at a time here): torch.save's CRC32 of every record, and how
    # long a thread that wants the GIL back waits for the one holding it (5 ms by default).
    crc, switch = torch.serialization.get_crc32_options(), sys.getswitchinterval()
    torch.serialization.set_crc32_options("nocrc" not in kind)
    if kind.endswith("0.5ms"):
        sys.setswitchinterval(0.0005)
    try:
        dcp.save(state, storage_writer=writer)
    finally:
        torch.serialization.set_crc32_options(crc)
        sys.setswitchinterval(switch)


def _process_save(state: dict[str, Any], target: Path, crc: bool = True) -> Any:
    """torch's writer process (dcp.async_save, AsyncCheckpointerType.PROCESS), given the state
    as it is: its tensors' storages are in shared memory, so only their handles are sent."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from rljob_worker.checkpoint_writer import FileWriter

    writer = dcp.FileSystemWriter(str(target)) if crc else FileWriter(str(target))
    response: Any = dcp.async_save(state, storage_writer=writer, async_stager=_PassThrough(),
                                   async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
    return getattr(response, "upload_completion", response)  # 2.11: a Future; 2.14: a response


class _PassThrough(AsyncStager):
    """dcp.async_save's stager that stages nothing: the state is in (shared) host memory."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _busy(load: str, done: Callable[[], bool]) -> int:
    """The main thread's work while the writer runs: steps done (a step ~1 ms alone)."""
    steps = 0
    a = torch.randn(160, 160)
    while not done():
        if load == "python":
            total = 0
            for i in range(20_000):
                total += i * i
        elif load == "torch":
            for _ in range(8):  # a training loop's shape: short Python, kernels without the GIL
                a = torch.tanh(a @ a) * 0.5
        else:
            time.sleep(0.001)
        steps += 1
    return steps


def compare_writers(target_root: Path, total_mib: int, tensors: int, repeats: int,
                    writers: list[str], loads: list[str]) -> None:  # fmt: skip
    import statistics

    import torch.distributed as dist

    from rljob_worker.checkpoint_writer import own_storage, start_thread

    torch.set_num_threads(1)  # as the ranks run (1 thread each); the writer gets the other core
    nbytes = total_mib << 20
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    work = Path(tempfile.mkdtemp(prefix="rljob-writer-", dir=target_root))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        _, state = _host_state(
            nbytes, tensors, shared=any(k.startswith("process") for k in writers)
        )
        exact = {name: own_storage(tensor) for name, tensor in state.items()}
        print(f"machine: {_machine()}, load average {os.getloadavg()[0]:.2f}, "
              f"torch {torch.__version__}, 1 intra-op thread; {total_mib} MiB in {tensors} "
              f"fp32 views of one host allocation, written to {target_root}")  # fmt: skip
        if any(
            kind.startswith("process") for kind in writers
        ):  # the first save spawns torch's writer process
            _process_save(exact, work / "warm-up").result()
            shutil.rmtree(work / "warm-up")
        rates = {}
        for load in loads:  # the main thread's steps/s with no writer beside it
            end = time.perf_counter() + 1.0
            started = time.perf_counter()
            steps = _busy(load, lambda e=end: time.perf_counter() > e)  # type: ignore[misc]
            rates[load] = steps / (time.perf_counter() - started)
        rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for index in range(repeats):
            for load in loads:
                for kind in writers:  # alternating: every writer once per round
                    target = work / f"{kind}-{load}-{index}"
                    started = time.perf_counter()
                    if kind.startswith("process"):
                        future = _process_save(exact, target, crc="nocrc" not in kind)
                    else:
                        future = start_thread(partial(_writer_once, kind, state, target), kind)
                    steps = _busy(load, future.done)
                    future.result()
                    seconds = time.perf_counter() - started
                    slowdown = steps / seconds / rates[load] if load != "idle" else float("nan")
                    rows.setdefault((load, kind), []).append((nbytes / seconds / 1e9, slowdown))
                    shutil.rmtree(target)
                    print(f"  {index} {load:6s} {kind:18s} {nbytes / seconds / 1e9:6.3f} GB/s, "
                          f"main thread at {slowdown:.2f} of its rate", flush=True)  # fmt: skip
        dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)
    print(f"medians of {repeats} (GB/s; the main thread's share of its own rate alone):")
    print("writer              " + "".join(f"{load:>20s}" for load in loads))
    for kind in writers:
        cells = []
        for load in loads:
            got = rows[(load, kind)]
            gbs = statistics.median(g for g, _ in got)
            share = statistics.median(s for _, s in got)
            cells.append(f"{gbs:7.3f}" + (f" ({share:.2f})" if load != "idle" else "       "))
        print(f"{kind:20s}" + "".join(f"{c:>20s}" for c in cells))


if __name__ == "__main__":
    main()
