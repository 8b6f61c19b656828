"""The model's shape for the memory plan (rljob/plan/model_shape.py): config.json's head_dim and
spec.model.shape.headDim, by hand against Qwen3-4B's config; mixture-of-experts configs refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rljob.api import RLJobSpec
from rljob.plan import ModelShape, shape_for

pytestmark = pytest.mark.unit

# Qwen3-4B's config.json: head_dim 128 given explicitly, where hidden / heads would be 80.
QWEN3_4B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
# Per layer: q 4096 x 2560 and o 2560 x 4096 (10,485,760 each), k and v 1024 x 2560 (2,621,440
# each), gate/up/down 3 x 9728 x 2560 (74,711,040), two norms (5,120); Qwen3 has no q/k/v
# biases: 100,930,560. x 36 = 3,633,500,160, + embeddings 151,936 x 2560 (388,956,160) + the
# final norm 2,560 = 4,022,458,880 (transformers counts 9,216 more: the q/k norms the plan omits).
QWEN3_4B_PARAMETERS = 4_022_458_880
# K and V: 2 x 36 layers x 8 KV heads x 128 x 2 bytes (sglang's cell_size, DenseLayout's,
# Qwen2Shape's), where hidden / heads would give 92,160.
QWEN3_4B_KV_BYTES_PER_TOKEN = 147_456


def _spec_with_shape(**shape: Any) -> RLJobSpec:
    return RLJobSpec.model_validate({"model": {"path": "Qwen/Qwen3-4B", "shape": shape}})


def test_config_json_head_dim_sizes_the_projections_and_the_kv_cache(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    shape = shape_for(RLJobSpec.model_validate({"model": {"path": str(tmp_path)}}))
    assert shape is not None and shape.head_dim == 128
    shapes = dict(shape.named_shapes())
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2560)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 2560)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (2560, 4096)
    assert "model.layers.0.self_attn.q_proj.bias" not in shapes
    assert shape.parameters == QWEN3_4B_PARAMETERS
    assert shape.kv_bytes_per_token(2) == QWEN3_4B_KV_BYTES_PER_TOKEN
    assert shape.kv_bytes_per_token(2, tp=4) == QWEN3_4B_KV_BYTES_PER_TOKEN // 4


def test_spec_model_shape_head_dim_plans_as_config_json_does() -> None:
    shape = shape_for(
        _spec_with_shape(
            numHiddenLayers=36, hiddenSize=2560, intermediateSize=9728, numAttentionHeads=32,
            numKeyValueHeads=8, headDim=128, vocabSize=151936, tieWordEmbeddings=True,
        )
    )  # fmt: skip
    assert shape is not None
    assert shape.kv_bytes_per_token(2) == QWEN3_4B_KV_BYTES_PER_TOKEN
    # The spec's shape plans with Qwen2's q/k/v biases: 36 x (4096 + 2 x 1024) more.
    assert shape.parameters == QWEN3_4B_PARAMETERS + 36 * (4096 + 2 * 1024)


def test_without_head_dim_it_is_hidden_over_heads() -> None:
    config = {k: v for k, v in QWEN3_4B.items() if k != "head_dim"}
    assert ModelShape.from_config(config).kv_bytes_per_token(2) == 2 * 36 * 8 * 80 * 2
    assert ModelShape.from_config({**config, "head_dim": None}).head_dim == 80


@pytest.mark.parametrize(("head_dim", "accepted"), [(None, False), (128, True)])
def test_heads_need_not_divide_hidden_when_head_dim_is_given(
    head_dim: int | None, accepted: bool
) -> None:
    shape = dict(numHiddenLayers=2, hiddenSize=2560, intermediateSize=64, numAttentionHeads=24,
                 numKeyValueHeads=8, vocabSize=320)  # fmt: skip
    if head_dim is not None:
        shape["headDim"] = head_dim
    if accepted:
        _spec_with_shape(**shape)
    else:
        with pytest.raises(ValidationError, match="unless headDim is given"):
            _spec_with_shape(**shape)


# Qwen3-30B-A3B's config.json (its MoE fields; the plan took it for a 2.89B dense model, 3.34B
# with its head_dim) and
# Mixtral-8x7B's: each names its experts differently.
QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
}  # fmt: skip
MIXTRAL_8X7B: dict[str, Any] = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "keys"),
    [(QWEN3_30B_A3B, "num_experts, moe_intermediate_size"), (MIXTRAL_8X7B, "num_local_experts")],
    ids=["qwen3-moe", "mixtral"],
)
def test_a_mixture_of_experts_config_is_refused_naming_its_keys(
    tmp_path: Path, config: dict[str, Any], keys: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = RLJobSpec.model_validate({"model": {"path": str(tmp_path)}})
    with pytest.raises(ValueError, match=f"config.json has {keys}: a mixture-of-experts model"):
        shape_for(spec)


def test_a_mixture_of_experts_job_runs_without_a_plan_rather_than_with_a_wrong_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The rank's plan: none (as for a shape it cannot read), so the job runs with the knobs it
    # names instead of failing before its engine starts, or running with a 10x too small plan.
    from rljob.plan import rank_plan

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    spec = RLJobSpec.model_validate({"model": {"path": str(tmp_path)}})
    assert rank_plan(spec, 80 << 30, 1, tmp_path) is None
    assert "no memory plan: the model's config.json has num_experts" in caplog.text
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(QWEN3_4B))
    assert rank_plan(RLJobSpec.model_validate({"model": {"path": str(dense)}}), 80 << 30, 1, dense)


def test_a_dense_config_with_its_expert_keys_empty_still_plans() -> None:
    dense = {**QWEN3_4B, "num_experts": 0, "moe_intermediate_size": None}
    assert ModelShape.from_config(dense).parameters == QWEN3_4B_PARAMETERS


def test_rljob_plan_refuses_a_mixture_of_experts_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rljob.plan_cli import main as plan_main

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        json.dumps({"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob",
                    "metadata": {"name": "moe"}, "spec": {"model": {"path": str(tmp_path)}}})
    )  # fmt: skip
    assert plan_main([str(manifest), "--gpu-memory", "80Gi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rljob plan: RLJob moe: the model's config.json has num_experts")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
