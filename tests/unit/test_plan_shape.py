"""The model's shape for the memory plan (rljob/plan/model_shape.py): config.json's head_dim and
spec.model.shape.headDim, by hand against Qwen3-4B's config; every parameter's name and shape
against transformers' own Qwen2, Qwen3, Llama and Mistral models (built on the meta device);
spec.model.shape.modelType and attentionBias; mixture-of-experts configs refused."""

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
# biases, but q/k norms of one head (2 x 128): 100,930,816. x 36 = 3,633,509,376, + embeddings
# 151,936 x 2560 (388,956,160) + the final norm 2,560 = 4,022,468,096 (transformers' count of
# Qwen3-4B: the model card's "4.0B").
QWEN3_4B_PARAMETERS = 4_022_468_096
# K and V: 2 x 36 layers x 8 KV heads x 128 x 2 bytes (sglang's cell_size, DenseLayout's,
# DecoderShape's), where hidden / heads would give 92,160.
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
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.layers.35.self_attn.k_norm.weight"] == (128,)
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
    # Without modelType the spec's shape is Qwen2's: q/k/v biases, 36 x (4096 + 2 x 1024) more,
    # and no q/k norms, 36 x 2 x 128 fewer.
    assert shape.parameters == QWEN3_4B_PARAMETERS + 36 * (4096 + 2 * 1024) - 36 * 2 * 128


def test_spec_model_shape_model_type_plans_qwen3_as_its_config_json_does(tmp_path: Path) -> None:
    fields = dict(numHiddenLayers=36, hiddenSize=2560, intermediateSize=9728,
                  numAttentionHeads=32, numKeyValueHeads=8, headDim=128, vocabSize=151936,
                  tieWordEmbeddings=True)  # fmt: skip
    from_spec = shape_for(_spec_with_shape(modelType="qwen3", **fields))
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    from_config = shape_for(RLJobSpec.model_validate({"model": {"path": str(tmp_path)}}))
    assert from_spec is not None and from_config is not None
    assert from_spec.named_shapes() == from_config.named_shapes()
    assert from_spec.parameters == QWEN3_4B_PARAMETERS
    # attentionBias: q/k/v and o biases, as config.json's attention_bias gives them.
    biased = shape_for(_spec_with_shape(modelType="qwen3", attentionBias=True, **fields))
    assert biased is not None
    assert biased.parameters == QWEN3_4B_PARAMETERS + 36 * (4096 + 2 * 1024 + 2560)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({"attentionBias": True}, "set modelType to one of them"),
        ({"modelType": "qwen2", "attentionBias": False}, "set modelType to one of them"),
        ({"modelType": "gemma"}, "Input should be 'qwen2', 'qwen3', 'llama' or 'mistral'"),
    ],
    ids=["bias-without-type", "bias-with-qwen2", "unknown-type"],
)
def test_spec_model_shape_refuses_what_it_cannot_plan(shape: dict[str, Any], message: str) -> None:
    fields = dict(numHiddenLayers=2, hiddenSize=64, intermediateSize=8, numAttentionHeads=4,
                  numKeyValueHeads=2, vocabSize=10)  # fmt: skip
    with pytest.raises(ValidationError, match=message):
        _spec_with_shape(**shape, **fields)


# Tiny configs of each family transformers builds, in the variants the plan must tell apart.
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)  # fmt: skip
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2", **SMALL, "tie_word_embeddings": True},
    "qwen2-untied": {"model_type": "qwen2", **SMALL, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", **SMALL, "head_dim": 32, "tie_word_embeddings": True},
    "qwen3-bias": {"model_type": "qwen3", **SMALL, "head_dim": 8, "attention_bias": True},
    "llama": {"model_type": "llama", **SMALL, "tie_word_embeddings": False},
    "llama-biases": {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", **SMALL, "head_dim": 24},
}


@pytest.mark.parametrize("config", FAMILIES.values(), ids=FAMILIES.keys())
def test_every_parameter_is_named_and_sized_as_transformers_builds_it(
    config: dict[str, Any],
) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    # What the plan reads: config.json as transformers writes it, every default spelled out.
    shape = ModelShape.from_config(hf_config.to_dict())
    assert shape.named_shapes() == built
    assert shape.parameters == sum(p.numel() for p in model.parameters())


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


def test_a_model_type_the_plan_does_not_know_is_planned_as_llama_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shape = ModelShape.from_config({**QWEN3_4B, "model_type": "olmo2"})
    assert not shape.attention_bias and not shape.qk_norm
    assert "model_type 'olmo2' is planned as a Llama-style decoder" in caplog.text
    # Once per model_type and process (the operator plans again at every reconcile).
    ModelShape.from_config({**QWEN3_4B, "model_type": "olmo2"})
    assert caplog.text.count("model_type 'olmo2' is planned") == 1


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
