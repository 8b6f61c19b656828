"""Child processes the tests start (etcd, apiserver, controllers, operators) and their logs,
and that none outlives the run: process groups, atexit, SIGTERM/SIGHUP handlers, pdeathsig.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TypeVar

T = TypeVar("T")

# Every process started here and not yet stopped; what the exit hooks kill.
_LIVE: dict[int, Process] = {}
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


@dataclass
class Process:
    """A component started in its own process group, with its log kept for failures."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `timeout` seconds."""
        _LIVE.pop(self.pid, None)
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=timeout)
        except ProcessLookupError:
            # It exited between poll() and killpg(): nothing left to stop.
            self.popen.wait(timeout=timeout)


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook that has the kernel SIGKILL the child if this process dies (even by
    SIGKILL, when no Python hook can run). Linux only; resolved here, before any fork."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    signum = int(signal.SIGKILL)

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)

    return hook


_PREEXEC = _die_with_parent()


def start_process(
    name: str,
    argv: Sequence[str | Path],
    log_dir: Path,
    env: Mapping[str, str] | None = None,
) -> Process:
    """Start `argv` in a new session (its own process group), output to log_dir/name.log."""
    _install_exit_hooks()
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            [str(a) for a in argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() reaches its children too
            # Only calls prctl, resolved before the fork, so it is safe alongside threads.
            preexec_fn=_PREEXEC,
            env={**os.environ, **(env or {})},
        )
    process = Process(name, popen, log_path)
    _LIVE[process.pid] = process
    return process


def stop_all() -> None:
    """Stop every live process, newest first."""
    for process in reversed(list(_LIVE.values())):
        process.stop()


atexit.register(stop_all)
_signal_hooks_installed = False


def _install_exit_hooks() -> None:
    """Ctrl-C reaches pytest as KeyboardInterrupt and fixtures tear down; SIGTERM and SIGHUP
    (CI cancelling, a closed terminal) would end Python without atexit, so handle them."""
    global _signal_hooks_installed
    # signal.signal() works only in the main thread; a start elsewhere leaves it for later.
    if _signal_hooks_installed or threading.current_thread() is not threading.main_thread():
        return
    _signal_hooks_installed = True
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _stop_all_and_die)


def _stop_all_and_die(signum: int, frame: FrameType | None) -> None:
    stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def as_another_user(call: Callable[[], object]) -> str:
    """`call`'s error ("Type: message"), or "no error", in a forked child that is not root
    (nobody, where the tests run as root): a permission the kernel refuses, as in a pod whose
    uid owns neither the file nor the folder."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one call, its error down the pipe, then out
        try:
            os.close(read)
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                call()
                said = "no error"
            except BaseException as error:
                said = f"{type(error).__name__}: {error}"
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    return said
