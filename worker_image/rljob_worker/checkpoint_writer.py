"""The asynchronous checkpoint's two halves: the training state as host tensors dcp.save can
write (views of the offload's host copies where it has them), and the thread that writes them.

docs/checkpoints.md ("Asynchronous save") says what blocks the loop and what runs behind it.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

log = logging.getLogger(__name__)

T = TypeVar("T")

# A local tensor (a shard) -> a view of its host copy, or None where there is none.
HostLookup = Callable[[torch.Tensor], torch.Tensor | None]


@dataclass
class HostState:
    """A state dict of host tensors, and how its bytes got there."""

    state: dict[str, Any]
    viewed_bytes: int = 0  # read in place from host copies that already existed
    copied_bytes: int = 0  # copied here (what had no host copy: AdamW's step, buffers)
    _cpu_meshes: dict[int, DeviceMesh] = field(default_factory=dict)


def _cpu_mesh(mesh: DeviceMesh, cache: dict[int, DeviceMesh]) -> DeviceMesh:
    """The same ranks and layout as `mesh`, on the CPU: DTensor.from_local moves a local tensor
    to its mesh's device, and dcp.save needs only the layout to place a shard."""
    if mesh.device_type == "cpu":
        return mesh
    if id(mesh) not in cache:
        cache[id(mesh)] = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
    return cache[id(mesh)]


def host_state_dict(
    state: dict[str, Any],
    lookup: HostLookup | None,
    cpu_meshes: dict[int, DeviceMesh] | None = None,
) -> HostState:
    """`state` (get_state_dict's: DTensors, tensors, numbers) with every tensor on the host.

    A tensor whose host copy `lookup` finds is a view of it (no copy, no device traffic; over a
    storage of its own bytes, see own_storage); any other is copied to host memory. Non-tensor
    values are copied too: the writer must see the state as it was here, whatever the loop
    changes while it writes. DTensors stay DTensors with the same placements and global shape,
    so dcp.save writes the same shards, in the same format, as from the device."""
    out = HostState(state={}, _cpu_meshes=cpu_meshes if cpu_meshes is not None else {})

    def host(tensor: torch.Tensor) -> torch.Tensor:
        found = lookup(tensor) if lookup is not None else None
        nbytes = tensor.numel() * tensor.element_size()
        if found is not None:
            out.viewed_bytes += nbytes
            return own_storage(found)
        out.copied_bytes += nbytes
        return tensor.detach().to("cpu", copy=True)

    def convert(value: Any) -> Any:
        if isinstance(value, DTensor):
            return DTensor.from_local(
                host(value.to_local()),
                _cpu_mesh(value.device_mesh, out._cpu_meshes),
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return host(value)
        if isinstance(value, dict):
            return {key: convert(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(convert(item) for item in value)
        return copy.deepcopy(value)

    out.state = convert(state)
    return out


def start_thread(work: Callable[[], T], name: str) -> Future[T]:
    """Run `work` on a thread of its own; its result or exception in the returned future.

    A daemon thread: a process that ends (or is killed) while it writes leaves the checkpoint
    without its marker, which no resume picks; nothing waits for it at interpreter exit."""
    future, release = held_thread(work, name, hold_seconds=0.0)
    release()
    return future


def held_thread(
    work: Callable[[], T], name: str, hold_seconds: float
) -> tuple[Future[T], Callable[[], None]]:
    """Start a thread that runs `work` once released (the returned call), or after
    `hold_seconds` without a release, whichever comes first; its result or exception in the
    returned future. The timeout makes sure it runs even where the release never comes (a peer
    rank's OOM stops the loop before the boundary that releases it, while the writer's own
    collectives wait for this rank's writer)."""
    future: Future[T] = Future()
    go = threading.Event()

    def run() -> None:
        if not go.wait(timeout=hold_seconds):
            log.warning("%s: not released within %.1f s, writing anyway", name, hold_seconds)
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to whoever waits, re-raised there
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future, go.set


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` over a storage of exactly its own bytes, the same memory (a contiguous host
    tensor; any other is returned as it is). torch.distributed.checkpoint's writer clones every
    tensor whose storage is larger than the tensor (both its loaders: `untyped_storage().size()
    != nbytes`), and the host copies are views of one allocation: without this every byte is
    copied once more, into fresh memory, before it is written."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return tensor
    if tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    if tensor.numel() == 0:
        # An empty shard (FSDP2 gives a rank none where a dimension has fewer chunks than
        # ranks): numpy's empty array has stride 0, which no dtype view accepts; the writer's
        # clone of it copies nothing.
        return tensor
    flat = tensor.reshape(-1).view(torch.uint8)
    # from_numpy makes a storage of the array's bytes; the array keeps the allocation alive.
    return torch.from_numpy(flat.numpy()).view(tensor.dtype).view(tensor.shape)


class _CrcOff:
    """torch.save's CRC32 switched off while at least one FileWriter writes, back to what it was
    when the last one ends. The switch is process-wide (torch.serialization), so two writers
    that overlapped, each saving and restoring it, could leave it off for good; this counts
    them under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writers = 0
        self._before = True

    def __enter__(self) -> None:
        with self._lock:
            if self._writers == 0:
                self._before = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            self._writers += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._writers -= 1
            if self._writers == 0:
                torch.serialization.set_crc32_options(self._before)


_CRC_OFF = _CrcOff()


class FileWriter(FileSystemWriter):
    """dcp's FileSystemWriter (the same files, fsynced, the same format) without torch.save's
    CRC32 of every record: computed while the writer holds the GIL, it took about half the
    writer's time on the CPU (docs/checkpoint-figures.md, "Why the writer was slow"), and torch.load
    does not check it. The switch is process-wide (torch.serialization), so it is off only
    while a FileWriter writes (`_CrcOff` counts overlapping writers)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        with _CRC_OFF:  # FileSystemWriter writes every file before it returns its (done) future
            return super().write_data(plan, planner)
