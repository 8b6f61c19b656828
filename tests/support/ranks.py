"""Run a function as N real processes (spawned, as the local driver does) that each put one
(rank, result) on a queue; a test then joins a gloo process group inside the function."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
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
