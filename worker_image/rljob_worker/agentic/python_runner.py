"""builtin:python's runner: a pool of "zygotes", small single-threaded `python -I -S` processes
started once, each of which forks a fresh grandchild per expression (limits set, evaluated, gone).

Why: spawning an interpreter per call from the rank (a process holding torch, CUDA and sglang's
tokenizer manager on its event loop) gave ~20-25 calls/s on the GPU machine, and tool calls hit
their timeout while they waited to be born. Here the rank starts a zygote once; a call costs one
fork of a ~10 MB process and no interpreter start, and no process is created in the rank per call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import weakref
from dataclasses import dataclass
from typing import Any

# The zygote's program. It reads one JSON request a line on stdin, forks a grandchild that sets
# its limits and evaluates the expression in fresh globals, reads the grandchild's output (its
# stdout and stderr, one pipe) until EOF or the deadline, reaps it and answers one JSON line.
# It exits when stdin ends (the rank closed it, or died) or its parent is gone.
_ZYGOTE = r"""
import json, math, os, resource, select, signal, sys, time

SAFE = {n: getattr(__builtins__, n) for n in (
    "abs", "all", "any", "bin", "bool", "chr", "divmod", "float", "hex", "int", "len", "list",
    "max", "min", "oct", "ord", "pow", "range", "reversed", "round", "sorted", "str", "sum",
    "tuple", "set", "dict", "zip", "enumerate", "map", "filter", "True", "False", "None")}
PARENT = os.getppid()


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def evaluate(request):  # in the grandchild: never returns
    code = 1
    try:
        memory, cpu = request["memory_bytes"], request["cpu_seconds"]
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU leaves no core file
        try:
            text, code = repr(eval(request["expression"], {"__builtins__": dict(SAFE), "math": math})), 0
        except BaseException as error:
            text = f"Error: {type(error).__name__}: {error}"
        write_all(1, text.encode(errors="replace"))
    except BaseException:  # as an interpreter would: the traceback on stderr, exit 1
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:
            pass
    finally:
        os._exit(code)


def run(request):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(write, 1)
        os.dup2(write, 2)
        evaluate(request)
    os.close(write)
    deadline = time.monotonic() + request["timeout_seconds"]
    chunks, timed_out, orphaned = [], False, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready = select.select([read, 0], [], [], min(left, 1.0))[0]
        if 0 in ready or os.getppid() != PARENT:  # stdin readable mid-call: only its end
            orphaned = True
            break
        if read in ready:
            data = os.read(read, 1 << 16)
            if not data:
                break
            chunks.append(data)
    if timed_out or orphaned:
        os.kill(pid, signal.SIGKILL)
    os.close(read)
    status = os.waitpid(pid, 0)[1]
    if orphaned:
        sys.exit(0)
    return {"exit": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
            "output": b"".join(chunks).decode(errors="replace")}


def main():
    pending = b""
    while True:
        while b"\n" not in pending:
            if not select.select([0], [], [], 1.0)[0]:
                if os.getppid() != PARENT:
                    return
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return
            pending += data
        line, pending = pending.split(b"\n", 1)
        write_all(1, json.dumps(run(json.loads(line))).encode() + b"\n")


main()
"""

# Seconds before the call's own deadline at which a zygote stops the grandchild and answers
# "timed out" (at most a tenth of the timeout), so the answer comes back before the rank's
# backstop (ToolSet.run's wait_for) even on a loaded host; a backstop that fires first costs
# the zygote (it is replaced), not the answer.
_DEADLINE_MARGIN_SECONDS = 0.25
# Seconds a zygote told to end (stdin closed) has before its process group is killed.
_END_GRACE_SECONDS = 2.0


def default_pool_size() -> int:
    """The CPUs this process may run on, at most 32: expressions are CPU-bound (no builtin does
    I/O or sleeps), so more grandchildren at once than cores buys no throughput."""
    return max(1, min(32, len(os.sched_getaffinity(0))))


class ZygoteGone(RuntimeError):
    """The zygote ended (killed, or crashed) before it answered."""


@dataclass(frozen=True)
class Evaluation:
    """What one grandchild did: its exit code (negative: the signal that ended it, as
    subprocess gives) and its stdout and stderr together."""

    exit_code: int
    output: str


class _Zygote:
    def __init__(self) -> None:
        # Its own session: killpg reaches a grandchild it left. close_fds (the default) keeps
        # the rank's other pipes out of it, so stdin's EOF comes when the rank closes or dies.
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            bufsize=0,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin = self.process.stdin.fileno()
        self.stdout = self.process.stdout.fileno()
        os.set_blocking(self.stdout, False)
        self.pending = bytearray()
        self.reading = False  # a call waits on stdout: the EOF of its end reaches it there
        self.reaped = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its answer line, on whichever loop is running (the
        rank's engine loop, or asyncio.run in tests): nothing here is bound to one loop."""
        try:  # small (an expression is at most 2000 characters): the pipe takes it at once
            os.write(self.stdin, json.dumps(request).encode() + b"\n")
        except BrokenPipeError:
            raise ZygoteGone("the python runner had ended") from None
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()

        def readable() -> None:
            if answer.done():
                return
            try:
                data = os.read(self.stdout, 1 << 16)
            except BlockingIOError:
                return
            except OSError as error:
                answer.set_exception(ZygoteGone(f"the python runner's pipe failed: {error}"))
                return
            if not data:
                answer.set_exception(ZygoteGone("the python runner ended before it answered"))
                return
            self.pending += data
            if b"\n" in self.pending:
                line, _, rest = bytes(self.pending).partition(b"\n")
                self.pending = bytearray(rest)
                answer.set_result(line)

        loop.add_reader(self.stdout, readable)
        self.reading = True
        try:
            line = await answer
        finally:
            loop.remove_reader(self.stdout)
            self.reading = False
            if self.reaped:
                self._close_stdout()
        return json.loads(line)  # type: ignore[no-any-return]

    def end(self) -> None:
        """Ask it to end: on its stdin's EOF it kills and reaps its grandchild, then exits."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()

    def reap(self) -> None:
        """Wait for it to end (briefly), then kill what may be left of its process group and
        reap it. A zygote that ended on its own has reaped its grandchild; one that did not
        end, or was killed by a signal (from outside: its grandchild may live on), has the
        group killed, while the group's id is still held (by the unreaped zygote, or by a
        grandchild still running)."""
        self.end()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=_END_GRACE_SECONDS)
        if self.process.returncode is None or self.process.returncode < 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.reaped = True
        if not self.reading:  # else the call reading it closes it, after the EOF
            self._close_stdout()

    def _close_stdout(self) -> None:
        if self.process.stdout is not None:
            self.process.stdout.close()


def _end_all(zygotes: set[_Zygote]) -> None:
    for zygote in zygotes:  # all told first: they end at once
        zygote.end()
    for zygote in zygotes:
        zygote.reap()
    zygotes.clear()


class ZygotePool:
    """Up to `size` zygotes, started lazily, each answering one request at a time.

    A pool of one-at-a-time zygotes rather than one zygote multiplexing requests by id: a
    zygote's protocol stays one line in, one line out; a zygote that is killed (the rank's
    backstop timeout, a cancelled rollout) takes only its own call with it; and the pool's size
    bounds the CPU that tool calls take from the rank's node. Calls beyond `size` wait for a
    free zygote; that wait counts inside the call's timeout. A dead zygote is replaced on the
    next call. close() (or the pool's collection, or the rank's exit) ends every process."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size if size is not None else default_pool_size()
        if self.size < 1:
            raise ValueError(f"the python runner pool needs at least one process, not {size}")
        self.zygotes: set[_Zygote] = set()  # all started and not yet killed
        self.idle: list[_Zygote] = []
        # Futures of calls waiting for a zygote; each gets an idle zygote, or None: start one.
        self.waiters: collections.deque[asyncio.Future[_Zygote | None]] = collections.deque()
        self._finalizer = weakref.finalize(self, _end_all, self.zygotes)

    @property
    def pids(self) -> list[int]:
        return sorted(z.pid for z in self.zygotes)

    async def _acquire(self) -> _Zygote:
        while True:
            if self.idle:
                zygote = self.idle.pop()
                if zygote.alive():
                    return zygote
                self._drop(zygote)
                continue
            if len(self.zygotes) < self.size:
                return self._start()
            waiter: asyncio.Future[_Zygote | None] = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # handed over, then cancelled
                    self._release(waiter.result())
                elif waiter in self.waiters:
                    self.waiters.remove(waiter)
                raise
            if handed is not None:
                if handed.alive():
                    return handed
                self._drop(handed)
            return self._start()

    def _start(self) -> _Zygote:
        zygote = _Zygote()
        self.zygotes.add(zygote)
        return zygote

    def _drop(self, zygote: _Zygote) -> None:
        zygote.reap()
        self.zygotes.discard(zygote)

    def _release(self, zygote: _Zygote | None) -> None:
        """A call is done with its zygote (None: it was killed): the first waiter gets it."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(zygote)
                return
        if zygote is not None:
            self.idle.append(zygote)

    async def evaluate(
        self,
        expression: str,
        *,
        memory_bytes: int,
        cpu_seconds: int,
        timeout_seconds: float,
    ) -> Evaluation:
        """Evaluate `expression` in a fresh grandchild; TimeoutError when it (with the wait for
        a zygote) takes longer than timeout_seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        zygote = await self._acquire()
        left = deadline - loop.time() - min(_DEADLINE_MARGIN_SECONDS, timeout_seconds / 10)
        if left <= 0:
            self._release(zygote)
            raise TimeoutError(f"no python runner was free within {timeout_seconds:g} s")
        request = {
            "expression": expression,
            "memory_bytes": memory_bytes,
            "cpu_seconds": cpu_seconds,
            "timeout_seconds": left,
        }
        try:
            answer = await zygote.ask(request)
        except BaseException:  # its state unknown (cancelled mid-call, or it died): replace it
            self._drop(zygote)
            self._release(None)
            raise
        self._release(zygote)
        if answer["timed_out"]:
            raise TimeoutError(f"the expression ran past {timeout_seconds:g} s")
        return Evaluation(int(answer["exit"]), str(answer["output"]))

    def close(self) -> None:
        """End every zygote and grandchild now, and reap them; the pool may be used again."""
        self.idle.clear()
        _end_all(self.zygotes)
