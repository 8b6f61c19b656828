"""spec.model: the policy model to train and serve, and its architecture for the memory plan."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import ConfigDict, Field, model_validator

from rljob.api._base import (
    CrossFieldRule,
    _builtin_rule,
    _cel_rules,
    _check_rules,
    _no_url_rule,
    _Spec,
    _with_rules,
    immutable,
)

# Builtin models the worker builds itself (rljob_worker.model).
TINY_QWEN2 = "builtin:tiny-qwen2"
BUILTIN_MODELS: tuple[str, ...] = (TINY_QWEN2,)


# config.json's model_type values whose parameters the memory plan sizes exactly, as transformers
# builds them (tests/unit/test_plan_shape.py); another dense decoder is planned as Llama.
ModelType = Literal["qwen2", "qwen3", "llama", "mistral"]
PLANNED_MODEL_TYPES: tuple[str, ...] = get_args(ModelType)

BUILTIN_MODEL_RULE = _builtin_rule("model", BUILTIN_MODELS)
MODEL_URL_RULE = _no_url_rule(
    "use a path in the pod (a mounted volume) or a Hugging Face id such as Qwen/Qwen2.5-0.5B"
)
ModelPath = Annotated[
    str, Field(min_length=1, max_length=4096), *_with_rules(BUILTIN_MODEL_RULE, MODEL_URL_RULE)
]


HEADS_DIVIDE_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        cel="self.numAttentionHeads % self.numKeyValueHeads == 0",
        message="numKeyValueHeads must divide numAttentionHeads (grouped-query attention)",
        field_path=".numKeyValueHeads",
        check=lambda s: s.num_attention_heads % s.num_key_value_heads == 0,
    ),
    CrossFieldRule(
        cel="has(self.headDim) || self.hiddenSize % self.numAttentionHeads == 0",
        message="numAttentionHeads must divide hiddenSize (head dim = hiddenSize / heads) "
        "unless headDim is given",
        field_path=".numAttentionHeads",
        check=lambda s: s.head_dim is not None or s.hidden_size % s.num_attention_heads == 0,
    ),
    CrossFieldRule(
        cel="!has(self.attentionBias) || (has(self.modelType) && self.modelType != 'qwen2')",
        message="attentionBias is config.json's flag of llama, mistral and qwen3 models: set "
        "modelType to one of them (qwen2, the default, always has q/k/v biases)",
        field_path=".attentionBias",
        check=lambda s: (
            s.attention_bias is None or (s.model_type is not None and s.model_type != "qwen2")
        ),
    ),
)


class ModelShapeSpec(_Spec):
    """The model's architecture as its config.json names it, for the memory plan (rljob/plan/)
    where the operator cannot read config.json (a Hugging Face id or a path in the pod)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*HEADS_DIVIDE_RULES))

    model_type: ModelType | None = Field(
        default=None,
        description="config.json's model_type: which parameters a layer has besides its "
        "projections. qwen2 (the default): q/k/v biases; qwen3: q/k norms of one head's "
        "width and no biases; llama and mistral: none (attentionBias where config.json sets "
        "it). Another dense decoder: the nearest of these.",
    )
    attention_bias: bool | None = Field(
        default=None,
        description="config.json's attention_bias (llama, qwen3): biases on q/k/v/o. Unset: "
        "false. Only with a modelType other than qwen2.",
    )
    num_hidden_layers: int = Field(ge=1, le=1024, description="Decoder layers.")
    hidden_size: int = Field(ge=1, le=1 << 20, description="Model width.")
    intermediate_size: int = Field(ge=1, le=1 << 22, description="MLP width.")
    num_attention_heads: int = Field(ge=1, le=4096, description="Query heads.")
    num_key_value_heads: int = Field(ge=1, le=4096, description="Key/value heads (GQA).")
    head_dim: int | None = Field(
        default=None,
        ge=1,
        le=1 << 16,
        description="Width of one attention head, where config.json gives head_dim (Qwen3: 128 "
        "at hiddenSize 2560 and 32 heads); sizes the q/k/v/o projections and the KV cache. "
        "Unset: hiddenSize / numAttentionHeads, as the engines derive it.",
    )
    vocab_size: int = Field(ge=1, le=1 << 24, description="Embedding rows.")
    tie_word_embeddings: bool = Field(
        default=False, description="lm_head shares the embedding matrix."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> ModelShapeSpec:
        _check_rules(self, HEADS_DIVIDE_RULES, "spec.model.shape")
        return self


class ModelSpec(_Spec):
    """The policy model to train and serve. Immutable after creation."""

    model_config = ConfigDict(json_schema_extra=immutable("spec.model"))

    path: ModelPath = Field(
        default=TINY_QWEN2,
        description="Model to load with transformers' from_pretrained: a local directory, a "
        "mounted volume path, or a Hugging Face id (verl: actor_rollout_ref.model.path). "
        "'builtin:tiny-qwen2' builds a tiny randomly initialised Qwen2 model and tokenizer "
        "locally (no download), for CPU runs and tests. No URL schemes.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="Parameter dtype of the rollout engine and of FSDP's compute.",
    )
    shape: ModelShapeSpec | None = Field(
        default=None,
        description="The model's config.json architecture fields, so the operator can plan "
        "memory before the job starts (builtin models need none; the driver reads config.json "
        "itself and plans again on the real GPU).",
    )
