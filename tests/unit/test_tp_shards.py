"""The weight sync shard to shard (rljob_worker.tp_shards) and its loader
(sglang_direct.copy_bucket), in one process: W ranks' FSDP shards cut from full tensors, each
rank's buffer filled by its plan, the exchange done by hand (what all_to_all_single moves),
then each TP rank's engine model (a stand-in: sglang's model classes need CUDA) loaded from its
rank's buffer and compared with what sglang's TP layout gives that rank
(support.sglang_standin.sglang_shards, written from sglang's layers independently of both).
Both ways the own blocks go: in the buffer, and as stored (each rank's shards in one fp32
buffer, as the policy's are, read from there by the loader).
The real exchange between gloo ranks is tests/worker/test_tp_shards_exchange.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.sglang_standin import assert_holds, engine_model, expected_shards, full_weights

from rljob_worker import tp_shards
from rljob_worker.engines.sglang_direct import copy_bucket
from rljob_worker.engines.sglang_weights import DenseLayout, EngineWeightsError
from rljob_worker.tp_shards import ALL, COLS, ROWS, ShardPlan, make_shard_plan, send_kind

# A small dense decoder: 4 query heads of 4, 2 KV heads (shared by ranks at TP 4), two layers.
CONFIG: dict[str, Any] = {
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "vocab_size": 100,  # sglang pads it to 128: not split as FSDP's rows are (sent whole)
    "num_hidden_layers": 2,
}
# 256 = 64 x 4: sglang's padding leaves it as it is, TP ranks split it as FSDP does.
CONFIG_SPLIT_VOCAB = {**CONFIG, "vocab_size": 256}
# Heads of 8 over a hidden of 16 (q_proj 32 rows), as Qwen3's config.head_dim sets them apart.
CONFIG_HEAD_DIM = {**CONFIG_SPLIT_VOCAB, "head_dim": 8}


def _plans(
    full: dict[str, torch.Tensor], config: dict[str, Any], world: int, names: list[str],
    kinds: list[str] | None = None, stored: bool = False,
) -> list[ShardPlan]:  # fmt: skip
    """Each rank's plan of the bucket `names`: its shards are the fp32 master weights' dim-0
    chunks, as FSDP2 holds them (`stored`: views of one buffer of the rank's, back to back,
    as sharded_load.to_empty_flat lays them out, and the own blocks read from there); `kinds`
    as send_kind gives them unless told."""
    layout = DenseLayout.from_config(config, world)
    if kinds is None:
        found = [send_kind(n, full[n].shape, layout) for n in names]
        assert None not in found
        kinds = [k for k in found if k is not None]
    master = {n: full[n].float() for n in names}
    plans = []
    for rank in range(world):
        locals_ = [master[n].chunk(world)[rank] for n in names]
        if stored:
            whole = torch.cat([t.reshape(-1) for t in locals_])
            starts = [0, *torch.tensor([t.numel() for t in locals_]).cumsum(0).tolist()]
            locals_ = [
                whole[a:b].view(t.shape)
                for a, b, t in zip(starts, starts[1:], locals_, strict=False)
            ]
        plans.append(
            make_shard_plan(
                names, [master[n] for n in names], locals_, kinds, torch.bfloat16, rank, world,
                None, [], own_as_stored=stored,
            )
        )  # fmt: skip
    assert all((plan.stored is not None) is stored for plan in plans)
    return plans


def _load(model: Any, plan: ShardPlan, buffer: torch.Tensor, world: int) -> list[Any]:
    """copy_bucket of TP rank plan.rank's bucket: the buffer, and the stored own blocks where
    the plan reads them so."""
    return copy_bucket(model, plan.payload, buffer, (plan.rank, world), plan.stored)


def _exchanged(plans: list[ShardPlan]) -> list[torch.Tensor]:
    """Every rank's buffer after the exchange (the engine's bytes: own and received blocks):
    region i of rank r gets, from its source s, the region s sent to r (all_to_all_single's
    order: ranks without the rank itself)."""
    world = len(plans)
    layout = plans[0].layout
    buffers = [tp_shards.fill(plan, torch.device("cpu")) for plan in plans]
    span = layout.region_bytes // 2
    for rank in range(world):
        received, _ = tp_shards.regions(layout, buffers[rank])
        for index in range(world - 1):
            source = tp_shards.region_source(index, rank)
            _, sent = tp_shards.regions(layout, buffers[source])
            to = rank if rank < source else rank - 1  # rank's place among source's others
            received[index * span : (index + 1) * span].copy_(sent[to * span : (to + 1) * span])
    return [b.view(torch.uint8)[: layout.payload_bytes] for b in buffers]


def _buckets(names: list[str], count: int) -> list[list[str]]:
    step = -(-len(names) // count)
    return [names[i : i + step] for i in range(0, len(names), step)]


@pytest.mark.parametrize("stored", [False, True], ids=["buffer", "stored"])
@pytest.mark.parametrize(
    "config", [CONFIG, CONFIG_SPLIT_VOCAB, CONFIG_HEAD_DIM], ids=["padded", "split", "head_dim"]
)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_each_tp_rank_holds_its_share_from_its_own_shards_and_what_the_others_sent(
    world: int, tied: bool, config: dict[str, Any], stored: bool
) -> None:
    config = {**config, "tie_word_embeddings": tied}
    full = full_weights(config)
    models = [engine_model(full, config, rank, world) for rank in range(world)]
    for names in _buckets(list(full), 3):
        plans = _plans(full, config, world, names, stored=stored)
        # The payload names every rank's buffer by the same layout (the TP engine checks it).
        assert len({plan.payload for plan in plans}) == 1
        for rank, buffer in enumerate(_exchanged(plans)):
            assert _load(models[rank], plans[rank], buffer, world) == []
    for rank in range(world):
        assert_holds(models[rank], expected_shards(full, config, rank, world))


def test_only_row_parallel_columns_and_whole_tensors_cross_between_ranks() -> None:
    """At TP 2 with a vocabulary TP splits as FSDP does, a rank receives, per layer, its
    columns of the other rank's o_proj rows (8 x 8) and down_proj rows (8 x 12) and the
    other's half of both norms (8 + 8), and half of the final norm (8): 2 x 176 + 8 = 360
    elements, 720 bytes in bf16; the full gather receives the other half of every tensor."""
    config = {**CONFIG_SPLIT_VOCAB, "tie_word_embeddings": False}
    full = full_weights(config)
    plan = _plans(full, config, 2, list(full))[0]
    assert plan.layout.region_bytes == 720
    kinds = {e.name: e.kind for e in plan.layout.entries}
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == COLS
    assert kinds["model.layers.0.mlp.down_proj.weight"] == COLS
    assert kinds["model.layers.0.self_attn.k_proj.bias"] == ROWS
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == ROWS
    assert kinds["model.norm.weight"] == ALL
    # The full gather receives the other rank's half of every tensor: of the embedding and
    # head (256 x 16 each), the norm (16) and two layers of 1984 elements: 6,088 elements.
    assert sum(t.numel() for t in full.values()) == 2 * 6_088
    # The engine's bytes: the rank's own half of each tensor (a quarter of o_proj and
    # down_proj), each block at a multiple of 16 bytes (the k and v biases' 4 elements, 8
    # bytes, each padded by 8: 32 bytes over two layers), then what it received.
    own = sum(t.numel() // 2 // (2 if kinds[n] == COLS else 1) * 2 for n, t in full.items())
    assert plan.layout.own_bytes == own + 32
    assert plan.layout.payload_bytes == own + 32 + 720
    # Own blocks as stored: the engine's bytes are what it received alone, the buffer that
    # and what the rank sent; the own shards (fp32, 6,088 elements) travel as they lie.
    stored = _plans(full, config, 2, list(full), stored=True)[0]
    assert stored.layout.own_bytes == 0 and stored.layout.payload_bytes == 720
    assert stored.layout.total_bytes == 2 * 720
    assert stored.stored is not None and stored.stored.numel() == 6_088 * 4  # bytes


@pytest.mark.parametrize(
    ("config", "world", "expected"),
    [
        # Qwen2.5-7B's shape: 28 query heads, 4 KV heads, vocabulary 152064 = 64 x 2376.
        (
            {"num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
             "vocab_size": 152064},
            2,
            {"q": ROWS, "k": ROWS, "o": COLS, "gate": ROWS, "down": COLS, "embed": ROWS,
             "norm": ALL, "q_bias": ROWS},
        ),
        # At TP 8 the 4 KV heads are shared and 28 heads do not divide: sent whole.
        (
            {"num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
             "vocab_size": 152064},
            8,
            {"q": ALL, "k": ALL, "o": COLS, "gate": ROWS, "down": COLS, "embed": ROWS,
             "norm": ALL, "q_bias": ALL},
        ),
        # A vocabulary sglang pads (151665 is not a multiple of 64 x 2): sent whole.
        (
            {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16,
             "vocab_size": 151666},
            2,
            {"q": ROWS, "k": ROWS, "o": COLS, "gate": ROWS, "down": COLS, "embed": ALL,
             "norm": ALL, "q_bias": ROWS},
        ),
    ],
)  # fmt: skip
def test_each_tensor_travels_by_how_tp_cuts_it(
    config: dict[str, Any], world: int, expected: dict[str, str]
) -> None:
    layout = DenseLayout.from_config(config, world)
    h, v = config["hidden_size"], config["vocab_size"]
    shapes = {
        "q": ("model.layers.0.self_attn.q_proj.weight", (h, h)),
        "q_bias": ("model.layers.0.self_attn.q_proj.bias", (h,)),
        "k": ("model.layers.0.self_attn.k_proj.weight", (512, h)),
        "o": ("model.layers.0.self_attn.o_proj.weight", (h, h)),
        "gate": ("model.layers.0.mlp.gate_proj.weight", (18944, h)),
        "down": ("model.layers.0.mlp.down_proj.weight", (h, 18944)),
        "embed": ("model.embed_tokens.weight", (v, h)),
        "norm": ("model.norm.weight", (h,)),
    }
    got = {key: send_kind(name, shape, layout) for key, (name, shape) in shapes.items()}
    assert got == expected


def test_rows_the_ranks_do_not_divide_are_not_sent_by_shards() -> None:
    layout = DenseLayout.from_config(CONFIG, 3)
    assert send_kind("model.layers.0.mlp.gate_proj.weight", (24, 16), layout) == ROWS
    assert send_kind("model.layers.0.self_attn.q_proj.weight", (16, 16), layout) is None
    assert send_kind("model.norm.weight", (16,), layout) is None
    assert send_kind("scalar", (), layout) is None


def test_a_kind_that_leaves_rows_of_a_part_unsent_is_refused_naming_the_tensor() -> None:
    """At TP 4 the 2 KV heads are shared by two ranks each: rank 1 holds head 0, rows 0-3 of
    k_proj, which FSDP rank 1 does not hold (rows 2-3). Sent as ROWS, its part is short."""
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    names = ["model.layers.0.self_attn.k_proj.weight"]
    for stored in (False, True):
        plans = _plans(full, config, 4, names, kinds=[ROWS], stored=stored)
        buffer = _exchanged(plans)[1]
        model = engine_model(full, config, 1, 4)
        with pytest.raises(
            EngineWeightsError,
            match=r"k_proj.weight: the sharded sync gave TP rank 1 2 of the 4 rows",
        ):
            _load(model, plans[1], buffer, 4)


def test_a_tensor_the_rules_do_not_place_reaches_sglangs_loader_whole_if_sent_whole() -> None:
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    extra = {"model.extra.weight": torch.randn(4, 16).bfloat16(), **full}
    for stored in (False, True):
        plans = _plans(extra, config, 2, ["model.extra.weight"], stored=stored)
        assert plans[0].layout.entries[0].kind == ALL
        for rank, buffer in enumerate(_exchanged(plans)):
            model = engine_model(full, config, rank, 2)
            rest = _load(model, plans[rank], buffer, 2)
            assert [name for name, _ in rest] == ["model.extra.weight"]
            # Joined from every rank's rows in the engine's dtype (the own ones cast from fp32).
            assert rest[0][1].dtype == torch.bfloat16
            assert torch.equal(rest[0][1], extra["model.extra.weight"])
    rows = _plans(extra, config, 2, ["model.extra.weight"], kinds=[ROWS])
    with pytest.raises(
        EngineWeightsError, match="do not place it and the sharded sync sent it as 'rows'"
    ):
        copy_bucket(engine_model(full, config, 0, 2), rows[0].payload, _exchanged(rows)[0],
                    tp=(0, 2))  # fmt: skip


def test_a_bucket_sharded_over_other_ranks_than_the_engines_is_refused() -> None:
    config = {**CONFIG, "tie_word_embeddings": False}
    full = full_weights(config)
    plans = _plans(full, config, 2, ["model.norm.weight"])
    with pytest.raises(
        EngineWeightsError, match="sharded over 2 ranks reached TP rank 0 of an engine of 4"
    ):
        copy_bucket(engine_model(full, config, 0, 4), plans[0].payload, _exchanged(plans)[0],
                    tp=(0, 4))  # fmt: skip


def test_the_switch_turns_the_shard_to_shard_sync_off_only_when_zero() -> None:
    off = tp_shards.OFF
    assert tp_shards.sharded_sync_mode({}) != off
    assert tp_shards.sharded_sync_mode({tp_shards.ENV: "1"}) != off
    assert tp_shards.sharded_sync_mode({tp_shards.ENV: "buffer"}) != off
    assert tp_shards.sharded_sync_mode({tp_shards.ENV: " 0 "}) == off
    assert tp_shards.sharded_sync_mode({}) == tp_shards.STORED
    assert tp_shards.sharded_sync_mode({tp_shards.ENV: " Buffer"}) == tp_shards.BUFFER
    # The policy's shards kept apart: no storage holds a bucket's, the own blocks go in the
    # buffer (as the memory plan counts it, rljob.plan.tp_own_as_stored).
    assert tp_shards.sharded_sync_mode({"RLJOB_FLAT_SHARDS": "0"}) == tp_shards.BUFFER
    assert tp_shards.sharded_sync_mode({"RLJOB_FLAT_SHARDS": "0", tp_shards.ENV: "0"}) == "off"
    # The ranks agree on the least of their modes: one rank's 0 or buffer decides for all.
    agreed = tp_shards.agreed_mode
    assert agreed([tp_shards.STORED, tp_shards.STORED]) == tp_shards.STORED
    assert agreed([tp_shards.STORED, tp_shards.BUFFER]) == tp_shards.BUFFER
    assert agreed([tp_shards.BUFFER, tp_shards.OFF, tp_shards.STORED]) == tp_shards.OFF


def test_a_bucket_read_as_stored_needs_its_stored_source_and_no_other_takes_one() -> None:
    config = {**CONFIG_SPLIT_VOCAB, "tie_word_embeddings": False}
    full = full_weights(config)
    names = ["model.layers.0.mlp.down_proj.weight"]
    stored = _plans(full, config, 2, names, stored=True)
    model = engine_model(full, config, 0, 2)
    with pytest.raises(EngineWeightsError, match="are read as stored and did not come"):
        copy_bucket(model, stored[0].payload, _exchanged(stored)[0], (0, 2))
    buffered = _plans(full, config, 2, names)
    with pytest.raises(EngineWeightsError, match="came unasked"):
        copy_bucket(model, buffered[0].payload, _exchanged(buffered)[0], (0, 2),
                    torch.zeros(16, dtype=torch.uint8))  # fmt: skip


def test_shards_apart_are_cast_into_the_buffer_even_when_asked_as_stored() -> None:
    """The own blocks go as stored only where a bucket's shards lie in one storage."""
    config = {**CONFIG_SPLIT_VOCAB, "tie_word_embeddings": False}
    full = {n: t.float() for n, t in full_weights(config).items()}
    names = list(full)[:4]
    layout = DenseLayout.from_config(config, 2)
    kinds = [send_kind(n, full[n].shape, layout) or ALL for n in names]
    apart = make_shard_plan(names, [full[n] for n in names],
                            [full[n].chunk(2)[0].clone() for n in names], kinds, torch.bfloat16,
                            0, 2, None, [], own_as_stored=True)  # fmt: skip
    assert apart.stored is None and apart.layout.stored is None and apart.layout.own_bytes > 0


def test_a_parameter_given_new_storage_is_planned_again_and_takes_the_next_sync() -> None:
    """A bucket's plan guards the parameters it writes: one given a new storage since gets a
    new plan, so the next sync lands in the storage the engine now reads. First layer 0's
    fused gate/up (a flat copy writes it), then its o_proj sent whole (a column slice, copied
    on its own, writes it)."""
    config = {**CONFIG_SPLIT_VOCAB, "tie_word_embeddings": False}
    names = list(full_weights(config))
    layout = DenseLayout.from_config(config, 2)
    kinds = [
        ALL if n.endswith("o_proj.weight") else send_kind(n, (16, 16) if "proj" in n else (16,),
                                                          layout) or ALL
        for n in names
    ]  # fmt: skip
    model = engine_model(full_weights(config), config, 1, 2)
    held = dict(model.named_parameters())
    replaced = [None, "model.layers.0.mlp.gate_up_proj.weight",
                "model.layers.0.self_attn.o_proj.weight"]  # fmt: skip
    for seed, target in enumerate(replaced, start=1):
        if target is not None:
            held[target].data = torch.zeros_like(held[target].data)
        full = full_weights(config, seed=seed)
        for stored in (False, True):
            plans = _plans(full, config, 2, names, kinds, stored=stored)
            assert _load(model, plans[1], _exchanged(plans)[1], 2) == []
            assert_holds(model, expected_shards(full, config, 1, 2))


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("model.layers.0.mlp.gate_proj.weight", ROWS),
        ("model.layers.0.mlp.down_proj.weight", COLS),
        ("model.layers.0.self_attn.q_proj.bias", ROWS),
        # An MoE expert's projections and a nested model's: sent whole, for sglang's loader.
        ("model.layers.0.mlp.experts.3.gate_proj.weight", ALL),
        ("model.layers.0.mlp.experts.3.down_proj.weight", ALL),
        ("language_model.model.layers.0.mlp.gate_proj.weight", ALL),
        ("model.layers.0.mlp.q_proj.weight", ALL),
        ("model.layers.0.self_attn.gate_proj.weight", ALL),
        ("model.layers.0.mlp.gate_proj.bias", ALL),
    ],
)
def test_only_the_dense_decoders_own_names_go_by_rows_or_columns(name: str, kind: str) -> None:
    assert send_kind(name, (16, 16), DenseLayout.from_config(CONFIG, 2)) == kind


def test_the_loader_takes_the_stored_own_blocks_handed_just_before_their_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sglang_direct.load as sglang's schedulers call it: one list of named tensors, the
    stored own blocks under tp_shards.STORED_NAME just before their bucket, then a bucket
    without them (its own blocks in its buffer)."""
    from rljob_worker.engines import sglang_direct

    config = {**CONFIG_SPLIT_VOCAB, "tie_word_embeddings": False}
    full = full_weights(config)
    names = list(full)
    half = len(names) // 2
    for rank in range(2):
        monkeypatch.setattr(sglang_direct, "_tp_rank_and_size", lambda rank=rank: (rank, 2))
        model = engine_model(full_weights(config, seed=9), config, rank, 2)
        stored = _plans(full, config, 2, names[:half], stored=True)
        buffered = _plans(full, config, 2, names[half:])
        own = stored[rank].stored
        assert own is not None
        sglang_direct.load(
            model,
            [
                (tp_shards.STORED_NAME, own),
                (stored[rank].payload, _exchanged(stored)[rank]),
                (buffered[rank].payload, _exchanged(buffered)[rank]),
            ],
        )
        assert_holds(model, expected_shards(full, config, rank, 2))
