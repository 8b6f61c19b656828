"""Benchmark: how much a checkpoint writer stalls the loop's round trips to other processes.

The weight sync hands each bucket to sglang's processes in a few request/answer trips. At 7B on
two H200s it took 3.37 s beside the asynchronous checkpoint's writers against 0.14-0.25 s
without (docs/checkpoint-figures.md). This measures the mechanism without a GPU: the main thread
sends one message to a child process and waits for its answer, again and again, while
`dcp.save` writes a state dict of `--gigabytes` through rljob's `FileWriter`, from a thread of
the same process (as `checkpoint.Keeper` runs it), from a process of its own, or not at all.
A stall is a round trip over 5 ms; the sum of the stalls over the write's seconds says how much
of the main thread's time the writer took. Thread against process tells the GIL from CPU time
on a machine with cores to spare (not on a loaded 2-core one).

  python bench/writer_stalls.py --gigabytes 2 --modes none,thread,process --repeats 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "worker_image"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

STALL_SECONDS = 0.005
TENSOR_BYTES = 512 << 20


def _echo(conn: Connection) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


def _state(gigabytes: float) -> dict[str, Any]:
    import torch

    count = max(1, round(gigabytes * (1 << 30) / TENSOR_BYTES))
    return {f"t{i}": torch.randn(TENSOR_BYTES // 4) for i in range(count)}


def _save(state: dict[str, Any], directory: str) -> None:
    """What the Keeper's writer does with the state: dcp.save through rljob's FileWriter."""
    import torch.distributed.checkpoint as dcp

    from rljob_worker.checkpoint_writer import FileWriter

    dcp.save(state, storage_writer=FileWriter(directory), no_dist=True)


def _write(directory: str, gigabytes: float, ready: Any) -> None:
    """The writer process: build the state, say so, write it."""
    state = _state(gigabytes)
    ready.set()  # built: the write starts now
    _save(state, directory)


def _round_trips(alive: Callable[[], bool]) -> list[float]:
    """Round trips to a child process for as long as `alive()`."""
    ours, theirs = mp.Pipe()
    child = mp.Process(target=_echo, args=(theirs,), daemon=True)
    child.start()
    trips: list[float] = []
    while alive():
        started = time.perf_counter()
        ours.send(1)
        ours.recv()
        trips.append(time.perf_counter() - started)
    ours.send(None)
    child.join()
    return trips


def run(mode: str, gigabytes: float, baseline_seconds: float) -> dict[str, Any]:
    """One measurement: `mode` is none (for baseline_seconds), thread or process."""
    directory = tempfile.mkdtemp(prefix="rljob-writer-stalls-")
    started = time.perf_counter()
    try:
        if mode == "none":
            trips = _round_trips(lambda: time.perf_counter() - started < baseline_seconds)
        elif mode == "thread":
            state = _state(gigabytes)  # built before the clock, as the stage builds it
            done = threading.Event()

            def write() -> None:
                try:
                    _save(state, directory)
                finally:
                    done.set()  # a failed write ends the measurement too

            started = time.perf_counter()
            threading.Thread(target=write, daemon=True).start()
            trips = _round_trips(lambda: not done.is_set())
        elif mode == "process":
            ready = mp.get_context("spawn").Event()
            writer = mp.get_context("spawn").Process(
                target=_write, args=(directory, gigabytes, ready), daemon=True
            )
            writer.start()
            ready.wait()
            started = time.perf_counter()
            trips = _round_trips(writer.is_alive)
            writer.join()
        else:
            raise ValueError(f"mode {mode!r}: one of none, thread, process")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    seconds = time.perf_counter() - started
    trips.sort()
    stalls = [t for t in trips if t > STALL_SECONDS]
    return {
        "mode": mode,
        "seconds": seconds,
        "round_trips": len(trips),
        "median_ms": trips[len(trips) // 2] * 1e3 if trips else None,
        "max_ms": trips[-1] * 1e3 if trips else None,
        "stall_seconds": sum(stalls),
        "stall_share": sum(stalls) / seconds if seconds else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0, help="state dict written")
    parser.add_argument("--modes", default="none,thread,process")
    parser.add_argument("--repeats", type=int, default=2, help="each mode, alternating")
    parser.add_argument("--baseline-seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("writer-stalls.json"))
    args = parser.parse_args(argv)
    import os

    import torch

    rows = []
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            row = run(mode.strip(), args.gigabytes, args.baseline_seconds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"torch": torch.__version__, "cpus": os.cpu_count(), "gigabytes": args.gigabytes,
              "runs": rows}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
