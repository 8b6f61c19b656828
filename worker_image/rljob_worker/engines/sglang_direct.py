"""The direct weight hand-off: a bucket's tensors copied straight into sglang's parameters, in
sglang's own processes, without the model's `load_weights`.

sglang's `update_weights_from_tensor` runs a weight loader on each TP scheduler. Its default,
the model's `load_weights`, walks every tensor through the stacked-parameter mapping and a
per-layer `weight_loader` (about 0.1 ms of host time a tensor), which is most of the sync at 3B
(docs/weight-sync.md). sglang also runs a loader named by import path when that path is in
`ServerArgs.custom_weight_loader` (0.5.17 and 0.5.23 alike: `load_format` equal to the path, the
loader called as `loader(model, named_tensors)` after each TP rank unwrapped its own tensor).
`load` below is that loader. The adapter starts the engine with it declared and hands it one
flat buffer per bucket (one CUDA IPC handle), the bucket's layout in the name it travels under;
each TP scheduler cuts its own shard of every tensor out of the buffer by shape arithmetic
(`rank_copies`: the dense decoder layout that `sglang_weights.join_shards` undoes) and copies it
into the parameter, a view of the fused `qkv_proj` / `gate_up_proj` rows where the trainer's
q/k/v and gate/up go. A name the rules do not place falls back to the model's `load_weights`, so
the result is sglang's own load for any model; only the time differs.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rljob_worker.engines.sglang_weights import DenseLayout, EngineWeightsError
from rljob_worker.weight_sync import (
    TIMINGS_ENV,
    CopySplit,
    copy_pairs,
    record_timing_line,
    split_copies,
)

if TYPE_CHECKING:
    import torch

    from rljob_worker.weight_sync import FlatBucket

log = logging.getLogger(__name__)

# The import path sglang's schedulers call (ServerArgs.custom_weight_loader and load_format).
DIRECT_LOADER = f"{__name__}.load"
# A bucket travels as one (name, uint8 buffer) pair; the name carries the bucket's layout.
PAYLOAD_PREFIX = "rljob-flat-bucket:"


@dataclass(frozen=True)
class Copy:
    """One copy into a parameter: `src.narrow(src_dim, src_start, length)` of the trainer's full
    tensor into `target`'s rows [dst_start, dst_start + rows) (the whole parameter where
    dst_start is None)."""

    target: str
    dst_start: int | None
    src_dim: int
    src_start: int
    length: int


def payload_name(bucket: FlatBucket) -> str:
    """The name a flat bucket travels under: its entries (name, shape, dtype, byte range).

    A planned gather hands the same entries object every sync (sync_send.SendPlan): its name is
    kept (by the object's identity, which the kept pair pins) instead of written again."""
    kept = _NAMES.get(id(bucket.entries))
    if kept is not None and kept[0] is bucket.entries:
        return kept[1]
    entries = [
        [e.name, list(e.shape), str(e.dtype).removeprefix("torch."), e.start, e.end]
        for e in bucket.entries
    ]
    name = PAYLOAD_PREFIX + json.dumps(entries, separators=(",", ":"))
    # Buckets of the general path never repeat their entries object: the cap bounds what they
    # leave here, and is far above a planned sync's bucket count (a 32B model in bf16 has
    # about 122 buckets of 512 MiB), which would otherwise never hit.
    if len(_NAMES) >= 4096:
        _NAMES.clear()
    _NAMES[id(bucket.entries)] = (bucket.entries, name)
    return name


_NAMES: dict[int, tuple[Any, str]] = {}


def _entries(name: str) -> list[tuple[str, list[int], str, int, int]]:
    """A payload name's entries: (tensor name, shape, dtype name, byte start, byte end)."""
    if not name.startswith(PAYLOAD_PREFIX):
        raise EngineWeightsError(
            f"the direct loader got {name[:60]!r}, not a bucket the rljob adapter sent"
        )
    return [tuple(e) for e in json.loads(name[len(PAYLOAD_PREFIX) :])]  # type: ignore[misc]


def _views(
    entries: Iterable[tuple[str, list[int], str, int, int]], buffer: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    import torch

    return [
        (tensor, buffer[start:end].view(getattr(torch, dtype)).view(shape))
        for tensor, shape, dtype, start, end in entries
    ]


def unpack(name: str, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors again, as views of `buffer` (the inverse of payload_name)."""
    return _views(_entries(name), buffer)


def _kv_head_start(layout: DenseLayout, tp_rank: int) -> int:
    """The first KV head TP rank `tp_rank` holds (one shared by several ranks where there are
    fewer KV heads than ranks; DenseLayout.kv_owners)."""
    if layout.num_kv_heads >= layout.tp_size:
        return tp_rank * layout.kv_heads_per_rank
    return tp_rank // (layout.tp_size // layout.num_kv_heads)


def rank_copies(
    name: str,
    shape: Sequence[int],
    layout: DenseLayout,
    tp_rank: int,
    param_rows: Mapping[str, int],
    transformed: frozenset[str] = frozenset(),
) -> list[Copy] | None:
    """Where TP rank `tp_rank` keeps its part of the trainer's full tensor `name` of `shape`.

    `param_rows` maps each of the engine's parameter names to its first dimension (the vocabulary
    shard's rows come from it: sglang pads the vocabulary). `transformed`: parameters whose own
    weight_loader does more than copy (a Gemma norm keeps `weight + 1` beside it), which no
    rule copies verbatim. None: the rules do not place `name` (no such parameter, a shape that
    does not divide as the layout says, a resized vocabulary); the caller then lets sglang's
    own loader take it. A tied LM head that the engine does not hold apart from
    the embedding needs no copy (an empty list).
    """
    tp, r = layout.tp_size, tp_rank
    for part in ("q_proj", "k_proj", "v_proj"):
        if f".{part}." in name:
            target = name.replace(part, "qkv_proj")
            q_rows = layout.num_heads // tp * layout.head_dim
            kv_rows = layout.kv_heads_per_rank * layout.head_dim
            if part == "q_proj":
                copy = Copy(target, 0, 0, r * q_rows, q_rows)
            else:
                start = _kv_head_start(layout, r) * layout.head_dim
                offset = q_rows if part == "k_proj" else q_rows + kv_rows
                copy = Copy(target, offset, 0, start, kv_rows)
            rows = param_rows.get(target)
            if rows != q_rows + 2 * kv_rows or copy.src_start + copy.length > shape[0]:
                return None
            return [copy]
    for index, part in enumerate(("gate_proj", "up_proj")):
        if f".{part}." in name:
            target = name.replace(part, "gate_up_proj")
            if shape[0] % tp or param_rows.get(target) != 2 * (shape[0] // tp):
                return None
            rows = shape[0] // tp
            return [Copy(target, index * rows, 0, r * rows, rows)]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        if name not in param_rows or shape[1] % tp:
            return None
        cols = shape[1] // tp
        return [Copy(name, None, 1, r * cols, cols)]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        if name not in param_rows:
            tied = name.endswith("lm_head.weight") and layout.tie_word_embeddings
            return [] if tied else None
        if shape[0] != layout.vocab_size:
            return None  # a resized vocabulary: sglang's own loader refuses it by name
        per_rank = param_rows[name]
        rows = min(per_rank, shape[0] - r * per_rank)
        return [Copy(name, 0, 0, r * per_rank, rows)] if rows > 0 else []
    if name in param_rows and name not in transformed:
        return [Copy(name, None, 0, 0, shape[0] if shape else 0)]
    return None


# Where sglang says a scheduler's TP place (0.5.17 and 0.5.23; the contract test checks both).
TP_PLACE = (
    "sglang.srt.distributed.parallel_state",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
)


def _tp_rank_and_size() -> tuple[int, int]:
    """This scheduler's TP rank and size, from sglang's parallel state (TP_PLACE)."""
    import importlib

    module, rank, size = TP_PLACE
    state = importlib.import_module(module)
    return int(getattr(state, rank)()), int(getattr(state, size)())


@dataclass
class _Targets:
    params: dict[str, torch.Tensor]
    layout: DenseLayout | None
    tp_rank: int
    tp_size: int
    rows: dict[str, int]
    transformed: frozenset[str]
    plans: dict[tuple[str, tuple[int, ...]], list[Copy] | None]
    fallbacks: set[str]
    # One _BucketPlan per bucket layout (its payload name): the same buckets come every sync.
    buckets: dict[str, _BucketPlan] = field(default_factory=dict)


@dataclass
class _BucketPlan:
    """One bucket layout on this TP rank, worked out at its first sync and kept (copy_bucket).

    `dests` are flat views of the parameters' rows; the buffer, split once by `sizes` (in
    `dtype`'s elements, or bytes where `dtype` is None), gives each one's source at `picks`:
    a sync then builds no per-tensor view in Python, only one split, and launches the copies
    as `copies` says (weight_sync.copy_pairs: a copy_ for each large one, one foreach for the rest).
    `slow` are the entries that take copy_into's per-tensor views (a column slice at TP > 1, a
    dtype no flat copy takes, a tensor the rules do not place, sources that alias); `guards` hold the address of
    each parameter the flat copies write when planned, so one given new storage since makes a
    new plan."""

    dtype: torch.dtype | None
    sizes: list[int]
    covered: int
    picks: list[int]
    piece_dtypes: list[torch.dtype]
    dests: list[torch.Tensor]
    guards: list[tuple[torch.Tensor, int]]
    slow: list[tuple[str, list[int], str, int, int]]
    # How the flat copies are launched (weight_sync.copy_pairs: the large ones one by one).
    copies: CopySplit
    # A sharded bucket's (tp_shards) column slices of whole-row blocks, each copied on its own:
    # (destination rows, the block's byte start, its rows, its other dims, dtype, first column,
    # columns); and the tensors the rules do not place, joined from every rank's rows for
    # sglang's own loader: (name, full shape, dtype, each source rank's block as (whether it
    # lies in the stored source, its byte start, its dtype)).
    sliced: tuple[tuple[torch.Tensor, int, int, tuple[int, ...], torch.dtype, int, int], ...] = ()
    joined: tuple[
        tuple[str, tuple[int, ...], torch.dtype, tuple[tuple[bool, int, torch.dtype], ...]], ...
    ] = ()
    # A sharded bucket whose own blocks are read as stored: the plan of the copies out of that
    # source (its flat copies and column slices), which travels beside the buffer.
    stored: _BucketPlan | None = None


# RLJOB_SGLANG_DIRECT_STRICT=1 (the schedulers inherit the rank's environment): a tensor the rules
# do not place is an error instead of a slow load through the model's load_weights (the GPU
# tests set it, so the direct path they check is the direct path).
STRICT_ENV = "RLJOB_SGLANG_DIRECT_STRICT"


def _transformed(params: Mapping[str, Any]) -> frozenset[str]:
    """Parameters of layers not otherwise placed whose weight_loader is their own: copying
    them verbatim would skip what it does. sglang's plain parameters have none, or its
    default_weight_loader."""
    names = set()
    for name, param in params.items():
        loader = getattr(param, "weight_loader", None)
        if loader is not None and getattr(loader, "__name__", "") != "default_weight_loader":
            names.add(name)
    return frozenset(names)


# One entry per model this process loads into (the scheduler holds one; a test several).
_TARGETS: weakref.WeakKeyDictionary[Any, _Targets] = weakref.WeakKeyDictionary()


def _targets(model: Any, tp: tuple[int, int] | None = None) -> _Targets:
    found = _TARGETS.get(model)
    if found is not None:
        return found
    tp_rank, tp_size = tp or _tp_rank_and_size()
    params = dict(model.named_parameters())
    config = getattr(model, "config", None)
    try:
        layout = DenseLayout.from_config(config, tp_size) if config is not None else None
    except (TypeError, ValueError, KeyError):
        layout = None  # not a dense decoder's config (a nested text_config, ...): all to sglang
    rows = {name: int(p.shape[0]) if p.dim() else 0 for name, p in params.items()}
    targets = _Targets(params, layout, tp_rank, tp_size, rows, _transformed(params), {}, set())
    _TARGETS[model] = targets
    return targets


def _rule(targets: _Targets, name: str, shape: tuple[int, ...]) -> list[Copy] | None:
    """rank_copies for this rank, once per (name, shape); None raises under STRICT_ENV."""
    key = (name, shape)
    if key not in targets.plans:
        targets.plans[key] = (
            None
            if targets.layout is None
            else rank_copies(
                name, shape, targets.layout, targets.tp_rank, targets.rows, targets.transformed
            )
        )
    plan = targets.plans[key]
    if plan is None and os.environ.get(STRICT_ENV, "").strip() not in ("", "0"):
        raise EngineWeightsError(
            f"{name} {shape}: the direct loader does not place it "
            f"({STRICT_ENV} is set; unset it to let sglang's own loader take it)"
        )
    return plan


def _pair(
    targets: _Targets, name: str, tensor: torch.Tensor, copy: Copy
) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, source) of one copy: views of the parameter and of `tensor` (a meta
    tensor of the same shape gives the source's layout without its data)."""
    param = targets.params[copy.target].data
    source = (
        tensor if tensor.dim() == 0 else tensor.narrow(copy.src_dim, copy.src_start, copy.length)
    )
    dest = param if copy.dst_start is None else param.narrow(0, copy.dst_start, source.shape[0])
    if dest.shape != source.shape:
        raise EngineWeightsError(
            f"{name} {tuple(tensor.shape)}: TP rank {targets.tp_rank}'s part "
            f"{tuple(source.shape)} does not fit {copy.target} {tuple(param.shape)}"
        )
    return dest, source


def copy_into(
    model: Any, named: Iterable[tuple[str, torch.Tensor]], tp: tuple[int, int] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Copy each full tensor's shard for this TP rank into the model's parameters; the tensors
    the rules do not place are returned (for sglang's own loader). `tp` (rank, size) is this
    process's TP place unless given (tests)."""
    import torch

    targets = _targets(model, tp)
    rest: list[tuple[str, torch.Tensor]] = []
    # Every copy checked first, then the contiguous ones launched as one torch._foreach_copy_: a
    # bucket holds hundreds of copies, and one launch each was host time the sync paid
    # (docs/weight-sync.md). The rules' targets never overlap (q/k/v and gate/up take disjoint
    # rows of their fused parameter; a tied head is not copied).
    dests: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for name, tensor in named:
        plan = _rule(targets, name, tuple(tensor.shape))
        if plan is None:
            if name not in targets.fallbacks:
                targets.fallbacks.add(name)
                log.warning("direct weight load: %s goes through the model's load_weights", name)
            rest.append((name, tensor))
            continue
        for copy in plan:
            dest, source = _pair(targets, name, tensor, copy)
            if _same_layout(dest, source):
                dests.append(dest)
                sources.append(source)
            else:  # a column slice (o_proj, down_proj at TP > 1): foreach would go per tensor
                dest.copy_(source)
    if dests:
        torch._foreach_copy_(dests, sources)
    return rest


def _same_layout(dest: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether a copy can join the one foreach launch: torch takes its fast path only when
    every pair has one dtype and the same sizes and strides; a single pair without them sends
    the whole list down a copy_ per tensor."""
    return dest.dtype == source.dtype and dest.stride() == source.stride()


def _takes(dest: torch.dtype, source: torch.dtype) -> bool:
    """Whether a flat copy may write `source` elements into a `dest` parameter: the same
    dtype, or floating point into floating point (the copy casts: a bucket of the trainer's
    fp32 shards into bf16 weights, Trainer.weight_buckets' engine_casts)."""
    return dest == source or (dest.is_floating_point and source.is_floating_point)


def _plan_bucket(targets: _Targets, name: str) -> _BucketPlan:
    """The plan of one bucket layout (see _BucketPlan): each copy whose source is one byte
    range of the buffer and whose destination is contiguous, of the same dtype or a floating
    one that the copy casts into, is a flat pair; every other entry is slow. Raises as
    copy_into would (a part that does not fit, an unplaced tensor under STRICT_ENV)."""
    import torch

    # (byte start, byte end, dtype, destination's flat view, its parameter, the entry)
    fast: list[tuple[int, int, torch.dtype, torch.Tensor, torch.Tensor, int]] = []
    entries = _entries(name)
    slow: list[int] = []
    for index, (tensor_name, shape, dtype_name, start, _) in enumerate(entries):
        dtype = getattr(torch, dtype_name)
        plan = _rule(targets, tensor_name, tuple(shape))
        meta = torch.empty(shape, dtype=dtype, device="meta")
        pairs = [] if plan is None else [_pair(targets, tensor_name, meta, c) for c in plan]
        flat = plan is not None and all(
            dest.is_contiguous() and source.is_contiguous() and _takes(dest.dtype, dtype)
            for dest, source in pairs
        )
        if not flat:
            slow.append(index)
            continue
        size = meta.element_size()
        for copy, (dest, source) in zip(plan or [], pairs, strict=True):
            if source.numel():
                begin = start + int(source.storage_offset()) * size
                param = targets.params[copy.target]
                fast.append(
                    (begin, begin + source.numel() * size, dtype, dest.view(-1), param, index)
                )
    fast.sort(key=lambda f: f[0])
    # Sources that share bytes (views of one storage that alias) cannot both be pieces of one
    # split: both entries take the per-tensor path, as before the plan. Sorted by start, a
    # source overlaps an earlier one exactly when it starts before the furthest end so far.
    aliased: set[int] = set()
    furthest: tuple[int, int] = (0, -1)  # (end, entry) of the source reaching furthest so far
    for begin, end, *_, index in fast:
        if begin < furthest[0]:
            aliased.update((index, furthest[1]))
        furthest = max(furthest, (end, index))
    if aliased:
        fast = [f for f in fast if f[5] not in aliased]
        slow = sorted({*slow, *aliased})
    return _flat_plan(fast, slow=[entries[i] for i in slow])


# A flat copy's place: (byte start, byte end, source dtype, destination's flat view, its
# parameter, the entry it belongs to).
_Fast = tuple[int, int, "torch.dtype", "torch.Tensor", "torch.Tensor", int]


def _flat_plan(fast: list[_Fast], watched: Sequence[torch.Tensor] = (), **rest: Any) -> _BucketPlan:
    """A _BucketPlan of the flat copies `fast` (sorted by byte start, none overlapping): the
    buffer's one split into their sources (in one dtype where they all have it and it divides
    their offsets, else in bytes) and their launches; `rest` the plan's other fields. The
    parameters the copies write, and `watched`, are guarded (a new storage, a new plan)."""
    dtypes = {f[2] for f in fast}
    one = next(iter(dtypes)) if len(dtypes) == 1 else None
    unit = 1 if one is None else one.itemsize
    if any(f[0] % unit or f[1] % unit for f in fast):
        one, unit = None, 1
    sizes: list[int] = []
    picks: list[int] = []
    at = 0
    for begin, end, *_ in fast:
        if begin > at:
            sizes.append((begin - at) // unit)  # the gap between two sources
        picks.append(len(sizes))
        sizes.append((end - begin) // unit)
        at = end
    written = {id(p): p for p in [*(f[4] for f in fast), *watched]}
    return _BucketPlan(
        dtype=one,
        sizes=sizes,
        covered=at // unit,
        picks=picks,
        piece_dtypes=[f[2] for f in fast],
        dests=[f[3] for f in fast],
        guards=[(p, p.data_ptr()) for p in written.values()],
        # By the destination's bytes, as the trainer's copies are: a cast's source is larger.
        copies=split_copies([f[3].numel() * f[3].element_size() for f in fast]),
        **rest,
    )


def _plan_sharded(targets: _Targets, name: str) -> _BucketPlan:
    """The plan of one sharded bucket (tp_shards: this TP rank's own blocks and those received
    from every other rank, in one buffer, or the own ones in the trainer's storage beside it,
    payload.stored: the plan's `stored` sub-plan copies out of that): each block copied into the rows of this rank's part
    it holds, flat where its rows are whole (ROWS and ALL blocks into row parts, a COLS block
    into a row-parallel part's rows), a column slice otherwise. Raises where the blocks do not
    cover every row of this rank's part (kinds that disagree with the rules), where a tensor
    the rules do not place was not sent whole, and as _plan_bucket would."""
    import math

    import torch

    from rljob_worker import tp_shards

    payload = tp_shards.parse_payload(name)
    world, rank = payload.world, targets.tp_rank
    if targets.tp_size != world:
        raise EngineWeightsError(
            f"a bucket sharded over {world} ranks reached TP rank {rank} of an engine of "
            f"{targets.tp_size} TP ranks"
        )
    stored_dtype = None if payload.stored is None else getattr(torch, payload.stored)
    # Each list twice: [0] for the bucket's buffer, [1] for the stored source (own as stored).
    fast: tuple[list[_Fast], list[_Fast]] = ([], [])
    sliced: tuple[list[_Sliced], list[_Sliced]] = ([], [])
    joined: list[tuple[str, tuple[int, ...], torch.dtype, tuple[tuple[bool, int, Any], ...]]] = []
    watched: list[torch.Tensor] = []  # the parameters the sliced copies write
    for index, entry in enumerate(payload.entries):
        dtype = getattr(torch, entry.dtype)
        rows, rest = entry.shape[0] // world, entry.shape[1:]
        # (source rank, byte start, whether in the stored source, its dtype): the own block
        # first, as stored (the rank's whole local shard) where the payload says so.
        blocks = [(rank, entry.own, stored_dtype is not None, stored_dtype or dtype)] + [
            (tp_shards.region_source(i, rank), at, False, dtype)
            for i, at in enumerate(entry.received)
        ]
        plan = _rule(targets, entry.name, entry.shape)
        if plan is None:
            starts = {source: (in_stored, at, d) for source, at, in_stored, d in blocks}
            if entry.kind != tp_shards.ALL or sorted(starts) != list(range(world)):
                raise EngineWeightsError(
                    f"{entry.name} {entry.shape}: the direct rules do not place it and the "
                    f"sharded sync sent it as {entry.kind!r}, not whole"
                )
            joined.append((entry.name, entry.shape, dtype, tuple(starts[s] for s in range(world))))
            continue
        for copy in plan:
            # The parameter itself is what the plan's guard watches (a new storage given to
            # it shows in its data_ptr; a .data alias taken now would keep the old one).
            param = targets.params[copy.target]
            data = param.data
            if copy.src_dim == 0:
                need, covered = copy.length, 0
                for source, at, in_stored, block_dtype in (
                    blocks if entry.kind != tp_shards.COLS else []
                ):
                    low = max(source * rows, copy.src_start)
                    high = min((source + 1) * rows, copy.src_start + copy.length)
                    if low >= high:
                        continue
                    dest = data.narrow(0, (copy.dst_start or 0) + low - copy.src_start, high - low)
                    _fits(entry.name, dest, (high - low, *rest), block_dtype, rank)
                    row_bytes = math.prod(rest) * block_dtype.itemsize
                    begin = at + (low - source * rows) * row_bytes
                    fast[in_stored].append(
                        (
                            begin,
                            begin + (high - low) * row_bytes,
                            block_dtype,
                            dest.view(-1),
                            param,
                            index,
                        )
                    )
                    covered += high - low
            else:  # a row-parallel part: its columns of every row
                need, covered = entry.shape[0], 0
                width = entry.shape[1] // world
                if entry.kind == tp_shards.COLS and (copy.src_start, copy.length) != (
                    rank * width,
                    width,
                ):
                    raise EngineWeightsError(
                        f"{entry.name}: TP rank {rank}'s part is columns "
                        f"{copy.src_start}+{copy.length}, the sharded sync sent "
                        f"{rank * width}+{width}"
                    )
                for source, at, in_stored, block_dtype in blocks:
                    dest = data.narrow(0, source * rows, rows)
                    if entry.kind == tp_shards.COLS and not in_stored:
                        # A block of this rank's columns alone: flat into its rows.
                        _fits(entry.name, dest, (rows, width), block_dtype, rank)
                        end = at + rows * width * block_dtype.itemsize
                        fast[False].append((at, end, block_dtype, dest.view(-1), param, index))
                    else:
                        # Whole rows (an ALL block, or the own shard as stored): its columns.
                        _fits(entry.name, dest, (rows, copy.length, *rest[1:]), block_dtype, rank)
                        sliced[in_stored].append(
                            (dest, at, rows, rest, block_dtype, copy.src_start, copy.length)
                        )
                        watched.append(param)
                    covered += rows
            if covered != need:
                raise EngineWeightsError(
                    f"{entry.name}: the sharded sync gave TP rank {rank} {covered} of the {need} "
                    f"rows its part of {copy.target} needs (sent as {entry.kind!r})"
                )
    for copies in fast:
        copies.sort(key=lambda f: f[0])
        for before, after in itertools.pairwise(copies):
            if after[0] < before[1]:
                raise EngineWeightsError(f"a sharded bucket's blocks overlap at byte {after[0]}")
    stored = None
    if stored_dtype is not None:
        stored = _flat_plan(fast[True], slow=[], sliced=tuple(sliced[True]))
        watched += [f[4] for f in fast[True]]
    return _flat_plan(
        fast[False],
        watched,
        slow=[],
        sliced=tuple(sliced[False]),
        joined=tuple(joined),
        stored=stored,
    )


# A column slice of a block's whole rows: (destination rows, the block's byte start, its rows,
# its other dims, dtype, first column, columns).
_Sliced = tuple["torch.Tensor", int, int, tuple[int, ...], "torch.dtype", int, int]


def _fits(
    name: str, dest: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, rank: int
) -> None:
    """A block's rows fit the destination they are copied into, flat (contiguous, a dtype the
    copy may write), or the bucket is refused naming the tensor."""
    if tuple(dest.shape) != tuple(shape) or not dest.is_contiguous():
        raise EngineWeightsError(
            f"{name}: TP rank {rank}'s block {tuple(shape)} does not fit {tuple(dest.shape)}"
        )
    if not _takes(dest.dtype, dtype):
        raise EngineWeightsError(f"{name}: a {dtype} block cannot be copied into {dest.dtype}")


def copy_bucket(
    model: Any,
    name: str,
    buffer: torch.Tensor,
    tp: tuple[int, int] | None = None,
    stored: torch.Tensor | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """copy_into for one bucket as the adapter sends it (its payload name and uint8 buffer),
    through the bucket's plan (_BucketPlan): one split of the buffer and the flat copies'
    launches. `stored`: a sharded bucket's own blocks as the trainer stores them (uint8), where
    its payload says they travel so. Returns what the rules do not place, as copy_into does."""
    import torch

    from rljob_worker.tp_shards import PAYLOAD_PREFIX as SHARDED_PREFIX

    targets = _targets(model, tp)
    plan = targets.buckets.get(name)
    if plan is None or any(p.data_ptr() != address for p, address in plan.guards):
        sharded = name.startswith(SHARDED_PREFIX)
        plan = targets.buckets[name] = (_plan_sharded if sharded else _plan_bucket)(targets, name)
    if (plan.stored is None) != (stored is None):
        raise EngineWeightsError(
            "a sharded bucket's own blocks "
            + ("are read as stored and did not come" if stored is None else "came unasked")
        )
    _copy_planned(plan, buffer)
    if plan.stored is not None:
        assert stored is not None
        _copy_planned(plan.stored, stored)

    def block(in_stored: bool, at: int, rows: int, rest: tuple[int, ...], dtype: Any) -> Any:
        source = stored if in_stored else buffer
        assert source is not None
        return _block(source, at, rows, rest, dtype)

    joined = [
        (
            name,
            torch.cat(
                [
                    block(in_stored, at, shape[0] // len(starts), shape[1:], block_dtype).to(dtype)
                    for in_stored, at, block_dtype in starts
                ]
            ),
        )
        for name, shape, dtype, starts in plan.joined
    ]
    if not plan.slow:
        return joined
    return joined + copy_into(model, _views(plan.slow, buffer), tp)


def _copy_planned(plan: _BucketPlan, buffer: torch.Tensor) -> None:
    """A plan's flat copies out of `buffer` (one split, copy_pairs' launches) and its column
    slices."""
    if plan.dests:
        whole = _typed(buffer, plan.dtype)
        if whole is None:  # this buffer cannot be viewed in the plan's dtype: split its bytes
            sources = _sources(buffer, plan, bytewise=True)
        else:
            sources = _sources(whole, plan, bytewise=False)
        copy_pairs(plan.dests, sources, plan.copies)
    for dest, at, rows, rest, dtype, first, columns in plan.sliced:
        dest.copy_(_block(buffer, at, rows, rest, dtype).narrow(1, first, columns))


def _block(
    buffer: torch.Tensor, at: int, rows: int, rest: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A sharded bucket's block at byte `at`: `rows` rows of shape `rest`, in `dtype`."""
    import math

    nbytes = rows * math.prod(rest) * dtype.itemsize
    return buffer[at : at + nbytes].view(dtype).view(rows, *rest)


def _typed(buffer: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    if dtype is None:
        return None
    size = dtype.itemsize
    if buffer.numel() % size or buffer.storage_offset() % size:
        return None
    return buffer.view(dtype)


def _sources(whole: torch.Tensor, plan: _BucketPlan, bytewise: bool) -> list[torch.Tensor]:
    import torch

    if bytewise and plan.dtype is not None:  # the plan's sizes are elements: back to bytes
        unit = plan.dtype.itemsize
        sizes = [s * unit for s in plan.sizes]
        covered = plan.covered * unit
    else:
        sizes, covered = plan.sizes, plan.covered
    if whole.numel() < covered:
        raise EngineWeightsError(
            f"a bucket's buffer holds {whole.numel()} {'bytes' if bytewise else 'elements'}, "
            f"its layout needs {covered}"
        )
    pieces = torch.split(whole, [*sizes, whole.numel() - covered])
    if not bytewise:
        return [pieces[i] for i in plan.picks]
    return [pieces[i].view(d) for i, d in zip(plan.picks, plan.piece_dtypes, strict=True)]


def load(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """sglang's custom weight loader (see the module's text): each (name, buffer) is one bucket
    from the adapter, but a sharded bucket's own blocks as stored (tp_shards.STORED_NAME),
    which go with the bucket after them. Waits for its copies before returning, so the sender
    may reuse the buffer once the call is answered."""
    import torch

    from rljob_worker.tp_shards import STORED_NAME

    started, entered = time.perf_counter(), time.time()
    rest: list[tuple[str, torch.Tensor]] = []
    stored = None  # a sharded bucket's own blocks as stored, handed just before it
    for name, buffer in named_tensors:
        if name == STORED_NAME:
            stored = buffer
            continue
        rest += copy_bucket(model, name, buffer, stored=stored)
        stored = None
    launched = time.perf_counter()
    if rest:
        model.load_weights(rest)
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    record_timing(named_tensors, started, launched, time.perf_counter(), len(rest), entered)


def record_timing(
    named_tensors: Sequence[tuple[str, Any]],
    started: float,
    launched: float,
    done: float,
    fallbacks: int,
    entered: float,
) -> None:
    """The loader's line of the weight sync's timings (weight_sync.TIMINGS_ENV): `entered` is
    the wall time the call began, the rest perf_counter() readings."""
    if not os.environ.get(TIMINGS_ENV, "").strip():
        return
    from rljob_worker.tp_shards import STORED_NAME

    # A sharded bucket's stored own blocks are a view of the trainer's storage from its start,
    # not bytes moved: counted apart, and not as a bucket.
    buckets = [b for name, b in named_tensors if name != STORED_NAME]
    stored = [b for name, b in named_tensors if name == STORED_NAME]
    line = {
        "call": "loader",
        "start": entered,
        "end": entered + (done - started),
        "buckets": len(buckets),
        "bytes": sum(int(b.numel()) * b.element_size() for b in buckets),
        "stored_view_bytes": sum(int(b.numel()) * b.element_size() for b in stored),
        "launch_seconds": launched - started,
        "seconds": done - started,
        "fallback_tensors": fallbacks,
    }
    record_timing_line(line)
