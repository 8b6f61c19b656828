"""builtin:python's pool of forking runners (issue 32): answers under many concurrent calls,
limits and timeouts per call, a killed runner replaced, nothing shared between calls, and no
process left behind by close() or by the rank's death."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import psutil
import pytest

from rljob_worker.agentic.python_runner import ZygoteGone, ZygotePool
from rljob_worker.agentic.tool_calls import ToolCall
from rljob_worker.agentic.tools import PythonExpression, ToolSet, python_answer

SLOW = "sum(range(10**12))"  # minutes of CPU: ends only by a limit or a timeout
REPO = Path(__file__).resolve().parents[2]


def _with_pool(size: int, body: Callable[[ZygotePool], Coroutine[Any, Any, Any]]) -> Any:
    pool = ZygotePool(size)
    try:
        return asyncio.run(body(pool))
    finally:
        pool.close()


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie that is not ours to reap (init's)."""
    try:
        process = psutil.Process(pid)
        return process.status() == psutil.STATUS_ZOMBIE and process.ppid() != os.getpid()
    except psutil.NoSuchProcess:
        return True


def _dead(pid: int, within_seconds: float = 5.0) -> None:
    """Wait until our child `pid` has died (a zombie until the pool reaps it)."""
    deadline = time.monotonic() + within_seconds
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"{pid} still runs after {within_seconds} s"
        time.sleep(0.02)


def _grandchild(zygote_pid: int, within_seconds: float = 5.0) -> int:
    deadline = time.monotonic() + within_seconds
    while time.monotonic() < deadline:
        children = psutil.Process(zygote_pid).children()
        if children:
            return int(children[0].pid)
        time.sleep(0.02)
    raise AssertionError(f"zygote {zygote_pid} forked no grandchild in {within_seconds} s")


def test_the_pool_answers_200_concurrent_calls_each_its_own() -> None:
    async def body(pool: ZygotePool) -> None:
        tool = PythonExpression(256, pool)
        answers = await asyncio.gather(
            *(tool({"expression": f"{i}**2 + {i}"}, 60.0) for i in range(200))
        )
        assert answers == [str(i * i + i) for i in range(200)]
        assert 1 <= len(pool.pids) <= 4  # never more runners than the pool's size

    _with_pool(4, body)


def test_a_timeout_does_not_disturb_the_calls_in_flight_nor_costs_a_runner() -> None:
    async def body(pool: ZygotePool) -> None:
        tools = ToolSet([PythonExpression(256, pool)], timeout_seconds=2.5)
        await asyncio.gather(
            *(tools.run(ToolCall("python", {"expression": "1"})) for _ in range(3))
        )
        runners = pool.pids
        assert len(runners) == 3
        ended: dict[str, float] = {}

        async def timed(key: str, expression: str) -> Any:
            outcome = await tools.run(ToolCall("python", {"expression": expression}))
            ended[key] = time.monotonic()
            return outcome

        slow, *quick = await asyncio.gather(
            timed("slow", SLOW), *(timed(f"q{i}", f"{i}*3") for i in range(30))
        )
        assert slow.timed_out and "took longer than 2.5 s" in slow.text
        assert [q.text for q in quick] == [str(i * 3) for i in range(30)]
        assert not any(q.error for q in quick)
        assert max(ended[f"q{i}"] for i in range(30)) < ended["slow"]
        assert pool.pids == runners  # the zygote stopped its grandchild and answered itself

    _with_pool(3, body)


def test_the_wait_for_a_runner_counts_inside_the_calls_timeout() -> None:
    async def body(pool: ZygotePool) -> None:
        tool = PythonExpression(256, pool)
        hog = asyncio.create_task(tool({"expression": SLOW}, 2.0))
        await asyncio.sleep(0.3)  # the only runner is busy
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(tool({"expression": "1+1"}, 0.5), 0.5)
        assert time.monotonic() - started < 1.5
        with pytest.raises(TimeoutError):
            await hog
        runner = pool.pids
        assert await tool({"expression": "2+2"}, 5.0) == "4"  # the runner was not lost
        assert pool.pids == runner and not pool.waiters

    _with_pool(1, body)


def test_memory_and_cpu_limit_breaches_give_the_runner_error_and_the_next_call_works() -> None:
    async def body(pool: ZygotePool) -> None:
        tool = PythonExpression(64, pool)
        with pytest.raises(RuntimeError, match="MemoryError"):
            await tool({"expression": "[0] * 10**9"}, 10.0)
        assert await tool({"expression": "sorted([3, 1, 2])"}, 10.0) == "[1, 2, 3]"
        runner = pool.pids
        # 1 s of CPU, long before the 20 s timeout: the kernel's limit ends it (SIGKILL at
        # the hard limit, equal to the soft one), as it did the child spawned per call.
        started = time.monotonic()
        evaluation = await pool.evaluate(
            SLOW, memory_bytes=256 << 20, cpu_seconds=1, timeout_seconds=20.0
        )
        assert time.monotonic() - started < 15
        assert evaluation.exit_code == -signal.SIGKILL
        with pytest.raises(RuntimeError, match=r"^the expression ended the runner \(exit -9\)"):
            python_answer(evaluation)
        assert await tool({"expression": "math.factorial(5)"}, 10.0) == "120"
        assert pool.pids == runner  # the zygote outlived its grandchild

    _with_pool(1, body)


def test_an_expression_that_raises_gives_its_error() -> None:
    async def body(pool: ZygotePool) -> None:
        tool = PythonExpression(256, pool)
        with pytest.raises(RuntimeError, match=r"^ZeroDivisionError: division by zero$"):
            await tool({"expression": "1/0"}, 10.0)
        with pytest.raises(RuntimeError, match=r"^NameError: name 'open' is not defined$"):
            await tool({"expression": "open('/etc/passwd')"}, 10.0)

    _with_pool(1, body)


def test_a_killed_runner_is_replaced_and_its_call_gets_an_error() -> None:
    async def body(pool: ZygotePool) -> None:
        tool = PythonExpression(256, pool)
        assert await tool({"expression": "6*7"}, 10.0) == "42"
        (first,) = pool.pids
        os.kill(first, signal.SIGKILL)  # while idle; the next call comes once it has died
        await asyncio.to_thread(_dead, first)
        assert await tool({"expression": "6*8"}, 10.0) == "48"
        (second,) = pool.pids
        assert second != first and _gone(first)

        call = asyncio.create_task(tool({"expression": SLOW}, 30.0))
        grandchild = await asyncio.to_thread(_grandchild, second)
        os.kill(second, signal.SIGKILL)  # mid-call
        with pytest.raises(ZygoteGone):
            await call
        assert _gone(second)
        deadline = time.monotonic() + 5
        while not _gone(grandchild) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _gone(grandchild)  # its process group was killed with it
        assert await tool({"expression": "6*9"}, 10.0) == "54"
        assert pool.pids not in ([first], [second])

    _with_pool(1, body)


@pytest.mark.parametrize(
    ("first", "first_answer", "then", "then_answer"),
    [
        ("math.__dict__.update(pi=3) or math.pi", "3", "math.pi", repr(math.pi)),
        ("(x := 5)", "5", "x", "NameError"),
        ("__builtins__.update(open=len)", "None", "open('abc')", "NameError"),
        ("__builtins__['sum'].__self__.__dict__.pop('len') and 1", "1", "len('ab')", "2"),
    ],
)
def test_nothing_an_expression_changes_is_seen_by_the_next_call(
    first: str, first_answer: str, then: str, then_answer: str
) -> None:
    async def body(pool: ZygotePool) -> tuple[str, str]:
        tool = PythonExpression(256, pool)
        done = await tool({"expression": first}, 10.0)
        try:
            return done, await tool({"expression": then}, 10.0)
        except RuntimeError as error:
            return done, str(error)

    done, after = _with_pool(1, body)  # one runner: both calls forked from the same zygote
    assert done == first_answer
    assert after.startswith(then_answer)


def test_close_leaves_no_process_and_the_pool_starts_again_after() -> None:
    async def body(pool: ZygotePool) -> None:
        tool = PythonExpression(256, pool)
        await asyncio.gather(*(tool({"expression": f"{i}"}, 10.0) for i in range(12)))
        in_flight = asyncio.create_task(tool({"expression": SLOW}, 30.0))
        await asyncio.sleep(0.2)
        runners = pool.pids
        grandchildren = [
            c.pid for pid in runners for c in psutil.Process(pid).children(recursive=True)
        ]
        assert len(runners) == 3 and len(grandchildren) == 1
        pool.close()
        with pytest.raises(ZygoteGone):
            await in_flight
        ours = {c.pid for c in psutil.Process().children(recursive=True)}
        for pid in runners + grandchildren:
            assert pid not in ours and _gone(pid)
        assert pool.pids == []
        assert await tool({"expression": "1+2"}, 10.0) == "3"

    _with_pool(3, body)


def test_the_runners_end_when_the_rank_dies() -> None:
    rank = textwrap.dedent(
        f"""
        import asyncio, sys, time
        import psutil
        from rljob_worker.agentic.tools import PythonExpression
        async def main():
            tool = PythonExpression(256)
            call = asyncio.create_task(tool({{"expression": {SLOW!r}}}, 60.0))
            while not tool.pool.pids or not psutil.Process(tool.pool.pids[0]).children():
                await asyncio.sleep(0.02)
            zygote = tool.pool.pids[0]
            print(zygote, psutil.Process(zygote).children()[0].pid, flush=True)
            await call
        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO)])}
    process = subprocess.Popen(
        [sys.executable, "-c", rank], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert process.stdout is not None
        zygote, grandchild = map(int, process.stdout.readline().split())
    finally:
        process.kill()  # the rank dies: no close(), no finalizer
        process.wait()
    deadline = time.monotonic() + 10
    while not (_gone(zygote) and _gone(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(zygote) and _gone(grandchild)


def test_a_pool_needs_a_runner() -> None:
    with pytest.raises(ValueError, match="at least one process"):
        ZygotePool(0)
