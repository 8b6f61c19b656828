"""The weight sync's rules and bytes for the memory plan: its buckets, the worker's switches,
how each tensor travels shard to shard, and the sync's transient on the device (gather_bytes).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence

from rljob.api import EngineName, RLJobSpec
from rljob.plan.costs import DTYPE_BYTES
from rljob.plan.knobs import bucket_megabytes
from rljob.plan.model_shape import ModelShape


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group named tensors, in order, into buckets of at most `bucket_bytes` (the weight sync's
    buckets; train.Trainer uses this very function). A tensor larger than a bucket travels
    alone; every name lands in exactly one bucket."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, nbytes in sizes:
        if current and filled + nbytes > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(name)
        filled += nbytes
    if current:
        buckets.append(current)
    return buckets


# The worker's switches that decide whether a one-rank sync needs any buffer (sync_as_stored):
# RLJOB_FLAT_SHARDS=0 keeps the policy's shards apart (rljob_worker.sync_send reads this name), and
# RLJOB_SGLANG_WEIGHT_SYNC other than "direct" hands sglang the engine's dtype
# (rljob_worker/engines/sglang_handoff.py; a test checks that both agree).
FLAT_SHARDS_ENV = "RLJOB_FLAT_SHARDS"
SGLANG_WEIGHT_SYNC_ENV = "RLJOB_SGLANG_WEIGHT_SYNC"
SGLANG_WEIGHT_SYNC_DEFAULT = "direct"


# RLJOB_TP_SHARDED_SYNC=0 sends full buckets to one TP engine over all the ranks, instead of
# shard to shard (rljob_worker/tp_shards.py, tp_sharded_sync below); =buffer sends shard to
# shard with each rank's own blocks cast into the bucket's buffer, as before the engine read
# them where the trainer stores them (tp_own_as_stored).
TP_SHARDED_SYNC_ENV = "RLJOB_TP_SHARDED_SYNC"
TP_SHARDED_SYNC_BUFFER = "buffer"
# Its modes (tp_sync_mode): full buckets; shard to shard with the own blocks in the buffer;
# shard to shard with the own blocks read where the trainer stores them.
TP_SYNC_OFF, TP_SYNC_BUFFER, TP_SYNC_STORED = "off", "buffer", "stored"

SYNC_SWITCHES = (FLAT_SHARDS_ENV, SGLANG_WEIGHT_SYNC_ENV, TP_SHARDED_SYNC_ENV)

# How a tensor travels in the shard-to-shard sync (shard_kind; rljob_worker/tp_shards.py).
SHARD_ROWS, SHARD_COLS, SHARD_ALL = "rows", "cols", "all"
# sglang pads its vocabulary-parallel embedding and LM head to a multiple of this
# (DEFAULT_VOCAB_PADDING_SIZE, 0.5.17 and 0.5.23): only a vocabulary of W such multiples splits
# as FSDP's rows do. The loader's coverage check catches a release that pads otherwise.
VOCAB_PADDING = 64


def shard_kind(
    name: str, shape: Sequence[int], heads: int, kv_heads: int, world: int
) -> str | None:
    """How the full tensor `name` of `shape` travels from FSDP rank r to TP rank r's engine
    when both number `world` (rljob_worker/tp_shards.py): SHARD_ROWS (rank r's own dim-0
    shard is TP rank r's part: no exchange), SHARD_COLS (TP rank r needs column block r of
    every rank's rows: o_proj, down_proj), SHARD_ALL (every rank's rows: norms, KV heads
    shared by ranks, a padded vocabulary); None where it cannot go by shards (no rows, or rows
    `world` does not divide: FSDP's last shards are then short)."""
    if not shape or shape[0] % world:
        return None
    dense = _DENSE_NAME.fullmatch(name)
    part = (dense.group("attn") or dense.group("mlp")) if dense else None
    if part == "q_proj":
        return SHARD_ROWS if heads % world == 0 else SHARD_ALL
    if part in ("k_proj", "v_proj"):
        return SHARD_ROWS if kv_heads % world == 0 else SHARD_ALL
    if part in ("gate_proj", "up_proj") and name.endswith(".weight"):
        return SHARD_ROWS
    if part in ("o_proj", "down_proj") and name.endswith(".weight") and len(shape) == 2:
        return SHARD_COLS if shape[1] % world == 0 else SHARD_ALL
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return SHARD_ROWS if shape[0] % (VOCAB_PADDING * world) == 0 else SHARD_ALL
    # Anything else (norms, an MoE expert's or another architecture's projections, a nested
    # model's names) goes whole: the engine's loader places it, or sglang's own takes it.
    return SHARD_ALL


# The dense decoder's projections as Qwen2 and Llama name them (what the loader's rules place).
_DENSE_NAME = re.compile(
    r"model\.layers\.\d+\."
    r"(?:self_attn\.(?P<attn>[qkvo]_proj)|mlp\.(?P<mlp>gate_proj|up_proj|down_proj))"
    r"\.(?:weight|bias)"
)


def on_unless_zero(value: str) -> bool:
    """A switch's value ("" where unset) as the worker reads it: on unless 0."""
    return value.strip() != "0"


def flat_shards_on(value: str) -> bool:
    """RLJOB_FLAT_SHARDS's value ("" where unset) read as the worker reads it: on unless 0."""
    return on_unless_zero(value)


def sglang_weight_sync(value: str) -> str:
    """RLJOB_SGLANG_WEIGHT_SYNC's value ("" where unset) as the path it names: the default
    where unset (sglang_handoff.weight_sync_choice checks it is one it knows)."""
    return value.strip().lower() or SGLANG_WEIGHT_SYNC_DEFAULT


def _switch(spec: RLJobSpec, name: str) -> str | None:
    """A sync switch's value in the ranks' environment as far as the spec tells: its literal
    value ("" for unset); None where the spec leaves it unknown (a valueFrom, or an envFrom
    that may set it: env wins over envFrom on a name, as in Kubernetes)."""
    for e in spec.env:
        if e.name == name:
            return None if e.value_from is not None else (e.value or "")
    return None if spec.env_from else ""


def sync_as_stored(spec: RLJobSpec, world: int) -> bool:
    """Whether the weight sync hands the engine the trainer's own fp32 buffer, holding nothing
    beside it (Trainer.weight_buckets with engine_casts, docs/weight-sync.md): one rank, the
    policy's shards in one buffer, and an engine that casts what it loads (the torch engine;
    sglang through rljob's loader, its default hand-off). Read from the spec's env; where a
    switch comes from a Secret or ConfigMap the plan cannot read it and counts the buckets (a
    rank's own plan reads the resolved values: with_process_switches)."""
    if world != 1:
        return False
    flat = _switch(spec, FLAT_SHARDS_ENV)
    if flat is None or not flat_shards_on(flat):
        return False
    if spec.rollout.engine is EngineName.SGLANG:
        choice = _switch(spec, SGLANG_WEIGHT_SYNC_ENV)
        return choice is not None and sglang_weight_sync(choice) == SGLANG_WEIGHT_SYNC_DEFAULT
    return True


def tp_sharded_sync(spec: RLJobSpec, world: int) -> bool:
    """Whether the weight sync goes shard to shard (rljob_worker/tp_shards.py): one sglang
    engine over all of the job's ranks (tensorParallelSize equal to them, more than one),
    rljob's loader (the default hand-off) and RLJOB_TP_SHARDED_SYNC not 0. Where a switch comes
    from a Secret or ConfigMap the plan counts full buckets (more)."""
    if spec.rollout.engine is not EngineName.SGLANG or world < 2:
        return False
    if spec.rollout.tensor_parallel_size != world:
        return False
    choice, sharded = _switch(spec, SGLANG_WEIGHT_SYNC_ENV), _switch(spec, TP_SHARDED_SYNC_ENV)
    if choice is None or sglang_weight_sync(choice) != SGLANG_WEIGHT_SYNC_DEFAULT:
        return False
    return sharded is not None and on_unless_zero(sharded)


def tp_sync_mode(sharded: str, flat: str) -> str:
    """The shard-to-shard sync's mode from RLJOB_TP_SHARDED_SYNC's and RLJOB_FLAT_SHARDS's
    values ("" where unset), as a rank reads them (rljob_worker.tp_shards.sharded_sync_mode) and
    the plan counts it (tp_own_as_stored): 0, TP_SYNC_OFF; "buffer", or the policy's shards kept
    apart (no storage holds a bucket's own shards), TP_SYNC_BUFFER; else TP_SYNC_STORED."""
    if not on_unless_zero(sharded):
        return TP_SYNC_OFF
    if sharded.strip().lower() == TP_SHARDED_SYNC_BUFFER or not flat_shards_on(flat):
        return TP_SYNC_BUFFER
    return TP_SYNC_STORED


def tp_own_as_stored(spec: RLJobSpec, world: int) -> bool:
    """Whether a shard-to-shard sync (tp_sharded_sync) reads each rank's own blocks from the
    trainer's fp32 buffer (the policy's shards in one buffer, RLJOB_FLAT_SHARDS not 0), so the
    bucket's buffer holds only what crosses between ranks (rljob_worker/tp_shards.py)."""
    if not tp_sharded_sync(spec, world):
        return False
    flat, sharded = _switch(spec, FLAT_SHARDS_ENV), _switch(spec, TP_SHARDED_SYNC_ENV)
    if flat is None or sharded is None:
        return False
    return tp_sync_mode(sharded, flat) == TP_SYNC_STORED


def with_process_switches(spec: RLJobSpec, environ: Mapping[str, str]) -> RLJobSpec:
    """`spec` with the sync switches as literal values, as `environ` (a rank's own environment,
    every valueFrom and envFrom resolved, and whatever the process was started with) has
    them; "" where it has none. The plan a rank makes then counts what its sync will hold."""
    from rljob.api import EnvVar

    env = [e for e in spec.env if e.name not in SYNC_SWITCHES]
    env += [EnvVar(name=name, value=environ.get(name, "")) for name in SYNC_SWITCHES]
    return spec.model_copy(update={"env": env})


def whole_model_megabytes(spec: RLJobSpec, shape: ModelShape) -> int:
    """The bucket that holds the whole model in the engine's dtype: one bucket a sync."""
    return math.ceil(shape.parameters * DTYPE_BYTES[spec.model.dtype] / (1 << 20))


def gather_bytes(spec: RLJobSpec, shape: ModelShape, world: int) -> int:
    """The weight sync's transient: the bucket being gathered (on > 1 rank its send buffer, the
    received [world, chunk] and the output) while the previous bucket's tensors are still held:
    the next bucket's gather is issued before the previous one is handed to the engine, so the
    two overlap (weight_sync.prefetched), and never a third (the stage drops each bucket
    before the next gather). The flattened hand-off views the gathered buffer: no copy. Where
    the sync hands the trainer's own buffer (sync_as_stored), none."""
    if sync_as_stored(spec, world):
        return 0
    dtype = DTYPE_BYTES[spec.model.dtype]
    shapes = dict(shape.named_shapes())
    sizes = [(name, math.prod(dims) * dtype) for name, dims in shapes.items()]
    by_name = dict(sizes)
    sharded = tp_sharded_sync(spec, world)
    own = not tp_own_as_stored(spec, world)

    def bucket(names: list[str]) -> tuple[int, int, bool]:
        """(what the bucket holds while gathered, what stays held while it is handed over,
        whether it goes shard to shard)."""
        b = sum(by_name[n] for n in names)
        if world == 1:
            return b, b, False
        if sharded:  # one buffer a bucket, held whole until the next one's is made
            named = [(n, shapes[n]) for n in names]
            held = shard_bucket_bytes(named, shape, world, dtype, own=own)
            if held is not None:
                return held, held, True
        return math.ceil(b / world) + 2 * b, b, False

    buckets = [bucket(names) for names in plan_buckets(sizes, bucket_megabytes(spec) << 20)]
    peaks = [buckets[0][0]] + [prev[1] + cur[0] for prev, cur in itertools.pairwise(buckets)]
    # A sharded bucket's buffer is made while the one before is held and the one before that
    # sits freed in torch's caching allocator, reused only if the new one fits in it: count
    # all three (7B over two H200s, 4096 MiB buckets: 41.0 GiB measured in wake_weights, 39.2
    # planned with two; bench/results/raw/sync-7b-tp2-sharded-h200x2/).
    peaks += [
        first[1] + second[1] + third[0]
        for first, second, third in zip(buckets, buckets[1:], buckets[2:], strict=False)
        if third[2]
    ]
    return max(peaks)


# Each block of a shard-to-shard bucket starts at a multiple of this many bytes.
SHARD_ALIGN_BYTES = 16


def shard_bucket_bytes(
    named: Sequence[tuple[str, Sequence[int]]],
    shape: ModelShape,
    world: int,
    dtype: int,
    *,
    own: bool = True,
) -> int | None:
    """One rank's buffer of a bucket sent shard to shard (rljob_worker/tp_shards.py: its own
    blocks unless the engine reads them where the trainer stores them, `own` False, and the
    blocks it receives from and sends to each other rank, each aligned to SHARD_ALIGN_BYTES;
    at least one alignment's bytes); None where a tensor of it goes by the full gather."""
    owned = region = 0
    for name, dims in named:
        kind = shard_kind(name, dims, shape.heads, shape.kv_heads, world)
        if kind is None:
            return None
        block = shard_aligned(shard_block_numel(dims, kind, world) * dtype)
        owned += block if own else 0
        region += 0 if kind == SHARD_ROWS else block
    return max(owned + 2 * (world - 1) * region, SHARD_ALIGN_BYTES)


def shard_block_numel(shape: Sequence[int], kind: str, world: int) -> int:
    """Elements of one block of a tensor sent shard to shard: its rows over `world`, times its
    columns (a SHARD_COLS block has a `world`th of them)."""
    rest = math.prod(shape[1:])
    return shape[0] // world * (rest // world if kind == SHARD_COLS else rest)


def shard_aligned(nbytes: int) -> int:
    """`nbytes` rounded up to SHARD_ALIGN_BYTES: where a sharded bucket's next block starts."""
    return -(-nbytes // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES
