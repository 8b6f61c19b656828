"""sglang's processes seen from the rank that owns them: the stderr they inherit (a tee that
keeps their last words), the errors their failure becomes, and the engine proxy that raises them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from rljob_worker.memory import LIBRARY_OOM_MARKERS


class SGLangEngineError(RuntimeError):
    """sglang refused a call (it answers with success=False instead of raising)."""


class SGLangProcessFailed(SGLangEngineError):
    """One of sglang's processes failed and signalled this one (SIGQUIT)."""


class SGLangProcessOutOfMemory(SGLangProcessFailed, torch.OutOfMemoryError):
    """An sglang process died of a CUDA OOM (its last words say so): a torch.OutOfMemoryError,
    so the stage boundary records it as the stage's CUDA OOM and the OOM policy can act on it."""


CHILD_FAILED_MESSAGE = (
    "an sglang process failed and signalled SIGQUIT; its own error is in the log above "
    "(sglang's scheduler logs it before it signals)"
)
# Set by _on_sglang_child_failure, never cleared: this process's engine lost a process.
_child_failed = threading.Event()

# What a child's stderr says when it died of a CUDA OOM: torch's OutOfMemoryError, the CUDA
# runtime's and driver's errors (torch_memory_saver resuming a region: "cudaError error: 2 (out of
# memory) ... func=resume", seen on an H100 with sglang 0.5.17, where the scheduler then exits 1
# with no Python traceback), and the CUDA libraries' failed workspaces the stage boundary counts
# as OOMs in this process (memory.LIBRARY_OOM_MARKERS). Not a bare "out of memory": sglang says
# that of its own pools too ("alloc_req_slots runs out of memory", "Prefill out of memory"),
# which a smaller memFractionStatic would make worse.
CHILD_OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "(out of memory)",
    "OutOfMemoryError",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "cudaErrorMemoryAllocation",
    *LIBRARY_OOM_MARKERS,
)
# torch_memory_saver's note on a cuMemCreate that the caller may still recover from: not a death.
CHILD_BENIGN_MARKERS = ("may not be an issue",)
CHILD_TAIL_BYTES = 64 << 10


class _ChildStderr:
    """The stderr sglang's processes inherit: a pipe whose every byte this process copies to its
    own stderr, keeping the last CHILD_TAIL_BYTES, so that when a child fails its last words can
    say why in the error (and in status) instead of only in the pod's log.

    Only the engine's start-up has it as fd 2 (the children are spawned then and keep it); this
    process's own stderr is its own again once the engine has started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tail = bytearray()
        self._pump_thread: threading.Thread | None = None
        self._inherited = False

    @contextlib.contextmanager
    def inherited(self) -> Iterator[None]:
        read_fd, write_fd = os.pipe()
        out_fd = os.dup(2)
        with self._lock:
            self._tail.clear()
        thread = threading.Thread(
            target=self._pump, args=(read_fd, out_fd), name="rljob-sglang-stderr", daemon=True
        )
        thread.start()
        self._pump_thread = thread
        sys.stderr.flush()
        os.dup2(write_fd, 2)
        self._inherited = True
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(out_fd, 2)
            os.close(write_fd)  # from now on only the children hold it: EOF when they are gone
            self._inherited = False

    def _pump(self, read_fd: int, out_fd: int) -> None:
        try:
            while chunk := os.read(read_fd, 65536):
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-CHILD_TAIL_BYTES]
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(out_fd, view) :]
                    except OSError:
                        break
        finally:
            os.close(read_fd)
            os.close(out_fd)

    def last_words(self, wait_seconds: float = 2.0) -> str:
        """The children's last output: waits (bounded) for the pipe's end once they are gone;
        during start-up this process still holds the pipe, so only briefly, for the pump."""
        thread = self._pump_thread
        if thread is not None:
            thread.join(wait_seconds if not self._inherited else 0.3)
        with self._lock:
            return self._tail.decode(errors="replace")


_child_stderr = _ChildStderr()


def child_failure_line(text: str) -> tuple[str | None, bool]:
    """(the line that says why a child failed, whether it is a CUDA OOM) from its last words:
    the last OOM line if any, else the last line naming an error; (None, False) if none does."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(m in line for m in CHILD_OOM_MARKERS) and not any(
            m in line for m in CHILD_BENIGN_MARKERS
        ):
            return line[:1000], True
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line[:1000], False
    return None, False


def child_failure(call: str | None = None) -> SGLangProcessFailed:
    """The error for a failed sglang process: an SGLangProcessOutOfMemory where its last words
    name a CUDA OOM, else SGLangProcessFailed quoting its last error line where there is one."""
    where = f"Engine.{call}: " if call else ""
    line, oom = child_failure_line(_child_stderr.last_words())
    if oom:
        return SGLangProcessOutOfMemory(
            f"CUDA out of memory in an sglang process: {where}its last words: {line}"
        )
    if line is not None:
        return SGLangProcessFailed(
            f"{where}an sglang process failed and signalled SIGQUIT; its last error: {line}"
        )
    return SGLangProcessFailed(f"{where}{CHILD_FAILED_MESSAGE}")


class _Guarded:
    """sglang.Engine whose calls, once one of its processes failed, raise SGLangProcessFailed
    (the call's own error, e.g. 'Event loop stopped before Future completed.', as the cause)."""

    def __init__(self, engine: Any) -> None:
        self._target = engine

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if _child_failed.is_set():
                raise child_failure(name)
            try:
                return attribute(*args, **kwargs)
            except Exception as error:
                if _child_failed.is_set():
                    raise child_failure(name) from error
                raise

        return call
