"""The model's shape for the memory plan (rljob/plan/model_shape.py): config.json's head_dim and
spec.model.shape.headDim, by hand against Qwen3-4B's config."""

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
