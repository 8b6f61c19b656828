"""Tagged GPU memory regions that can be released and re-acquired at the same addresses.

A thin layer over torch_memory_saver (CUDA), plus `PassThroughSaver`, its stand-in where CUDA is not.

The rollout engine allocates its weights inside `region("weights")` and its KV pool inside
`region("kv_cache")`; `pause(tag)` unmaps the physical memory of every allocation made under that
tag (the virtual addresses stay reserved, so tensors, block tables and CUDA graphs remain valid)
and `resume(tag)` maps fresh physical memory back at the same addresses. Unless a region was
opened with `enable_cpu_backup=True`, the contents after resume are undefined.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

SaverCall = tuple[Literal["region", "pause", "resume"], str]


class MemorySaver(Protocol):
    """What the engines need from a memory saver."""

    @property
    def releases_device_memory(self) -> bool:
        """True when pause() really gives physical device memory back (the CUDA saver)."""
        ...

    def region(
        self, tag: str, enable_cpu_backup: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """Allocations made inside belong to `tag`."""
        ...

    def pause(self, tag: str) -> None:
        """Give the physical memory of `tag` back to the device; addresses stay reserved."""
        ...

    def resume(self, tag: str) -> None:
        """Map physical memory back under `tag`'s addresses."""
        ...


class CudaMemorySaver:
    """torch_memory_saver on CUDA, in hook_mode "torch" (a pluggable allocator: no LD_PRELOAD).

    torch_memory_saver is a process-wide singleton whose hook mode is fixed at its first use, so
    the mode is set here only if nothing initialised it before; every CudaMemorySaver in a
    process shares the same regions.
    """

    releases_device_memory = True

    def __init__(self, hook_mode: Literal["torch", "preload"] = "torch") -> None:
        from torch_memory_saver import torch_memory_saver

        if torch_memory_saver._impl is None:
            torch_memory_saver.hook_mode = hook_mode
        self._tms = torch_memory_saver
        _free_regions_at_exit(torch_memory_saver)

    def region(
        self, tag: str, enable_cpu_backup: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        return self._tms.region(tag=tag, enable_cpu_backup=enable_cpu_backup)

    def pause(self, tag: str) -> None:
        import torch

        # Unmapping memory that queued kernels still read or write corrupts them.
        torch.cuda.synchronize()
        self._tms.pause(tag)

    def resume(self, tag: str) -> None:
        self._tms.resume(tag)


_EXIT_HOOKED = False


def _free_regions_at_exit(tms: Any) -> None:
    """Let the interpreter's teardown free region memory instead of ending the process with 1.

    In hook_mode "torch", torch_memory_saver's allocator accepts a free only while the calling
    thread is inside a region, and otherwise calls exit(1). Its memory pools and region tensors
    are freed when the interpreter tears its modules down, outside any region: a process that
    finished its work cleanly exited with status 1 (seen on two H200s: pytest after all GPU
    tests passed, and the rank processes' logs; tests/gpu/test_saver_exit_gpu.py). At exit, after
    the atexit hooks registered later have run, this marks the main thread as inside a region,
    so those frees unmap and release the memory as a free inside `region()` would.
    """
    global _EXIT_HOOKED
    if _EXIT_HOOKED:
        return
    _EXIT_HOOKED = True

    def mark_main_thread_as_region() -> None:
        impl = tms._impl
        if impl is not None and impl._hook_mode == "torch":
            impl._binary_wrapper.cdll.tms_set_interesting_region(True)

    atexit.register(mark_main_thread_as_region)


@dataclass
class PassThroughSaver:
    """Stand-in for torch_memory_saver where CUDA is not (CPU runs and tests): frees nothing.

    It keeps the same calls and records them in order (`calls`), and refuses what the real saver
    would make a silent bug: pausing a tag twice, resuming a tag that is not paused.
    """

    calls: list[SaverCall] = field(default_factory=list)
    paused: set[str] = field(default_factory=set)
    releases_device_memory = False

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        self.calls.append(("region", tag))
        yield

    def pause(self, tag: str) -> None:
        if tag in self.paused:
            raise RuntimeError(f"memory tag {tag!r} is already paused")
        self.paused.add(tag)
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        if tag not in self.paused:
            raise RuntimeError(f"memory tag {tag!r} is not paused; nothing to resume")
        self.paused.discard(tag)
        self.calls.append(("resume", tag))


def make_saver(device: str | None = None) -> MemorySaver:
    """The real saver on a CUDA device, the pass-through stand-in otherwise."""
    import torch

    on_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if on_cuda:
        return CudaMemorySaver()
    return PassThroughSaver()
