"""The memory plan's arithmetic (rljob/plan/) and the OOM policy / plan admission
(rljob/oom_policy.py), against hand-computed cases and the stored H100 measurements."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rljob.api import AttemptKnobs, CheckpointSpec, EngineName, EnvVar, RLJobSpec, WakeUp
from rljob.oom_policy import (
    Outcome,
    admit,
    capacity_note,
    changed_text,
    next_attempt,
    plan_for_knobs,
    rayjob_name,
)
from rljob.plan import (
    BUILTIN_MODEL_SHAPES,
    FLAT_SHARDS_ENV,
    SGLANG_WEIGHT_SYNC_DEFAULT,
    SGLANG_WEIGHT_SYNC_ENV,
    TP_SHARDED_SYNC_ENV,
    ModelShape,
    Parts,
    gather_bytes,
    kv_pool,
    largest_fitting_fraction,
    mode_plan,
    parts,
    plan,
    rank_plan,
    reserved_bytes,
    stage_peaks,
    sync_as_stored,
    tp_own_as_stored,
    tp_sharded_sync,
    with_process_switches,
)
from rljob.plan_cli import main as plan_main
from rljob.plan_cli import parse_bytes
from rljob.report import Stage

pytestmark = pytest.mark.unit

H100 = 85017493504  # NVIDIA H100 80GB HBM3, mem_get_info total (bench/results/colocate.json)
QWEN25_3B = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "model_type": "qwen2",
}
SHAPE_3B = ModelShape.from_config(QWEN25_3B)
# Every stored bench run kept its reference in fp32 (before the sharded loader, issue 30): the
# tests that hold the plan against those measurements plan the reference as the runs had it.
STORED_RUNS_REFERENCE = "float32"


def bench_spec(mode: str = "staged", fraction: float = 0.97, **extra: Any) -> RLJobSpec:
    """bench/colocate.make_spec's job (4 prompts x 8 x 128 tokens, micro-batch 4)."""
    return RLJobSpec.model_validate(
        {
            "model": {"path": "/models/qwen2.5-3b"},
            "algorithm": {"groupSize": 8, "klCoef": 0.001, "iterations": 3},
            "data": {"trainBatchSize": 4, "maxResponseLength": 128},
            "rollout": {"engine": "torch", "wakeUp": mode, "memFractionStatic": fraction},
            # The stored runs predate the overlapped staging order (issue 33): each copy in its stage.
            "training": {"microBatchSize": 4, "overlapStaging": "Off"},
            **extra,
        }
    )


def test_parameter_count_and_kv_bytes_match_the_bench_model() -> None:
    # The bench counted 3085938688 params with transformers on the meta device; K and V of
    # 36 layers x 2 KV heads x 128 dims x 2 bytes = 36864 bytes per token.
    assert SHAPE_3B.parameters == 3085938688
    assert SHAPE_3B.kv_bytes_per_token(2) == 36864
    assert SHAPE_3B.kv_bytes_per_token(2, tp=2) == 36864 // 2
    assert SHAPE_3B.kv_bytes_per_token(2, tp=4) == 36864 // 2  # 2 KV heads: replicated past 2


@pytest.mark.parametrize(
    ("fraction", "tokens", "pool_bytes"),
    [
        # torch engine: int(f * total) - weights, whole 16-token blocks, plus one null block;
        # the tokens are the capacity the H100 runs reported (bench/results/colocate.json).
        (0.95, 2023504, (2023504 + 16) * 36864),
        (0.97, 2069632, (2069632 + 16) * 36864),
        (0.65, 1331632, (1331632 + 16) * 36864),
    ],
)
def test_torch_kv_pool_is_what_the_engine_sized(
    fraction: float, tokens: int, pool_bytes: int
) -> None:
    spec = bench_spec(fraction=fraction)
    assert kv_pool(spec, SHAPE_3B, H100, 2 * SHAPE_3B.parameters) == (pool_bytes, tokens)


def test_weight_sync_transient_is_two_consecutive_buckets() -> None:
    # The tied embedding (151936 x 2048 bf16 = 622329856 bytes) travels alone, then a bucket
    # of up to 512 MiB of layer tensors while the embedding's is still held. (The shards kept
    # apart: on one rank the sync otherwise hands the trainer's own buffer, below.)
    spec = bench_spec(env=[{"name": FLAT_SHARDS_ENV, "value": "0"}])
    embed = 151936 * 2048 * 2
    gate = 2048 * 11008 * 2  # the largest layer tensor
    one_rank = gather_bytes(spec, SHAPE_3B, world=1)
    second = one_rank - embed  # a bucket of whole tensors: within one tensor of 512 MiB
    assert (512 << 20) - gate < second <= 512 << 20
    # Two ranks: the bucket's send chunk, the received [world, chunk] and the output buffer.
    assert gather_bytes(spec, SHAPE_3B, world=2) == embed + (second // 2 + 2 * second)


@pytest.mark.parametrize(
    ("engine", "env", "world", "as_stored"),
    [
        ("torch", {}, 1, True),
        ("sglang", {}, 1, True),
        ("sglang", {SGLANG_WEIGHT_SYNC_ENV: "direct"}, 1, True),
        ("sglang", {SGLANG_WEIGHT_SYNC_ENV: "tensors"}, 1, False),
        ("sglang", {SGLANG_WEIGHT_SYNC_ENV: "flattened_bucket"}, 1, False),
        ("torch", {FLAT_SHARDS_ENV: "0"}, 1, False),
        ("sglang", {FLAT_SHARDS_ENV: "1"}, 1, True),
        ("torch", {}, 2, False),
        ("sglang", {}, 2, False),
    ],
)
def test_a_one_rank_sync_that_hands_the_trainers_buffer_holds_no_buckets(
    engine: str, env: dict[str, str], world: int, as_stored: bool
) -> None:
    """One rank, the shards in one buffer and an engine that casts (the torch engine, sglang's
    default direct hand-off): the sync holds nothing beside the weights; otherwise buckets."""
    spec = bench_spec(
        env=[{"name": k, "value": v} for k, v in env.items()],
        rollout={"engine": engine, "wakeUp": "single", "memFractionStatic": 0.9},
    )
    assert sync_as_stored(spec, world) is as_stored
    assert (gather_bytes(spec, SHAPE_3B, world) == 0) is as_stored
    if as_stored:  # and the plan's wake_weights row is the buckets' bytes lower
        kept = bench_spec(
            env=[{"name": FLAT_SHARDS_ENV, "value": "0"}],
            rollout={"engine": engine, "wakeUp": "single", "memFractionStatic": 0.9},
        )
        assert gather_bytes(kept, SHAPE_3B, world) > 0


SECRET_REF = {"secretKeyRef": {"name": "knobs", "key": "value"}}


@pytest.mark.parametrize(
    ("env", "env_from"),
    [
        ([{"name": FLAT_SHARDS_ENV, "valueFrom": SECRET_REF}], []),
        ([{"name": SGLANG_WEIGHT_SYNC_ENV, "valueFrom": SECRET_REF}], []),
        ([], [{"secretRef": {"name": "knobs"}}]),
        ([{"name": FLAT_SHARDS_ENV, "value": "1"}], [{"configMapRef": {"name": "knobs"}}]),
    ],
    ids=["flat-from-secret", "handoff-from-secret", "env-from", "one-literal-one-env-from"],
)
def test_a_switch_the_spec_does_not_show_counts_the_buckets_until_the_rank_reads_it(
    env: list[dict[str, Any]], env_from: list[dict[str, Any]]
) -> None:
    """A sync switch from a Secret or ConfigMap may turn the as-stored sync off: the spec's
    plan counts the buckets; a rank's plan reads the switches from its own environment."""
    rollout = {"engine": "sglang", "wakeUp": "single", "memFractionStatic": 0.9}
    spec = bench_spec(env=env, envFrom=env_from, rollout=rollout)
    assert not sync_as_stored(spec, 1)
    assert gather_bytes(spec, SHAPE_3B, 1) > 0
    # The rank's environment has them resolved: unset (the defaults), or set to the other path.
    assert sync_as_stored(with_process_switches(spec, {}), 1)
    assert not sync_as_stored(with_process_switches(spec, {FLAT_SHARDS_ENV: "0"}), 1)
    assert not sync_as_stored(with_process_switches(spec, {SGLANG_WEIGHT_SYNC_ENV: "tensors"}), 1)
    # ... and so does the plan a rank makes (the worker passes os.environ).
    spec = spec.model_copy(
        update={"memory_plan": spec.memory_plan.model_copy(update={"gpu_memory": "80Gi"})}
    )
    spec = spec.model_copy(
        update={"model": spec.model.model_copy(update={"path": "builtin:tiny-qwen2"})}
    )
    bare = rank_plan(spec, None, 1)
    resolved = rank_plan(spec, None, 1, environ={})
    assert bare is not None and resolved is not None
    assert bare.chosen.parts.gather > 0
    assert resolved.chosen.parts.gather == 0


def test_a_switch_named_without_a_value_is_unset() -> None:
    """`- name: RLJOB_FLAT_SHARDS` with no value: Kubernetes sets it to "", the default."""
    rollout = {"engine": "sglang", "wakeUp": "single", "memFractionStatic": 0.9}
    spec = bench_spec(env=[{"name": FLAT_SHARDS_ENV}], rollout=rollout)
    assert sync_as_stored(spec, 1)


def _tp_spec(world: int, **env: str) -> RLJobSpec:
    """bench_spec's job on sglang with one engine over `world` cards (tensorParallelSize), the
    whole 3B model in one bucket, and these env values."""
    return bench_spec(
        env=[{"name": k, "value": v} for k, v in env.items()],
        rollout={"engine": "sglang", "wakeUp": "staged", "memFractionStatic": 0.9,
                 "tensorParallelSize": world, "weightSyncBucketMegabytes": 8192},
        resources={"workers": 1, "gpusPerWorker": world},
    )  # fmt: skip


def test_a_sync_shard_to_shard_holds_what_crosses_between_the_two_and_its_own_half_in_a_buffer() -> (
    None
):
    """One engine over both ranks (TP 2 = FSDP 2), the whole 3B model in one bucket: each rank
    holds, received and sent, its half of the norms and a quarter of o_proj and down_proj; with
    RLJOB_TP_SHARDED_SYNC=buffer also its own half of every tensor (a quarter of o_proj and
    down_proj: its rows, its columns), which by default the engine reads where the trainer
    stores it; the full gather holds half a bucket sent, the whole received and the output."""
    h, i, layers = 2048, 11008, 36
    embed = 151936 * h  # 151936 = 64 x 2374: split as FSDP's rows (tied: one tensor)
    qkv = h * h + h + 2 * (256 * h + 256)  # 2 KV heads of 128: one per rank
    cols = h * h + h * i  # o_proj, down_proj
    rows = qkv + 2 * h * i  # q/k/v and their biases, gate, up
    norms = 2 * h
    own = (embed // 2 + layers * (rows // 2 + cols // 4 + norms // 2) + h // 2) * 2
    # Each block at a multiple of 16 bytes: only the k and v biases' 128 elements (256 bytes)
    # and everything else already are; none padded.
    crossing = (layers * (cols // 4 + norms // 2) + h // 2) * 2
    sharded = _tp_spec(2)
    assert tp_sharded_sync(sharded, 2) and tp_own_as_stored(sharded, 2)
    assert gather_bytes(sharded, SHAPE_3B, 2) == 2 * crossing
    buffered = _tp_spec(2, **{TP_SHARDED_SYNC_ENV: "buffer"})
    assert tp_sharded_sync(buffered, 2) and not tp_own_as_stored(buffered, 2)
    assert gather_bytes(buffered, SHAPE_3B, 2) == own + 2 * crossing
    # The own blocks lie in the trainer's one buffer only with RLJOB_FLAT_SHARDS on.
    apart = _tp_spec(2, **{FLAT_SHARDS_ENV: "0"})
    assert tp_sharded_sync(apart, 2) and not tp_own_as_stored(apart, 2)
    assert gather_bytes(apart, SHAPE_3B, 2) == own + 2 * crossing
    whole = SHAPE_3B.parameters * 2
    full = _tp_spec(2, **{TP_SHARDED_SYNC_ENV: "0"})
    assert not tp_sharded_sync(full, 2)
    assert gather_bytes(full, SHAPE_3B, 2) == whole // 2 + 2 * whole
    assert own + 2 * crossing < whole // 2 + 2 * whole


def test_the_plans_shard_to_shard_buffer_is_the_one_the_trainer_lays_out() -> None:
    """rljob.plan.shard_bucket_bytes against rljob_worker.tp_shards.shard_layout (the buffer
    the trainer allocates), bucket by bucket, for the 3B and 7B shapes at 2 and 4 ranks."""
    import torch

    from rljob.plan import plan_buckets, shard_bucket_bytes
    from rljob_worker.tp_shards import shard_kind, shard_layout

    seven = ModelShape(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
                       vocab=152064, tied_embeddings=False)  # fmt: skip
    for shape in (SHAPE_3B, seven):
        shapes = dict(shape.named_shapes())
        sizes = [(n, math.prod(s) * 2) for n, s in shapes.items()]
        for world in (2, 4):
            for names in plan_buckets(sizes, 512 << 20):
                named = [(n, shapes[n]) for n in names]
                kinds = [shard_kind(n, s, shape.heads, shape.kv_heads, world) for n, s in named]
                known = [k for k in kinds if k is not None]
                if len(known) < len(kinds):
                    assert shard_bucket_bytes(named, shape, world, 2) is None
                    continue
                tensors = [(n, s, k) for (n, s), k in zip(named, known, strict=True)]
                laid = shard_layout(tensors, world, torch.bfloat16)
                assert shard_bucket_bytes(named, shape, world, 2) == laid.total_bytes
                # The own blocks read where the trainer stores them: the buffer crosses only.
                offsets = [0] * len(tensors)  # where they lie does not size the buffer
                stored = shard_layout(tensors, world, torch.bfloat16, (offsets, torch.float32))
                assert stored.own_bytes == 0
                assert shard_bucket_bytes(named, shape, world, 2, own=False) == stored.total_bytes


@pytest.mark.parametrize(
    ("world", "tp", "env", "sharded"),
    [
        (2, 2, {}, True),
        (4, 4, {SGLANG_WEIGHT_SYNC_ENV: "direct", TP_SHARDED_SYNC_ENV: "1"}, True),
        (2, 1, {}, False),  # an engine per card: each needs the whole model
        (2, 2, {SGLANG_WEIGHT_SYNC_ENV: "flattened_bucket"}, False),  # not rljob's loader
        (2, 2, {TP_SHARDED_SYNC_ENV: "0"}, False),
        (2, 2, {TP_SHARDED_SYNC_ENV: "buffer"}, True),
        (2, 2, {TP_SHARDED_SYNC_ENV: " Buffer "}, True),
        (1, 1, {}, False),
    ],
)
def test_the_plan_counts_a_shard_to_shard_sync_only_where_the_worker_sends_one(
    world: int, tp: int, env: dict[str, str], sharded: bool
) -> None:
    from rljob_worker.tp_shards import BUFFER, OFF, STORED, sharded_sync_mode

    spec = _tp_spec(tp, **env)
    assert tp_sharded_sync(spec, world) is sharded
    # The own blocks as stored exactly where the worker's mode says so (it reads the same env).
    mode = sharded_sync_mode(env)
    assert tp_own_as_stored(spec, world) is (sharded and mode == STORED)
    assert mode == (OFF if env.get(TP_SHARDED_SYNC_ENV, "").strip() == "0" else
                    BUFFER if env.get(TP_SHARDED_SYNC_ENV, "").strip().lower() == "buffer"
                    else STORED)  # fmt: skip


def test_a_shard_to_shard_switch_from_a_secret_counts_full_buckets_until_the_rank_reads_it() -> (
    None
):
    spec = _tp_spec(2)
    spec = spec.model_copy(
        update={
            "env": [
                *spec.env,
                EnvVar.model_validate({"name": TP_SHARDED_SYNC_ENV, "valueFrom": SECRET_REF}),
            ]
        }
    )
    assert not tp_sharded_sync(spec, 2)
    assert tp_sharded_sync(with_process_switches(spec, {}), 2)
    assert not tp_sharded_sync(with_process_switches(spec, {TP_SHARDED_SYNC_ENV: "0"}), 2)


def test_the_plans_sync_switches_are_the_workers() -> None:
    from rljob_worker.engines import sglang_handoff
    from rljob_worker.sync_send import FLAT_SHARDS_ENV as WORKER_FLAT_SHARDS_ENV

    assert WORKER_FLAT_SHARDS_ENV == FLAT_SHARDS_ENV
    assert sglang_handoff.WEIGHT_SYNC_ENV == SGLANG_WEIGHT_SYNC_ENV
    assert sglang_handoff.DEFAULT_WEIGHT_SYNC == SGLANG_WEIGHT_SYNC_DEFAULT


PARTS = Parts(
    context=10,
    train_params=100,
    optimizer=200,
    grads=100,
    step_temp=100,
    step_cache=29,
    activations=50,
    fsdp_buffers=0,
    engine_weights=30,
    kv_pool=400,
    kv_tokens=0,
    gather=5,
    rollout_workspace=3,
)


@pytest.mark.parametrize(
    ("wake_up", "offload", "expected"),
    [
        # train: 10 + 100 + 200 + 100 + max(100 + 29, 50) = 539 (offload_optimizer starts there);
        # staged wake: 10 + 100 + 30 + 5; kv: 10 + 30 + 400; rollout + 3; sleep: max(443, 310).
        (
            WakeUp.STAGED,
            (True, True),
            {"train": 539, "offload_optimizer": 539, "wake_weights": 145, "offload_train": 145,
             "wake_kv_cache": 440, "rollout": 443, "sleep": 443},
        ),
        # single: the KV pool wakes with the weights, on top of the training params.
        (
            WakeUp.SINGLE,
            (True, True),
            {"train": 539, "offload_optimizer": 539, "wake_weights": 545, "offload_train": 545,
             "rollout": 443, "sleep": 443},
        ),
        # no offload: optimizer (200) and params (100) stay under everything.
        (
            WakeUp.STAGED,
            (False, False),
            {"train": 539, "offload_optimizer": 539, "wake_weights": 345, "offload_train": 345,
             "wake_kv_cache": 740, "rollout": 743, "sleep": 743},
        ),
    ],
)  # fmt: skip
def test_stage_peaks_by_hand(
    wake_up: WakeUp, offload: tuple[bool, bool], expected: dict[str, int]
) -> None:
    peaks = stage_peaks(PARTS, wake_up, *offload)
    assert {str(k): v for k, v in peaks.items()} == expected


SMALL_POOL = replace(PARTS, kv_pool=50)


@pytest.mark.parametrize(
    ("wake_up", "offload", "overlap", "expected"),
    [
        # A small pool, so sleep's own peak shows: serving 10 + 30 + 50, rollout 93.
        # Off: sleep ends with the whole state back, 10 + 100 + 200 = 310.
        (WakeUp.STAGED, (True, True), False,
         {"wake_weights": 145, "offload_train": 145, "rollout": 93, "sleep": 310}),
        # On: the moments leave during the sync (wake 10 + 100 + 200 + 30 + 5 = 345, freed in
        # offload_train) and come back in train (539 either way); sleep loads the params with
        # the engine's weights still mapped: 10 + 100 + 30 = 140.
        (WakeUp.STAGED, (True, True), True,
         {"train": 539, "wake_weights": 345, "offload_train": 345, "rollout": 93,
          "sleep": 140}),
        # Single: the moments' offload stays in its stage (the KV pool wakes with the weights);
        # wake 10 + 100 + 30 + 50 + 5 = 195 either way, only sleep changes.
        (WakeUp.SINGLE, (True, True), True,
         {"wake_weights": 195, "offload_train": 195, "rollout": 93, "sleep": 140}),
        # Moments kept on the device: the params come back beside them and the engine's
        # weights, 10 + 100 + 200 + 30 = 340 against Off's 310; rollout 10 + 200 + 30 + 50 + 3.
        (WakeUp.STAGED, (False, True), True,
         {"wake_weights": 345, "rollout": 293, "sleep": 340}),
        (WakeUp.STAGED, (False, True), False,
         {"wake_weights": 345, "rollout": 293, "sleep": 310}),
    ],
)  # fmt: skip
def test_overlapped_staging_moves_the_moments_from_sleep_to_the_weight_sync(
    wake_up: WakeUp, offload: tuple[bool, bool], overlap: bool, expected: dict[str, int]
) -> None:
    peaks = stage_peaks(SMALL_POOL, wake_up, *offload, overlap=overlap)
    assert {k: peaks[Stage(k)] for k in expected} == expected
    assert peaks[Stage.TRAIN] == 539  # the moments arrive during train, which held them anyway


@pytest.mark.parametrize(("setting", "overlap"), [("Auto", True), ("On", True), ("Off", False)])
def test_the_plan_counts_the_overlapped_order_unless_it_is_off(setting: str, overlap: bool) -> None:
    spec = bench_spec(fraction=0.9, training={"microBatchSize": 4, "overlapStaging": setting})
    m = mode_plan(spec, SHAPE_3B, H100)
    stages = {s.stage: s.peak_bytes for s in m.stages}
    moments = m.parts.optimizer if overlap else 0
    p = m.parts
    assert stages[Stage.WAKE_WEIGHTS] == (
        p.context + p.train_params + moments + p.engine_weights + p.gather
    )


QWEN25_1_5B = {**QWEN25_3B, "hidden_size": 1536, "intermediate_size": 8960,
               "num_hidden_layers": 28, "num_attention_heads": 12}  # fmt: skip
QWEN25_0_5B = {**QWEN25_3B, "hidden_size": 896, "intermediate_size": 4864,
               "num_hidden_layers": 24, "num_attention_heads": 14}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "unused_mib"),
    # The torch engine's bf16 weight region on an H100 (RLJOB_ALLOCATOR_REPORT,
    # bench/results/raw/allocator-report/): free bytes in the segments its tensors hold.
    [(QWEN25_0_5B, 41.8), (QWEN25_1_5B, 188.7), (QWEN25_3B, 145.5)],
)
def test_reserved_bytes_is_what_torchs_allocator_held_for_the_engine_weights(
    config: dict[str, Any], unused_mib: float
) -> None:
    sizes = [n * 2 for _, n in ModelShape.from_config(config).named_sizes()]
    reserved = reserved_bytes(sizes)
    # The segments' free bytes, plus the sub-MiB tails the allocator leaves unsplit.
    assert reserved - sum(sizes) >= unused_mib * (1 << 20) - 1
    assert reserved - sum(sizes) < unused_mib * (1 << 20) + 120 * (1 << 20)


def test_reserved_bytes_by_hand() -> None:
    MiB = 1 << 20
    # Four 4.5 MiB tensors share one 20 MiB segment; the fifth opens a second.
    assert reserved_bytes([9 * MiB // 2] * 5) == 40 * MiB
    # 16 MiB and up: a segment each, rounded to 2 MiB; the 1 MiB tail is not split off.
    assert reserved_bytes([17 * MiB, 16 * MiB]) == 18 * MiB + 16 * MiB
    # Small tensors share 2 MiB segments, 512-byte rounded.
    assert reserved_bytes([1000] * 4) == 2 * MiB
    assert reserved_bytes([]) == 0


def test_train_peaks_at_backward_when_the_activations_outweigh_the_step() -> None:
    # Long sequences: all of one micro-batch's activations (500) live in backward exceed the
    # step's temporary and cached logits (129): train = 10 + 100 + 200 + 100 + 500.
    long_sequences = replace(PARTS, activations=500)
    assert stage_peaks(long_sequences, WakeUp.STAGED, True, True)[Stage.TRAIN] == 910


def test_sglang_pool_matches_sglangs_own_token_counts() -> None:
    # sglang sizes its pool from the free memory before its model load (its
    # _profile_available_bytes): stored runs at two sizes, fractions 0.50 to 0.97.
    raw = Path(__file__).parents[2] / "bench" / "results" / "raw"
    checked = 0
    for name in ("s1-sglang-h100", "s2-sglang-h100-single", "s3-sglang-h100-1.5b",
                 "s8-sglang-h100-1.5b-offload-always"):  # fmt: skip
        result = json.loads((raw / f"{name}.json").read_text())
        shape = ModelShape.from_config(
            {"model_type": "qwen2", "vocab_size": 151936, **result["model"]}
        )
        for point in result["points"]:
            if not point["kv_capacity_tokens"]:
                continue
            spec = bench_spec(point["mode"], point["fraction"])
            spec.rollout.engine = EngineName.SGLANG
            tokens = parts(spec, shape, result["environment"]["device_total_bytes"]).kv_tokens
            assert abs(tokens - point["kv_capacity_tokens"]) / point["kv_capacity_tokens"] < 0.005
            checked += 1
    assert checked == 7


def test_largest_fitting_fraction_on_the_h100_matches_the_measured_sweep() -> None:
    # Measured: staged completes at 0.97 and OOMs at 0.98; single completes at 0.65 and OOMs
    # at 0.70 (0.66-0.69 were not run).
    spec = bench_spec(offload="Always")
    ref = STORED_RUNS_REFERENCE
    assert (
        largest_fitting_fraction(spec, SHAPE_3B, H100, WakeUp.STAGED, reference_dtype=ref) == 0.97
    )
    single = largest_fitting_fraction(spec, SHAPE_3B, H100, WakeUp.SINGLE, reference_dtype=ref)
    assert single is not None and 0.65 <= single < 0.70
    for mode, fraction in (("staged", 0.98), ("single", 0.70)):
        over = bench_spec(mode, fraction, offload="Always")
        assert not mode_plan(over, SHAPE_3B, H100, reference_dtype=ref).fits
    # With the reference in bf16 (the current loader) single's fraction goes up by its bytes.
    bf16 = largest_fitting_fraction(spec, SHAPE_3B, H100, WakeUp.SINGLE)
    assert bf16 is not None and single < bf16 <= single + 0.09


def test_plan_matches_every_completed_h100_point_within_5_percent() -> None:
    result = json.loads(
        (Path(__file__).parents[2] / "bench" / "results" / "colocate.json").read_text()
    )
    compared = 0
    for point in result["points"]:
        spec = bench_spec(point["mode"], point["fraction"], offload="Always")
        m = mode_plan(spec, SHAPE_3B, H100, reference_dtype=STORED_RUNS_REFERENCE)
        assert m.fits == point["completed"], point["fraction"]
        predicted = {str(s.stage): s.peak_bytes for s in m.stages}
        if point["completed"]:
            for stage, measured in point["stage_peak_bytes"].items():
                assert abs(predicted[stage] - measured) / measured < 0.05, (stage, point)
                compared += 1
    assert compared == 39  # every stage of the 6 completed points


def test_auto_offloads_only_what_the_kv_pool_needs() -> None:
    # A 141 GB GPU holds the 3B job's training state under a 0.5 KV pool without offloading;
    # at 0.9 the optimizer state must go, and on the H100 at 0.97 the params too.
    assert (lambda m: (m.offload_optimizer, m.offload_params))(
        mode_plan(bench_spec(fraction=0.5), SHAPE_3B, 150109880320)
    ) == (False, False)
    m = mode_plan(bench_spec(fraction=0.97), SHAPE_3B, H100)
    assert (m.offload_optimizer, m.offload_params) == (True, True) and m.fits
    always = mode_plan(bench_spec(fraction=0.5, offload="Always"), SHAPE_3B, 150109880320)
    assert (always.offload_optimizer, always.offload_params) == (True, True)
    flags_off = bench_spec(fraction=0.97, training={"microBatchSize": 4, "offloadParams": False})
    assert not mode_plan(flags_off, SHAPE_3B, H100).offload_params


def test_plan_reports_both_modes_and_wraps_into_status() -> None:
    p = plan(bench_spec(fraction=0.97), SHAPE_3B, H100)
    assert set(p.modes) == {WakeUp.STAGED, WakeUp.SINGLE}
    status = p.to_status()
    # No spec.checkpoint: no checkpoint stage in the plan.
    assert [s.name for s in status.stages] == [s for s in Stage if s is not Stage.CHECKPOINT]
    assert status.largest_fitting_fraction["staged"] == 0.97
    assert [s["name"] for s in p.to_dict()["modes"]["single"]["stages"]] == [
        "train", "offload_optimizer", "wake_weights", "offload_train", "rollout", "sleep",
    ]  # fmt: skip


def test_checkpoint_stage_is_planned_at_trains_peak_when_the_job_checkpoints() -> None:
    spec = bench_spec(fraction=0.9)
    spec = spec.model_copy(update={"checkpoint": CheckpointSpec(path="/ckpt")})
    stages = {s.stage: s.peak_bytes for s in mode_plan(spec, SHAPE_3B, H100).stages}
    assert list(stages)[:3] == [Stage.TRAIN, Stage.CHECKPOINT, Stage.OFFLOAD_OPTIMIZER]
    assert stages[Stage.CHECKPOINT] == stages[Stage.TRAIN]


def test_builtin_model_shape_is_the_built_model() -> None:
    from rljob_worker.model import TINY_QWEN2_CONFIG, TOKENIZER_VOCAB_SIZE

    shape = BUILTIN_MODEL_SHAPES["builtin:tiny-qwen2"]
    assert (shape.layers, shape.hidden, shape.vocab) == (
        TINY_QWEN2_CONFIG["num_hidden_layers"],
        TINY_QWEN2_CONFIG["hidden_size"],
        TOKENIZER_VOCAB_SIZE,
    )


@pytest.mark.parametrize(("text", "value"), [("85017493504", 85017493504), ("80Gi", 80 << 30)])
def test_gpu_memory_argument(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_cli_prints_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        json.dumps(
            {
                "apiVersion": "rljob.dev/v1alpha1",
                "kind": "RLJob",
                "metadata": {"name": "big"},
                "spec": {
                    **bench_spec().model_dump(by_alias=True, mode="json", exclude={"model"}),
                    "model": {"path": "Qwen/Qwen2.5-3B", "shape": {
                        k: v for k, v in QWEN25_3B.items() if k != "model_type"}},
                },
            }
        )
    )  # fmt: skip
    assert plan_main([str(manifest), "--gpu-memory", str(H100)]) == 0
    out = capsys.readouterr().out
    assert "largest memFractionStatic that fits: 0.97" in out and "wake_kv_cache" in out
    assert plan_main([str(manifest), "--gpu-memory", "40Gi", "--json"]) == 1  # does not fit
    doc = json.loads(capsys.readouterr().out)
    assert doc["modes"]["staged"]["fits"] is False and doc["capacityBytes"] == 40 << 30


# -- the OOM policy -------------------------------------------------------------------------


def policy_spec(**policy: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {"rollout": {"memFractionStatic": 0.9}, "oomPolicy": {"maxRetries": 2, **policy}}
    )


OOM = Outcome("CUDAOutOfMemory", Stage.WAKE_KV_CACHE, 0)


@pytest.mark.parametrize(
    ("knobs", "made", "policy", "expected"),
    [
        # single -> staged first, same fraction
        ((0.9, "single"), 1, {}, (0.9, "staged")),
        # then lowered by the step
        ((0.9, "staged"), 1, {}, (0.85, "staged")),
        ((0.85, "staged"), 2, {}, (0.8, "staged")),
        # switchToStaged off: single stays single, lowered
        ((0.9, "single"), 1, {"switchToStaged": False}, (0.85, "single")),
        # exhausted: maxRetries 2 means attempts 2 and 3; a third OOM ends it
        ((0.8, "staged"), 3, {}, None),
        # never below minFraction
        ((0.52, "staged"), 1, {"minFraction": 0.5}, None),
    ],
)
def test_policy_table(
    knobs: tuple[float, str],
    made: int,
    policy: dict[str, Any],
    expected: tuple[float, str] | None,
) -> None:
    current = AttemptKnobs(mem_fraction_static=knobs[0], wake_up=WakeUp(knobs[1]))
    decision = next_attempt(policy_spec(**policy), current, made, OOM)
    if expected is None:
        assert not decision.retry and decision.reason == "OOMRetriesExhausted"
        assert "wake_kv_cache" in decision.message
    else:
        assert decision.retry and decision.knobs is not None
        assert (decision.knobs.mem_fraction_static, str(decision.knobs.wake_up)) == expected


@pytest.mark.parametrize(
    ("stage", "micro", "checkpointing", "policy", "expected"),
    [
        # the engine is released in train and offload_optimizer: the micro-batch halves ...
        (Stage.TRAIN, 4, False, {}, (2, None)),
        (Stage.OFFLOAD_OPTIMIZER, 3, False, {}, (1, None)),
        (Stage.TRAIN, 8, False, {"minMicroBatchSize": 6}, (6, None)),
        # ... then, at its floor, gradient checkpointing goes on
        (Stage.TRAIN, 1, False, {}, (None, True)),
        (Stage.TRAIN, 2, False, {"minMicroBatchSize": 2}, (None, True)),
        # nothing left: floor reached and checkpointing on already (or not allowed)
        (Stage.TRAIN, 1, True, {}, None),
        (Stage.TRAIN, 1, False, {"gradientCheckpointing": False}, None),
    ],
)
def test_a_training_stage_oom_retries_with_training_knobs_not_the_engines(
    stage: Stage,
    micro: int,
    checkpointing: bool,
    policy: dict[str, Any],
    expected: tuple[int | None, bool | None] | None,
) -> None:
    spec = RLJobSpec.model_validate(
        {
            "rollout": {"memFractionStatic": 0.9, "wakeUp": "single"},
            "training": {"microBatchSize": micro, "gradientCheckpointing": checkpointing},
            "oomPolicy": {"maxRetries": 2, **policy},
        }
    )
    current = AttemptKnobs(mem_fraction_static=0.9, wake_up=WakeUp.SINGLE)
    # A plan that vetoes every engine setting must not matter: no engine knob is tried.
    decision = next_attempt(spec, current, 1, Outcome("CUDAOutOfMemory", stage, 0), lambda k: False)
    if expected is None:
        assert not decision.retry and decision.reason == "OOMRetriesExhausted"
        assert "no knobs left: training.microBatchSize is at" in decision.message
        return
    assert decision.retry and decision.knobs is not None
    assert (decision.knobs.mem_fraction_static, decision.knobs.wake_up) == (0.9, WakeUp.SINGLE)
    assert (decision.knobs.micro_batch_size, decision.knobs.gradient_checkpointing) == expected
    ran = decision.knobs.apply(spec).training
    assert ran.micro_batch_size == (expected[0] or micro)
    assert ran.gradient_checkpointing is (expected[1] or checkpointing)
    changed = changed_text(current, decision.knobs, spec)
    assert changed in decision.message and changed.startswith("training.")


def test_an_engine_stage_oom_never_touches_the_training_knobs() -> None:
    spec = RLJobSpec.model_validate(
        {"training": {"microBatchSize": 4}, "oomPolicy": {"maxRetries": 2}}
    )
    current = AttemptKnobs(mem_fraction_static=0.9, wake_up=WakeUp.STAGED)
    decision = next_attempt(spec, current, 1, OOM)
    assert decision.knobs == AttemptKnobs(mem_fraction_static=0.85, wake_up=WakeUp.STAGED)
    assert decision.message.endswith("rollout.memFractionStatic 0.9 -> 0.85")


def test_the_retry_plans_on_the_card_the_ranks_measured_and_says_when_the_spec_is_off() -> None:
    spec = RLJobSpec.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen2"},
            "rollout": {"engine": "torch", "memFractionStatic": 0.9},
            "resources": {"gpusPerWorker": 1},
            "memoryPlan": {"gpuMemory": "80Gi"},
        }
    )
    h200 = 150_000_000_000  # what ranks on an H200 report, against the spec's 80Gi (an H100)
    assert capacity_note(spec, 80 << 30) == ""
    assert capacity_note(spec, None) == ""
    note = capacity_note(spec, h200)
    assert "150000000000 bytes" in note and "gpuMemory=80Gi is 75% off" in note
    on_spec, on_card = plan_for_knobs(spec), plan_for_knobs(spec, capacity_bytes=h200)
    assert on_spec is not None and on_card is not None
    assert on_card.worst.capacity_bytes == h200 and on_spec.worst.capacity_bytes == 80 << 30


def test_policy_skips_fractions_the_plan_says_do_not_fit() -> None:
    current = AttemptKnobs(mem_fraction_static=0.9, wake_up=WakeUp.STAGED)
    decision = next_attempt(
        policy_spec(), current, 1, OOM, fits=lambda k: k.mem_fraction_static in (0.75, 0.7, 0.65)
    )
    assert decision.knobs == AttemptKnobs(mem_fraction_static=0.75, wake_up=WakeUp.STAGED)


def test_host_oomkilled_is_not_retried_and_names_the_limit() -> None:
    current = AttemptKnobs(mem_fraction_static=0.9, wake_up=WakeUp.STAGED)
    decision = next_attempt(
        policy_spec(), current, 1, Outcome("OOMKilled", pod="job-worker-0", limit_bytes=1 << 30)
    )
    assert not decision.retry and decision.reason == "OOMKilled"
    assert "1073741824 bytes" in decision.message and "job-worker-0" in decision.message


def test_other_failures_are_not_the_policys() -> None:
    current = AttemptKnobs(mem_fraction_static=0.9, wake_up=WakeUp.STAGED)
    assert next_attempt(policy_spec(), current, 1, Outcome("Failed")).reason is None


def test_rayjob_names_per_attempt_stay_within_kuberays_limit() -> None:
    assert rayjob_name("job", 1) == "job"
    assert rayjob_name("job", 2) == "job-a2"
    long = "a" * 47
    assert rayjob_name(long, 3) == "a" * 44 + "-a3" and len(rayjob_name(long, 12)) == 47


@pytest.mark.parametrize(
    ("memory_plan", "status", "start"),
    [
        ({"gpuMemory": "80Gi", "onMisfit": "Reject"}, "True", True),
        ({"gpuMemory": "2Gi", "onMisfit": "Reject"}, "False", False),
        ({"gpuMemory": "2Gi", "onMisfit": "Warn"}, "False", True),
        ({"onMisfit": "Reject"}, "Unknown", True),  # no GPU memory given: no plan
    ],
)
def test_admission_by_plan(memory_plan: dict[str, str], status: str, start: bool) -> None:
    spec = RLJobSpec.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen2"},
            "rollout": {"engine": "torch", "memFractionStatic": 0.5},
            "resources": {"gpusPerWorker": 1},
            "memoryPlan": memory_plan,
        }
    )
    admission = admit(spec)
    assert (admission.status, admission.start) == (status, start)
    if status == "False":
        assert "wake_kv_cache needs" in admission.message and "GiB over" in admission.message


@pytest.mark.parametrize(("on_misfit", "phase"), [("Reject", "Failed"), ("Warn", "Pending")])
def test_operator_status_names_the_misfit_stage(on_misfit: str, phase: str) -> None:
    from rljob_operator import status

    spec = RLJobSpec.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen2"},
            "rollout": {"engine": "torch", "memFractionStatic": 0.5},
            "resources": {"gpusPerWorker": 1},
            "memoryPlan": {"gpuMemory": "2Gi", "onMisfit": on_misfit},
        }
    )
    fields, transitions = status.compute(
        status.Observed(generation=1, spec=spec, applied_spec=None, rayjob=None),
        "2026-01-01T00:00:00Z",
    )
    assert fields["phase"] == phase
    fits = next(c for c in fields["conditions"] if c["type"] == "MemoryPlanFits")
    assert fits["status"] == "False" and "wake_kv_cache needs" in fits["message"]
    warning = next(t for t in transitions if t.type == "MemoryPlanFits")
    assert warning.event_type == "Warning" and "GiB over" in warning.message


def test_describe_shows_predicted_beside_measured() -> None:
    from rich.console import Console

    from rljob.api import RLJobStatus
    from rljob.kubectl_plugin import memory_table

    p = plan(bench_spec(fraction=0.97), SHAPE_3B, H100)
    measured = {"wake_kv_cache": 84645597184}  # c6 staged 0.97 (78.83 GiB)
    status = RLJobStatus.model_validate(
        {
            "memory": {
                "iteration": 3, "kind": "cuda", "device": "NVIDIA H100 80GB HBM3",
                "capacityBytes": H100,
                "stages": [{"name": k, "peakBytes": v, "peakFraction": v / H100, "seconds": 0.1,
                            "rank": 0} for k, v in measured.items()],
            },
            "plan": p.to_status().model_dump(by_alias=True, mode="json"),
        }
    )  # fmt: skip
    table = memory_table("job", status)
    assert table is not None
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "predicted" in text and "plan error" in text
    # Predicted, and its error against measured (the plan takes the current tree's baseline,
    # 194 MiB above c4's, where c6 sat: plan.ENGINE_OUTSIDE_REGIONS_BYTES).
    assert "│ 79.02 GiB │      +0.2% │" in text


def test_a_tp_groups_rollout_workspace_holds_the_whole_groups_batch() -> None:
    """With TP the group's leader sends every rank's requests to the one engine, and each of
    its GPUs holds the logits of that whole batch: the workspace grows with the TP size."""

    def sglang_spec(tp: int) -> RLJobSpec:
        return bench_spec(
            rollout={"engine": "sglang", "wakeUp": "staged", "memFractionStatic": 0.9,
                     "tensorParallelSize": tp},
            resources={"gpusPerWorker": 2},
        )  # fmt: skip

    one, two = (parts(sglang_spec(tp), SHAPE_3B, H100) for tp in (1, 2))
    assert sglang_spec(1).world_size == sglang_spec(2).world_size == 2
    assert two.rollout_workspace == 2 * one.rollout_workspace
