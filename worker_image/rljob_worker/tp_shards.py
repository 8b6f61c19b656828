"""The weight sync shard to shard: where one sglang engine spans every rank of the job with
tensor parallel size equal to the FSDP world, TP rank r's part of most weights is FSDP rank r's
own dim-0 shard, so only what TP cuts the other way crosses the link between the cards.

The full sync (sync_send.gather_full) all-gathers every tensor to every rank, and each TP scheduler
then cuts its part out of the full tensor: at 7B over two cards each rank receives its peer's
7.6 GB, which alone takes 3.6-4.1x the HBM floor of the sync (docs/weight-sync.md). Here each
tensor of a bucket travels by its kind (send_kind):

- ROWS: TP rank r keeps full rows [r*R/W, (r+1)*R/W), exactly FSDP rank r's shard (q/k/v and
  their biases, gate/up, a vocabulary that sglang does not pad): no exchange.
- COLS: TP rank r keeps columns [r*C/W, (r+1)*C/W) of every row (o_proj, down_proj, row-parallel
  in sglang): each rank sends each other rank that column block of its own rows.
- ALL: TP rank r keeps the whole tensor (norms) or a part the rules above do not give (KV heads
  shared by several ranks, a padded vocabulary): each rank sends its rows to every other.

One buffer per rank and bucket, in the engine's dtype: [the rank's own blocks, in bucket order]
[the blocks received from each other rank][the blocks it sends]. One all_to_all_single moves the
last region into the middle one (nothing goes to the rank itself). The engine gets the first two
regions under one payload name whose byte offsets are the same on every rank (every block's size
depends on the tensor and W only: each tensor's rows divide by W, or the bucket takes the full
gather), which the TP engine checks; rljob's loader in each scheduler
(sglang_direct.copy_bucket) places each block by the same geometry (the source's rows,
region_source) and checks that the blocks cover every row its part needs. Block sizes and
alignment are the memory plan's arithmetic (rljob.plan.shard_block_numel, shard_aligned), so
its count of these buffers is theirs.

Own blocks as stored (the default where the policy's shards lie in one buffer,
sharded_load.to_empty_flat): the rank's own blocks are not cast into the bucket's buffer at all.
The engine gets, beside the buffer's received region, the trainer's fp32 storage of the bucket's
shards (a view, sent as weight_sync.ipc_alias), and each entry's `own` is the byte offset of the
rank's whole local shard there (the same on every rank: the shards lie at the same offsets of
each rank's buffer); the loader's copy out of it is the cast. The buffer then holds only what
crosses between ranks, and the trainer's cast only what it sends. RLJOB_TP_SHARDED_SYNC=buffer
keeps the own blocks in the buffer (the figures before this).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rljob.plan import (
    FLAT_SHARDS_ENV,
    SHARD_ALIGN_BYTES,
    SHARD_ALL,
    SHARD_COLS,
    SHARD_ROWS,
    TP_SHARDED_SYNC_ENV,
    TP_SYNC_BUFFER,
    TP_SYNC_OFF,
    TP_SYNC_STORED,
    shard_aligned,
    shard_block_numel,
    shard_kind,
    tp_sync_mode,
)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from rljob_worker.engines.sglang_weights import DenseLayout

# The kinds, the switch and the rule are the memory plan's (rljob.plan counts these buffers).
ROWS, COLS, ALL = SHARD_ROWS, SHARD_COLS, SHARD_ALL
ENV = TP_SHARDED_SYNC_ENV
# A sharded bucket travels under this prefix and its layout as JSON (ShardPayload.name).
PAYLOAD_PREFIX = "rljob-tp-bucket:"
# Its own blocks as stored travel just before it, as one more tensor under this name. Every
# such view starts at its storage's start, so torch's receiving side keys each by the same CUDA
# IPC handle and offset: a scheduler must drop one before the next is rebuilt (one bucket a
# request, and sglang_direct.load keeps nothing), or it would get the cached, shorter storage.
STORED_NAME = "rljob-tp-stored"
# The sync's modes (rljob.plan.tp_sync_mode, the memory plan's rule too): full buckets; shard to
# shard with the own blocks in the buffer; shard to shard with the own blocks read where the
# trainer stores them.
OFF, BUFFER, STORED = TP_SYNC_OFF, TP_SYNC_BUFFER, TP_SYNC_STORED


def sharded_sync_mode(environ: Any = os.environ) -> str:
    """This rank's mode from its environment (rljob.plan.tp_sync_mode): RLJOB_TP_SHARDED_SYNC=0
    OFF, every bucket full (the bench's before; a model whose TP layout the kinds misjudge);
    =buffer, or RLJOB_FLAT_SHARDS=0, BUFFER; else STORED (a bucket whose shards do not lie in
    one storage still keeps its own blocks in the buffer, stored_source)."""
    return tp_sync_mode(str(environ.get(ENV, "")), str(environ.get(FLAT_SHARDS_ENV, "")))


def agreed_mode(modes: Sequence[str]) -> str:
    """The mode every rank can send in, from each rank's own (sharded_sync_mode): the least of
    them, so no rank's environment alone picks a collective the others do not join."""
    for mode in (OFF, BUFFER):
        if mode in modes:
            return mode
    return STORED


def send_kind(name: str, shape: Sequence[int], layout: DenseLayout) -> str | None:
    """rljob.plan.shard_kind for the engine's layout (its TP size is the FSDP world)."""
    return shard_kind(name, shape, layout.num_heads, layout.num_kv_heads, layout.tp_size)


def region_source(index: int, rank: int) -> int:
    """The rank whose blocks lie in received region `index` of `rank`'s buffer: every rank but
    `rank` itself, in rank order (all_to_all_single's order without its own empty chunk)."""
    return index if index < rank else index + 1


@dataclass(frozen=True)
class ShardEntry:
    """One tensor of a sharded bucket: its full shape, dtype name and kind; the byte offset of
    its own block; and, for COLS and ALL, of its block in each received region (in region
    order, region_source), else ()."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    own: int
    received: tuple[int, ...]


@dataclass(frozen=True)
class ShardPayload:
    """What a sharded bucket's payload name carries to the engine's loader: the ranks it is
    sharded over, its entries (each block's byte offsets) and, where the own blocks are read
    as stored, the stored source's dtype (`stored`; each entry's `own` is then the byte offset
    of the rank's whole local shard in that source, which travels as STORED_NAME)."""

    world: int
    entries: tuple[ShardEntry, ...]
    stored: str | None

    def name(self) -> str:
        """The payload name: the layout as JSON (rank-independent)."""
        entries = [
            [e.name, list(e.shape), e.dtype, e.kind, e.own, list(e.received)] for e in self.entries
        ]
        body: dict[str, Any] = {"world": self.world, "entries": entries}
        if self.stored is not None:
            body["stored"] = self.stored
        return PAYLOAD_PREFIX + json.dumps(body, separators=(",", ":"))


@dataclass(frozen=True)
class ShardLayout(ShardPayload):
    """A sharded bucket's buffer (see the module's text): its payload, the bytes the engine
    gets (`payload_bytes`: the own and received regions), and where the sent region lies."""

    region_bytes: int
    payload_bytes: int
    total_bytes: int

    @property
    def own_bytes(self) -> int:
        """The own region's bytes (0 where the own blocks are read as stored)."""
        return 0 if self.stored is not None else self.payload_bytes - self.sent_bytes

    @property
    def sent_bytes(self) -> int:
        return (self.world - 1) * self.region_bytes


def shard_layout(
    tensors: Sequence[tuple[str, Sequence[int], str]],
    world: int,
    dtype: torch.dtype,
    stored: tuple[Sequence[int], torch.dtype] | None = None,
) -> ShardLayout:
    """The buffer of a bucket of (name, full shape, kind) in `dtype` over `world` ranks.
    `stored`: the own blocks are read as stored, each tensor's whole local shard at these byte
    offsets of a source of that dtype; the buffer has no own region then. Its payload region
    and the whole buffer take at least SHARD_ALIGN_BYTES (a bucket of ROWS alone crosses
    nothing, and the engine is still handed a buffer to open)."""
    size = dtype.itemsize
    dtype_name = str(dtype).removeprefix("torch.")
    own_at, at = [], 0
    if stored is not None:
        own_at = [int(offset) for offset in stored[0]]
        if len(own_at) != len(tensors):
            raise ValueError(f"{len(own_at)} stored offsets for {len(tensors)} tensors")
    else:
        for _, shape, kind in tensors:
            own_at.append(at)
            at = shard_aligned(at + shard_block_numel(shape, kind, world) * size)
    own_end = at
    region_at: list[int | None] = []
    at = 0
    for _, shape, kind in tensors:
        if kind == ROWS:
            region_at.append(None)
            continue
        region_at.append(at)
        at = shard_aligned(at + shard_block_numel(shape, kind, world) * size)
    region = at
    entries = tuple(
        ShardEntry(
            name,
            tuple(int(d) for d in shape),
            dtype_name,
            kind,
            own,
            ()
            if offset is None
            else tuple(own_end + i * region + offset for i in range(world - 1)),
        )
        for (name, shape, kind), own, offset in zip(tensors, own_at, region_at, strict=True)
    )
    payload = own_end + (world - 1) * region
    stored_name = None if stored is None else str(stored[1]).removeprefix("torch.")
    return ShardLayout(
        world,
        entries,
        stored_name,
        region,
        max(payload, SHARD_ALIGN_BYTES),
        max(payload + (world - 1) * region, SHARD_ALIGN_BYTES),
    )


def parse_payload(name: str) -> ShardPayload:
    """What a payload name carries (the inverse of ShardPayload.name)."""
    body = json.loads(name[len(PAYLOAD_PREFIX) :])
    entries = tuple(
        ShardEntry(n, tuple(shape), dtype, kind, int(own), tuple(received))
        for n, shape, dtype, kind, own, received in body["entries"]
    )
    return ShardPayload(int(body["world"]), entries, body.get("stored"))


class ShardedBucket:
    """One bucket of the shard-to-shard sync on one rank: the payload name (the same on every
    rank) and this rank's buffer as the engine gets it (uint8: its own and received blocks, or
    the received ones alone where `stored` is the trainer's storage of the own shards, uint8,
    to be sent as weight_sync.ipc_alias). `names` are the bucket's tensors; no full tensor
    exists on any rank."""

    def __init__(
        self,
        names: Sequence[str],
        name: str,
        buffer: torch.Tensor,
        stored: torch.Tensor | None = None,
    ) -> None:
        self.names, self.name, self.buffer, self.stored = list(names), name, buffer, stored


@dataclass(frozen=True)
class _Pair:
    """One copy into the buffer: piece `piece` of its split (viewed as `shape` where the
    source is a column slice) from `source`."""

    piece: int
    source: torch.Tensor
    shape: tuple[int, ...] | None


@dataclass(frozen=True)
class ShardPlan:
    """One bucket's shard-to-shard send on one rank, worked out once per trainer: the buffer's
    split into every block (gaps included), the copies that fill the sent blocks (and the own
    ones, unless read as stored: `stored`) from the rank's shards (contiguous ones as weight_sync.copy_pairs launches them, column slices
    one by one), and the exchange's ranges. Holds while its params and local shards are the
    same objects at the same addresses and layouts (sync_send.SendPlan.holds)."""

    layout: ShardLayout
    payload: str
    dtype: torch.dtype
    # Where the own blocks are read as stored: the trainer's storage from its start to the end
    # of the last local shard, as bytes (a view over the storage: it follows the offload's
    # resize of it to 0 and back), else None.
    stored: torch.Tensor | None
    sizes: tuple[int, ...]
    flat: tuple[_Pair, ...]
    flat_copies: tuple[tuple[int, ...], tuple[int, ...]]
    sliced: tuple[_Pair, ...]
    rank: int
    group: dist.ProcessGroup | None
    params: tuple[Any, ...]
    locals_: tuple[torch.Tensor, ...]
    # A view of each local shard: follows its storage, so a shard given another is seen.
    anchors: tuple[torch.Tensor, ...]
    layouts: list[tuple[torch.dtype, torch.Size, tuple[int, ...], int]]


def make_shard_plan(
    names: Sequence[str],
    params: Sequence[Any],
    locals_: Sequence[torch.Tensor],
    kinds: Sequence[str],
    dtype: torch.dtype,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
    layouts: list[tuple[torch.dtype, torch.Size, tuple[int, ...], int]],
    own_as_stored: bool = False,
) -> ShardPlan:
    """The plan of one bucket (see ShardPlan) for FSDP rank `rank` of `world` (the ranks of
    `group`): each local shard is rows [rank*R/W, (rank+1)*R/W) of its full tensor
    `params[i].shape`. `own_as_stored`: the own blocks are read where the shards lie, if they
    lie in one storage (stored_source), else cast into the buffer as without it."""
    from rljob_worker.weight_sync import split_copies

    shapes = [tuple(int(d) for d in p.shape) for p in params]
    as_stored = stored_source(locals_) if own_as_stored else None
    layout = shard_layout(
        [(n, s, k) for n, s, k in zip(names, shapes, kinds, strict=True)],
        world,
        dtype,
        None if as_stored is None else (as_stored[1], locals_[0].dtype),
    )
    size = dtype.itemsize
    # Every block's byte range, then the split (in elements) that cuts the buffer into them.
    ranges: list[tuple[int, int, torch.Tensor, tuple[int, ...] | None]] = []
    sent_at = layout.payload_bytes
    for entry, local in zip(layout.entries, locals_, strict=True):
        numel = shard_block_numel(entry.shape, entry.kind, world)
        rows = entry.shape[0] // world
        if entry.kind == COLS:
            width = entry.shape[1] // world
            if as_stored is None:
                own = local.narrow(1, rank * width, width)
                ranges.append((entry.own, entry.own + numel * size, own, (rows, width)))
            for index, received in enumerate(entry.received):
                # Sent region `index` goes to that rank: its column block of this rank's rows.
                to = region_source(index, rank)
                start = sent_at + received - layout.own_bytes
                part = local.narrow(1, to * width, width)
                ranges.append((start, start + numel * size, part, (rows, width)))
        else:
            whole = local.reshape(-1) if local.is_contiguous() else local
            if as_stored is None:
                ranges.append((entry.own, entry.own + numel * size, whole, None))
            for received in entry.received:
                start = sent_at + received - layout.own_bytes
                ranges.append((start, start + numel * size, whole, None))
    ranges.sort(key=lambda r: r[0])
    sizes: list[int] = []
    flat: list[_Pair] = []
    sliced: list[_Pair] = []
    at = 0
    for begin, end, source, shape in ranges:
        if begin > at:
            sizes.append((begin - at) // size)
        pair = _Pair(len(sizes), source, shape)
        contiguous = shape is None and source.is_contiguous() and source.dim() == 1
        (flat if contiguous else sliced).append(pair)
        sizes.append((end - begin) // size)
        at = end
    if at < layout.total_bytes:
        sizes.append((layout.total_bytes - at) // size)
    return ShardPlan(
        layout=layout,
        payload=layout.name(),
        dtype=dtype,
        stored=None if as_stored is None else as_stored[0],
        sizes=tuple(sizes),
        flat=tuple(flat),
        flat_copies=split_copies([p.source.numel() * size for p in flat]),
        sliced=tuple(sliced),
        rank=rank,
        group=group,
        params=tuple(params),
        locals_=tuple(locals_),
        anchors=tuple(local.view(local.shape) for local in locals_),
        layouts=layouts,
    )


def stored_source(
    locals_: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """Where the local shards lie in one storage, contiguous and of one dtype (the policy's
    shards in one buffer): that storage's bytes from its start to the last shard's end
    (weight_sync.byte_view), and each shard's byte offset in them; else None. From the storage's start,
    not the first shard's: CUDA IPC shares an allocation by its base address (torch's
    getBaseAllocation takes no pointer inside a block), and the offsets are the same on every
    rank (each rank's buffer lays the shards out alike)."""
    from rljob_worker.weight_sync import byte_view

    if not locals_ or len({t.dtype for t in locals_}) != 1:
        return None
    if not all(t.is_contiguous() for t in locals_):
        return None
    storage = locals_[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in locals_):
        return None
    unit = locals_[0].element_size()
    end = max(int(t.storage_offset()) + t.numel() for t in locals_)
    return byte_view(storage, end * unit), tuple(int(t.storage_offset()) * unit for t in locals_)


def fill(plan: ShardPlan, device: torch.device) -> torch.Tensor:
    """A new buffer (in the plan's dtype) with the blocks this rank sends and, unless the plan
    reads them as stored, its own blocks, cast from its shards."""
    import torch

    from rljob_worker.weight_sync import copy_pairs

    buffer = torch.empty(plan.layout.total_bytes // plan.dtype.itemsize, dtype=plan.dtype,
                         device=device)  # fmt: skip
    pieces = buffer.split(list(plan.sizes))
    if plan.flat:  # none where a bucket's own blocks go as stored and it sends nothing flat
        copy_pairs(
            [pieces[p.piece] for p in plan.flat], [p.source for p in plan.flat], plan.flat_copies
        )
    for pair in plan.sliced:
        pieces[pair.piece].view(pair.shape or pair.source.shape).copy_(pair.source)
    return buffer


def regions(layout: ShardLayout, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(received, sent): the buffer's two exchange regions, each W-1 regions back to back in
    rank order without this rank (region_source)."""
    size = buffer.element_size()
    own, span = layout.own_bytes // size, layout.sent_bytes // size
    return buffer.narrow(0, own, span), buffer.narrow(0, own + span, span)


def exchange(plan: ShardPlan, buffer: torch.Tensor) -> None:
    """Move every rank's sent region into the others' received regions: one all_to_all_single
    over the plan's group, nothing to the rank itself (collective)."""
    import torch.distributed as dist

    layout = plan.layout
    received, sent = regions(layout, buffer)
    region = layout.region_bytes // buffer.element_size()
    splits = [0 if r == plan.rank else region for r in range(layout.world)]
    dist.all_to_all_single(received, sent, splits, splits, group=plan.group)


def send(plan: ShardPlan, device: torch.device) -> ShardedBucket:
    """Fill a new buffer by the plan and exchange its blocks (collective: every rank sends the
    same bucket in the same order)."""
    from rljob_worker.weight_sync import byte_view

    layout = plan.layout
    buffer = fill(plan, device)
    if layout.world > 1 and layout.region_bytes:
        exchange(plan, buffer)
    storage = buffer.untyped_storage()
    return ShardedBucket(
        [e.name for e in layout.entries],
        plan.payload,
        byte_view(storage, layout.payload_bytes),
        plan.stored,
    )
