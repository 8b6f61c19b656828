"""Ranks in their own spawned processes, for the bench's probes: each runs `work(rank, world,
init_method, *args)` (a module-level function: spawn pickles it by name); rank 0's return value
comes back, and any rank's exception as an error."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answer(
    work: Callable[..., Any], rank: int, world: int, init_method: str, args: tuple[Any, ...],
    answers: Any,
) -> None:  # fmt: skip
    try:
        result = work(rank, world, init_method, *args)
    except Exception as error:
        answers.put(f"rank {rank}: {type(error).__name__}: {error}"[:500])
        raise
    if rank == 0:
        answers.put(result)


def run_spawned_ranks(
    work: Callable[..., Any], world: int, args: tuple[Any, ...], timeout_seconds: float
) -> Any:
    """Start `world` processes of `work` on one TCP rendezvous and return rank 0's answer; a
    rank's exception is raised here as a RuntimeError with its text."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    answers = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        context.Process(target=_answer, args=(work, rank, world, init_method, args, answers))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        answer = answers.get(timeout=timeout_seconds)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
    if isinstance(answer, str):
        raise RuntimeError(answer)
    return answer
