"""The direct weight hand-off (rljob_worker.engines.sglang_direct): the trainer's full tensors
copied into each TP rank's share of sglang's fused parameters, in the schedulers.

What each TP rank must end up holding comes from tests/support/sglang_standin.sglang_shards,
written from sglang's layers independently of the loader (and of the adapter's join). The
"engine" here is a torch module with sglang's parameter names and shard shapes (a stand-in:
sglang's model classes need CUDA); the loader sees only its named_parameters(), its config and
its load_weights, as in a scheduler. The adapter's side runs against SGLangEngineStandIn.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_standin import (
    HANDOFF_DIRECT_STAND_IN,
    SGLangEngineStandIn,
    assert_holds,
    engine_model,
    expected_shards,
    full_weights,
)
from test_weight_sync import _adapter

from rljob_worker import weight_sync
from rljob_worker.engines import sglang_direct
from rljob_worker.engines.sglang_direct import DIRECT_LOADER, copy_into, load, payload_name
from rljob_worker.engines.sglang_engine import (
    CONTRACTS,
    SUPPORTED_SGLANG_VERSIONS,
    WEIGHT_SYNC_ENV,
    SGLangEngine,
    SGLangVersionError,
    flattened_bucket_metadata,
    weight_sync_choice,
)
from rljob_worker.engines.sglang_handoff import direct_chosen
from rljob_worker.engines.sglang_weights import EngineWeightsError
from rljob_worker.weight_sync import LARGE_COPY_BYTES, GatheredBucket, flatten

# A small dense decoder: 4 query heads of 4, 2 KV heads (fewer than 4 TP ranks: shared), a
# vocabulary that is not a multiple of 64 (sglang pads it), two layers.
CONFIG: dict[str, Any] = {
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "vocab_size": 100,
    "num_hidden_layers": 2,
}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_tp_rank_holds_its_share_of_every_fused_and_sharded_parameter(
    tp: int, tied: bool
) -> None:
    config = {**CONFIG, "tie_word_embeddings": tied}
    full = full_weights(config)
    for rank in range(tp):
        model = engine_model(full, config, rank, tp)
        rest = copy_into(model, full.items(), tp=(rank, tp))
        assert rest == []  # every tensor placed by the rules: none through load_weights
        assert_holds(model, expected_shards(full, config, rank, tp))


def test_a_second_sync_overwrites_the_first_and_touches_only_this_ranks_rows() -> None:
    config = {**CONFIG, "tie_word_embeddings": False}
    first, second = full_weights(config, seed=1), full_weights(config, seed=2)
    model = engine_model(first, config, 1, 2)
    copy_into(model, first.items(), tp=(1, 2))
    copy_into(model, second.items(), tp=(1, 2))
    assert_holds(model, expected_shards(second, config, 1, 2))


def test_the_loader_takes_the_adapters_flat_buckets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """load() as the schedulers call it: (payload name, uint8 buffer) pairs, one per bucket;
    with RLJOB_SGLANG_DIRECT_TIMINGS set, each call appends what it took (the bench's split of
    a hand-off into the loader's part and the request's)."""
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    monkeypatch.setattr(sglang_direct, "_tp_rank_and_size", lambda: (1, 2))
    timings = tmp_path / "loader.jsonl"
    monkeypatch.setenv(sglang_direct.TIMINGS_ENV, str(timings))
    model = engine_model(full, config, 1, 2)
    names = list(full)
    buckets = [names[: len(names) // 2], names[len(names) // 2 :]]
    payloads = []
    for bucket in buckets:
        flat = flatten([(n, full[n]) for n in bucket])
        payloads.append((payload_name(flat), flat.buffer))
    load(model, payloads[:1])
    load(model, payloads[1:])
    assert_holds(model, expected_shards(full, config, 1, 2))
    assert model.given == []
    lines = [json.loads(line) for line in timings.read_text().splitlines()]
    assert [line["buckets"] for line in lines] == [1, 1]
    assert [line["bytes"] for line in lines] == [int(b.numel()) for _, b in payloads]
    assert sum(line["bytes"] for line in lines) == sum(t.numel() * 2 for t in full.values())
    assert all(0 <= line["launch_seconds"] <= line["seconds"] for line in lines)
    assert all(line["fallback_tensors"] == 0 for line in lines)
    assert [line["call"] for line in lines] == ["loader", "loader"]
    assert lines[0]["start"] <= lines[0]["end"] <= lines[1]["start"] <= lines[1]["end"]


def _payloads(full: dict[str, torch.Tensor], buckets: int) -> list[tuple[str, torch.Tensor]]:
    """The adapter's (payload name, buffer) pairs for `full` in `buckets` buckets."""
    names = list(full)
    step = -(-len(names) // buckets)
    pairs = []
    for begin in range(0, len(names), step):
        flat = flatten([(n, full[n]) for n in names[begin : begin + step]])
        pairs.append((payload_name(flat), flat.buffer))
    return pairs


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("large_bytes", [64, LARGE_COPY_BYTES], ids=["split", "default"])
def test_each_bucket_layout_is_planned_once_and_every_later_sync_lands_where_the_first_did(
    tp: int, tied: bool, large_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy_bucket works a layout out at its first sync (one plan per bucket) and then only
    splits the buffer: the second and third syncs, with other values, leave each rank holding
    exactly their shards, through the rules alone. `split`: copies of 64 bytes or more are
    launched one by one and the rest as one foreach (weight_sync.copy_pairs), as the large
    ones of a real model are."""
    monkeypatch.delenv(weight_sync.LARGE_COPY_ENV, raising=False)
    monkeypatch.setattr(weight_sync, "LARGE_COPY_BYTES", large_bytes)
    config = {**CONFIG, "tie_word_embeddings": tied}
    syncs = [full_weights(config, seed=s) for s in (1, 2, 3)]
    for rank in range(tp):
        model = engine_model(syncs[0], config, rank, tp)
        for full in syncs:
            for name, buffer in _payloads(full, buckets=3):
                assert sglang_direct.copy_bucket(model, name, buffer, tp=(rank, tp)) == []
            assert_holds(model, expected_shards(full, config, rank, tp))
        assert len(sglang_direct._TARGETS[model].buckets) == 3
        assert model.given == []
        parts = [
            [len(part) for part in plan.copies]
            for plan in sglang_direct._TARGETS[model].buckets.values()
        ]
        large, small = (sum(counts) for counts in zip(*parts, strict=True))
        assert small > 0 and (large > 0) == (large_bytes == 64)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_plan_takes_every_contiguous_copy_flat_and_only_column_slices_per_tensor(
    tp: int,
) -> None:
    """At TP 1 every copy of a dense decoder is one byte range on both sides: the plan sends
    none down the per-tensor path. At TP 2 the column slices of o_proj and down_proj go there,
    and nothing else does."""
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    model = engine_model(full, config, 0, tp)
    ((name, buffer),) = _payloads(full, buckets=1)
    sglang_direct.copy_bucket(model, name, buffer, tp=(0, tp))
    (plan,) = sglang_direct._TARGETS[model].buckets.values()
    slow = sorted(entry[0] for entry in plan.slow)
    columns = sorted(n for n in full if n.endswith(("o_proj.weight", "down_proj.weight")))
    assert slow == ([] if tp == 1 else columns)
    assert len(plan.dests) == len(full) - len(slow)
    assert_holds(model, expected_shards(full, config, 0, tp))


def test_a_buffer_shorter_than_its_layout_is_refused_before_any_copy() -> None:
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    model = engine_model(full, config, 0, 1)
    ((name, buffer),) = _payloads(full, buckets=1)
    with pytest.raises(EngineWeightsError, match="its layout needs"):
        sglang_direct.copy_bucket(model, name, buffer[:-2], tp=(0, 1))
    assert all(not p.data.any() for p in model.parameters())  # still the zeros it started with


def test_tensors_that_share_bytes_in_the_buffer_are_each_copied_whole() -> None:
    """Views of one storage that overlap travel as one buffer whose entries share bytes; such
    sources cannot be pieces of one split, so they take the per-tensor path, and each
    parameter still gets its whole tensor."""
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    model = engine_model(full, config, 0, 1)
    base = torch.arange(24, dtype=torch.float32).bfloat16()
    pair = [
        ("model.layers.0.input_layernorm.weight", base[0:16]),
        ("model.layers.1.input_layernorm.weight", base[8:24]),
        ("model.norm.weight", base[4:20]),
    ]
    flat = flatten(pair)
    assert not flat.packed  # one storage: the entries are where the views lie, overlapping
    for _ in range(2):
        assert sglang_direct.copy_bucket(model, payload_name(flat), flat.buffer, tp=(0, 1)) == []
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n].data, t) for n, t in pair)


def test_a_parameter_given_new_storage_is_planned_again() -> None:
    """A plan keeps views of the parameters: one whose storage was replaced since (a
    loader that reassigns .data) must get the next sync, not its old storage."""
    config = {**CONFIG, "tie_word_embeddings": False}
    first, second = full_weights(config, seed=1), full_weights(config, seed=2)
    model = engine_model(first, config, 0, 1)
    ((name, buffer),) = _payloads(first, buckets=1)
    sglang_direct.copy_bucket(model, name, buffer, tp=(0, 1))
    norm = dict(model.named_parameters())["model.norm.weight"]
    old = norm.data
    norm.data = torch.zeros_like(old)
    ((name, buffer),) = _payloads(second, buckets=1)
    sglang_direct.copy_bucket(model, name, buffer, tp=(0, 1))
    assert torch.equal(norm.data, second["model.norm.weight"])
    assert torch.equal(old, first["model.norm.weight"])  # the old storage was left alone


def test_a_bucket_of_several_dtypes_and_a_cast_is_copied_exactly() -> None:
    """A bucket whose tensors are not all of one dtype is split by bytes, and a copy that
    casts (an fp32 parameter held, bf16 sent) is a flat copy too; both land exactly."""
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    full["model.norm.weight"] = full["model.norm.weight"].float()  # an fp32 tensor in bf16's bucket
    model = engine_model(full, config, 0, 1)
    params = dict(model.named_parameters())
    norm = params["model.norm.weight"]
    norm.data = torch.zeros(norm.shape, dtype=torch.float32)
    head = params["lm_head.weight"]
    head.data = torch.zeros(head.shape, dtype=torch.float32)  # bf16 sent, fp32 held: a cast
    for _ in range(2):
        for name, buffer in _payloads(full, buckets=2):
            assert sglang_direct.copy_bucket(model, name, buffer, tp=(0, 1)) == []
    slow = [e[0] for p in sglang_direct._TARGETS[model].buckets.values() for e in p.slow]
    assert "lm_head.weight" not in slow and "model.norm.weight" not in slow
    assert torch.equal(norm.data, full["model.norm.weight"])
    expected = expected_shards(full, config, 0, 1)  # the head's rows padded as sglang pads
    assert torch.equal(head.data, expected.pop("lm_head.weight").float())
    expected.pop("model.norm.weight")
    assert all(torch.equal(params[n].data, t) for n, t in expected.items())


@pytest.mark.parametrize("tp", [1, 2])
def test_a_bucket_of_the_trainers_fp32_shards_is_cast_into_bf16_weights_by_the_flat_copies(
    tp: int,
) -> None:
    """The trainer's own fp32 shards (Trainer.weight_buckets with engine_casts) go to bf16
    weights through the plan's flat copies, which cast: every weight equals the bf16 sync's,
    bit for bit, and no entry takes the per-tensor path but the column slices at TP 2."""
    config = {**CONFIG, "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(5)
    master = {n: torch.randn(t.shape, generator=g) for n, t in full_weights(config).items()}
    model = engine_model(master, config, 0, tp)
    for _ in range(2):
        ((name, buffer),) = _payloads(master, buckets=1)
        assert sglang_direct.copy_bucket(model, name, buffer, tp=(0, tp)) == []
    (plan,) = sglang_direct._TARGETS[model].buckets.values()
    assert plan.dtype == torch.float32 and plan.dests
    assert {d.dtype for d in plan.dests} == {torch.bfloat16}
    columns = sorted(n for n in master if n.endswith(("o_proj.weight", "down_proj.weight")))
    assert sorted(entry[0] for entry in plan.slow) == ([] if tp == 1 else columns)
    cast = {n: t.bfloat16() for n, t in master.items()}
    assert_holds(model, expected_shards(cast, config, 0, tp))


def test_what_the_rules_do_not_place_goes_to_sglangs_own_loader() -> None:
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    model = engine_model(full, config, 0, 1)
    extra = [("model.layers.0.self_attn.rotary.scale", torch.ones(3).bfloat16())]
    rest = copy_into(model, [*full.items(), *extra], tp=(0, 1))
    assert [n for n, _ in rest] == ["model.layers.0.self_attn.rotary.scale"]
    # A model without a config: nothing is placed by the rules, all goes to load_weights.
    bare = engine_model(full, config, 0, 1)
    del bare.config
    assert [n for n, _ in copy_into(bare, full.items(), tp=(0, 1))] == list(full)


def test_resized_vocabularies_own_loaders_and_tied_heads_are_not_copied_verbatim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An embedding of another vocabulary size, and a parameter whose own weight_loader does
    more than copy (a Gemma norm), go to sglang's loader; a tied head sent by name needs no copy
    (the embedding is the head); with RLJOB_SGLANG_DIRECT_STRICT set, what is not placed is an
    error instead."""
    config = {**CONFIG, "tie_word_embeddings": True}
    full = full_weights(config)
    model = engine_model(full, config, 0, 1)
    norm = dict(model.named_parameters())["model.norm.weight"]

    def gemma_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None: ...

    norm.weight_loader = gemma_weight_loader  # type: ignore[attr-defined]
    resized = ("model.embed_tokens.weight", torch.ones(CONFIG["vocab_size"] + 8, 16).bfloat16())
    head = ("lm_head.weight", full["model.embed_tokens.weight"])
    rest = copy_into(model, [resized, head, ("model.norm.weight", full["model.norm.weight"])],
                     tp=(0, 1))  # fmt: skip
    assert [n for n, _ in rest] == ["model.embed_tokens.weight", "model.norm.weight"]
    monkeypatch.setenv(sglang_direct.STRICT_ENV, "1")
    strict = engine_model(full, config, 0, 1)
    with pytest.raises(EngineWeightsError, match="does not place it"):
        copy_into(strict, [resized], tp=(0, 1))


def test_a_tensor_that_does_not_fit_its_parameter_is_refused_by_name() -> None:
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    model = engine_model(full, config, 0, 1)
    wrong = [("model.norm.weight", torch.ones(CONFIG["hidden_size"] + 1).bfloat16())]
    with pytest.raises(EngineWeightsError, match=r"model.norm.weight \(17,\).*does not fit"):
        copy_into(model, wrong, tp=(0, 1))


def test_the_loader_refuses_a_payload_it_did_not_make() -> None:
    with pytest.raises(EngineWeightsError, match="not a bucket the rljob adapter sent"):
        sglang_direct.unpack("model.norm.weight", torch.zeros(4, dtype=torch.uint8))


@pytest.mark.parametrize("release", SUPPORTED_SGLANG_VERSIONS)
def test_on_the_direct_path_each_bucket_is_one_buffer_for_rljobs_declared_loader(
    release: str,
) -> None:
    engine, sgl = _adapter(HANDOFF_DIRECT_STAND_IN, release)
    assert engine.direct_buckets
    # sglang runs a custom loader only if it was declared when the engine started.
    assert sgl.calls[0][1]["custom_weight_loader"] == [DIRECT_LOADER]
    full = full_weights({**CONFIG, "tie_word_embeddings": False})
    names = list(full)
    buckets = [[(n, full[n]) for n in names[:5]], [(n, full[n]) for n in names[5:]]]
    for bucket in buckets:
        engine.update_weights(bucket)
    engine.flush_cache()
    updates = [kw for name, kw in sgl.calls if name == "update_weights_from_tensor"]
    assert [kw["load_format"] for kw in updates] == [DIRECT_LOADER] * 2
    assert all(len(kw["named_tensors"]) == 1 for kw in updates)  # one buffer a bucket
    assert sgl.direct_loads == 2
    for name, tensor in full.items():
        (loaded,) = sgl.loaded[name]
        assert torch.equal(loaded, tensor) and loaded.dtype == tensor.dtype


def test_a_gathered_bucket_goes_as_its_worked_out_buffer_without_a_view_per_tensor() -> None:
    """sync_send.gather_full's planned buckets carry their layout (GatheredBucket): the direct
    hand-off sends that buffer and name as they are and never makes the per-tensor views."""
    engine, sgl = _adapter(HANDOFF_DIRECT_STAND_IN, SUPPORTED_SGLANG_VERSIONS[-1])
    full = full_weights({**CONFIG, "tie_word_embeddings": False})
    flat = flatten(list(full.items()))

    def no_views() -> list[torch.Tensor]:
        raise AssertionError("the hand-off made the bucket's per-tensor views")

    engine.update_weights(GatheredBucket(list(full), no_views, flat))
    engine.flush_cache()
    (update,) = [kw for name, kw in sgl.calls if name == "update_weights_from_tensor"]
    ((name, buffer),) = update["named_tensors"]
    assert name == payload_name(flat) and buffer is flat.buffer
    for tensor_name, tensor in full.items():
        (loaded,) = sgl.loaded[tensor_name]
        assert torch.equal(loaded, tensor)


def test_the_adapter_writes_each_request_it_sends_to_the_timings_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """bench/sync_trip.py's other half: each update request and the flush, sent to answered."""
    timings = tmp_path / "sync.jsonl"
    engine, _ = _adapter(HANDOFF_DIRECT_STAND_IN, SUPPORTED_SGLANG_VERSIONS[-1])
    full = full_weights({**CONFIG, "tie_word_embeddings": False})
    names = list(full)
    engine.update_weights([(n, full[n]) for n in names[:5]])  # before the variable: no line
    monkeypatch.setenv(sglang_direct.TIMINGS_ENV, str(timings))
    engine.update_weights([(n, full[n]) for n in names[5:]])
    engine.flush_cache()
    lines = [json.loads(line) for line in timings.read_text().splitlines()]
    assert [line["call"] for line in lines] == ["update", "flush"]
    assert lines[0]["start"] <= lines[0]["end"] <= lines[1]["start"] <= lines[1]["end"]
    assert {line["pid"] for line in lines} == {os.getpid()}


def test_the_direct_path_is_chosen_by_the_environment_and_takes_no_flattened_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    contract = CONTRACTS[SUPPORTED_SGLANG_VERSIONS[-1]]
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "direct")
    assert weight_sync_choice() == "direct"
    assert flattened_bucket_metadata(contract) is None
    monkeypatch.setenv(WEIGHT_SYNC_ENV, " Direct ")
    assert weight_sync_choice() == "direct"


def test_a_release_without_custom_loaders_refuses_the_direct_path_at_start() -> None:
    contract = CONTRACTS[SUPPORTED_SGLANG_VERSIONS[-1]]
    sglang_direct_less = dataclasses.replace(contract, direct_loader=None)
    with pytest.raises(SGLangVersionError, match="runs no custom weight loader"):
        SGLangEngine(
            model_path="/models/qwen",
            dtype="bfloat16",
            mem_fraction_static=0.9,
            engine_class=lambda **kw: SGLangEngineStandIn(contract=sglang_direct_less, **kw),
            contract=sglang_direct_less,
            handoff=HANDOFF_DIRECT_STAND_IN,
        )


def test_the_direct_path_is_the_default_and_falls_back_where_sglang_has_no_custom_loader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, RLJOB_SGLANG_WEIGHT_SYNC means the direct path where the release runs custom
    loaders and one tensor per parameter where it does not; asked for by name on such a release
    it is an error, not a silent fallback."""
    contract = CONTRACTS[SUPPORTED_SGLANG_VERSIONS[-1]]
    direct_less = dataclasses.replace(contract, direct_loader=None)
    monkeypatch.delenv(WEIGHT_SYNC_ENV, raising=False)
    assert weight_sync_choice() == "direct"
    assert direct_chosen(contract) is True
    assert direct_chosen(direct_less) is False
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "direct")
    with pytest.raises(SGLangVersionError, match="runs no custom weight loader"):
        direct_chosen(direct_less)
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "tensors")
    assert direct_chosen(contract) is False
