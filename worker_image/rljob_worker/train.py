"""FSDP2 training of the policy: sharding, AdamW, offload and weight-sync buckets.

The Trainer owns the sharded policy (and frozen reference), runs the policy update of each train
stage (policy_update.py; its math in rl_math.py), moves optimizer state and params between device
and CPU on the stage machine's request, and gathers full tensors bucket by bucket.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from rljob.api import RLJobSpec

# The weight sync's buckets are planned where the memory plan sizes them (one function).
from rljob.plan import FLAT_SHARDS_ENV as FLAT_SHARDS_ENV
from rljob.plan import flat_shards_on
from rljob.plan import plan_buckets as plan_buckets
from rljob_worker import tp_shards
from rljob_worker.engines.sglang_weights import DenseLayout
from rljob_worker.model import torch_dtype

# The rollout's record and the update's sums, used by the stage machine through this module.
from rljob_worker.policy_update import Experience as Experience
from rljob_worker.policy_update import PolicyUpdate
from rljob_worker.policy_update import TrainStats as TrainStats
from rljob_worker.sharded_load import chunk_rows, load_sharded, row_chunk
from rljob_worker.staging import (
    OPTIMIZER_TO_DEVICE,
    OPTIMIZER_TO_HOST,
    PARAMS_TO_DEVICE,
    PARAMS_TO_HOST,
    Staging,
)
from rljob_worker.weight_sync import (
    CopySplit,
    FlatBucket,
    FlatEntry,
    GatheredBucket,
    byte_view,
    copy_pairs,
    overlap_enabled,
    prefetched,
    split_copies,
)

NamedTensors = list[tuple[str, torch.Tensor]]
T = TypeVar("T")
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
            planned = _gather_planned(params, dtype, plans)
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


def _gather_planned(
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


def _shard(model: torch.nn.Module, mesh: DeviceMesh, dtype: torch.dtype) -> None:
    # One FSDP unit per decoder layer (transformers names them in _no_split_modules), then the
    # root for embeddings, final norm and head: the layer-by-layer all-gather FSDP is built for.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _enable_checkpointing(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable()  # type: ignore[operator]


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (padding included)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _reshard(module: torch.nn.Module) -> None:
    """Free FSDP2's unsharded params and register the shards again, in every FSDP unit.

    FSDP2 keeps a root's params unsharded after a forward that no backward follows (the
    reference model's): until resharded, parameters() are the full compute-dtype copies.
    """
    for child in module.modules():
        if isinstance(child, FSDPModule):
            child.reshard()


def _storages(tensors: Sequence[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storage behind each tensor (a DTensor's local shard), each once, in order."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.data
        storages.setdefault(local.untyped_storage().data_ptr(), local.untyped_storage())
    return list(storages.values())


# Each storage's host copy starts at a multiple of this, so a copy can be viewed in its dtype.
_HOST_ALIGN_BYTES = 64


class ParamPaths:
    """A module's named parameters as named_parameters() gives them now, read through each
    one's owning module and attribute, found by one named_parameters() walk and kept: a dict
    lookup a parameter instead of the walk over every module (0.83-0.97 ms at 3B on an H200's
    host, most of the one-card sync's host time before its bucket: docs/weight-sync-figures.md).
    What is read is the object registered now (FSDP2 swaps a module's parameter between its
    sharded and unsharded forms, and a parameter may be replaced); an attribute that no longer
    holds a parameter makes a new walk. Tied parameters appear once, under the walk's name."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._paths: list[tuple[str, dict[str, Any], str]] | None = None

    def read(self) -> dict[str, torch.Tensor]:
        if self._paths is not None:
            found = {name: owner.get(attr) for name, owner, attr in self._paths}
            if all(p is not None for p in found.values()):
                return found  # type: ignore[return-value]
        return self._walk()

    def _walk(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        modules = dict(self.module.named_modules())
        paths = []
        for name in named:
            prefix, _, attr = name.rpartition(".")
            paths.append((name, modules[prefix]._parameters, attr))
        self._paths = paths
        return named


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


class Trainer:
    """The sharded policy of one rank; every method is collective (all ranks call it together)."""

    def __init__(
        self,
        spec: RLJobSpec,
        model_path: Path | str,
        device: torch.device,
        pad_id: int,
        staging: Staging | None = None,
    ):
        self.spec = spec
        self.device = device
        self.pad_id = pad_id
        self.compute_dtype = torch_dtype(spec.model.dtype)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.mesh = init_device_mesh(device.type, (world,))
        # Built on the meta device, sharded, then each rank reads only its rows from the
        # files (sharded_load.py): no rank holds a whole model. Master weights in float32;
        # FSDP casts to the spec's dtype for compute.
        shard = lambda model: _shard(model, self.mesh, self.compute_dtype)  # noqa: E731
        prepare = _enable_checkpointing if spec.training.gradient_checkpointing else None
        # The policy's shards in one buffer (sharded_load.to_empty_flat): the weight sync casts a
        # bucket in one copy, and on one rank hands the buffer itself to an engine that casts.
        self.model, slice_bytes = load_sharded(
            model_path, torch.float32, device, shard, prepare, flat=flat_shards_enabled()
        )
        self.reference: torch.nn.Module | None = None
        if spec.algorithm.kl_coef > 0:
            # Frozen, so in the engine's dtype: what its forward computed in anyway (the
            # MixedPrecisionPolicy casts to it), at half an fp32 copy's bytes.
            self.reference, ref_slice_bytes = load_sharded(
                model_path, self.compute_dtype, device, shard
            )
            self.reference.requires_grad_(False).eval()
            slice_bytes = max(slice_bytes, ref_slice_bytes)
        # The largest tensor slice one read held (host, then device): the loading's transient.
        self.load_slice_bytes = slice_bytes
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.algorithm.learning_rate, weight_decay=0.0
        )
        # The copies of the training state, and (overlapStaging) their side stream.
        self.staging = staging if staging is not None else Staging(device, overlap=False)
        self._optimizer_copies = _HostCopies(
            device, self.staging, OPTIMIZER_TO_HOST, OPTIMIZER_TO_DEVICE
        )
        self._param_copies = _HostCopies(device, self.staging, PARAMS_TO_HOST, PARAMS_TO_DEVICE)
        # Moments whose load was started arrive behind forward/backward: the step reads them.
        self.optimizer.register_step_pre_hook(
            lambda *_: self.staging.wait(OPTIMIZER_TO_DEVICE, before="optimizer.step()")
        )
        # Micro-batches packed by length (PolicyUpdate.micro_batches); False only for a bench's
        # before/after (bench/train_alone.py).
        self.pack_micro_batches = True
        self.optimizer_on_device = True
        self.params_on_device = True
        self._optimizer_leaving = False  # start_offload_optimizer's copies, not yet freed
        # Each weight-sync bucket's gather, worked out on the first sync (gather_full), and its
        # shard-to-shard send (shard_bucket).
        self._send_plans: dict[tuple[str, ...], SendPlan] = {}
        self._shard_plans: dict[tuple[tuple[str, ...], bool], tp_shards.ShardPlan] = {}
        self._param_paths = ParamPaths(self.model)

    # -- training ----------------------------------------------------------------------------

    def train_step(self, experience: Experience) -> TrainStats:
        """PPO epochs over mini-batches of the rank's experience (policy_update.PolicyUpdate)."""
        update = PolicyUpdate(
            self.spec,
            self.model,
            self.reference,
            self.optimizer,
            self.pad_id,
            self.device,
            pack=self.pack_micro_batches,
        )
        stats = update.run(experience)
        # Without an optimizer step (no tokens), the moments' later users still come after.
        self.staging.wait(OPTIMIZER_TO_DEVICE)
        if self.reference is not None:
            _reshard(self.reference)  # forward only: its root would stay unsharded (see _reshard)
        return stats

    # -- offload -----------------------------------------------------------------------------

    def _optimizer_storages(self) -> list[torch.UntypedStorage]:
        tensors = [
            value
            for group in self.optimizer.param_groups
            for param in group["params"]
            for key, value in self.optimizer.state.get(param, {}).items()
            if isinstance(value, torch.Tensor) and key != "step"  # AdamW keeps `step` on CPU
        ]
        return _storages(tensors)

    def _param_storages(self) -> list[torch.UntypedStorage]:
        for module in self._modules():
            _reshard(module)
        return _storages([p for module in self._modules() for p in module.parameters()])

    def copy_to_host(self) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """Copy the policy's params (and the reference's) and the AdamW moments into the host
        buffers the offloads use, freeing nothing; the offloads after it then only free the
        device memory, so the copy is made once per iteration either way. Returns the lookup
        from a local tensor (a shard) to a view of its host copy (None: not copied). Valid until
        the next train step: the stage machine's checkpoint stage, right after train."""
        if not (self.optimizer_on_device and self.params_on_device):
            raise RuntimeError("copy_to_host needs the training state on the device")
        self._optimizer_copies.copy_out(self._optimizer_storages())
        self._param_copies.copy_out(self._param_storages())

        def lookup(tensor: torch.Tensor) -> torch.Tensor | None:
            found = self._optimizer_copies.host_copy(tensor)
            return found if found is not None else self._param_copies.host_copy(tensor)

        return lookup

    def hold_host_copies(self, wait: Callable[[], None]) -> None:
        """A reader of copy_to_host's copies (the checkpoint writer) is done once `wait()`
        returns: the next write into those buffers calls it first."""
        self._optimizer_copies.hold(wait)
        self._param_copies.hold(wait)

    def offload_optimizer(self) -> None:
        """AdamW moments to (pinned) CPU memory; their device memory is freed."""
        self._optimizer_copies.offload(self._optimizer_storages())
        self.optimizer_on_device, self._optimizer_leaving = False, False

    def start_offload_optimizer(self) -> None:
        """The moments' copies to the host start (behind what follows, where the staging
        overlaps); finish_offloads frees them."""
        self._optimizer_copies.start_offload(self._optimizer_storages())
        self._optimizer_leaving = True

    def finish_offloads(self) -> None:
        """Free what start_offload_optimizer began to copy, once copied (else nothing)."""
        if self._optimizer_leaving:
            self.offload_optimizer()

    def load_optimizer(self) -> None:
        """The moments back. Where the staging overlaps, their copies run behind what follows
        and the next optimizer step (or the train step's end) waits for them."""
        self._optimizer_copies.load(wait=not self.staging.overlap)
        self.optimizer_on_device = True

    def _modules(self) -> list[torch.nn.Module]:
        return [self.model] + ([self.reference] if self.reference is not None else [])

    def offload_params(self) -> None:
        """Sharded params (policy and reference) to (pinned) CPU memory; device memory freed."""
        self._param_copies.offload(self._param_storages())
        self.params_on_device = False

    def load_params(self) -> None:
        """The params back: where the staging overlaps, the host goes on at once (the
        device's later work waits for the copies)."""
        self._param_copies.load()
        self.params_on_device = True

    # -- weight sync -------------------------------------------------------------------------

    def _shard_layout(self, shard_world: int | None) -> DenseLayout | None:
        """The engine's TP layout where buckets may go shard to shard (tp_shards): an engine
        over every rank of this trainer's mesh, a dense decoder's config; else None."""
        world = self.mesh.size()
        if shard_world is None or shard_world < 2 or shard_world != world:
            return None
        try:
            return DenseLayout.from_config(getattr(self.model, "config", None) or {}, world)
        except (KeyError, TypeError, ValueError):
            return None

    def weight_buckets(
        self, bucket_bytes: int, dtype: torch.dtype, *, engine_casts: bool = False
    ) -> Iterator[Bucket]:
        """Full (unsharded) tensors in the engine's dtype (or, `engine_casts`, the master
        dtype where that needs no copy), one bucket at a time.

        `engine_casts`: the engine casts what it loads into its own dtype (casts_weights). On one
        rank with the shards in one buffer (sharded_load.to_empty_flat) the whole model is then
        one bucket of that buffer as it is, in the master dtype: no cast here, no send buffer,
        the engine's load the one copy (docs/weight-sync.md). Otherwise, as below.

        Bucket N+1's gather is issued before bucket N is yielded (weight_sync.prefetched), so
        its kernels run while the caller hands bucket N to the engine. At most two buckets of
        full tensors exist at once, the one yielded and the one being gathered (on more than one
        rank the latter also has its send buffer and the received [world, chunk] buffer): that
        bound is what the bucket size buys, and what the memory plan's gather term counts. The
        caller drops each bucket before asking for the next. Collective: every rank gathers the
        same bucket in the same order.
        """
        params = self._param_paths.read()
        plans = self._send_plans
        if engine_casts and self.mesh.size() == 1:
            with torch.no_grad():
                whole = _gather_planned(list(params.items()), dtype, plans, as_stored=True)
            if whole is not None:
                yield from prefetched([lambda: whole], overlap_enabled())
                return
        # No detach: gather_full runs without autograd (a DTensor's detach is ~30 us each).
        yield from self._in_buckets(
            params, bucket_bytes, dtype, lambda bucket: gather_full(bucket, dtype, plans)
        )

    def shard_buckets(
        self,
        bucket_bytes: int,
        dtype: torch.dtype,
        shard_world: int,
        *,
        own_as_stored: bool = True,
    ) -> Iterator[Bucket | tp_shards.ShardedBucket]:
        """weight_buckets for one tensor-parallel engine over all of this trainer's ranks,
        `shard_world` of them (TensorParallelEngine.shard_world): each bucket that can goes
        shard to shard (shard_bucket: a tp_shards.ShardedBucket, only what TP cuts across
        FSDP's rows crossing between ranks; `own_as_stored`, the engine's
        shard_own_as_stored, the own blocks read where the shards lie), the others by the
        full gather; all of them full where the engine or the model does not allow it
        (_shard_layout). Collective, as weight_buckets."""
        layout = self._shard_layout(shard_world)
        if layout is None:
            yield from self.weight_buckets(bucket_bytes, dtype)
            return
        plans, full_plans = self._shard_plans, self._send_plans

        def send(bucket: list[tuple[str, torch.Tensor]]) -> Bucket | tp_shards.ShardedBucket:
            sent = shard_bucket(bucket, dtype, plans, layout, own_as_stored)
            return sent if sent is not None else gather_full(bucket, dtype, full_plans)

        params = self._param_paths.read()
        yield from self._in_buckets(params, bucket_bytes, dtype, send)

    def _in_buckets(
        self,
        params: Mapping[str, torch.Tensor],
        bucket_bytes: int,
        dtype: torch.dtype,
        send: Callable[[list[tuple[str, torch.Tensor]]], T],
    ) -> Iterator[T]:
        """`send` of each bucket of `params` (plan_buckets in the engine's dtype), the next
        one's issued before the last is yielded (weight_sync.prefetched)."""
        sizes = [(name, p.numel() * dtype.itemsize) for name, p in params.items()]

        def gather(names: list[str]) -> Callable[[], T]:
            return lambda: send([(name, params[name]) for name in names])

        yield from prefetched(
            (gather(names) for names in plan_buckets(sizes, bucket_bytes)), overlap_enabled()
        )
