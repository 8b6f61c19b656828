"""The memory plan: per rank and per stage, the device bytes a colocated job will peak at.

Pure arithmetic over the spec, the model's shape and the GPU's memory (no torch), shared by the
`rljob plan` CLI, the operator (admission) and the driver (status.plan, Auto offload).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rljob.api import (
    AUTO,
    BUILTIN_PREFIX,
    MAX_PLAN_CANDIDATES,
    TINY_QWEN2,
    AutoStatus,
    EngineName,
    OffloadMode,
    OverlapStaging,
    PlanCandidate,
    PlannedLoad,
    PlannedStage,
    PlanStatus,
    RLJobSpec,
    WakeUp,
)
from rljob.report import Stage

# -- fixed costs, in one place -------------------------------------------------------------------
# Fitted to the stored bench points (bench/results/raw/c4..c10, torch engine, Qwen2.5-3B
# architecture): c4 and c5 on one H100 80GB (1 rank), c9/c10 on two H200s (2 ranks). Each is one
# stage boundary's device-wide use (mem_get_info) minus the bytes the model accounts for; the
# derivation is in bench/results/plan-accuracy.md. Instances of one machine kind differ: c5's
# whole baseline sat 176 MiB below c4's, and the constants take the higher (c4).
GiB = 1 << 30
MiB = 1 << 20
# CUDA context, torch's kernels, cuBLAS handles: held before any training step (c5, iteration 0,
# offload_train end minus engine weights and ENGINE_OUTSIDE_REGIONS_BYTES, moved to c4's level).
CUDA_CONTEXT_BYTES = 1_520_992_256
# What the first training step leaves behind for good (cuBLAS workspaces, autograd caches):
# c5 offload_optimizer end (iteration 1+) minus its iteration-0 level.
TRAIN_RESIDUAL_BYTES = 375_390_208
# The torch engine's tensors outside its memory-saver regions, allocated at its first wake
# (offload_train end minus offload_optimizer end minus the engine weights' reserved bytes:
# 278798336 in c4 and c5, less the 254 MiB its weight region reserves beyond the tensors at 3B,
# see reserved_bytes), plus what the torch engine's runs on the current tree hold beyond c4's
# baseline at both offload ends: 164-194 MiB at 0.5B and 1.5B on an H100 (r2, 2026-11-25) and
# 158-188 MiB on an H200 (v1), not broken down; sglang's runs on the same tree show none (r3,
# and bench/results/raw/oom-retry-sglang-1.5b-h100). Taken at its highest (r2, 1.5B), as the
# constants take the higher of two machines: c4 over c5.
ENGINE_OUTSIDE_REGIONS_BYTES = 278_798_336 - 266_338_304 + 203_382_784
# Per rank when world > 1: NCCL's buffers and streams (and the H200's larger context): c9's
# offload_optimizer end minus half the params minus the one-rank baseline.
NCCL_BUFFER_BYTES = 1_296_023_552
# What the caching allocator still holds at the optimizer step's peak, per token per vocab entry
# of one micro-batch: the training logits' blocks (bf16 logits, fp32 copy, log_softmax and their
# gradients), freed after backward but cached, which AdamW's temporaries do not reuse. Fitted as
# the highest over the torch engine's one-rank points at three sizes, H100 and H200 (train peak
# minus the context, params as reserved, moments, grads and the step's temporary: 2.58-2.60 GiB
# at 0.5B, 2.18-2.30 at 1.5B, 2.66-2.83 at 3B, for 768 tokens x 151936 entries): a share of the
# logits, not of the layer activations, which grow 3.4x from 0.5B to 3B while this does not.
STEP_CACHE_BYTES_PER_LOGIT_ENTRY = 26.06
# Bytes kept per token per layer for backward, in units of the compute dtype: ~10 hidden-wide
# tensors (norm inputs, q/k/v/o, residuals) and 4 MLP-wide ones (gate, up, act, product).
ACTIVATION_HIDDEN_TENSORS = 10
ACTIVATION_INTERMEDIATE_TENSORS = 4
# Per token per vocab entry in training: bf16 logits, fp32 copy, log_softmax, their gradients.
LOGIT_BYTES_PER_ENTRY = 14
# FSDP2 unsharded buffers with world > 1: the root's params (compute dtype) and fp32 grads plus
# this many decoder layers' (fitted to c9's train peak, 2 ranks).
FSDP_UNSHARDED_LAYERS = 1
# Rollout workspace per running request per vocab entry (logits, probabilities, sampling):
# rollout peak minus wake_kv_cache peak, 88 MB for 32 requests (c4), 46 MB for 16 (c9).
ROLLOUT_BYTES_PER_REQUEST_VOCAB = 18
# A stage fits when its peak leaves this much of the device free (2 MiB mapping granularity,
# rounding of pinned copies; the bench's RELEASE_SLACK_BYTES).
ALLOCATOR_SLACK_BYTES = 64 * MiB
# sglang only, fitted to bench/results/raw/s1-sglang-h100.json (sglang 0.5.17, Qwen2.5-3B
# architecture, one H100, staged 0.95 and 0.97): what sglang's processes hold on the device when
# it profiles the KV pool (its scheduler's CUDA context, kernels, workspaces: the plan's KV tokens
# match the measured ones within 0.04%); what they hold for good outside the memory-saver
# regions, in every stage (in place of the torch engine's ENGINE_OUTSIDE_REGIONS_BYTES); and the
# CUDA graphs captured after the pool (released with the cuda_graph tag while training).
SGLANG_PROCESS_CONTEXT_BYTES = 1_363_492_864
SGLANG_RESIDENT_BYTES = 2_130_706_432
SGLANG_CUDA_GRAPH_BYTES = 1_140_850_688
# What was in use on the device when sglang took its "free memory before the model" (its own and
# the rank's CUDA contexts): sglang 0.5.17 sizes the pool as the free memory at profile time minus
# (1 - memFractionStatic) x that earlier free memory (kv_cache_configurator's
# _profile_available_bytes), so the pool grows by (1 - fraction) x this over a pool of
# fraction x capacity. Fitted to sglang's own token counts at ten points (3B and 1.5B, fractions
# 0.50 to 0.97): within 0.11 GiB of every pool.
SGLANG_BOOTSTRAP_USED_BYTES = 2_755_540_650
# sglang with wakeUp single: what its wake (every tag resumed at once, then the weight update)
# and rollout hold beyond the staged accounting. Not explained yet; fitted to the one completing
# sglang single point (bench/results/raw/s2-sglang-h100-single.json, 3B at 0.65: +397 MiB at
# wake_weights over the plan with sglang's own pool size, +0.84 GiB at rollout; the wake figure
# taken).
SGLANG_SINGLE_WAKE_BYTES = 397 * MiB
# sglang with tensorParallelSize > 1, per GPU of the group: what its schedulers hold outside the
# memory-saver regions beyond a TP-1 engine's (the TP group's communicators: sglang's
# _init_parallel_groups builds a PyNccl communicator, whose warm-up all_reduce allocates NCCL's
# buffers, and custom all-reduce buffers). sglang takes its "free memory before the model"
# (distributed/bootstrap.py, pre_model_load_memory) after that init, so the pool shrinks by
# memFractionStatic x this while the device holds all of it. Measured at TP 2 (sglang 0.5.17,
# Qwen2.5-3B shape, two H200s, bench/results/raw/two-gpu-3b-tp-h200x2): sglang's pool at single
# 0.70 held 40,248 tokens (18,432 B each per GPU) fewer than the TP-1 accounting, i.e. 0.70 x
# 1.060 GB; rank 0's device at offload_train's end of staged 0.95 (engine weights resident, no
# training state) held 1.054 GB more than it. The higher is taken; TP 4 and up not measured.
SGLANG_TP_RESIDENT_BYTES = 40_248 * 18_432 * 10 // 7
# The torch engine's pool: whole 16-token blocks plus one null block (torch_engine.py).
TORCH_KV_BLOCK_TOKENS = 16

# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp), which also serves the memory
# saver's regions: requests round up to 512 B; up to 1 MiB from 2 MiB segments (small pool),
# below 10 MiB from 20 MiB segments, larger ones from a segment of their size rounded up to
# 2 MiB; a free block is split when more than 1 MiB (small pool: 512 B) would be left.
ALLOC_ROUND = 512
ALLOC_SMALL = 1 << 20
ALLOC_SMALL_SEGMENT = 2 << 20
ALLOC_MEDIUM_SEGMENT = 20 << 20
ALLOC_LARGE_MIN = 10 << 20
ALLOC_LARGE_ROUND = 2 << 20

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MASTER_BYTES = 4  # train.Trainer keeps fp32 master params of the policy
# The frozen reference is kept in the engine's dtype (spec.model.dtype) since the sharded loader
# (issue 30); every stored bench run kept it in fp32, which `reference_dtype` recreates.
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
GRAD_BYTES = 4  # FSDP2 reduce dtype fp32, sharded
ADAM_TEMP_BYTES = 4  # foreach AdamW's sqrt(exp_avg_sq) temporary, fp32, one per param

# The builtin tiny Qwen2 (rljob_worker.model builds it from exactly these fields).
TINY_QWEN2_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
TINY_QWEN2_VOCAB_SIZE = 320


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2/Llama-family decoder's architecture (config.json's fields)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = True  # Qwen2 has q/k/v biases; Llama none

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        heads = int(config["num_attention_heads"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=str(config.get("model_type", "qwen2")) == "qwen2",
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def named_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Parameter names and shapes in from_pretrained's order (weight-sync buckets)."""
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        bias = self.attention_bias
        layer: list[tuple[str, tuple[int, ...]]] = [
            ("self_attn.q_proj.weight", (h, h)),
            *([("self_attn.q_proj.bias", (h,))] if bias else []),
            ("self_attn.k_proj.weight", (kv, h)),
            *([("self_attn.k_proj.bias", (kv,))] if bias else []),
            ("self_attn.v_proj.weight", (kv, h)),
            *([("self_attn.v_proj.bias", (kv,))] if bias else []),
            ("self_attn.o_proj.weight", (h, h)),
            ("mlp.gate_proj.weight", (i, h)),
            ("mlp.up_proj.weight", (i, h)),
            ("mlp.down_proj.weight", (h, i)),
            ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,)),
        ]
        shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for index in range(self.layers):
            shapes += [(f"model.layers.{index}.{name}", shape) for name, shape in layer]
        shapes.append(("model.norm.weight", (h,)))
        if not self.tied_embeddings:
            shapes.append(("lm_head.weight", (self.vocab, h)))
        return shapes

    def named_sizes(self) -> list[tuple[str, int]]:
        """Parameter names and element counts in from_pretrained's order (weight-sync buckets)."""
        return [(name, math.prod(shape)) for name, shape in self.named_shapes()]

    @property
    def parameters(self) -> int:
        return sum(n for _, n in self.named_sizes())

    @property
    def layer_parameters(self) -> int:
        return (self.parameters - self.root_parameters) // self.layers

    @property
    def root_parameters(self) -> int:
        """Embeddings, final norm and an untied head: FSDP's root unit."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        kv_heads = max(self.kv_heads // tp, 1)  # replicated when there are fewer than tp
        return 2 * self.layers * kv_heads * self.head_dim * dtype_bytes


BUILTIN_MODEL_SHAPES: dict[str, ModelShape] = {
    TINY_QWEN2: ModelShape.from_config(
        {**TINY_QWEN2_CONFIG, "vocab_size": TINY_QWEN2_VOCAB_SIZE, "model_type": "qwen2"}
    ),
}


def shape_for(spec: RLJobSpec, read_config: bool = True) -> ModelShape | None:
    """The model's shape: builtin, spec.model.shape, else config.json in a local model.path
    (read_config False: the operator, which never reads the pod's files)."""
    path = spec.model.path
    if path in BUILTIN_MODEL_SHAPES:
        return BUILTIN_MODEL_SHAPES[path]
    if spec.model.shape is not None:
        return ModelShape.from_config(spec.model.shape.model_dump())
    config = Path(path) / "config.json"
    if read_config and not path.startswith(BUILTIN_PREFIX) and config.is_file():
        return ModelShape.from_config(json.loads(config.read_text()))
    return None


def reserved_bytes(sizes: Iterable[int]) -> int:
    """Device bytes torch's caching allocator reserves for tensors of these byte sizes,
    allocated in this order and all kept (best fit among the free remainders, as the allocator
    does). The torch engine's weights go in this way: 20 MiB segments hold whole tensors only,
    so at Qwen2.5-1.5B four 4.5 MiB projections leave 2 MiB of each segment unused (189.6 MiB in
    all; 49.7 at 0.5B, 254 at 3B: what RLJOB_ALLOCATOR_REPORT showed on an H100, to the MiB)."""
    free: dict[bool, list[int]] = {True: [], False: []}
    reserved = 0
    for n in sizes:
        size = max(ALLOC_ROUND, -(-n // ALLOC_ROUND) * ALLOC_ROUND)
        small = size <= ALLOC_SMALL
        fitting = [b for b in free[small] if b >= size]
        if fitting:
            block = min(fitting)
            free[small].remove(block)
        else:
            if small:
                block = ALLOC_SMALL_SEGMENT
            elif size < ALLOC_LARGE_MIN:
                block = ALLOC_MEDIUM_SEGMENT
            else:
                block = -(-size // ALLOC_LARGE_ROUND) * ALLOC_LARGE_ROUND
            reserved += block
        rest = block - size
        if rest >= ALLOC_ROUND if small else rest > ALLOC_SMALL:
            free[small].append(rest)
    return reserved


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


# -- the parts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parts:
    """Bytes of each thing one rank may hold on its device (all per rank)."""

    context: int  # CUDA context, train residual, NCCL, engine tensors outside its regions
    train_params: int  # fp32 master params, policy (+ reference), this rank's shard
    optimizer: int  # AdamW moments, this rank's shard
    grads: int
    step_temp: int  # AdamW's foreach temporary at the step
    step_cache: int  # the logits' blocks the allocator still caches at the step
    activations: int  # one micro-batch's forward/backward (layers and logits), at backward
    fsdp_buffers: int  # unsharded root and layers (world > 1)
    engine_weights: int  # this rank's TP shard, engine dtype
    kv_pool: int  # KV cache (+ sglang's CUDA graphs)
    kv_tokens: int
    gather: int  # weight sync: two consecutive buckets' buffers at once
    rollout_workspace: int
    single_wake_extra: int = 0  # sglang, wakeUp single only: SGLANG_SINGLE_WAKE_BYTES
    # mode multiTurn: KV tokens for maxConcurrentConversations full-length trajectories (0:
    # single-turn, where the engine queues what does not fit and the plan does not ask).
    kv_tokens_needed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.__dict__.items()}


def response_budget(spec: RLJobSpec) -> int:
    """Tokens after the prompt: data.maxResponseLength, or in mode multiTurn the whole
    trajectory's rollout.multiTurn.maxResponseLength (model, template and tool tokens)."""
    multi_turn = spec.rollout.multi_turn_settings
    return multi_turn.max_response_length if multi_turn else spec.data.max_response_length


def training_tokens(spec: RLJobSpec) -> int:
    """Tokens of one micro-batch at the longest sequence the spec allows (prompt + response)."""
    return spec.training.micro_batch_size * (spec.data.max_prompt_length + response_budget(spec))


def concurrent_conversations(spec: RLJobSpec, world: int) -> int:
    """Conversations one rank's engine holds at once in mode multiTurn (0 in singleTurn)."""
    multi_turn = spec.rollout.multi_turn_settings
    if multi_turn is None:
        return 0
    per_rank = spec.data.train_batch_size // max(world, 1) * spec.algorithm.group_size
    return min(multi_turn.max_concurrent_conversations, per_rank)


def multi_turn_kv_tokens(spec: RLJobSpec, world: int) -> int:
    """KV tokens that concurrent_conversations full-length trajectories take (prompt + the
    trajectory budget each): below it, sglang would queue or retract conversations mid-turn
    and the torch engine would refuse the longest."""
    return concurrent_conversations(spec, world) * (
        spec.data.max_prompt_length + response_budget(spec)
    )


def activation_bytes(spec: RLJobSpec, shape: ModelShape) -> int:
    """One micro-batch's activations kept for backward, at the longest sequence the spec allows
    (prompt + response): per layer, or with checkpointing one layer plus each layer's input."""
    dtype = DTYPE_BYTES[spec.model.dtype]
    tokens = training_tokens(spec)
    per_layer = dtype * (
        ACTIVATION_HIDDEN_TENSORS * shape.hidden
        + ACTIVATION_INTERMEDIATE_TENSORS * shape.intermediate
    )
    if spec.training.gradient_checkpointing:
        layers = shape.layers * dtype * shape.hidden + per_layer
    else:
        layers = shape.layers * per_layer
    return tokens * (layers + LOGIT_BYTES_PER_ENTRY * shape.vocab)


def sglang_tp_resident_bytes(tp: int) -> int:
    """What an sglang engine of `tp` GPUs holds per GPU outside its regions beyond a TP-1
    engine's (SGLANG_TP_RESIDENT_BYTES; none at TP 1)."""
    return SGLANG_TP_RESIDENT_BYTES if tp > 1 else 0


def kv_pool(
    spec: RLJobSpec, shape: ModelShape, capacity_bytes: int, engine_weights: int
) -> tuple[int, int]:
    """(pool bytes, tokens) the engine sizes from memFractionStatic on a device of
    `capacity_bytes`: torch_engine.kv_pool_capacity_tokens for torch (fraction of the device
    minus the weights, whole blocks, plus the null block); for sglang the fraction minus what is
    already used when it profiles (the rank's and its own context, and its weights)."""
    rollout = spec.rollout
    dtype = DTYPE_BYTES[spec.model.dtype]
    per_token = shape.kv_bytes_per_token(dtype, rollout.tensor_parallel_size)
    fraction = resolved_rollout(spec)[1]
    budget = int(fraction * capacity_bytes) - engine_weights
    if rollout.engine is EngineName.TORCH:
        tokens = max(budget, 0) // per_token // TORCH_KV_BLOCK_TOKENS * TORCH_KV_BLOCK_TOKENS
        return (tokens + TORCH_KV_BLOCK_TOKENS) * per_token, tokens
    # Held before sglang takes its free memory before the model, and still at profile time:
    # the pool loses fraction x it (sglang's _profile_available_bytes).
    tp_resident = sglang_tp_resident_bytes(rollout.tensor_parallel_size)
    budget -= CUDA_CONTEXT_BYTES + SGLANG_PROCESS_CONTEXT_BYTES + tp_resident
    budget += int((1 - fraction) * (SGLANG_BOOTSTRAP_USED_BYTES + tp_resident))
    tokens = max(budget, 0) // per_token
    return tokens * per_token + SGLANG_CUDA_GRAPH_BYTES, tokens


# The worker's switches that decide whether a one-rank sync needs any buffer (sync_as_stored):
# RLJOB_FLAT_SHARDS=0 keeps the policy's shards apart (rljob_worker.train reads this name), and
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


# weightSyncBucketMegabytes Auto: the rollout's Auto is chosen at the smallest bucket (the
# spec's default), then the largest of the whole model in one bucket and these sizes (MiB)
# whose plan still fits under the margin's limit (auto_bucket); none fitting, the smallest.
AUTO_BUCKET_FALLBACK_MEGABYTES = 512
AUTO_BUCKET_MEGABYTES = (4096, 2048, 1024)


def bucket_megabytes(spec: RLJobSpec) -> int:
    """The spec's weight-sync bucket in MiB; under Auto not yet resolved, the smallest Auto
    tries (what the rollout's own Auto is chosen with)."""
    value = spec.rollout.weight_sync_bucket_megabytes
    return AUTO_BUCKET_FALLBACK_MEGABYTES if value == AUTO else int(value)


def resolved_bucket_bytes(spec: RLJobSpec) -> int:
    """The weight-sync bucket in bytes of a spec whose Auto is resolved (auto_choice)."""
    value = spec.rollout.weight_sync_bucket_megabytes
    if value == AUTO:
        raise ValueError(
            "weightSyncBucketMegabytes Auto is not resolved: plan it with auto_choice on the "
            "card first (rljob/plan.py)"
        )
    return int(value) << 20


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


def parts(
    spec: RLJobSpec,
    shape: ModelShape,
    capacity_bytes: int,
    world: int | None = None,
    reference_dtype: str | None = None,
) -> Parts:
    """Each thing one rank holds. `reference_dtype`: the reference's dtype where a run had
    another than the engine's (bench/plan_accuracy.py: the stored runs' fp32 reference)."""
    world = world or spec.world_size
    n = shape.parameters
    dtype = DTYPE_BYTES[spec.model.dtype]
    reference = spec.algorithm.kl_coef > 0
    shard = lambda total: math.ceil(total / world)  # noqa: E731 (FSDP2's dim-0 chunks)
    tp = spec.rollout.tensor_parallel_size
    engine_weights = n * dtype // tp
    pool, tokens = kv_pool(spec, shape, capacity_bytes, engine_weights)
    if spec.rollout.engine is EngineName.TORCH:
        # Its pool is sized from the tensors' bytes; its weight region holds whole segments.
        engine_weights = reserved_bytes(size * dtype // tp for _, size in shape.named_sizes())
    outside = (
        ENGINE_OUTSIDE_REGIONS_BYTES
        if spec.rollout.engine is EngineName.TORCH
        else SGLANG_RESIDENT_BYTES + sglang_tp_resident_bytes(tp)
    )
    context = CUDA_CONTEXT_BYTES + TRAIN_RESIDUAL_BYTES + outside
    fsdp = 0
    if world > 1:
        context += NCCL_BUFFER_BYTES
        unsharded = shape.root_parameters + FSDP_UNSHARDED_LAYERS * shape.layer_parameters
        fsdp = unsharded * (dtype + GRAD_BYTES)
    # The rollout's requests on one GPU: a rank's own, times the TP group (its leader sends the
    # group's batches to the one engine, whose every TP GPU holds the whole batch's logits).
    requests = spec.data.train_batch_size // max(world, 1) * spec.algorithm.group_size * tp
    if spec.rollout.multi_turn_settings is not None:
        requests = concurrent_conversations(spec, world) * tp
    return Parts(
        context=context,
        # fp32 masters (and the reference's shards) as torch's allocator holds them, whole
        # segments: 115 MiB over the tensors per Qwen2.5-0.5B fp32 copy, 101 at 1.5B, 2 at 3B.
        train_params=reserved_bytes(
            [math.ceil(MASTER_BYTES * size / world) for _, size in shape.named_sizes()]
            + [
                math.ceil(DTYPE_BYTES[reference_dtype or spec.model.dtype] * size / world)
                for _, size in shape.named_sizes()
                if reference
            ]
        ),
        optimizer=shard(ADAM_STATE_BYTES * n),
        grads=shard(GRAD_BYTES * n),
        step_temp=shard(ADAM_TEMP_BYTES * n),
        step_cache=round(STEP_CACHE_BYTES_PER_LOGIT_ENTRY * training_tokens(spec) * shape.vocab),
        activations=activation_bytes(spec, shape),
        fsdp_buffers=fsdp,
        engine_weights=engine_weights,
        kv_pool=pool,
        kv_tokens=tokens,
        gather=gather_bytes(spec, shape, world),
        rollout_workspace=requests * shape.vocab * ROLLOUT_BYTES_PER_REQUEST_VOCAB,
        single_wake_extra=0
        if spec.rollout.engine is EngineName.TORCH
        else SGLANG_SINGLE_WAKE_BYTES,
        kv_tokens_needed=multi_turn_kv_tokens(spec, world),
    )


# -- the stages -----------------------------------------------------------------------------------


def stage_peaks(
    p: Parts,
    wake_up: WakeUp,
    offload_optimizer: bool,
    offload_params: bool,
    checkpoint: bool = False,
    overlap: bool = False,
) -> dict[Stage, int]:
    """Device-wide peak per stage of a steady iteration (1+), following stages.py. A stage's
    peak includes what it started with (the bench samples at the boundary), and memory freed
    into torch's cache stays counted until the next empty_cache().

    `overlap` (spec.training.overlapStaging, stages.StagingOrder): the offloaded moments come
    back during train (which held them already), so sleep no longer holds them; sleep brings the
    params back once the KV cache is released, with the engine's weights still mapped; staged
    only, the moments leave while the weight sync runs, so wake_weights and offload_train (which
    frees them) hold them beside the engine's weights."""
    optimizer = 0 if offload_optimizer else p.optimizer
    params = 0 if offload_params else p.train_params
    single = wake_up is WakeUp.SINGLE
    # The moments on the device during the weight sync: leaving behind it (overlap, staged).
    syncing_optimizer = p.optimizer if overlap and not single else optimizer
    peaks: dict[Stage, int] = {}
    # The higher of the optimizer step (its temporary and the cached logits) and backward (the
    # micro-batch's activations, all live): at the bench's 768-token micro-batches the step.
    train = (
        p.context
        + p.train_params
        + p.optimizer
        + p.grads
        + max(p.step_temp + p.step_cache, p.activations)
        + p.fsdp_buffers
    )
    peaks[Stage.TRAIN] = train
    if checkpoint:
        # The same as train: it starts with train's cache and state, frees nothing, and the
        # save copies one tensor at a time to host memory (docs/checkpoints.md).
        peaks[Stage.CHECKPOINT] = train
    peaks[Stage.OFFLOAD_OPTIMIZER] = train  # starts with train's cache; frees after
    resident = p.context + p.train_params + syncing_optimizer
    kv = p.kv_pool + p.single_wake_extra if single else 0
    wake = resident + p.engine_weights + kv + p.gather
    peaks[Stage.WAKE_WEIGHTS] = wake
    peaks[Stage.OFFLOAD_TRAIN] = wake  # starts with the sync's buckets cached
    serving = p.context + params + optimizer + p.engine_weights + p.kv_pool
    serving += p.single_wake_extra if single else 0
    if wake_up is WakeUp.STAGED:
        peaks[Stage.WAKE_KV_CACHE] = serving
    peaks[Stage.ROLLOUT] = serving + p.rollout_workspace
    # Starts with the pool mapped. Without overlap it ends with the whole training state back;
    # with it, the params come back while the engine's weights are still mapped (the KV cache
    # released first) and the moments only in train.
    back = p.context + p.train_params
    back += optimizer + p.engine_weights if overlap else p.optimizer
    peaks[Stage.SLEEP] = max(peaks[Stage.ROLLOUT], back)
    return peaks


# -- start-up: building and loading the models ---------------------------------------------------


@dataclass(frozen=True)
class LoadPeak:
    """Start-up (train.Trainer with sharded_load.py): policy and reference built on the meta
    device and sharded, then each rank's rows read from the files one tensor at a time.

    Device: the CUDA context, NCCL and the engine's bytes outside its regions (it started
    first and released them), every shard of this rank, and one slice cast to fp32. Host, per
    rank beyond the process's own: the largest slice as stored plus its fp32 cast; per node,
    times the worker's ranks. The files' pages are page cache (the model once per node, shared
    by the ranks and by policy and reference): reclaimable, not counted.
    """

    device_bytes: int
    capacity_bytes: int
    host_bytes_per_rank: int
    ranks_per_node: int
    host_limit_bytes: int  # the worker pod's memory (spec.resources.memory)

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_rank * self.ranks_per_node

    @property
    def fraction(self) -> float:
        return self.device_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    def fits_under(self, limit_bytes: int) -> bool:
        return (
            self.device_bytes + ALLOCATOR_SLACK_BYTES <= limit_bytes
            and self.host_bytes_per_node <= self.host_limit_bytes
        )

    @property
    def fits(self) -> bool:
        return self.fits_under(self.capacity_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peakBytes": self.device_bytes,
            "fraction": round(self.fraction, 4),
            "hostBytesPerRank": self.host_bytes_per_rank,
            "hostBytesPerNode": self.host_bytes_per_node,
            "ranksPerNode": self.ranks_per_node,
            "hostLimitBytes": self.host_limit_bytes,
            "fits": self.fits,
        }

    def to_status(self) -> PlannedLoad:
        return PlannedLoad(
            peak_bytes=self.device_bytes,
            peak_fraction=round(self.fraction, 4),
            host_bytes_per_node=self.host_bytes_per_node,
        )

    def misfit_text(self) -> str:
        over = []
        if self.device_bytes + ALLOCATOR_SLACK_BYTES > self.capacity_bytes:
            over.append(
                f"load needs {self.device_bytes / GiB:.2f} GiB of {self.capacity_bytes / GiB:.2f}"
                f" GiB ({(self.device_bytes + ALLOCATOR_SLACK_BYTES - self.capacity_bytes) / GiB:.2f}"
                " GiB over)"
            )
        if self.host_bytes_per_node > self.host_limit_bytes:
            over.append(
                f"load needs {self.host_bytes_per_node / GiB:.2f} GiB of host memory per worker "
                f"pod, spec.resources.memory is {self.host_limit_bytes / GiB:.2f} GiB"
            )
        return "; ".join(over)


def load_peak(
    spec: RLJobSpec, shape: ModelShape, p: Parts, capacity_bytes: int, world: int
) -> LoadPeak:
    """The start-up peak of one rank (rank 0 holds the largest shard) and its worker's host."""
    from rljob.api import _quantity  # the manifest's quantity parser (no kubernetes client)

    # The largest rank slice of any tensor, in elements (FSDP2's dim-0 chunk of the largest).
    slice_elements = max(math.ceil(size / world) for _, size in shape.named_sizes())
    stored = DTYPE_BYTES[spec.model.dtype]  # checkpoints are stored in the engine's dtype
    return LoadPeak(
        device_bytes=p.context
        - TRAIN_RESIDUAL_BYTES
        + p.train_params
        + slice_elements * MASTER_BYTES,
        capacity_bytes=capacity_bytes,
        host_bytes_per_rank=slice_elements * (stored + MASTER_BYTES),
        ranks_per_node=min(spec.resources.ranks_per_worker, world),
        host_limit_bytes=int(_quantity(spec.resources.memory)),
    )


@dataclass(frozen=True)
class StagePeak:
    stage: Stage
    peak_bytes: int
    capacity_bytes: int

    @property
    def fraction(self) -> float:
        return self.peak_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= ALLOCATOR_SLACK_BYTES


@dataclass(frozen=True)
class ModePlan:
    """One wake-up mode at the spec's memFractionStatic."""

    wake_up: WakeUp
    mem_fraction_static: float
    offload_optimizer: bool
    offload_params: bool
    stages: tuple[StagePeak, ...]
    parts: Parts
    largest_fitting_fraction: float | None = None
    load: LoadPeak | None = None  # start-up, before iteration 0 (None: not planned)

    @property
    def fits(self) -> bool:
        return (
            all(s.fits for s in self.stages)
            and (self.load is None or self.load.fits)
            and self.kv_holds_conversations
        )

    @property
    def kv_holds_conversations(self) -> bool:
        """mode multiTurn: the KV pool holds maxConcurrentConversations full trajectories."""
        return self.parts.kv_tokens >= self.parts.kv_tokens_needed

    def fits_under(self, limit_bytes: int) -> bool:
        """Every stage's peak and the start-up's, plus the allocator's slack, within
        `limit_bytes` (and the start-up's host bytes within the worker pod's memory, and in mode
        multiTurn the KV pool large enough for the conversations)."""
        return (
            self.kv_holds_conversations
            and all(s.peak_bytes + ALLOCATOR_SLACK_BYTES <= limit_bytes for s in self.stages)
            and (self.load is None or self.load.fits_under(limit_bytes))
        )

    @property
    def worst(self) -> StagePeak:
        return max(self.stages, key=lambda s: s.peak_bytes)

    def misfit_text(self) -> str:
        """'wake_weights needs 81.02 GiB of 79.18 GiB (1.84 GiB over)' for each misfit."""
        misfits = [self.load.misfit_text()] if self.load is not None and not self.load.fits else []
        misfits += [
            f"{s.stage} needs {s.peak_bytes / GiB:.2f} GiB of {s.capacity_bytes / GiB:.2f} GiB "
            f"({(s.peak_bytes + ALLOCATOR_SLACK_BYTES - s.capacity_bytes) / GiB:.2f} GiB over)"
            for s in self.stages
            if not s.fits
        ]
        if not self.kv_holds_conversations:
            misfits.append(
                f"the KV cache holds {self.parts.kv_tokens} tokens, the multi-turn rollout's "
                f"concurrent full-length trajectories need {self.parts.kv_tokens_needed} (lower "
                "rollout.multiTurn.maxConcurrentConversations or maxResponseLength, or raise "
                "memFractionStatic)"
            )
        return "; ".join(misfits)


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one job: per mode, per stage, on one rank (the largest shard, rank 0)."""

    capacity_bytes: int
    world_size: int
    shape: ModelShape
    requested: WakeUp
    modes: dict[WakeUp, ModePlan] = field(default_factory=dict)
    auto: AutoChoice | None = None

    @property
    def chosen(self) -> ModePlan:
        return self.modes[self.requested]

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacityBytes": self.capacity_bytes,
            "worldSize": self.world_size,
            "shape": self.shape.__dict__,
            "parameters": self.shape.parameters,
            "requested": str(self.requested),
            "auto": (
                self.auto.to_status().model_dump(by_alias=True, mode="json")
                if self.auto is not None
                else None
            ),
            "modes": {
                str(mode): {
                    "memFractionStatic": m.mem_fraction_static,
                    "fits": m.fits,
                    "offloadOptimizer": m.offload_optimizer,
                    "offloadParams": m.offload_params,
                    "largestFittingFraction": m.largest_fitting_fraction,
                    "kvTokens": m.parts.kv_tokens,
                    "parts": m.parts.as_dict(),
                    "load": m.load.to_dict() if m.load is not None else None,
                    "stages": [
                        {
                            "name": str(s.stage),
                            "peakBytes": s.peak_bytes,
                            "fraction": round(s.fraction, 4),
                            "headroomBytes": s.headroom_bytes,
                            "fits": s.fits,
                        }
                        for s in m.stages
                    ],
                }
                for mode, m in self.modes.items()
            },
        }

    def to_status(self, auto: AutoStatus | None = None) -> PlanStatus:
        m = self.chosen
        return PlanStatus(
            auto=auto or (self.auto.to_status() if self.auto is not None else None),
            capacity_bytes=self.capacity_bytes,
            wake_up=m.wake_up,
            mem_fraction_static=m.mem_fraction_static,
            fits=m.fits,
            offload_optimizer=m.offload_optimizer,
            offload_params=m.offload_params,
            stages=[
                PlannedStage(
                    name=s.stage, peak_bytes=s.peak_bytes, peak_fraction=round(s.fraction, 4)
                )
                for s in m.stages
            ],
            largest_fitting_fraction={
                str(k): v.largest_fitting_fraction for k, v in self.modes.items()
            },
            load=m.load.to_status() if m.load is not None else None,
        )


def _with(spec: RLJobSpec, wake_up: WakeUp, fraction: float) -> RLJobSpec:
    rollout = spec.rollout.model_copy(update={"wake_up": wake_up, "mem_fraction_static": fraction})
    return spec.model_copy(update={"rollout": rollout})


def _with_bucket(spec: RLJobSpec, megabytes: int) -> RLJobSpec:
    rollout = spec.rollout.model_copy(update={"weight_sync_bucket_megabytes": megabytes})
    return spec.model_copy(update={"rollout": rollout})


def _offload_choices(spec: RLJobSpec) -> list[tuple[bool, bool]]:
    """(optimizer, params) offloads to try, fewest bytes moved first; Always: the flags."""
    allowed = (spec.training.offload_optimizer, spec.training.offload_params)
    if spec.offload is OffloadMode.ALWAYS:
        return [allowed]
    # Params (policy + reference) are usually as large as the moments; either order is
    # one offload, so try optimizer first (it is the one that leaves the device at train end).
    choices = [(False, False), (True, False), (False, True), (True, True)]
    return [c for c in choices if (not c[0] or allowed[0]) and (not c[1] or allowed[1])]


def mode_plan(
    spec: RLJobSpec,
    shape: ModelShape,
    capacity_bytes: int,
    world: int | None = None,
    limit_bytes: int | None = None,
    reference_dtype: str | None = None,
) -> ModePlan:
    """The spec's own mode and fraction; with offload Auto the least offload that fits (under
    `limit_bytes`, default the capacity; or, when none fits, everything the flags allow)."""
    wake_up, fraction = resolved_rollout(spec)
    world = world or spec.world_size
    p = parts(spec, shape, capacity_bytes, world, reference_dtype)
    load = load_peak(spec, shape, p, capacity_bytes, world)
    choices = _offload_choices(spec)
    plans = []
    for optimizer, params in choices:
        peaks = stage_peaks(
            p,
            wake_up,
            optimizer,
            params,
            checkpoint=spec.checkpoint is not None,
            overlap=overlaps_staging(spec),
        )
        stages = tuple(StagePeak(s, b, capacity_bytes) for s, b in peaks.items())
        plans.append(ModePlan(wake_up, fraction, optimizer, params, stages, p, load=load))
    limit = capacity_bytes if limit_bytes is None else limit_bytes
    return next((m for m in plans if m.fits_under(limit)), plans[-1])


def overlaps_staging(spec: RLJobSpec) -> bool:
    """Whether the plan counts the overlapped staging order: On, or Auto (On on CUDA, which is
    what the plan is for: a GPU's memory)."""
    return spec.training.overlap_staging is not OverlapStaging.OFF


def resolved_rollout(spec: RLJobSpec) -> tuple[WakeUp, float]:
    """(wakeUp, memFractionStatic) of a spec whose Auto is resolved (auto_choice)."""
    wake_up, fraction = spec.rollout.wake_up, spec.rollout.mem_fraction_static
    if rollout_is_auto(spec):
        raise ValueError(
            "rollout Auto is not resolved: plan it with auto_choice on the card first "
            "(rljob/plan.py)"
        )
    assert isinstance(wake_up, WakeUp) and not isinstance(fraction, str)
    return wake_up, fraction


def largest_fitting_fraction(
    spec: RLJobSpec,
    shape: ModelShape,
    capacity_bytes: int,
    wake_up: WakeUp,
    world: int | None = None,
    step: float = 0.01,
    reference_dtype: str | None = None,
) -> float | None:
    """The largest memFractionStatic (on a grid of `step`) at which every stage fits."""
    for i in range(round(1 / step) - 1, 0, -1):
        fraction = round(i * step, 4)
        candidate = _with(spec, wake_up, fraction)
        if mode_plan(candidate, shape, capacity_bytes, world, reference_dtype=reference_dtype).fits:
            return fraction
    return None


def plan(
    spec: RLJobSpec, shape: ModelShape, capacity_bytes: int, world: int | None = None
) -> MemoryPlan:
    """Both wake-up modes at the spec's fraction, each with its largest fitting fraction."""
    world = world or spec.world_size
    auto = None
    # The modes' tables: under the bucket's Auto, at the smallest bucket it takes (the size it
    # chose fits the chosen mode only; Auto's own row replaces that mode's below).
    tables = spec
    if spec.rollout.weight_sync_bucket_megabytes == AUTO:
        tables = _with_bucket(spec, AUTO_BUCKET_FALLBACK_MEGABYTES)
    if is_auto(spec):
        auto = auto_choice(spec, shape, capacity_bytes, world)
        spec = auto.resolve(spec)
        tables = _with(tables, auto.chosen.wake_up, auto.chosen.mem_fraction_static)
    requested, fraction = resolved_rollout(spec)
    modes = {}
    for mode in (WakeUp.STAGED, WakeUp.SINGLE):
        m = mode_plan(_with(tables, mode, fraction), shape, capacity_bytes, world)
        best = largest_fitting_fraction(tables, shape, capacity_bytes, mode, world)
        modes[mode] = replace(m, largest_fitting_fraction=best)
    if auto is not None:
        # The mode Auto chose, with the offload it chose under the margin's limit.
        modes[requested] = replace(
            auto.chosen, largest_fitting_fraction=modes[requested].largest_fitting_fraction
        )
    return MemoryPlan(capacity_bytes, world, shape, requested, modes, auto)


def plan_for_point(
    spec: RLJobSpec,
    config: Mapping[str, Any],
    capacity_bytes: int,
    ranks: int,
    reference_dtype: str | None = None,
) -> ModePlan:
    """The bench's hook (bench/colocate.py): the plan of one (mode, fraction) point, for a
    model given by its config.json fields, on `ranks` GPUs of `capacity_bytes`; a stored run's
    `reference_dtype` where it differs from the engine's (see MASTER_BYTES)."""
    shape = ModelShape.from_config({"model_type": "qwen2", **config})
    return mode_plan(spec, shape, capacity_bytes, ranks, reference_dtype=reference_dtype)


def plan_line(spec: RLJobSpec, config: Mapping[str, Any], capacity_bytes: int, ranks: int) -> str:
    """One line for the bench to print beside a measured point: the plan's per-stage peaks."""
    m = plan_for_point(spec, config, capacity_bytes, ranks)
    peaks = ", ".join(f"{s.stage}: {s.peak_bytes / GiB:.2f}" for s in m.stages)
    verdict = "fits" if m.fits else f"misfit ({m.misfit_text()})"
    return (
        f"plan {m.wake_up} {m.mem_fraction_static:.2f}: {verdict}, KV {m.parts.kv_tokens} "
        f"tokens, peaks {{{peaks}}} GiB"
    )


# -- rollout Auto: the largest KV cache that fits within the margin -----------------------------

# The fractions Auto tries: the plan's grid (largest_fitting_fraction's), 0.01 to 0.99.
AUTO_FRACTION_STEP = 0.01


class AutoRefused(ValueError):
    """No candidate fits: the message names the closest one's stage and the bytes it is short."""


def rollout_is_auto(spec: RLJobSpec) -> bool:
    """Whether the rollout's mode or fraction is Auto (the candidates auto_choice compares)."""
    return AUTO in (spec.rollout.wake_up, spec.rollout.mem_fraction_static)


def is_auto(spec: RLJobSpec) -> bool:
    return rollout_is_auto(spec) or spec.rollout.weight_sync_bucket_megabytes == AUTO


def auto_candidates(spec: RLJobSpec) -> list[tuple[WakeUp, float]]:
    """(wakeUp, memFractionStatic) pairs Auto plans: each Auto knob over all its values, the
    other as the spec says."""
    wake_up, fraction = spec.rollout.wake_up, spec.rollout.mem_fraction_static
    modes = [WakeUp.STAGED, WakeUp.SINGLE] if wake_up == AUTO else [WakeUp(wake_up)]
    steps = round(1 / AUTO_FRACTION_STEP)
    fractions = (
        [round(i * AUTO_FRACTION_STEP, 4) for i in range(1, steps)]
        if fraction == AUTO
        else [float(fraction)]
    )
    return [(m, f) for m in modes for f in fractions]


def _short_bytes(m: ModePlan, limit_bytes: int) -> tuple[StagePeak, int]:
    """The worst stage of `m` and the bytes it passes the limit by (<= 0: it fits)."""
    worst = m.worst
    return worst, worst.peak_bytes + ALLOCATOR_SLACK_BYTES - limit_bytes


def _usable(m: ModePlan, limit_bytes: int) -> bool:
    # A candidate without one KV token would fit a card smaller than the weights: the engine
    # could not serve a request, so it is never chosen.
    return m.parts.kv_tokens > 0 and m.fits_under(limit_bytes)


def choose(candidates: Sequence[ModePlan], limit_bytes: int) -> ModePlan:
    """The candidate with the largest KV pool whose every stage fits under `limit_bytes`; on a
    tie staged (its peaks are lower), then the lower fraction (more headroom). None fitting:
    AutoRefused naming the closest candidate's stage and the bytes it is short."""
    fitting = [m for m in candidates if _usable(m, limit_bytes)]
    if fitting:
        return max(
            fitting,
            key=lambda m: (m.parts.kv_tokens, m.wake_up is WakeUp.STAGED, -m.mem_fraction_static),
        )
    if not candidates:
        raise AutoRefused("rollout Auto: no candidate to plan")
    closest = min(candidates, key=lambda m: _short_bytes(m, limit_bytes)[1])
    stage, short = _short_bytes(closest, limit_bytes)
    text = (
        f"rollout Auto: nothing fits {limit_bytes / GiB:.2f} GiB (the GPU less "
        f"spec.memoryPlan.margin); closest: wakeUp {closest.wake_up} at memFractionStatic "
        f"{closest.mem_fraction_static:.2f}, where {stage.stage} needs "
        f"{stage.peak_bytes / GiB:.2f} GiB ({max(short, 0) / GiB:.2f} GiB short)"
    )
    if closest.parts.kv_tokens <= 0:
        text += (
            f" and the engine's weights ({closest.parts.engine_weights / GiB:.2f} GiB) leave no "
            "KV cache"
        )
    raise AutoRefused(
        text + "; use more GPUs (FSDP shards training state), offload, a smaller "
        "micro-batch or gradient checkpointing, or a lower spec.memoryPlan.margin"
    )


@dataclass(frozen=True)
class AutoChoice:
    """What rollout Auto chose on one card, from which candidates, under which limit."""

    chosen: ModePlan
    margin: float
    capacity_bytes: int
    limit_bytes: int
    candidates: tuple[ModePlan, ...]
    # weightSyncBucketMegabytes Auto's choice (auto_bucket); None where the spec gave a size.
    bucket_megabytes: int | None = None
    # Whether the rollout's mode or fraction was Auto (False: only the bucket was).
    rollout_auto: bool = True

    def resolve(self, spec: RLJobSpec) -> RLJobSpec:
        """`spec` with the chosen mode, fraction and bucket in place of Auto (what the ranks
        run)."""
        spec = _with(spec, self.chosen.wake_up, self.chosen.mem_fraction_static)
        if self.bucket_megabytes is not None:
            spec = _with_bucket(spec, self.bucket_megabytes)
        return spec

    @property
    def reason(self) -> str:
        m = self.chosen
        stage = m.worst
        under = (
            f"under {self.limit_bytes / GiB:.2f} GiB (margin {self.margin:.1%} of "
            f"{self.capacity_bytes / GiB:.2f} GiB); worst stage {stage.stage} at "
            f"{stage.peak_bytes / GiB:.2f} GiB"
        )
        bucket = (
            f"weight-sync bucket {self.bucket_megabytes} MiB, the largest that keeps every stage "
            "under the limit with the same offload"
            if _usable(m, self.limit_bytes)
            else f"weight-sync bucket {self.bucket_megabytes} MiB, the smallest: the plan at this "
            "mode and fraction passes the limit"
        )
        if not self.rollout_auto:
            return f"{bucket}: {under}"
        text = (
            f"the largest KV cache ({m.parts.kv_tokens} tokens) of {len(self.candidates)} "
            f"candidates whose every stage stays {under}"
        )
        return text if self.bucket_megabytes is None else f"{text}; {bucket}"

    def recorded(self) -> list[ModePlan]:
        """The bounded record: per mode, the chosen or best fitting candidate and the next
        fraction up that does not fit (why Auto stopped there)."""
        out: list[ModePlan] = []
        for mode in (WakeUp.STAGED, WakeUp.SINGLE):
            mine = [m for m in self.candidates if m.wake_up is mode]
            fitting = [m for m in mine if _usable(m, self.limit_bytes)]
            best = (
                self.chosen
                if self.chosen.wake_up is mode
                else (choose(fitting, self.limit_bytes) if fitting else None)
            )
            above = [
                m
                for m in mine
                if not _usable(m, self.limit_bytes)
                and (best is None or m.mem_fraction_static > best.mem_fraction_static)
            ]
            if best is not None:
                out.append(best)
            if above:
                out.append(min(above, key=lambda m: m.mem_fraction_static))
        return out[:MAX_PLAN_CANDIDATES]

    def to_status(self) -> AutoStatus:
        return AutoStatus(
            weight_sync_bucket_megabytes=self.bucket_megabytes,
            rollout=self.rollout_auto,
            margin=self.margin,
            limit_bytes=self.limit_bytes,
            planned=len(self.candidates),
            reason=self.reason[:1024],
            candidates=[
                PlanCandidate(
                    wake_up=m.wake_up,
                    mem_fraction_static=m.mem_fraction_static,
                    worst_stage=m.worst.stage,
                    peak_bytes=m.worst.peak_bytes,
                    kv_tokens=m.parts.kv_tokens,
                    kv_pool_bytes=m.parts.kv_pool,
                    fits=_usable(m, self.limit_bytes),
                )
                for m in self.recorded()
            ],
        )


def auto_lines(plan_status: PlanStatus) -> list[str]:
    """rollout Auto's choice as text lines (rljob run, kubectl rljob describe, rljob plan):
    what it chose and why, then the recorded candidates; [] where Auto was not used."""
    auto = plan_status.auto
    if auto is None:
        return []
    if not auto.rollout:  # only the bucket was Auto: no candidates of mode and fraction
        return [
            f"weightSyncBucketMegabytes Auto chose {auto.weight_sync_bucket_megabytes} MiB "
            f"at wakeUp {plan_status.wake_up}, memFractionStatic "
            f"{plan_status.mem_fraction_static:.2f}: {auto.reason}"
        ]
    lines = [
        f"rollout Auto chose wakeUp {plan_status.wake_up}, memFractionStatic "
        f"{plan_status.mem_fraction_static:.2f}: {auto.reason}",
        f"  {'wakeUp':<8}{'fraction':>9}{'worst stage':>16}{'peak GiB':>10}{'KV tokens':>11}"
        f"{'KV GiB':>8}  fits",
    ]
    for c in auto.candidates:
        lines.append(
            f"  {c.wake_up!s:<8}{c.mem_fraction_static:>9.2f}{c.worst_stage!s:>16}"
            f"{c.peak_bytes / GiB:>10.2f}{c.kv_tokens:>11}{c.kv_pool_bytes / GiB:>8.2f}  "
            f"{'yes' if c.fits else 'no'}"
        )
    return lines


def auto_limit_bytes(capacity_bytes: int, margin: float) -> int:
    """No stage's predicted peak may pass this: the card less `margin` of it."""
    return int(capacity_bytes * (1 - margin))


def auto_choice(
    spec: RLJobSpec, shape: ModelShape, capacity_bytes: int, world: int | None = None
) -> AutoChoice:
    """Plan every Auto candidate on a card of `capacity_bytes` and choose (see `choose`);
    AutoRefused when none fits. Pure: every rank given the same inputs chooses the same."""
    margin = spec.memory_plan.margin
    limit = auto_limit_bytes(capacity_bytes, margin)
    planned = tuple(
        mode_plan(_with(spec, mode, fraction), shape, capacity_bytes, world, limit)
        for mode, fraction in auto_candidates(spec)
    )
    rollout_auto = rollout_is_auto(spec)
    # Only the bucket Auto: the spec's mode and fraction planned as with the fixed smallest
    # bucket (its offload chosen as a fixed bucket's is, fitting or not: the plan reports a
    # misfit as it would there, and the bucket's Auto never refuses a job).
    if rollout_auto:
        chosen = choose(planned, limit)
    else:
        fixed = _with_bucket(spec, AUTO_BUCKET_FALLBACK_MEGABYTES)
        chosen = mode_plan(fixed, shape, capacity_bytes, world)
    bucket = None
    if spec.rollout.weight_sync_bucket_megabytes == AUTO:
        resolved = _with(spec, chosen.wake_up, chosen.mem_fraction_static)
        bucket, chosen = auto_bucket(resolved, shape, capacity_bytes, world, limit, chosen)
    return AutoChoice(chosen, margin, capacity_bytes, limit, planned, bucket, rollout_auto)


def auto_bucket(
    spec: RLJobSpec,
    shape: ModelShape,
    capacity_bytes: int,
    world: int | None,
    limit_bytes: int,
    smallest: ModePlan,
) -> tuple[int, ModePlan]:
    """weightSyncBucketMegabytes Auto, the mode and fraction already chosen (`smallest`: their
    plan at the smallest bucket): the largest of the whole model in the engine's dtype and
    AUTO_BUCKET_MEGABYTES whose plan fits under `limit_bytes` with `smallest`'s offload and KV
    cache, and that plan; none (or `smallest` not fitting), the smallest. A larger bucket is
    never bought with an offload the smallest did not need, nor with KV cache. Fewer, larger
    buckets measured the faster sync (docs/weight-sync.md): fewer requests, and on more than
    one rank no gather running beside the engine's load (two processes on one GPU take turns)."""
    whole = whole_model_megabytes(spec, shape)
    same = (smallest.offload_optimizer, smallest.offload_params, smallest.parts.kv_tokens)
    if _usable(smallest, limit_bytes):
        sizes = {whole, *(m for m in AUTO_BUCKET_MEGABYTES if m < whole)}
        for megabytes in sorted(sizes, reverse=True):
            if megabytes <= AUTO_BUCKET_FALLBACK_MEGABYTES:
                break
            m = mode_plan(_with_bucket(spec, megabytes), shape, capacity_bytes, world, limit_bytes)
            kept = (m.offload_optimizer, m.offload_params, m.parts.kv_tokens) == same
            if kept and _usable(m, limit_bytes):
                return megabytes, m
    return AUTO_BUCKET_FALLBACK_MEGABYTES, smallest


def resolved_spec(spec: RLJobSpec, memory_plan: MemoryPlan | None) -> RLJobSpec:
    """The spec the ranks run: Auto replaced by the plan's choice (unchanged without Auto)."""
    if not is_auto(spec):
        return spec
    if memory_plan is None or memory_plan.auto is None:
        raise AutoRefused(
            "rollout Auto (wakeUp, memFractionStatic or weightSyncBucketMegabytes) needs the "
            "memory plan: the model's shape (a builtin model, "
            "spec.model.shape or a config.json) and the GPU's memory (on CPU: "
            "spec.memoryPlan.gpuMemory or the host's)"
        )
    return memory_plan.auto.resolve(spec)


def rank_plan(
    spec: RLJobSpec,
    capacity_bytes: int | None,
    world: int,
    model_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> MemoryPlan | None:
    """The plan a rank makes before starting its engine: its real GPU's memory (or, on CPU,
    spec.memoryPlan.gpuMemory), the shape from builtin, spec or config.json; None without.
    `environ`: the rank's environment, where the weight sync's switches are read
    (with_process_switches); without it, the spec's env."""
    from rljob.api import _quantity  # the manifest's quantity parser (no kubernetes client)

    if capacity_bytes is None and spec.memory_plan.gpu_memory is not None:
        capacity_bytes = int(_quantity(spec.memory_plan.gpu_memory))
    shape = shape_for(spec)
    if shape is None and model_path is not None and (Path(model_path) / "config.json").is_file():
        shape = ModelShape.from_config(json.loads((Path(model_path) / "config.json").read_text()))
    if shape is None or capacity_bytes is None:
        return None
    if environ is not None:
        spec = with_process_switches(spec, environ)
    return plan(spec, shape, capacity_bytes, world)


def offload_choice(spec: RLJobSpec, memory_plan: MemoryPlan | None) -> tuple[bool, bool]:
    """(offload optimizer, offload params) for the stage machine: Always, or no plan, is what
    training.offloadOptimizer/offloadParams say; Auto is the plan's least offload that fits."""
    allowed = (spec.training.offload_optimizer, spec.training.offload_params)
    if spec.offload is OffloadMode.ALWAYS or memory_plan is None:
        return allowed
    chosen = memory_plan.chosen
    return chosen.offload_optimizer, chosen.offload_params
