"""The training state's host copies: device storages emptied into pinned host buffers and
refilled in place, the buffers kept for the next offload and read by the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rljob_worker.staging import Staging

# Each storage's host copy starts at a multiple of this, so a copy can be viewed in its dtype.
_HOST_ALIGN_BYTES = 64


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (padding included)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


class _HostCopies:
    """Empties device storages into host buffers and refills them in place.

    The tensors (FSDP2's sharded params, AdamW's moments, DTensors or not) keep their identity:
    only their storage is resized to 0 and back, the way FSDP2 frees unsharded params, so no
    bookkeeping that holds them changes. Moving the tensors themselves does not free anything:
    DTensor.from_local puts a CPU tensor back on the mesh's device, and module.to("cpu") copies
    through pageable memory. Buffers are pinned on CUDA (asynchronous, full link speed) and
    allocated once: pinning is slow, reusing is not.

    The checkpoint reads these buffers too (checkpoint_writer.py): `copy_out` fills them
    without freeing anything, the offload that follows then only frees, and a background
    writer may read them until `hold`'s wait returns, which the next write into them calls.
    """

    def __init__(self, device: torch.device, staging: Staging, outward: str, inward: str) -> None:
        self.pin = device.type == "cuda"
        self.device = device
        # Runs the copies (on its side stream where the staging overlaps) and their waits.
        self.staging, self.outward, self.inward = staging, outward, inward
        self._buffers: list[torch.Tensor] = []
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        # The storages copy_out copied and not freed since (their host copies are current).
        self._current: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._by_pointer: dict[int, torch.Tensor] = {}
        self._reader_wait: Callable[[], None] | None = None

    def hold(self, wait: Callable[[], None]) -> None:
        """Someone reads the buffers until `wait()` returns: called before they are rewritten."""
        self._reader_wait = wait

    def copy_out(self, storages: list[torch.UntypedStorage], *, wait: bool = True) -> None:
        """Copy the storages into the host buffers (allocated on first use), freeing nothing;
        `wait=False`: the copies may still run on return (the next offload waits for them).

        Valid only while the storages do not change until the next offload (the stage machine
        runs nothing that writes them in between): that offload then only frees them."""
        if self._held:
            raise RuntimeError("copy_out while offloaded: load first")
        if self._reader_wait is not None:
            reader_done, self._reader_wait = self._reader_wait, None
            reader_done()
        if not self._buffers:
            self._allocate([storage.nbytes() for storage in storages])
        if len(storages) != len(self._buffers):
            raise RuntimeError(f"{len(storages)} storages to offload, {len(self._buffers)} before")
        self._current, self._by_pointer = [], {}
        sources = [_bytes_of(storage) for storage in storages]
        for index, (source, buffer) in enumerate(zip(sources, self._buffers, strict=True)):
            if buffer.numel() != source.numel():
                raise RuntimeError(f"storage {index} changed size since the last offload")
        with self.staging.copies(self.outward):
            for source, buffer in zip(sources, self._buffers, strict=True):
                buffer.copy_(source, non_blocking=self.pin)
        for storage, buffer in zip(storages, self._buffers, strict=True):
            self._current.append((storage, buffer))
            self._by_pointer[storage.data_ptr()] = buffer
        if wait:  # the copies read what may be freed next; the host reads the buffers
            self.staging.wait(self.outward, host=True)

    def start_offload(self, storages: list[torch.UntypedStorage]) -> None:
        """The copies to the host start, unless copy_out made them; `offload` frees."""
        if self._held:
            raise RuntimeError("offload while already offloaded: load first")
        if not self._copied(storages):
            self.copy_out(storages, wait=False)

    def offload(self, storages: list[torch.UntypedStorage]) -> None:
        if self._held:
            raise RuntimeError("offload while already offloaded: load first")
        if not self._copied(storages):
            self.copy_out(storages)
        self.staging.wait(self.outward, host=True)  # start_offload's copies read them
        for storage, _ in self._current:
            storage.resize_(0)
        self._held, self._current = self._current, []

    def _copied(self, storages: list[torch.UntypedStorage]) -> bool:
        copied = {storage.data_ptr() for storage, _ in self._current}
        return copied == {storage.data_ptr() for storage in storages}

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor` (a plain tensor over a storage the last copy_out copied) as a view of its
        host copy; None where copy_out did not copy its storage."""
        buffer = self._by_pointer.get(tensor.untyped_storage().data_ptr())
        if buffer is None or not self._current:
            return None
        typed = buffer.view(tensor.dtype)
        # as_strided's offset counts from the start of the whole host allocation, not the view.
        offset = typed.storage_offset() + tensor.storage_offset()
        return torch.as_strided(typed, tensor.size(), tensor.stride(), offset)

    def _allocate(self, sizes: list[int]) -> None:
        # One host allocation, registered (pinned) as a whole: torch's pinned allocator rounds
        # every tensor up to a power of two (up to 2x the host memory, and pinning time).
        starts, total = [], 0
        for size in sizes:
            starts.append(total)
            total += -(-size // _HOST_ALIGN_BYTES) * _HOST_ALIGN_BYTES
        self._host = torch.empty(total, dtype=torch.uint8)
        if self.pin and self._host.numel():
            torch.cuda.check_error(
                torch.cuda.cudart().cudaHostRegister(self._host.data_ptr(), self._host.numel(), 0)
            )
        self._buffers = [
            self._host[start : start + size] for start, size in zip(starts, sizes, strict=True)
        ]

    def load(self, *, wait: bool = True) -> None:
        """The storages back on the device (allocated on the current stream) and refilled;
        `wait=False`: whoever uses them first waits (`staging.wait(inward)`)."""
        if not self._held:
            return  # nothing offloaded (a fresh AdamW has no moments yet)
        for storage, buffer in self._held:
            storage.resize_(buffer.numel())
        with self.staging.copies(self.inward):
            for storage, buffer in self._held:
                _bytes_of(storage).copy_(buffer, non_blocking=self.pin)
        self._held = []
        if wait:
            self.staging.wait(self.inward)
