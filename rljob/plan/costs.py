"""The memory plan's fixed costs: the bytes fitted to the stored bench points, the dtypes'
sizes, and torch's caching allocator's rounding (reserved_bytes).
"""

from __future__ import annotations

from collections.abc import Iterable

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
