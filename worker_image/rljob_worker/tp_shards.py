"""The weight sync shard to shard: where one sglang engine spans every rank of the job with
tensor parallel size equal to the FSDP world, TP rank r's part of most weights is FSDP rank r's
own dim-0 shard, so only what TP cuts the other way crosses the link between the cards.

The full sync (train.gather_full) all-gathers every tensor to every rank, and each TP scheduler
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
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rljob.plan import (
    SHARD_ALL,
    SHARD_COLS,
    SHARD_ROWS,
    TP_SHARDED_SYNC_ENV,
    on_unless_zero,
    shard_aligned,
    shard_block_numel,
    shard_kind,
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


def sharded_sync_enabled(environ: Any = os.environ) -> bool:
    """RLJOB_TP_SHARDED_SYNC=0 sends every bucket full (the bench's before; a model whose TP
    layout the kinds misjudge). Unset or anything else: shard to shard where it applies."""
    return on_unless_zero(str(environ.get(ENV, "")))


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
    sharded over and its entries (each block's byte offsets)."""

    world: int
    entries: tuple[ShardEntry, ...]

    def name(self) -> str:
        """The payload name: the layout as JSON (rank-independent)."""
        entries = [
            [e.name, list(e.shape), e.dtype, e.kind, e.own, list(e.received)] for e in self.entries
        ]
        body = {"world": self.world, "entries": entries}
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
        return self.payload_bytes - (self.world - 1) * self.region_bytes


def shard_layout(
    tensors: Sequence[tuple[str, Sequence[int], str]], world: int, dtype: torch.dtype
) -> ShardLayout:
    """The buffer of a bucket of (name, full shape, kind) in `dtype` over `world` ranks."""
    size = dtype.itemsize
    dtype_name = str(dtype).removeprefix("torch.")
    own_at, at = [], 0
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
    return ShardLayout(world, entries, region, payload, payload + (world - 1) * region)


def parse_payload(name: str) -> ShardPayload:
    """What a payload name carries (the inverse of ShardPayload.name)."""
    body = json.loads(name[len(PAYLOAD_PREFIX) :])
    entries = tuple(
        ShardEntry(n, tuple(shape), dtype, kind, int(own), tuple(received))
        for n, shape, dtype, kind, own, received in body["entries"]
    )
    return ShardPayload(int(body["world"]), entries)


class ShardedBucket:
    """One bucket of the shard-to-shard sync on one rank: the payload name (the same on every
    rank) and this rank's buffer as the engine gets it (uint8: its own and received blocks).
    `names` are the bucket's tensors; no full tensor exists on any rank."""

    def __init__(self, names: Sequence[str], name: str, buffer: torch.Tensor) -> None:
        self.names, self.name, self.buffer = list(names), name, buffer


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
    split into every block (gaps included), the copies that fill the own and sent blocks from
    the rank's shards (contiguous ones as weight_sync.copy_pairs launches them, column slices
    one by one), and the exchange's ranges. Holds while its params and local shards are the
    same objects at the same addresses and layouts (train.SendPlan.holds)."""

    layout: ShardLayout
    payload: str
    dtype: torch.dtype
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
) -> ShardPlan:
    """The plan of one bucket (see ShardPlan) for FSDP rank `rank` of `world` (the ranks of
    `group`): each local shard is rows [rank*R/W, (rank+1)*R/W) of its full tensor
    `params[i].shape`."""
    from rljob_worker.weight_sync import split_copies

    shapes = [tuple(int(d) for d in p.shape) for p in params]
    layout = shard_layout(
        [(n, s, k) for n, s, k in zip(names, shapes, kinds, strict=True)], world, dtype
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


def fill(plan: ShardPlan, device: torch.device) -> torch.Tensor:
    """A new buffer (in the plan's dtype) with this rank's own blocks and the blocks it sends,
    cast from its shards."""
    import torch

    from rljob_worker.weight_sync import copy_pairs

    buffer = torch.empty(plan.layout.total_bytes // plan.dtype.itemsize, dtype=plan.dtype,
                         device=device)  # fmt: skip
    pieces = buffer.split(list(plan.sizes))
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
    own, span = layout.own_bytes // size, (layout.world - 1) * layout.region_bytes // size
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
        [e.name for e in layout.entries], plan.payload, byte_view(storage, layout.payload_bytes)
    )
