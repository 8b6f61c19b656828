"""The weight sync's buckets as one flat buffer each, and the gather of the next bucket issued
while the previous one is handed to the engine.

A bucket of full tensors goes to sglang as one buffer and a list of (name, shape, dtype, byte
range) entries (sglang's `load_format="flattened_bucket"`): one CUDA IPC handle per bucket
instead of one per tensor, which is what the per-tensor hand-off spends its time on. The
trainer's gather already writes a bucket into one buffer (sync_send.gather_full), so the flat view
costs no copy; tensors that do not share one buffer are packed into a new one (one copy).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class FlatEntry:
    """One tensor of a flat bucket: bytes [start, end) of the buffer hold it, contiguous."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start: int
    end: int


@dataclass(frozen=True)
class FlatBucket:
    """A bucket as one uint8 buffer and where each tensor lies in it."""

    buffer: torch.Tensor
    entries: tuple[FlatEntry, ...]
    # Whether the buffer was made by packing (a copy of the bucket's bytes) or is a view.
    packed: bool

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors again, as views of the buffer (sglang's reconstruct_tensors)."""
        return [
            (e.name, self.buffer[e.start : e.end].view(e.dtype).reshape(e.shape))
            for e in self.entries
        ]


class GatheredBucket(Sequence[tuple[str, torch.Tensor]]):
    """A bucket of (name, tensor) whose tensors already lie in one buffer, its layout worked out
    where they were gathered (sync_send.gather_full's plans): flatten() gives `flat` back as it is,
    without measuring every tensor again. The tensors, views of that buffer, are made on first
    use: the direct hand-off needs only `flat` (a view per tensor costs ~4 us of host time)."""

    def __init__(
        self, names: Sequence[str], tensors: Callable[[], list[torch.Tensor]], flat: FlatBucket
    ) -> None:
        self.names, self.flat = names, flat
        self._make: Callable[[], list[torch.Tensor]] | None = tensors
        self._items: list[tuple[str, torch.Tensor]] = []

    def _all(self) -> list[tuple[str, torch.Tensor]]:
        if self._make is not None:
            self._items = list(zip(self.names, self._make(), strict=True))
            self._make = None
        return self._items

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, index: int) -> tuple[str, torch.Tensor]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, torch.Tensor]]: ...
    def __getitem__(
        self, index: int | slice
    ) -> tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]]:
        return self._all()[index]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._all())


def byte_view(storage: torch.UntypedStorage, length: int) -> torch.Tensor:
    """A uint8 tensor over the first `length` bytes of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (length,), (1,)
    )


def flatten(named: Sequence[tuple[str, torch.Tensor]]) -> FlatBucket:
    """One buffer for the bucket `named`: a view where every tensor is contiguous in one
    storage (sync_send.gather_full's output), else the tensors packed into a new buffer, each at a
    byte offset its dtype can be viewed at. Offsets are from the storage's start, so a view of
    any dtype stays aligned. A GatheredBucket's layout is known already: its `flat`."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    if isinstance(named, GatheredBucket):
        return named.flat
    tensors = [tensor.detach() for _, tensor in named]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) == 1 and all(t.is_contiguous() for t in tensors):
        entries = tuple(
            FlatEntry(
                name,
                t.shape,
                t.dtype,
                int(t.storage_offset()) * t.element_size(),
                (int(t.storage_offset()) + t.numel()) * t.element_size(),
            )
            for (name, _), t in zip(named, tensors, strict=True)
        )
        end = max(e.end for e in entries)
        return FlatBucket(byte_view(tensors[0].untyped_storage(), end), entries, packed=False)
    entries_list: list[FlatEntry] = []
    offset = 0
    for (name, _), tensor in zip(named, tensors, strict=True):
        size = tensor.element_size()
        offset = -(-offset // size) * size  # aligned for a view of its dtype
        entries_list.append(
            FlatEntry(name, tensor.shape, tensor.dtype, offset, offset + tensor.numel() * size)
        )
        offset += tensor.numel() * size
    buffer = torch.empty(offset, dtype=torch.uint8, device=tensors[0].device)
    for entry, tensor in zip(entries_list, tensors, strict=True):
        buffer[entry.start : entry.end].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return FlatBucket(buffer, tuple(entries_list), packed=True)


def ipc_alias(buffer: torch.Tensor) -> torch.Tensor:
    """`buffer` as a tensor of its own storage object over the same memory (DLPack), for
    sending to another process by CUDA IPC.

    Sending a CUDA tensor wraps its storage's memory in torch's IPC reference count (the
    storage's data pointer is replaced by one that outlives the receiver's use): done to a
    storage the trainer keeps (the policy's shards, handed as they are by
    Trainer.weight_buckets), every sync would wrap it once more. The alias takes the wrapping
    and is dropped with the request; the memory stays the trainer's.

    So torch's reference count no longer keeps the memory alive for the receiver: the
    receiver must be done with it when its request is answered. rljob's loader is
    (sglang_direct.load synchronizes its stream before returning, and sglang's scheduler
    answers after every TP rank loaded); use the alias for no receiver that reads later."""
    if buffer.device.type != "cuda":
        return buffer
    return torch.from_dlpack(buffer)


def sglang_flattened_bucket(bucket: FlatBucket, metadata_class: Callable[..., Any]) -> dict:
    """The object sglang's scheduler unpickles for `load_format="flattened_bucket"`
    (weight_updater._update_weights_from_flattened_bucket, 0.5.17 and 0.5.23 alike): the buffer
    and one `FlattenedTensorMetadata` (sglang's own class, which its restricted unpickler admits)
    per tensor, whose start_idx/end_idx/numel count bytes of the uint8 buffer."""
    return {
        "flattened_tensor": bucket.buffer,
        "metadata": [
            metadata_class(
                name=e.name,
                shape=e.shape,
                dtype=e.dtype,
                start_idx=e.start,
                end_idx=e.end,
                numel=e.end - e.start,
            )
            for e in bucket.entries
        ],
    }


# A weight sync's copies (the sender's cast into its send buffer, the all-gather's unpacking,
# the direct loader's copy into the engine's weights) are hundreds of pairs of very different
# sizes. One torch._foreach_copy_ over all of them cuts the large ones into its multi-tensor
# kernels' small launches; a copy_ each costs a launch per small one. So pairs whose destination
# holds at least LARGE_COPY_BYTES get a copy_ each and the rest one foreach. On one H200
# (bench/copy_kernels.py, a 3B model's 434 tensors, 2026-11-27) the GPU time of the cast
# fp32 -> bf16 was 5.46 ms as one foreach, 5.49 ms as a copy_ each and 4.77 ms split at 32 MiB
# (its HBM floor 4.39 ms); of the bf16 copy 4.43, 4.25 and 3.43 ms (floor 2.92 ms).
# RLJOB_LARGE_COPY_BYTES sets another threshold in this process and the engine's schedulers,
# which inherit it (the GPU tests lower it so their small models take both launches).
LARGE_COPY_BYTES = 32 << 20
LARGE_COPY_ENV = "RLJOB_LARGE_COPY_BYTES"

CopySplit = tuple[tuple[int, ...], tuple[int, ...]]


def split_copies(dest_bytes: Sequence[int], threshold: int | None = None) -> CopySplit:
    """(large, small): the indices of the copies launched one by one (their destinations'
    sizes in `dest_bytes` at least `threshold`: unless given, LARGE_COPY_BYTES, or
    RLJOB_LARGE_COPY_BYTES where set) and of the rest."""
    if threshold is None:
        raw = os.environ.get(LARGE_COPY_ENV, "").strip()
        try:
            threshold = int(raw) if raw else LARGE_COPY_BYTES
        except ValueError:
            threshold = -1
        if threshold < 0:
            raise ValueError(f"{LARGE_COPY_ENV}={raw!r} is not a number of bytes (0 or more)")
    large = tuple(i for i, size in enumerate(dest_bytes) if size >= threshold)
    return large, tuple(i for i, size in enumerate(dest_bytes) if size < threshold)


def copy_pairs(
    dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], split: CopySplit
) -> None:
    """dests[i].copy_(sources[i]) for every i, launched as `split` (split_copies) says."""
    large, small = split
    if len(large) + len(small) != len(dests) or len(sources) != len(dests):
        raise ValueError(
            f"a copy split of {len(large)} + {len(small)} for {len(dests)} destinations and "
            f"{len(sources)} sources"
        )
    for i in large:
        dests[i].copy_(sources[i])
    if len(small) == len(dests):
        torch._foreach_copy_(list(dests), list(sources))
    elif small:
        torch._foreach_copy_([dests[i] for i in small], [sources[i] for i in small])


def _ready_marker() -> Callable[[], None]:
    """A wait for the kernels issued so far on the current CUDA stream (none on the CPU)."""
    if not torch.cuda.is_available():
        return lambda: None
    event = torch.cuda.Event()
    event.record()
    return event.synchronize


# The next bucket's gather is issued before the previous one is handed over (the default, the
# direct hand-off's measured setting: docs/weight-sync.md); RLJOB_WEIGHT_SYNC_OVERLAP=0 gathers
# each bucket only after the previous hand-off.
OVERLAP_ENV = "RLJOB_WEIGHT_SYNC_OVERLAP"


def overlap_enabled() -> bool:
    return os.environ.get(OVERLAP_ENV, "").strip() != "0"  # unset or empty: the default


def prefetched(gathers: Iterable[Callable[[], T]], ahead: bool = True) -> Iterator[T]:
    """The results of `gathers`, in order, each one's successor issued before it is yielded
    (`ahead`; else each gathered only once the previous one was handed back).

    A gather on the GPU only enqueues kernels (casts, the all-gather); the hand-off of the
    bucket yielded runs on the host (sglang's scheduler loads it from another process), so
    while the consumer hands bucket N over, bucket N+1's kernels run. A result is yielded once
    its own kernels are done (an event), not after the next one's. At most two results are
    held here at once: the one yielded and the one being gathered; the consumer must drop its
    reference before asking for the next (the memory plan's gather term counts two buckets).
    """
    if not ahead:
        for gather in gathers:
            result = _issued(gather)
            _waited(_ready_marker())
            yield result
            del result
        return
    pending: tuple[T, Callable[[], None]] | None = None
    for gather in gathers:
        result = _issued(gather)
        ready = _ready_marker()
        if pending is not None:
            previous, wait = pending
            pending = None
            _waited(wait)
            yield previous
            del previous
        pending = (result, ready)
        del result
    if pending is not None:
        previous, wait = pending
        pending = None
        _waited(wait)
        yield previous


def _issued(gather: Callable[[], T]) -> T:
    """A bucket's gather called: its host work, the kernels only enqueued (span
    `bucket_issue`, see TIMINGS_ENV)."""
    issuing = time.time()
    result = gather()
    record_span("bucket_issue", issuing, time.time())
    return result


def _waited(wait: Callable[[], None]) -> None:
    """The host waiting for a bucket's kernels, collectives with the other ranks included
    (span `bucket_kernels`)."""
    waiting = time.time()
    wait()
    record_span("bucket_kernels", waiting, time.time())


# RLJOB_SGLANG_DIRECT_TIMINGS=<file> (sglang's schedulers inherit the rank's environment): the
# weight sync's parts as JSON lines on one host's wall clock: the stage's spans (record_span:
# the whole sync, each wait for the next bucket, the device synchronize), the adapter's requests
# to sglang (`update`, `flush`) and the direct loader's own part of each update
# (sglang_direct.record_timing), so bench/sync_trip.py can split a hand-off into the request's
# way in, the loader and the way back. Unset (the default), nothing is written.
TIMINGS_ENV = "RLJOB_SGLANG_DIRECT_TIMINGS"


def record_timing_line(line: Mapping[str, Any]) -> None:
    path = os.environ.get(TIMINGS_ENV, "").strip()
    if path:
        with open(path, "a") as out:  # one short line a write: appends from several processes
            out.write(json.dumps({"pid": os.getpid(), **line}) + "\n")


def record_span(call: str, start_wall: float, end_wall: float) -> None:
    """One span of the weight sync (see TIMINGS_ENV), in time.time() seconds."""
    record_timing_line({"call": call, "start": start_wall, "end": end_wall})
