"""The weight sync's sending side: each bucket of the FSDP2-sharded policy gathered into full
tensors with one flat all-gather (gather_full, through a SendPlan made once per bucket), or sent
shard to shard to a tensor-parallel engine (shard_bucket).

The Trainer (train.py) cuts the policy into buckets and calls these for each one.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from rljob.plan import FLAT_SHARDS_ENV as FLAT_SHARDS_ENV
from rljob.plan import flat_shards_on
from rljob_worker import tp_shards
from rljob_worker.engines.sglang_weights import DenseLayout
from rljob_worker.sharded_load import chunk_rows, row_chunk
from rljob_worker.weight_sync import (
    CopySplit,
    FlatBucket,
    FlatEntry,
    GatheredBucket,
    byte_view,
    copy_pairs,
    split_copies,
)

# A weight-sync bucket as gather_full gives it: a list, or a GatheredBucket with its layout.
Bucket = Sequence[tuple[str, torch.Tensor]]


# The policy's shards are laid out in one buffer (sharded_load.to_empty_flat) unless
# RLJOB_FLAT_SHARDS=0 (a bench's before, or a model this layout does not suit); the name is the
# memory plan's (rljob.plan.sync_as_stored reads it too).
def flat_shards_enabled() -> bool:
    return flat_shards_on(os.environ.get(FLAT_SHARDS_ENV, ""))


def flat_chunk_elements(shape: torch.Size, world: int) -> int:
    """Elements each rank sends for one tensor in gather_full's flat all-gather: a full dim-0
    chunk, the rank's shard padded up to it, so every rank sends the same number."""
    return chunk_rows(shape[0], world) * shape[1:].numel()


# torch.distributed's one-buffer all-gather: `all_gather_single` from torch 2.14 (where
# `all_gather_into_tensor` warns that it is deprecated), `all_gather_into_tensor` before it
# (torch 2.11 on the GPU machines has only that).
FLAT_ALL_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)


def flat_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """`input` of every rank of `group`, in rank order, into `output` (world x its size).

    The function is looked up by name on each call, so a test that counts the calls by
    replacing torch.distributed's FLAT_ALL_GATHER sees every one."""
    getattr(dist, FLAT_ALL_GATHER)(output, input, group=group)


def gather_full(
    params: Sequence[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    plans: dict[tuple[str, ...], SendPlan] | None = None,
) -> Bucket:
    """Full tensors in `dtype` of FSDP2-sharded params, with one all-gather for all of them.

    Gathering per tensor (DTensor.full_tensor) costs a collective and its dispatch per tensor,
    which for a 3B model's 434 tensors is most of the weight sync (bench/results/colocate.md).
    Here each rank casts its dim-0 shards into one flat buffer, each shard padded to the full
    chunk size so every rank sends the same number of elements; one flat all-gather
    fills [world, elements]; each tensor is then its chunks, one per rank, unpadded, copied into
    one output buffer. With one rank the flat buffer of cast shards is the answer. Tensors not
    sharded that way (plain tensors, other placements) are gathered on their own.

    Per-tensor host work is kept small, since a bucket holds hundreds of tensors: no autograd
    (a DTensor's detach, or to_local with grad on, costs ~15-30 us each on a CPU core), views
    cut by one split, and each group of copies is one torch._foreach_copy_ (weight_sync.copy_pairs
    on the planned path: a copy_ each for the large ones). With `plans` (the
    trainer's, kept across syncs) a bucket of Shard(0) DTensors is worked out once (SendPlan):
    its shards' flat views, the send buffer's split and the output's layout, which comes back
    as a GatheredBucket (weight_sync.flatten measures nothing again). On one H200 the host
    work before the cast's one launch was most of a 3B sync's wait for its bucket (13.9 of
    27.7 ms, docs/weight-sync-figures.md).
    Collective: every rank calls it with the same names in the same order.
    """
    with torch.no_grad():
        if plans is not None and params:
            planned = gather_planned(params, dtype, plans)
            if planned is not None:
                return planned
        full: dict[str, torch.Tensor] = {}
        sharded: list[tuple[str, DTensor]] = []
        for name, tensor in params:
            if isinstance(tensor, DTensor) and tuple(tensor.placements) == (Shard(0),):
                sharded.append((name, tensor))
            elif isinstance(tensor, DTensor):
                # Cast the shard first, then gather: the gather moves engine-dtype bytes.
                cast = tensor.to(dtype)
                assert isinstance(cast, DTensor)
                full[name] = cast.full_tensor()
            else:
                full[name] = tensor.to(dtype)
        if sharded:
            mesh = sharded[0][1].device_mesh
            world, rank = mesh.size(), mesh.get_local_rank()
            full.update(_gather_flat(sharded, dtype, world, rank, mesh.get_group()))
    return [(name, full[name]) for name, _ in params]


def _gather_flat(
    sharded: Sequence[tuple[str, DTensor]],
    dtype: torch.dtype,
    world: int,
    rank: int,
    group: dist.ProcessGroup,
) -> Iterator[tuple[str, torch.Tensor]]:
    names = [name for name, _ in sharded]
    shapes = [tensor.shape for _, tensor in sharded]
    locals_ = [tensor.to_local() for _, tensor in sharded]
    chunks = [flat_chunk_elements(shape, world) for shape in shapes]
    _check_rows(names, shapes, locals_, world, rank)
    device = locals_[0].device
    send = torch.empty(sum(chunks), dtype=dtype, device=device)
    slots = send.split(chunks)
    torch._foreach_copy_(
        [slot[: local.numel()].view_as(local) for slot, local in zip(slots, locals_, strict=True)],
        locals_,
    )
    if world == 1:  # the cast shards are the full tensors
        yield from (
            (n, slot.view(shape)) for n, slot, shape in zip(names, slots, shapes, strict=True)
        )
        return
    yield from zip(names, _all_gather_blocks(send, chunks, shapes, world, group), strict=True)


def _check_rows(
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    locals_: Sequence[torch.Tensor],
    world: int,
    rank: int,
) -> None:
    for name, shape, local in zip(names, shapes, locals_, strict=True):
        rows = row_chunk(shape[0], world, rank)[1]
        if local.shape[0] != rows:
            raise RuntimeError(
                f"{name}: local shard has {local.shape[0]} rows, FSDP2's dim-0 chunking gives "
                f"{rows} of {shape[0]} on rank {rank} of {world}"
            )


def _all_gather_blocks(
    send: torch.Tensor,
    chunks: Sequence[int],
    shapes: Sequence[torch.Size],
    world: int,
    group: dist.ProcessGroup,
    split: CopySplit | None = None,
) -> list[torch.Tensor]:
    """Every rank's `send` all-gathered, then each tensor's chunks (one a rank) copied into its
    own block of one output buffer, laid out as the padded full tensor [world * chunk rows]
    (launched as `split` says, a send plan's; worked out here where None)."""
    received = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
    flat_all_gather(received, send, group=group)
    # received is [world, send]: tensor i is column block i of every rank's row.
    by_rank = received.view(world, send.numel()).split(list(chunks), dim=1)
    out = torch.empty_like(received).split([world * chunk for chunk in chunks])
    blocks = [o.view(world, c) for o, c in zip(out, chunks, strict=True)]
    if split is None:
        split = split_copies([world * c * send.element_size() for c in chunks])
    copy_pairs(blocks, by_rank, split)
    return [block[: shape.numel()].view(shape) for shape, block in zip(shapes, out, strict=True)]


@dataclass(frozen=True)
class SendPlan:
    """One bucket's gather, worked out once per trainer (gather_full's `plans`).

    `sources` are the local shards viewed flat: views share their shard's storage, so they
    follow the offload's resize of that storage to 0 and back (_HostCopies). `split` cuts the
    send buffer into each shard and, where a shard is short of its chunk (the last ranks'), the
    padding after it; `picks` are the shards' pieces. `entries` is where each full tensor lies
    in the output buffer, in bytes (the send buffer itself on one rank).
    A plan holds while the params are the same objects over the same local shards, each still
    at its flat view's address with the layout it was planned with (a shard given a new
    storage, or re-strided in place, gets a new plan)."""

    params: tuple[DTensor, ...]
    locals_: tuple[torch.Tensor, ...]
    sources: tuple[torch.Tensor, ...]
    shapes: tuple[torch.Size, ...]
    chunks: tuple[int, ...]
    split: tuple[int, ...]
    picks: tuple[int, ...]
    world: int
    group: dist.ProcessGroup
    entries: tuple[FlatEntry, ...]
    layouts: list[tuple[torch.dtype, torch.Size, tuple[int, ...], int]]
    # How the shards' copies into the send buffer, and (more than one rank) the gathered
    # chunks' copies into the output, are launched (weight_sync.copy_pairs).
    copies: CopySplit
    unpack: CopySplit
    # Where the shards lie back to back in one storage exactly as the send buffer holds them
    # (sharded_load.to_empty_flat's layout): that range of the storage, in the shards' dtype,
    # and the cast into the send buffer is one copy of it. On one rank, the bucket's entries
    # in that storage as it is (byte offsets from its start, the shards' dtype) too.
    flat_source: torch.Tensor | None = None
    source_entries: tuple[FlatEntry, ...] | None = None

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        return _still_planned(params, self.params, self.locals_, self.sources, self.layouts)


def _still_planned(
    params: Sequence[torch.Tensor],
    planned: Sequence[DTensor],
    locals_: Sequence[torch.Tensor],
    anchors: Sequence[torch.Tensor],
    layouts: Sequence[tuple[torch.dtype, torch.Size, tuple[int, ...], int]],
) -> bool:
    """Whether a plan made for `planned` (their local shards `locals_`, a view of each in
    `anchors`, their `layouts`) holds for `params`: the same objects over the same local
    shards, each still where its view is (not given another storage) with the same layout."""
    if len(params) != len(planned) or not all(map(operator.is_, params, planned)):
        return False
    now = [_local_shard(p) for p in params]  # DTensors: the same objects as planned
    return (
        all(map(operator.is_, now, locals_))
        and list(map(torch.Tensor.data_ptr, now)) == list(map(torch.Tensor.data_ptr, anchors))
        # A shard re-strided in place keeps its object and address: its layout is checked
        # too (FSDP2 replaces _local_tensor instead, but nothing here relies on that).
        and list(map(_layout, now)) == list(layouts)
    )


def shard_bucket(
    params: Sequence[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    plans: dict[tuple[tuple[str, ...], bool], tp_shards.ShardPlan],
    layout: DenseLayout,
    own_as_stored: bool = True,
) -> tp_shards.ShardedBucket | None:
    """The bucket sent shard to shard (tp_shards) to an engine whose TP ranks are this job's
    FSDP ranks (layout.tp_size of them), through its ShardPlan (made on first use); None where
    it cannot go so (a tensor not a Shard(0) DTensor over that many ranks, or whose rows they do
    not divide: gather_full then). The answer depends on shapes and placements only, the same
    on every rank. `own_as_stored`: the engine reads this rank's own blocks where its shards
    lie, where they lie in one storage (tp_shards.stored_source), as every rank's do with the
    policy's shards in one buffer. Collective: every rank calls it with the same names in the
    same order and the same `own_as_stored`."""
    names = tuple(name for name, _ in params)
    key = (names, own_as_stored)
    tensors = [tensor for _, tensor in params]
    plan = plans.get(key)
    if (
        plan is None
        or plan.dtype != dtype
        or not _still_planned(tensors, plan.params, plan.locals_, plan.anchors, plan.layouts)
    ):
        if not tensors or not all(
            isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),) for t in tensors
        ):
            return None
        dtensors = [t for t in tensors if isinstance(t, DTensor)]
        mesh = dtensors[0].device_mesh
        if mesh.size() != layout.tp_size:
            return None
        kinds = [tp_shards.send_kind(name, t.shape, layout) for name, t in params]
        if None in kinds:
            return None
        world, rank = mesh.size(), mesh.get_local_rank()
        locals_ = [_local_shard(t) for t in dtensors]
        shapes = [t.shape for t in dtensors]
        _check_rows(names, shapes, locals_, world, rank)
        plans[key] = plan = tp_shards.make_shard_plan(
            names,
            dtensors,
            locals_,
            [kind for kind in kinds if kind is not None],
            dtype,
            rank,
            world,
            mesh.get_group(),
            [_layout(local) for local in locals_],
            own_as_stored,
        )
    with torch.no_grad():
        return tp_shards.send(plan, plan.locals_[0].device)


def _layout(tensor: torch.Tensor) -> tuple[torch.dtype, torch.Size, tuple[int, ...], int]:
    return tensor.dtype, tensor.shape, tensor.stride(), int(tensor.storage_offset())


def _local_shard(tensor: torch.Tensor) -> torch.Tensor:
    # What DTensor.to_local() returns without autograd (torch 2.11 and 2.14 alike), read
    # directly: to_local's dispatch costs ~1.3 us a tensor, most of a planned gather's host time.
    local: torch.Tensor = tensor._local_tensor  # type: ignore[attr-defined]
    return local


def gather_planned(
    params: Sequence[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    plans: dict[tuple[str, ...], SendPlan],
    as_stored: bool = False,
) -> GatheredBucket | None:
    """gather_full through the bucket's SendPlan (made on first use); None where the bucket is
    not all Shard(0) DTensors with contiguous shards (gather_full's general path then), or,
    `as_stored`, where it cannot be handed as stored (source_bucket)."""
    key = tuple(name for name, _ in params)
    tensors = [tensor for _, tensor in params]
    plan = plans.get(key)
    if plan is None or plan.entries[0].dtype != dtype or not plan.holds(tensors):
        made = _make_plan(key, tensors, dtype)
        if made is None:
            return None
        plans[key] = plan = made
    if as_stored:
        return _as_stored(key, plan)
    send = torch.empty(sum(plan.split), dtype=dtype, device=plan.sources[0].device)

    @functools.cache
    def slots() -> list[torch.Tensor]:
        # The send buffer cut into the shards' pieces, once, and only where a copy or a view
        # needs them (the flat source's one copy on more than one rank needs neither).
        pieces = send.split(plan.split)
        return [pieces[i] for i in plan.picks] if len(plan.picks) != len(pieces) else list(pieces)

    if plan.flat_source is not None:
        send.copy_(plan.flat_source)  # the shards' own layout: one copy (the padding too)
    else:
        copy_pairs(slots(), plan.sources, plan.copies)
    if plan.world == 1:
        out = send

        def views() -> list[torch.Tensor]:
            return [slot.view(shape) for slot, shape in zip(slots(), plan.shapes, strict=True)]
    else:
        blocks = _all_gather_blocks(
            send, plan.chunks, plan.shapes, plan.world, plan.group, plan.unpack
        )
        out = blocks[0]

        def views() -> list[torch.Tensor]:
            return blocks

    flat = FlatBucket(byte_view(out.untyped_storage(), plan.entries[-1].end), plan.entries, False)
    return GatheredBucket(key, views, flat)


def _as_stored(key: tuple[str, ...], plan: SendPlan) -> GatheredBucket | None:
    """The bucket as the trainer stores it (one rank, the shards back to back in one storage):
    that storage's bytes and where each tensor lies in them, in the shards' dtype; no copy."""
    if plan.source_entries is None:
        return None
    assert plan.flat_source is not None
    storage = plan.flat_source.untyped_storage()
    flat = FlatBucket(byte_view(storage, plan.source_entries[-1].end), plan.source_entries, False)
    return GatheredBucket(key, lambda: [tensor for _, tensor in flat.tensors()], flat)


def _flat_source(
    locals_: Sequence[torch.Tensor], starts: Sequence[int], total: int
) -> torch.Tensor | None:
    """The range of the shards' one storage that holds them exactly as the send buffer does
    (each shard at its piece's start in `starts`, the padding between; `total` elements), in
    their dtype; None where they are not laid out so (the general per-shard copies then)."""
    if not locals_ or len({t.dtype for t in locals_}) != 1:
        return None
    storage = locals_[0].untyped_storage()
    pointer = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != pointer for t in locals_):
        return None
    base = int(locals_[0].storage_offset())
    for local, start in zip(locals_, starts, strict=True):
        if int(local.storage_offset()) != base + start:
            return None
    if (base + total) * locals_[0].element_size() > storage.nbytes():
        return None
    return torch.empty(0, dtype=locals_[0].dtype, device=locals_[0].device).set_(
        storage, base, (total,), (1,)
    )


def _make_plan(
    names: tuple[str, ...], tensors: Sequence[torch.Tensor], dtype: torch.dtype
) -> SendPlan | None:
    if not all(isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),) for t in tensors):
        return None
    params = tuple(t for t in tensors if isinstance(t, DTensor))
    locals_ = tuple(_local_shard(p) for p in params)
    if not all(local.is_contiguous() for local in locals_):
        return None
    mesh = params[0].device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    shapes = tuple(p.shape for p in params)
    _check_rows(names, shapes, locals_, world, rank)
    chunks = tuple(flat_chunk_elements(shape, world) for shape in shapes)
    split: list[int] = []
    picks: list[int] = []
    for local, chunk in zip(locals_, chunks, strict=True):
        picks.append(len(split))
        split.append(local.numel())
        if chunk > local.numel():
            split.append(chunk - local.numel())
    size = dtype.itemsize
    entries, start = [], 0
    for name, shape, chunk in zip(names, shapes, chunks, strict=True):
        entries.append(FlatEntry(name, shape, dtype, start, start + shape.numel() * size))
        start += world * chunk * size  # one rank: the chunk is the tensor
    # Each shard's piece starts a whole chunk after the previous one's (its padding between).
    starts = [0, *itertools.accumulate(chunks)][:-1]
    flat_source = _flat_source(locals_, starts, sum(chunks))
    source_entries = None
    if flat_source is not None and world == 1:
        unit = flat_source.element_size()
        base = int(flat_source.storage_offset())
        source_entries = tuple(
            FlatEntry(
                name,
                shape,
                flat_source.dtype,
                (base + at) * unit,
                (base + at + shape.numel()) * unit,
            )
            for name, shape, at in zip(names, shapes, starts, strict=True)
        )
    return SendPlan(
        params=params,
        locals_=locals_,
        sources=tuple(local.view(-1) for local in locals_),
        shapes=shapes,
        chunks=chunks,
        split=tuple(split),
        picks=tuple(picks),
        world=world,
        group=mesh.get_group(),
        entries=tuple(entries),
        layouts=[_layout(local) for local in locals_],
        copies=split_copies([local.numel() * size for local in locals_]),
        unpack=split_copies([world * chunk * size for chunk in chunks]),
        flat_source=flat_source,
        source_entries=source_entries,
    )
