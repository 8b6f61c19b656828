"""The parts of the memory plan: each thing one rank may hold on its device (Parts), from the
spec, the model's shape and the GPU's memory: training state, activations, engine weights, KV pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rljob.api import EngineName, RLJobSpec
from rljob.plan.costs import (
    ACTIVATION_HIDDEN_TENSORS,
    ACTIVATION_INTERMEDIATE_TENSORS,
    ADAM_STATE_BYTES,
    ADAM_TEMP_BYTES,
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    ENGINE_OUTSIDE_REGIONS_BYTES,
    FSDP_UNSHARDED_LAYERS,
    GRAD_BYTES,
    LOGIT_BYTES_PER_ENTRY,
    MASTER_BYTES,
    NCCL_BUFFER_BYTES,
    ROLLOUT_BYTES_PER_REQUEST_VOCAB,
    SGLANG_BOOTSTRAP_USED_BYTES,
    SGLANG_CUDA_GRAPH_BYTES,
    SGLANG_PROCESS_CONTEXT_BYTES,
    SGLANG_RESIDENT_BYTES,
    SGLANG_SINGLE_WAKE_BYTES,
    SGLANG_TP_RESIDENT_BYTES,
    STEP_CACHE_BYTES_PER_LOGIT_ENTRY,
    TORCH_KV_BLOCK_TOKENS,
    TRAIN_RESIDUAL_BYTES,
    reserved_bytes,
)
from rljob.plan.knobs import resolved_rollout
from rljob.plan.model_shape import ModelShape
from rljob.plan.weight_sync import gather_bytes

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
    # KV tokens the rollout needs at once: one full-length request (prompt + response budget;
    # below it sglang cuts responses short, the torch engine refuses them), or in mode
    # multiTurn kv_conversations full-length trajectories. More single-turn requests than fit
    # are queued by the engine, so the plan does not ask for them.
    kv_tokens_needed: int = 0
    kv_conversations: int = 0  # mode multiTurn: conversations held at once (0: single-turn)

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


def rollout_kv_tokens(spec: RLJobSpec, world: int) -> int:
    """KV tokens the rollout needs at once: one full-length request (prompt + response
    budget), whose tokens sglang caps at its pool (it shortens max_new_tokens to what the pool
    holds: a response cut short without an error) and the torch engine refuses; in mode
    multiTurn, concurrent_conversations full-length trajectories, below which sglang would
    queue or retract conversations mid-turn."""
    one = spec.data.max_prompt_length + response_budget(spec)
    return max(concurrent_conversations(spec, world), 1) * one


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
        kv_tokens_needed=rollout_kv_tokens(spec, world),
        kv_conversations=concurrent_conversations(spec, world),
    )
