"""The model's shape for the memory plan: a Qwen2/Qwen3/Llama-family decoder's sizes
(ModelShape), the builtin tiny Qwen2's, and where a spec's shape comes from (shape_for).

The parameters are named and sized as transformers builds them (tests/unit/test_plan_shape.py
compares them with its models on the meta device): Qwen2 has q/k/v biases and nothing else
apart, Llama and Mistral have none (config.json's attention_bias where given), and Qwen3 has no
biases but an RMSNorm of one head's width on the queries and on the keys of every layer.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.api import BUILTIN_PREFIX, TINY_QWEN2, RLJobSpec
from rljob.api.model import PLANNED_MODEL_TYPES

log = logging.getLogger(__name__)

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

# config.json keys that make a model a mixture of experts (Qwen2/Qwen3-MoE, Mixtral, DeepSeek):
# the plan sizes dense decoders only, and would size such a model as a dense one
# (Qwen3-30B-A3B, 30.5B parameters, as 3.3B).
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# model_type where config.json has none (and spec.model.shape's default): the plan began with
# Qwen2.5, the model family of the bench and of the examples.
DEFAULT_MODEL_TYPE = "qwen2"
# model_types with a per-head RMSNorm on the queries and the keys (q_norm, k_norm: head_dim each).
QK_NORM_MODEL_TYPES = frozenset({"qwen3"})


class MixtureOfExperts(ValueError):
    """A config.json of a mixture-of-experts model: the plan cannot size it."""


# model_types whose planning-as-Llama warning this process has logged.
_WARNED_MODEL_TYPES: set[str] = set()


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2/Qwen3/Llama-family decoder's architecture (config.json's fields)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = True  # q/k/v biases: Qwen2's; Llama, Mistral and Qwen3 have none
    # config.json's head_dim where it gives one (Qwen3: 128 at hidden 2560, 32 heads); None:
    # hidden // heads, as transformers, sglang and the worker's engines derive it then.
    config_head_dim: int | None = None
    qk_norm: bool = False  # Qwen3: q_norm and k_norm, head_dim wide, in every layer
    output_bias: bool = False  # o_proj's bias: Llama's and Qwen3's with attention_bias true
    mlp_bias: bool = False  # gate/up/down biases: Llama's mlp_bias

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From config.json's fields; ValueError for a mixture-of-experts model."""
        moe = [key for key in MOE_CONFIG_KEYS if config.get(key)]
        if moe:
            raise MixtureOfExperts(
                f"the model's config.json has {', '.join(moe)}: a mixture-of-experts model, "
                "which the memory plan does not support (it sizes dense Qwen2/Llama-style "
                "decoders)"
            )
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim")
        model_type = str(config.get("model_type") or DEFAULT_MODEL_TYPE)
        if model_type not in PLANNED_MODEL_TYPES and model_type not in _WARNED_MODEL_TYPES:
            # Once per model_type and process: the operator plans again at every reconcile.
            _WARNED_MODEL_TYPES.add(model_type)
            log.warning(
                "the memory plan sizes %s models exactly; model_type %r is planned as a "
                "Llama-style decoder (its extra parameters, if any, are not counted)",
                "/".join(PLANNED_MODEL_TYPES),
                model_type,
            )
        # Qwen2's attention always has q/k/v biases and no o_proj bias (its config.json has no
        # attention_bias); Llama's and Qwen3's attention_bias puts one on all four, and Llama's
        # mlp_bias one on gate/up/down; Mistral has none of them.
        qwen2 = model_type == "qwen2"
        bias = bool(config.get("attention_bias") or False)
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or bias,
            config_head_dim=int(head_dim) if head_dim else None,
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            output_bias=bias and not qwen2,
            mlp_bias=bool(config.get("mlp_bias") or False),
        )

    @property
    def head_dim(self) -> int:
        """What sglang's and the worker's layouts (DenseLayout, DecoderShape) use: config.json's
        head_dim first, else hidden // heads."""
        return self.config_head_dim or self.hidden // self.heads

    def named_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Parameter names and shapes in from_pretrained's order (weight-sync buckets)."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = self.attention_bias
        norms = [
            ("self_attn.q_norm.weight", (self.head_dim,)),
            ("self_attn.k_norm.weight", (self.head_dim,)),
        ]
        layer: list[tuple[str, tuple[int, ...]]] = [
            ("self_attn.q_proj.weight", (q, h)),
            *([("self_attn.q_proj.bias", (q,))] if bias else []),
            ("self_attn.k_proj.weight", (kv, h)),
            *([("self_attn.k_proj.bias", (kv,))] if bias else []),
            ("self_attn.v_proj.weight", (kv, h)),
            *([("self_attn.v_proj.bias", (kv,))] if bias else []),
            ("self_attn.o_proj.weight", (h, q)),
            *([("self_attn.o_proj.bias", (h,))] if self.output_bias else []),
            *(norms if self.qk_norm else []),
            ("mlp.gate_proj.weight", (i, h)),
            *([("mlp.gate_proj.bias", (i,))] if self.mlp_bias else []),
            ("mlp.up_proj.weight", (i, h)),
            *([("mlp.up_proj.bias", (i,))] if self.mlp_bias else []),
            ("mlp.down_proj.weight", (h, i)),
            *([("mlp.down_proj.bias", (h,))] if self.mlp_bias else []),
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
