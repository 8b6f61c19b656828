"""Run a function as N real processes (spawned, as the local driver does) that each put one
(rank, result) on a queue; a test then joins a gloo process group inside the function
(`gloo_rank` does the joining, leaving and putting for the common case)."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
from collections.abc import Callable, Iterator
from typing import Any


def run_ranks(
    target: Callable[..., None], world: int, *args: Any, timeout_seconds: float = 120
) -> dict[int, Any]:
    """Start `target(rank, init_method, *args, results)` on `world` processes; what each put.

    init_method is a free TCP rendezvous on loopback. Processes still alive after their result
    (or the timeout) are killed, so a hung collective fails the test instead of hanging it.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=target, args=(rank, f"tcp://127.0.0.1:{port}", *args, results))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        return dict(results.get(timeout=timeout_seconds) for _ in range(world))
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, init_method: str, results: Any) -> Iterator[dict[str, Any]]:
    """Inside a rank: join a gloo group of `world` for the block, which fills the yielded dict;
    an exception in the block is recorded as its "error" (repr) instead of raised. On the way
    out the group is left and (rank, dict) is put on `results`, as run_ranks expects."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        yield out
    except Exception as exc:
        out["error"] = repr(exc)
    finally:
        dist.destroy_process_group()
        results.put((rank, out))
