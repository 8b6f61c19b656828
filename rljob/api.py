"""The RLJob API: pydantic models that are the single source of truth for the CRD schema.

The CRD in crds/ is generated from these models (`rljob crd`); the worker reads the same spec
(through the job-config ConfigMap), so nothing here may import kopf or torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from rljob.report import MAX_METRICS, IterationMetrics, MemorySummary, OOMRecord, Stage

GROUP = "rljob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]

# Builtin models and prompt sources the worker makes itself (no download). The worker resolves
# exactly these (rljob_worker.model, rljob_worker.task) and admission refuses any other
# `builtin:` name, so the two cannot disagree.
BUILTIN_PREFIX = "builtin:"
TINY_QWEN2 = "builtin:tiny-qwen2"
BUILTIN_MODELS: tuple[str, ...] = (TINY_QWEN2,)
BUILTIN_ARITHMETIC = "builtin:arithmetic"
# One digit named in the prompt ('say 7:'), rewarded by the response's first character: what the
# tiny builtin model learns on a CPU in a few dozen iterations (tests/worker/test_learns.py).
BUILTIN_DIGIT = "builtin:digit"
# Multi-step arithmetic whose answer needs the calculator tool (spec.rollout.mode multiTurn;
# docs/multi-turn.md).
BUILTIN_CALCULATOR = "builtin:calculator"
BUILTIN_DATA_SOURCES: tuple[str, ...] = (BUILTIN_ARITHMETIC, BUILTIN_DIGIT, BUILTIN_CALCULATOR)
# Reward functions the worker has itself (rljob_worker.reward); anything else is FILE:callable.
BUILTIN_EXACT_MATCH = "exactMatch"
BUILTIN_NUMERIC = "numeric"
BUILTIN_REWARDS: tuple[str, ...] = (BUILTIN_EXACT_MATCH, BUILTIN_NUMERIC)

# Kubernetes quantity syntax exactly (resource.Quantity's grammar: an optionally signed decimal
# number, then one binary-SI, decimal-SI or exponent suffix). No lone dots, no repeated dots,
# no suffix soup. Also valid RE2 (the apiserver) and Rust regex (pydantic).
QUANTITY_PATTERN = (
    r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
# Names as the apiserver checks them (k8s.io/apimachinery/pkg/util/validation).
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN_PATTERN = rf"^{_DNS_LABEL}(?:\.{_DNS_LABEL})*$"
# A Service name (KubeRay names the head Service after the RayJob): starts with a letter.
DNS_1035_LABEL_PATTERN = r"^[a-z](?:[-a-z0-9]*[a-z0-9])?$"
LABEL_KEY_PATTERN = (
    rf"^(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
# A container image reference (the grammar of github.com/distribution/reference):
# [domain[:port]/]path[:tag][@digest], path components lower case.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:__|[._]|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
IMAGE_PATTERN = (
    rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
# A URL scheme (ftp://, s3://, https://): the worker reads builtin sources and files in the pod.
URL_SCHEME_PATTERN = r"^[A-Za-z][A-Za-z0-9+.-]*://"


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several fields, written once and enforced twice: as CEL by the apiserver
    (x-kubernetes-validations, at admission) and as Python by the models (`rljob run`, and the
    operator's deeper check). `field_path` is relative to the model the rule sits on."""

    cel: str
    message: str
    field_path: str
    check: Callable[[Any], bool]

    def to_k8s(self) -> dict[str, str]:
        return {
            "rule": self.cel,
            "message": self.message,
            "fieldPath": self.field_path,
            "reason": "FieldValueInvalid",
        }


@dataclass(frozen=True)
class ValueRule:
    """A rule on one field's value, written once and enforced twice: as CEL on the field itself
    (`self` is the value, so the apiserver's error names the field) and as a pydantic validator."""

    cel: str
    message: str
    check: Callable[[Any], bool]

    def to_k8s(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message, "reason": "FieldValueInvalid"}

    def validate(self, value: Any) -> Any:
        if value is not None and not self.check(value):
            raise ValueError(self.message)
        return value


def immutable(what: str) -> dict[str, Any]:
    """json_schema_extra for a field that cannot change after creation (a CEL transition rule)."""
    return {
        "x-kubernetes-validations": [
            {"rule": "self == oldSelf", "message": f"{what} is immutable after creation"}
        ]
    }


def _cel_rules(*rules: CrossFieldRule | ValueRule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.to_k8s() for r in rules]}


def _check_rules(model: BaseModel, rules: tuple[CrossFieldRule, ...], where: str) -> None:
    broken = [r for r in rules if not r.check(model)]
    if broken:
        raise ValueError("; ".join(f"{where}{r.field_path}: {r.message}" for r in broken))


def _positive_quantity(value: str) -> bool:
    # The pattern has already held (pydantic checks it first), so the value's sign and its
    # number's digits decide: every suffix multiplies by a positive factor.
    number = re.match(r"[+-]?[0-9.]*", value)
    digits = number.group() if number else ""
    return not digits.startswith("-") and any(c in "123456789" for c in digits)


POSITIVE_QUANTITY_RULE = ValueRule(
    cel="isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
    message="must be a Kubernetes quantity greater than 0 (e.g. 8, 500m, 64Gi)",
    check=_positive_quantity,
)


def _builtin_rule(what: str, known: tuple[str, ...]) -> ValueRule:
    names = ", ".join(known)
    return ValueRule(
        cel=f"!self.startsWith('{BUILTIN_PREFIX}') || self in ["
        + ", ".join(f"'{n}'" for n in known)
        + "]",
        message=f"unknown builtin {what}; the builtin {what}s are: {names}",
        check=lambda v: not v.startswith(BUILTIN_PREFIX) or v in known,
    )


def _no_url_rule(what: str) -> ValueRule:
    return ValueRule(
        cel=f"!self.matches(r'{URL_SCHEME_PATTERN}')",
        message=f"URL schemes (ftp://, s3://, https://...) are not read: {what}",
        check=lambda v: re.match(URL_SCHEME_PATTERN, v) is None,
    )


BUILTIN_MODEL_RULE = _builtin_rule("model", BUILTIN_MODELS)
MODEL_URL_RULE = _no_url_rule(
    "use a path in the pod (a mounted volume) or a Hugging Face id such as Qwen/Qwen2.5-0.5B"
)
BUILTIN_DATA_RULE = _builtin_rule("data source", BUILTIN_DATA_SOURCES)
DATA_URL_RULE = _no_url_rule(
    "use a builtin source or the path of a .jsonl or .parquet file in the pod"
)
# A user reward function: what comes before the last ':' is a file path or a dotted module,
# what follows it a Python name. RE2 (the apiserver) and Rust regex (pydantic) both take it.
REWARD_FUNCTION_PATTERN = r"^[^:]*[^:\s]:[A-Za-z_][A-Za-z0-9_]*$"
REWARD_BUILTIN_RULE = ValueRule(
    cel="self.contains(':') || self in [" + ", ".join(f"'{n}'" for n in BUILTIN_REWARDS) + "]",
    message="unknown builtin reward function; the builtins are "
    + ", ".join(BUILTIN_REWARDS)
    + ", and a user function is FILE_OR_MODULE:callable (e.g. /data/reward.py:compute_score)",
    check=lambda v: ":" in v or v in BUILTIN_REWARDS,
)
REWARD_CALLABLE_RULE = ValueRule(
    cel=f"!self.contains(':') || self.matches(r'{REWARD_FUNCTION_PATTERN}')",
    message="a user reward function is FILE_OR_MODULE:callable: a .py path or a dotted module, "
    "then ':' and the function's Python name (e.g. my_rewards.gsm8k:compute_score)",
    check=lambda v: ":" not in v or re.match(REWARD_FUNCTION_PATTERN, v) is not None,
)


def _with_rules(*rules: ValueRule) -> list[Any]:
    """Annotated metadata of a field carrying `rules`: their CEL in the CRD, their checks here."""
    return [
        Field(json_schema_extra=_cel_rules(*rules)),
        *(AfterValidator(rule.validate) for rule in rules),
    ]


# A resource quantity that must be > 0 (cpu, memory, /dev/shm).
PositiveQuantity = Annotated[
    str,
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    *_with_rules(POSITIVE_QUANTITY_RULE),
]
ModelPath = Annotated[
    str, Field(min_length=1, max_length=4096), *_with_rules(BUILTIN_MODEL_RULE, MODEL_URL_RULE)
]
DataSource = Annotated[
    str, Field(min_length=1, max_length=4096), *_with_rules(BUILTIN_DATA_RULE, DATA_URL_RULE)
]
# A column, with dots reaching into nested columns (reward_model.ground_truth): no empty part.
DataKey = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^.]+(?:\.[^.]+)*$")]
RewardFunction = Annotated[
    str,
    Field(min_length=1, max_length=4096),
    *_with_rules(REWARD_BUILTIN_RULE, REWARD_CALLABLE_RULE),
]
ImageReference = Annotated[str, Field(pattern=IMAGE_PATTERN, min_length=1, max_length=512)]
DNSSubdomain = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253)]
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, min_length=1, max_length=317)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]


class _Spec(BaseModel):
    """Base for spec sections: camelCase on the wire, snake_case in Python, unknown keys refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=False
    )


HEADS_DIVIDE_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        cel="self.numAttentionHeads % self.numKeyValueHeads == 0",
        message="numKeyValueHeads must divide numAttentionHeads (grouped-query attention)",
        field_path=".numKeyValueHeads",
        check=lambda s: s.num_attention_heads % s.num_key_value_heads == 0,
    ),
    CrossFieldRule(
        cel="self.hiddenSize % self.numAttentionHeads == 0",
        message="numAttentionHeads must divide hiddenSize (head dim = hiddenSize / heads)",
        field_path=".numAttentionHeads",
        check=lambda s: s.hidden_size % s.num_attention_heads == 0,
    ),
)


class ModelShapeSpec(_Spec):
    """The model's architecture as its config.json names it, for the memory plan (rljob/plan.py)
    where the operator cannot read config.json (a Hugging Face id or a path in the pod)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*HEADS_DIVIDE_RULES))

    num_hidden_layers: int = Field(ge=1, le=1024, description="Decoder layers.")
    hidden_size: int = Field(ge=1, le=1 << 20, description="Model width.")
    intermediate_size: int = Field(ge=1, le=1 << 22, description="MLP width.")
    num_attention_heads: int = Field(ge=1, le=4096, description="Query heads.")
    num_key_value_heads: int = Field(ge=1, le=4096, description="Key/value heads (GQA).")
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


class AlgorithmName(StrEnum):
    GRPO = "grpo"
    PPO = "ppo"


GRPO_GROUP_RULE = CrossFieldRule(
    cel="self.name != 'grpo' || self.groupSize >= 2",
    message="grpo needs groupSize >= 2 (its advantage is relative to the group)",
    field_path=".groupSize",
    check=lambda a: a.name != AlgorithmName.GRPO or a.group_size >= 2,
)


class AlgorithmSpec(_Spec):
    """The RL algorithm (verl: algorithm.* and actor_rollout_ref.actor.*)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(GRPO_GROUP_RULE))

    name: AlgorithmName = Field(
        default=AlgorithmName.GRPO,
        description="grpo: group-relative advantages (reward minus the group's mean, over its "
        "std). ppo: PPO-style clipped loss with batch-normalised advantages (no critic).",
    )
    group_size: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Responses sampled per prompt (verl: actor_rollout_ref.rollout.n). "
        "GRPO needs at least 2.",
    )
    learning_rate: float = Field(
        default=1e-6, gt=0, le=1, description="AdamW learning rate (verl: actor.optim.lr)."
    )
    kl_coef: float = Field(
        default=0.001,
        ge=0,
        description="Coefficient of the KL term to the reference policy (verl: "
        "actor.kl_loss_coef). 0 disables the reference model.",
    )
    clip_ratio: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip range epsilon (verl: actor.clip_ratio)."
    )
    ppo_epochs: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Passes over each rollout's responses (verl: actor.ppo_epochs). The PPO "
        "ratio is against the log-probs before the first pass (docs/algorithm.md).",
    )
    ppo_mini_batches: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Optimizer steps per pass: each rank's responses are split into this many "
        "mini-batches (verl: train_batch_size / ppo_mini_batch_size). 1: one step per pass.",
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="Truncated importance sampling: weight each token's loss by "
        "min(p_trainer / p_engine, tisCap), correcting for the rollout engine's numerics "
        "(verl: tis_imp_ratio_cap, e.g. 2). Unset: off.",
    )
    iterations: int = Field(
        default=2,
        ge=1,
        description="Training iterations, each train -> sync -> rollout "
        "(verl: trainer.total_training_steps).",
    )
    seed: int = Field(default=0, ge=0, description="Seed for sampling and initialisation.")

    @model_validator(mode="after")
    def _cross_field(self) -> AlgorithmSpec:
        _check_rules(self, (GRPO_GROUP_RULE,), "spec.algorithm")
        return self


class ChatTemplateMode(StrEnum):
    AUTO = "Auto"
    NONE = "None"


class PromptOverflow(StrEnum):
    REFUSE = "Refuse"
    TRUNCATE = "Truncate"


class DataSpec(_Spec):
    """Where prompts come from and how they become tokens (docs/data-and-reward.md)."""

    source: DataSource = Field(
        default=BUILTIN_ARITHMETIC,
        description="'builtin:arithmetic' generates addition prompts (no download); otherwise "
        "the path (in the pod: a mounted volume, or the image) of a .jsonl or .parquet file. "
        "No URL schemes: the worker reads local files.",
    )
    prompt_key: DataKey = Field(
        default="prompt",
        description="The prompt's column: plain text, or a list of chat messages ({role, "
        "content}) as verl's 'prompt' column holds. Dots reach into nested columns.",
    )
    answer_key: DataKey = Field(
        default="answer",
        description="The ground truth's column, given to the reward function; dots reach into "
        "nested columns (verl: reward_model.ground_truth).",
    )
    chat_template: ChatTemplateMode = Field(
        default=ChatTemplateMode.AUTO,
        description="Auto: a prompt of chat messages goes through the tokenizer's chat template "
        "(with the generation prompt); plain text is used as it is. None: never; messages' "
        "contents are joined by newlines.",
    )
    train_batch_size: int = Field(
        default=8,
        ge=1,
        description="Prompts per iteration across all ranks (verl: data.train_batch_size).",
    )
    max_prompt_length: int = Field(
        default=64, ge=1, description="Tokens of a prompt (after the chat template)."
    )
    prompt_overflow: PromptOverflow = Field(
        default=PromptOverflow.REFUSE,
        description="A prompt longer than maxPromptLength: Refuse fails the job at start, "
        "naming the rows (verl: data.truncation error); Truncate keeps its last "
        "maxPromptLength tokens.",
    )
    max_response_length: int = Field(
        default=16, ge=1, description="New tokens generated per response."
    )


class RewardOnError(StrEnum):
    FAIL = "Fail"
    ZERO = "Zero"


class RewardSpec(_Spec):
    """How a response is scored (docs/data-and-reward.md)."""

    function: RewardFunction = Field(
        default=BUILTIN_EXACT_MATCH,
        description="A builtin (exactMatch: the response's first line equals the answer; "
        "numeric: the last number, '#### N' or '\\boxed{N}' equals the answer as a number) "
        "or FILE_OR_MODULE:callable, a .py file in the pod or a module in the image, with "
        "verl's signature (data_source, solution_str, ground_truth, extra_info) -> float or "
        "{score, ...}.",
    )
    timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Seconds one call of a user function may take; its process is then ended "
        "and the call counts as an error.",
    )
    on_error: RewardOnError = Field(
        default=RewardOnError.FAIL,
        description="A call that raises, times out or returns no number: Fail ends the job "
        "with the row, the response and the error; Zero scores it 0 and counts it in the "
        "iteration's report.",
    )


class EngineName(StrEnum):
    SGLANG = "sglang"
    TORCH = "torch"


class WakeUp(StrEnum):
    STAGED = "staged"
    SINGLE = "single"


# `Auto` for rollout.memFractionStatic and rollout.wakeUp: the memory plan chooses on the card
# the job got (rljob/plan.py auto_choice; docs/zero-tuning.md). The spec and the attempt's knobs
# keep "Auto"; only the driver's resolved spec, which the stage machine and engine run, and
# status.plan hold the numbers chosen.
AUTO: Literal["Auto"] = "Auto"
WakeUpSetting = WakeUp | Literal["Auto"]


def _fraction_or_auto(value: float | str) -> float | str:
    if value != AUTO and not (isinstance(value, int | float) and 0 < value < 1):
        raise ValueError("memFractionStatic must be Auto or a number in (0, 1)")
    return value


# A number in (0, 1), or Auto. A structural schema cannot type a number-or-string (it has
# int-or-string only) and CEL cannot see an untyped field, so the CRD keeps any value and checks
# it with value validations that ignore the other JSON types: "Auto" by enum, or a number in
# (0, 1) with every string, list and object excluded by impossible length bounds
# (rljob_operator/crdgen.py writes UNTYPED_SCHEMA as is).
UNTYPED_SCHEMA = "x-rljob-untyped-schema"
_IMPOSSIBLE_FOR_NON_NUMBERS = {
    "minLength": 1, "maxLength": 0, "minItems": 1, "maxItems": 0,
    "minProperties": 1, "maxProperties": 0,
}  # fmt: skip
MemFraction = Annotated[
    float | Literal["Auto"],
    Field(
        json_schema_extra={
            UNTYPED_SCHEMA: {
                "x-kubernetes-preserve-unknown-fields": True,
                "anyOf": [
                    {"enum": [AUTO]},
                    {
                        "minimum": 0, "exclusiveMinimum": True, "maximum": 1,
                        "exclusiveMaximum": True, **_IMPOSSIBLE_FOR_NON_NUMBERS,
                    },
                ],
            }
        }
    ),
    AfterValidator(_fraction_or_auto),
]  # fmt: skip


SAMPLING_UNTRUNCATED_RULE = CrossFieldRule(
    cel="self.topP == 1.0 && self.topK == -1",
    message="topP must be 1 and topK -1: the trainer's log-probs are those of the whole "
    "softmax(logits / temperature), so a truncated sampler would make the PPO ratio and the "
    "gradient wrong (docs/algorithm.md)",
    field_path=".topP",
    check=lambda s: s.top_p == 1.0 and s.top_k == -1,
)


class SamplingSpec(_Spec):
    """Sampling parameters of the rollout: the policy trained is softmax(logits / temperature)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(SAMPLING_UNTRUNCATED_RULE))

    temperature: float = Field(
        default=1.0,
        gt=0,
        description="Logits are divided by it when sampling and when training (log-probs).",
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="Nucleus sampling mass; only 1 is accepted today."
    )
    top_k: int = Field(default=-1, ge=-1, description="Top-k; only -1 (off) is accepted today.")

    @model_validator(mode="after")
    def _cross_field(self) -> SamplingSpec:
        _check_rules(self, (SAMPLING_UNTRUNCATED_RULE,), "spec.rollout.sampling")
        return self


# Engines whose weights and KV cache can be released and resumed separately (by tag); staged
# wake-up needs that. A new engine joins this list only once its adapter implements tags.
ENGINES_WITH_TAGGED_RELEASE: tuple[EngineName, ...] = (EngineName.SGLANG, EngineName.TORCH)

STAGED_NEEDS_TAGS_RULE = CrossFieldRule(
    cel="self.wakeUp != 'staged' || self.engine in ["
    + ", ".join(f"'{e.value}'" for e in ENGINES_WITH_TAGGED_RELEASE)
    + "]",
    message="wakeUp staged needs an engine with tagged release ("
    + ", ".join(e.value for e in ENGINES_WITH_TAGGED_RELEASE)
    + "); use wakeUp single",
    field_path=".wakeUp",
    check=lambda r: r.wake_up != WakeUp.STAGED or r.engine in ENGINES_WITH_TAGGED_RELEASE,
)


class RolloutMode(StrEnum):
    SINGLE_TURN = "singleTurn"
    MULTI_TURN = "multiTurn"


# Tools the worker has itself (rljob_worker.agentic.tools); anything else is MODULE:callable.
BUILTIN_TOOL_CALCULATOR = "builtin:calculator"
BUILTIN_TOOL_PYTHON = "builtin:python"
BUILTIN_TOOLS: tuple[str, ...] = (BUILTIN_TOOL_CALCULATOR, BUILTIN_TOOL_PYTHON)
TOOL_RULE = ValueRule(
    cel=f"self.startsWith('{BUILTIN_PREFIX}') ? self in ["
    + ", ".join(f"'{n}'" for n in BUILTIN_TOOLS)
    + f"] : self.matches(r'{REWARD_FUNCTION_PATTERN}')",
    message="a tool is a builtin ("
    + ", ".join(BUILTIN_TOOLS)
    + ") or FILE_OR_MODULE:callable (e.g. my_tools.search:search or /data/tools.py:lookup)",
    check=lambda v: (
        v in BUILTIN_TOOLS
        if v.startswith(BUILTIN_PREFIX)
        else re.match(REWARD_FUNCTION_PATTERN, v) is not None
    ),
)
ToolName = Annotated[str, Field(min_length=1, max_length=4096), *_with_rules(TOOL_RULE)]

TOOL_RESPONSE_FITS_RULE = CrossFieldRule(
    cel="self.maxToolResponseLength < self.maxResponseLength",
    message="maxToolResponseLength must be less than maxResponseLength (the whole trajectory's "
    "budget, which tool responses share with the model's turns)",
    field_path=".maxToolResponseLength",
    check=lambda m: m.max_tool_response_length < m.max_response_length,
)


class MultiTurnSpec(_Spec):
    """Conversations of several turns with tools (spec.rollout.mode multiTurn; docs/multi-turn.md)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(TOOL_RESPONSE_FITS_RULE))

    max_turns: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Model turns per conversation; a conversation still calling tools after "
        "this many turns ends there (cut off, trained with what it has, loss-masked).",
    )
    max_response_length: int = Field(
        default=256,
        ge=2,
        le=1_048_576,
        description="Tokens of the whole trajectory after the prompt: the model's turns plus "
        "the template and tool tokens between them. A conversation that reaches it is cut off "
        "and trained with what it has.",
    )
    max_tool_response_length: int = Field(
        default=64,
        ge=1,
        le=1_048_576,
        description="Tokens of one tool result; a longer one is cut to this many tokens.",
    )
    tool_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="Seconds one tool call may take; then the model gets an error text and "
        "the conversation goes on.",
    )
    tool_memory_megabytes: int = Field(
        default=256,
        ge=16,
        le=65536,
        description="Address-space limit (MiB) of the child process builtin:python runs in.",
    )
    max_concurrent_conversations: int = Field(
        default=64,
        ge=1,
        le=65536,
        description="Conversations one rank drives at once; the memory plan reserves KV for "
        "this many full-length trajectories per engine.",
    )
    tools: list[ToolName] = Field(
        default=[BUILTIN_TOOL_CALCULATOR],
        min_length=1,
        max_length=32,
        description="The tools the model may call: builtin:calculator (arithmetic), "
        "builtin:python (a Python expression in a child process with time and memory limits), "
        "or FILE_OR_MODULE:callable taking the call's arguments as keywords and returning text.",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> MultiTurnSpec:
        _check_rules(self, (TOOL_RESPONSE_FITS_RULE,), "spec.rollout.multiTurn")
        return self


MULTI_TURN_NEEDS_MODE_RULE = CrossFieldRule(
    cel="!has(self.multiTurn) || self.mode == 'multiTurn'",
    message="multiTurn settings are used only with mode multiTurn: set mode: multiTurn, or "
    "remove multiTurn",
    field_path=".multiTurn",
    check=lambda r: r.multi_turn is None or r.mode is RolloutMode.MULTI_TURN,
)
# The tensor-parallel engine group (engines/tensor_parallel.py) has no async generate yet.
MULTI_TURN_ONE_GPU_ENGINE_RULE = CrossFieldRule(
    cel="self.mode != 'multiTurn' || self.tensorParallelSize == 1",
    message="mode multiTurn runs on engines of one GPU each for now: set tensorParallelSize 1",
    field_path=".mode",
    check=lambda r: r.mode is not RolloutMode.MULTI_TURN or r.tensor_parallel_size == 1,
)
ROLLOUT_RULES: tuple[CrossFieldRule, ...] = (
    STAGED_NEEDS_TAGS_RULE,
    MULTI_TURN_NEEDS_MODE_RULE,
    MULTI_TURN_ONE_GPU_ENGINE_RULE,
)


class RolloutSpec(_Spec):
    """The rollout engine that shares the GPUs with training (verl: actor_rollout_ref.rollout)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*ROLLOUT_RULES))

    engine: EngineName = Field(
        default=EngineName.SGLANG,
        description="sglang: the production engine. torch: the reference engine on "
        "transformers (CPU runs, tests and measurement; not a production engine). "
        "Immutable after creation.",
        json_schema_extra=immutable("spec.rollout.engine"),
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs per engine (verl: rollout.tensor_model_parallel_size); must divide "
        "the ranks of one worker (gpusPerWorker, or cpuRanksPerWorker on CPU). Immutable.",
        json_schema_extra=immutable("spec.rollout.tensorParallelSize"),
    )
    mem_fraction_static: MemFraction = Field(
        default=0.85,
        description="Fraction of device memory for the engine's weights plus KV cache "
        "(sglang's mem_fraction_static; verl: rollout.gpu_memory_utilization). Staged "
        "wake-up makes 0.9-0.95 reachable. Auto: the memory plan picks, on the card the job "
        "got, the fraction with the largest KV cache whose every stage fits within "
        "spec.memoryPlan.margin (docs/zero-tuning.md).",
    )
    wake_up: WakeUpSetting = Field(
        default=WakeUp.STAGED,
        description="staged: resume weights, update them, free training params, then resume "
        "the KV cache. single: resume weights and KV cache together (baseline). Auto: the "
        "mode the memory plan gives the larger KV cache (staged on a tie).",
    )
    weight_sync_bucket_megabytes: int = Field(
        default=512,
        ge=1,
        le=65536,
        description="Size of one weight-update bucket in MiB "
        "(verl: rollout.update_weights_bucket_megabytes).",
    )
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec, description="Sampling parameters of the rollout."
    )
    mode: RolloutMode = Field(
        default=RolloutMode.SINGLE_TURN,
        description="singleTurn: one batch of single responses per iteration. multiTurn: "
        "conversations of several turns in which the model calls tools (spec.rollout.multiTurn; "
        "docs/multi-turn.md).",
    )
    multi_turn: MultiTurnSpec | None = Field(
        default=None,
        description="Turns, budgets and tools of mode multiTurn (its defaults when absent).",
    )

    @property
    def multi_turn_settings(self) -> MultiTurnSpec | None:
        """The multiTurn settings in force: None in singleTurn, the defaults where not given."""
        if self.mode is not RolloutMode.MULTI_TURN:
            return None
        return self.multi_turn or MultiTurnSpec()

    @model_validator(mode="after")
    def _cross_field(self) -> RolloutSpec:
        _check_rules(self, ROLLOUT_RULES, "spec.rollout")
        return self


class TrainingSpec(_Spec):
    """FSDP training of the policy (verl: actor_rollout_ref.actor)."""

    strategy: Literal["fsdp2"] = Field(
        default="fsdp2", description="torch.distributed.fsdp.fully_shard over all ranks."
    )
    micro_batch_size: int = Field(
        default=2,
        ge=1,
        description="Sequences per forward/backward per rank "
        "(verl: actor.ppo_micro_batch_size_per_gpu).",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward."
    )
    offload_optimizer: bool = Field(
        default=True,
        description="Move optimizer state to pinned CPU memory during rollout "
        "(verl: actor.fsdp_config.optimizer_offload).",
    )
    offload_params: bool = Field(
        default=True,
        description="Move training parameters to CPU during rollout "
        "(verl: actor.fsdp_config.param_offload). Staged wake-up frees them before the "
        "KV cache is resumed.",
    )


class Toleration(_Spec):
    """A Kubernetes toleration for the worker pods."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value)",
                    "message": "a toleration with operator Exists must not set value",
                    "fieldPath": ".value",
                }
            ]
        }
    )

    # Bounded lengths keep the apiserver's CEL cost estimate of this list's rule small.
    key: LabelKey | None = Field(default=None, description="Taint key; empty matches all keys.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default)."
    )
    value: LabelValue | None = Field(default=None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists must not set value")
        return self


_QUANTITY_SUFFIX = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
}


def _quantity(value: str) -> Decimal:
    """A quantity's value, exactly (QUANTITY_PATTERN has held). Parsed here, not with the
    kubernetes client: the worker parses manifests too, and needs only pydantic."""
    match = re.fullmatch(
        r"(?P<number>[+-]?[0-9.]+)(?:[eE](?P<exponent>[+-]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]|))",
        value,
    )
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number = Decimal(match["number"])
    if match["exponent"] is not None:
        return number * Decimal(10) ** int(match["exponent"])
    return number * _QUANTITY_SUFFIX[match["suffix"]]


SHM_WITHIN_MEMORY_RULE = CrossFieldRule(
    cel="!isQuantity(self.sharedMemory) || !isQuantity(self.memory) || "
    "quantity(self.sharedMemory).compareTo(quantity(self.memory)) <= 0",
    message="sharedMemory is memory-backed (/dev/shm counts against the pod's memory limit), "
    "so it may not exceed memory",
    field_path=".sharedMemory",
    check=lambda r: _quantity(r.shared_memory) <= _quantity(r.memory),
)
RESOURCES_RULES: tuple[CrossFieldRule, ...] = (SHM_WITHIN_MEMORY_RULE,)


class ResourcesSpec(_Spec):
    """Where and how big the Ray pods are."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*RESOURCES_RULES))

    workers: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Worker pods (one per node). Immutable after creation.",
        json_schema_extra=immutable("spec.resources.workers"),
    )
    gpus_per_worker: int = Field(
        default=1,
        ge=0,
        le=16,
        description="nvidia.com/gpu per worker pod, one rank per GPU; 0 runs on CPU (kind, "
        "laptops) with cpuRanksPerWorker ranks. Immutable after creation.",
        json_schema_extra=immutable("spec.resources.gpusPerWorker"),
    )
    cpu_ranks_per_worker: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks (processes on gloo) per worker pod when gpusPerWorker is 0; ignored "
        "on GPU. Immutable after creation.",
        json_schema_extra=immutable("spec.resources.cpuRanksPerWorker"),
    )
    image: ImageReference = Field(
        default="ghcr.io/rljob/worker:0.1.0",
        description="Worker image for the Ray head and workers: [registry[:port]/]path[:tag]"
        "[@digest].",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the worker image."
    )
    cpu: PositiveQuantity = Field(default="8", description="CPU request and limit per worker pod.")
    memory: PositiveQuantity = Field(
        default="64Gi", description="Memory request and limit per worker pod."
    )
    shared_memory: PositiveQuantity = Field(
        default="16Gi",
        description="Size of the /dev/shm volume (NCCL, Ray object store); memory-backed, so it "
        "counts against the pod's memory and may not exceed it.",
    )
    head_cpu: PositiveQuantity = Field(default="2", description="CPU of the Ray head pod.")
    head_memory: PositiveQuantity = Field(default="8Gi", description="Memory of the Ray head pod.")
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        max_length=64,
        description="Node labels the worker pods must match.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations of the worker pods."
    )
    priority_class_name: DNSSubdomain | None = Field(
        default=None,
        description="PriorityClass of the head and worker pods (it must exist: the apiserver "
        "refuses pods that name a missing one, and the RLJob then fails to start).",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> ResourcesSpec:
        _check_rules(self, RESOURCES_RULES, "spec.resources")
        return self

    @property
    def ranks_per_worker(self) -> int:
        """One rank per GPU; on CPU, cpu_ranks_per_worker processes."""
        return self.gpus_per_worker if self.gpus_per_worker > 0 else self.cpu_ranks_per_worker


# ---------------------------------------------------------------------------------------------
# Storage and environment of the Ray containers (issue 30): spec.volumes, spec.volumeMounts,
# spec.env, spec.envFrom. Kubernetes' own shapes, cut down to the volume sources rljob supports;
# names and paths the operator uses itself are refused, so a user's never silently replaces one.
# ---------------------------------------------------------------------------------------------

# What the operator mounts and sets in every Ray container itself (rljob_operator.render).
JOB_CONFIG_DIR = "/etc/rljob"
JOB_CONFIG_VOLUME = "job-config"
SHM_DIR = "/dev/shm"
SHM_VOLUME = "dshm"
RAY_MEMORY_MONITOR_ENV = "RAY_memory_monitor_refresh_ms"
SGL_TP_IMBALANCE_ENV = "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK"
SGLANG_TP_IMBALANCE_ENV = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"
OPERATOR_VOLUMES: dict[str, str] = {
    JOB_CONFIG_VOLUME: f"the job config, mounted at {JOB_CONFIG_DIR}",
    SHM_VOLUME: f"{SHM_DIR}, sized by spec.resources.sharedMemory",
}
OPERATOR_MOUNT_PATHS: dict[str, str] = {
    JOB_CONFIG_DIR: f"the job config (volume {JOB_CONFIG_VOLUME})",
    SHM_DIR: f"shared memory for NCCL and Ray (volume {SHM_VOLUME})",
}
OPERATOR_ENV: dict[str, str] = {
    RAY_MEMORY_MONITOR_ENV: "0: Ray's memory monitor off, so a host OOM is the kernel's OOMKilled",
    SGL_TP_IMBALANCE_ENV: "with tensorParallelSize > 1",
    SGLANG_TP_IMBALANCE_ENV: "with tensorParallelSize > 1",
}
SUPPORTED_VOLUME_SOURCES: tuple[str, ...] = (
    "persistentVolumeClaim",
    "configMap",
    "secret",
    "emptyDir",
    "hostPath",
)

# An absolute path without empty components; a path relative to a volume (subPath, items[].path)
# the same without the leading '/'. '.' and '..' components are refused by a rule, so a clash
# with the operator's paths cannot hide behind /etc/./rljob.
ABSOLUTE_PATH_PATTERN = r"^/(?:[^/]+/?)*$"
RELATIVE_PATH_PATTERN = r"^[^/]+(?:/[^/]+)*$"
_DOT_COMPONENT = r"(^|/)\.\.?(/|$)"
NO_DOT_COMPONENTS_RULE = ValueRule(
    cel=f"!self.matches(r'{_DOT_COMPONENT}')",
    message="a path here may not have '.' or '..' components",
    check=lambda v: re.search(_DOT_COMPONENT, v) is None,
)
# Environment variable names as Kubernetes has long checked them (a C identifier, plus '-' and
# '.'); a ConfigMap or Secret key.
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


def _not_operator_volume(name: str, what: str) -> ValueRule:
    return ValueRule(
        cel=f"self != '{name}'",
        message=f"volume name {name} is the operator's own volume ({what}); "
        "give your volume another name",
        check=lambda v: v != name,
    )


def _not_operator_path(path: str, what: str) -> ValueRule:
    return ValueRule(
        cel=f"self != '{path}' && !self.startsWith('{path}/')",
        message=f"mountPath {path} (and anything under it) is where the operator mounts {what}; "
        "mount your volume elsewhere",
        check=lambda v: v != path and not v.startswith(f"{path}/"),
    )


def _not_operator_env(name: str, why: str) -> ValueRule:
    return ValueRule(
        cel=f"self != '{name}'",
        message=f"env {name} is set by the operator ({why}); remove it from spec.env",
        check=lambda v: v != name,
    )


VolumeName = Annotated[
    str,
    Field(pattern=rf"^{_DNS_LABEL}$", min_length=1, max_length=63),
    *_with_rules(*(_not_operator_volume(n, w) for n, w in OPERATOR_VOLUMES.items())),
]
MountPath = Annotated[
    str,
    Field(pattern=ABSOLUTE_PATH_PATTERN, min_length=1, max_length=1024),
    *_with_rules(
        NO_DOT_COMPONENTS_RULE, *(_not_operator_path(p, w) for p, w in OPERATOR_MOUNT_PATHS.items())
    ),
]
HostPath = Annotated[
    str,
    Field(pattern=ABSOLUTE_PATH_PATTERN, min_length=1, max_length=1024),
    *_with_rules(NO_DOT_COMPONENTS_RULE),
]
RelativePath = Annotated[
    str,
    Field(pattern=RELATIVE_PATH_PATTERN, min_length=1, max_length=1024),
    *_with_rules(NO_DOT_COMPONENTS_RULE),
]
EnvName = Annotated[
    str,
    Field(pattern=ENV_NAME_PATTERN, min_length=1, max_length=256),
    *_with_rules(*(_not_operator_env(n, w) for n, w in OPERATOR_ENV.items())),
]
ConfigKey = Annotated[str, Field(pattern=CONFIG_KEY_PATTERN, min_length=1, max_length=253)]
FileMode = Annotated[int, Field(ge=0, le=0o777)]


def _exactly_one(what: str, fields: tuple[str, ...], context: str) -> CrossFieldRule:
    """A rule that exactly one of `fields` (camelCase, as on the wire) is set."""
    snake = tuple(re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), f) for f in fields)
    return CrossFieldRule(
        cel="[" + ", ".join(f"has(self.{f})" for f in fields) + "].exists_one(s, s)",
        message=f"{what} sets exactly one of " + ", ".join(fields) + context,
        field_path="",
        check=lambda m: sum(getattr(m, f) is not None for f in snake) == 1,
    )


class _Ruled(_Spec):
    """A section whose CrossFieldRules (`rules`, CEL on the CRD) the model checks as well;
    `where` names the section in the message."""

    rules: ClassVar[tuple[CrossFieldRule, ...]] = ()
    where: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.model_config = {**cls.model_config, "json_schema_extra": _cel_rules(*cls.rules)}

    @model_validator(mode="after")
    def _cross_field(self) -> Self:
        _check_rules(self, self.rules, self.where)
        return self


class KeyToPath(_Spec):
    """One key of a ConfigMap or Secret projected as a file (Kubernetes KeyToPath)."""

    key: ConfigKey = Field(description="The key in the ConfigMap or Secret.")
    path: RelativePath = Field(description="File path relative to the mount point.")
    mode: FileMode | None = Field(default=None, description="File mode bits (0 to 0777).")


class PersistentVolumeClaimSource(_Spec):
    """A PersistentVolumeClaim in the RLJob's namespace (checkpoints, data, models)."""

    claim_name: DNSSubdomain = Field(description="The claim's name.")
    read_only: bool | None = Field(default=None, description="Mount the claim read-only.")


class _KeysAsFiles(_Spec):
    """What a ConfigMap volume and a Secret volume share: which keys, as which files."""

    items: list[KeyToPath] | None = Field(
        default=None,
        max_length=64,
        description="Only these keys, each at its path (default: every key, named by key).",
    )
    default_mode: FileMode | None = Field(
        default=None, description="Mode bits of the files (0 to 0777; default 0644)."
    )
    optional: bool | None = Field(default=None, description="Start without it if it is missing.")


class ConfigMapVolumeSource(_KeysAsFiles):
    """A ConfigMap's keys as files (a reward function, a small prompt file)."""

    name: DNSSubdomain = Field(description="The ConfigMap's name.")


class SecretVolumeSource(_KeysAsFiles):
    """A Secret's keys as files (credentials a library reads from a file)."""

    secret_name: DNSSubdomain = Field(description="The Secret's name.")


class EmptyDirVolumeSource(_Spec):
    """Scratch space that lives as long as the pod."""

    medium: Literal["", "Memory"] | None = Field(
        default=None, description="'' (node disk) or Memory (tmpfs, counts against memory)."
    )
    size_limit: PositiveQuantity | None = Field(
        default=None, description="The most it may hold (e.g. 20Gi); the pod is evicted beyond."
    )


class HostPathVolumeSource(_Spec):
    """A node's directory or file (a node-local model cache, say); the node's to keep."""

    path: HostPath = Field(description="Absolute path on the node.")
    type: (
        Literal[
            "",
            "DirectoryOrCreate",
            "Directory",
            "FileOrCreate",
            "File",
            "Socket",
            "CharDevice",
            "BlockDevice",
        ]
        | None
    ) = Field(default=None, description="What must be at path ('' checks nothing).")


VOLUME_SOURCE_RULE = _exactly_one(
    "a volume",
    SUPPORTED_VOLUME_SOURCES,
    " (the supported sources; docs/volumes-and-env.md)",
)


class Volume(_Ruled):
    """A Kubernetes Volume of the Ray pods, with one of the supported sources."""

    rules = (VOLUME_SOURCE_RULE,)
    where = "spec.volumes[]"

    name: VolumeName = Field(description="The name volumeMounts refer to (a DNS label).")
    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    config_map: ConfigMapVolumeSource | None = None
    secret: SecretVolumeSource | None = None
    empty_dir: EmptyDirVolumeSource | None = None
    host_path: HostPathVolumeSource | None = None


class VolumeMount(_Spec):
    """Where a volume of spec.volumes appears in the Ray containers (head and workers)."""

    name: VolumeName = Field(description="A volume of spec.volumes.")
    mount_path: MountPath = Field(
        description=f"Absolute path in the container; not {JOB_CONFIG_DIR} or {SHM_DIR} "
        "(the operator's) nor anything under them."
    )
    sub_path: RelativePath | None = Field(
        default=None, description="A path inside the volume to mount instead of its root."
    )
    read_only: bool | None = Field(default=None, description="Mount read-only.")


class KeySelector(_Spec):
    """One key of a Secret or ConfigMap in the RLJob's namespace."""

    name: DNSSubdomain = Field(description="The Secret's or ConfigMap's name.")
    key: ConfigKey = Field(description="The key whose value the variable takes.")
    optional: bool | None = Field(
        default=None, description="Leave the variable unset if the key is missing."
    )


ENV_VALUE_SOURCE_RULE = _exactly_one(
    "valueFrom", ("secretKeyRef", "configMapKeyRef"), " (the supported sources)"
)


class EnvVarSource(_Ruled):
    """Where an env var's value comes from, so a secret never appears in the manifest."""

    rules = (ENV_VALUE_SOURCE_RULE,)
    where = "spec.env[].valueFrom"

    secret_key_ref: KeySelector | None = None
    config_map_key_ref: KeySelector | None = None


ENV_ONE_VALUE_RULE = CrossFieldRule(
    cel="!has(self.value) || !has(self.valueFrom)",
    message="an env var has value or valueFrom, not both",
    field_path=".valueFrom",
    check=lambda e: e.value is None or e.value_from is None,
)


class EnvVar(_Ruled):
    """An environment variable of the Ray containers: a literal value or one from a Secret or
    ConfigMap key ($(NAME) references expand as Kubernetes expands them)."""

    rules = (ENV_ONE_VALUE_RULE,)
    where = "spec.env[]"

    name: EnvName = Field(description="The variable's name.")
    value: str | None = Field(
        default=None, max_length=32768, description="A literal value (never a secret)."
    )
    value_from: EnvVarSource | None = None


class LocalObjectRef(_Spec):
    """A Secret or ConfigMap in the RLJob's namespace, all of whose keys become env vars."""

    name: DNSSubdomain = Field(description="The Secret's or ConfigMap's name.")
    optional: bool | None = Field(default=None, description="Start without it if it is missing.")


ENV_FROM_SOURCE_RULE = _exactly_one("envFrom", ("secretRef", "configMapRef"), "")


class EnvFromSource(_Ruled):
    """Every key of a Secret or ConfigMap as an env var (env wins over envFrom on a name, so
    the operator's own variables cannot be replaced this way)."""

    rules = (ENV_FROM_SOURCE_RULE,)
    where = "spec.envFrom[]"

    prefix: Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=64)] | None = Field(
        default=None, description="Prepended to every key's name."
    )
    secret_ref: LocalObjectRef | None = None
    config_map_ref: LocalObjectRef | None = None


def _unique(key: Callable[[Any], str], what: str) -> Callable[[list[Any]], list[Any]]:
    """A list validator mirroring x-kubernetes-list-type map (the apiserver refuses repeats)."""

    def check(items: list[Any]) -> list[Any]:
        seen: set[str] = set()
        for item in items:
            if key(item) in seen:
                raise ValueError(f"{what} {key(item)!r} appears twice")
            seen.add(key(item))
        return items

    return check


def _map_list(key: str) -> dict[str, Any]:
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}


Volumes = Annotated[
    list[Volume],
    Field(max_length=64, json_schema_extra=_map_list("name")),
    AfterValidator(_unique(lambda v: v.name, "volume name")),
]
VolumeMounts = Annotated[
    list[VolumeMount],
    Field(max_length=64, json_schema_extra=_map_list("mountPath")),
    AfterValidator(_unique(lambda m: m.mount_path, "mountPath")),
]
EnvVars = Annotated[
    list[EnvVar],
    Field(max_length=256, json_schema_extra=_map_list("name")),
    AfterValidator(_unique(lambda e: e.name, "env name")),
]

MOUNTS_NAME_VOLUMES_RULE = CrossFieldRule(
    cel="self.volumeMounts.all(m, self.volumes.exists(v, v.name == m.name))",
    message="every volumeMounts[].name must be the name of a volume in spec.volumes",
    field_path=".volumeMounts",
    check=lambda s: {m.name for m in s.volume_mounts} <= {v.name for v in s.volumes},
)


TP_DIVIDES_RANKS_RULE = CrossFieldRule(
    cel="(self.resources.gpusPerWorker > 0 ? self.resources.gpusPerWorker "
    ": self.resources.cpuRanksPerWorker) % self.rollout.tensorParallelSize == 0",
    message="rollout.tensorParallelSize must divide the ranks of one worker "
    "(resources.gpusPerWorker, or resources.cpuRanksPerWorker when that is 0)",
    field_path=".rollout.tensorParallelSize",
    check=lambda s: s.resources.ranks_per_worker % s.rollout.tensor_parallel_size == 0,
)
SGLANG_NEEDS_GPU_RULE = CrossFieldRule(
    cel="self.rollout.engine != 'sglang' || self.resources.gpusPerWorker >= 1",
    message="rollout.engine sglang needs resources.gpusPerWorker >= 1 (use engine torch on CPU)",
    field_path=".resources.gpusPerWorker",
    check=lambda s: s.rollout.engine != EngineName.SGLANG or s.resources.gpus_per_worker >= 1,
)


def _min_fraction_problem(s: RLJobSpec) -> str | None:
    """Checked by the models only: CEL cannot read memFractionStatic (an untyped field)."""
    fraction = s.rollout.mem_fraction_static
    if s.oom_policy.max_retries == 0 or fraction == AUTO or s.oom_policy.min_fraction <= fraction:
        return None
    return (
        "spec.oomPolicy.minFraction: oomPolicy.minFraction must not exceed "
        "rollout.memFractionStatic (retries only lower the fraction)"
    )


SPEC_RULES: tuple[CrossFieldRule, ...] = (
    TP_DIVIDES_RANKS_RULE,
    SGLANG_NEEDS_GPU_RULE,
    MOUNTS_NAME_VOLUMES_RULE,
)


class MisfitAction(StrEnum):
    REJECT = "Reject"
    WARN = "Warn"


# The plan's largest |error| per stage peak on the current tree's GPU runs is 2.79% (and that one
# an over-prediction); every stored run's, 4.88%, came from trees since fixed (the cuBLAS
# workspace pinning freed training memory): bench/results/plan-accuracy.md.
DEFAULT_PLAN_MARGIN = 0.015


class MemoryPlanSpec(_Spec):
    """What to do when the memory plan (rljob/plan.py) says the job will not fit its GPUs."""

    on_misfit: MisfitAction = Field(
        default=MisfitAction.WARN,
        description="Reject: a job predicted not to fit is not started (no RayJob; phase "
        "Failed). Warn: it starts, with condition MemoryPlanFits=False and a Warning Event.",
    )
    gpu_memory: PositiveQuantity | None = Field(
        default=None,
        description="Memory of one GPU (e.g. 80Gi, or 85017493504) for the operator's plan "
        "before any pod runs; the driver reads the real GPU and plans again before starting.",
    )
    margin: float = Field(
        default=DEFAULT_PLAN_MARGIN,
        ge=0,
        lt=0.5,
        description="For rollout Auto: the share of the GPU every stage's predicted peak leaves "
        "free (the plan's error). The default 0.015 covers the largest amount by which a stage "
        "needed more than planned in every stored GPU run, 1.25% of the GPU "
        "(docs/zero-tuning.md). An OOM retry raises it by the overshoot it measured.",
    )


class OffloadMode(StrEnum):
    AUTO = "Auto"
    ALWAYS = "Always"


class OOMPolicySpec(_Spec):
    """Retries after a CUDA out-of-memory in a stage, each a new RayJob with adjusted knobs."""

    max_retries: int = Field(
        default=0, ge=0, le=20, description="New attempts after a CUDA OOM; 0 never retries."
    )
    fraction_step: float = Field(
        default=0.05,
        gt=0,
        lt=1,
        description="How much each retry lowers rollout.memFractionStatic.",
    )
    min_fraction: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="A retry never lowers memFractionStatic below this.",
    )
    switch_to_staged: bool = Field(
        default=True,
        description="A job in wakeUp single retries first as staged (same fraction).",
    )
    min_micro_batch_size: int = Field(
        default=1,
        ge=1,
        description="A CUDA OOM in train or offload_optimizer (the engine is released then, so "
        "its fraction cannot help) halves training.microBatchSize, never below this.",
    )
    gradient_checkpointing: bool = Field(
        default=True,
        description="Once training.microBatchSize is at minMicroBatchSize, a training-stage OOM "
        "retries with gradient checkpointing on (slower, far fewer activations).",
    )


class ResumeMode(StrEnum):
    AUTO = "Auto"
    NEVER = "Never"


class CheckpointMode(StrEnum):
    ASYNC = "Async"
    SYNC = "Sync"


class CheckpointSpec(_Spec):
    """Where and how often the job saves what a resumed run needs (docs/checkpoints.md)."""

    path: str = Field(
        min_length=1,
        description="A directory (in a mounted volume on a cluster): each checkpoint is a "
        "subdirectory iteration-NNNNNNNN, complete once its COMPLETE marker is written.",
    )
    every_iterations: int = Field(
        default=1, ge=1, description="Save after the train stage of every N-th iteration."
    )
    keep: int = Field(
        default=2,
        ge=1,
        description="The newest N complete checkpoints stay; an older one is deleted only after "
        "a newer one is complete.",
    )
    resume: ResumeMode = Field(
        default=ResumeMode.AUTO,
        description="Auto: a new attempt (or run) continues from the newest complete checkpoint "
        "under path. Never: always start at iteration 0.",
    )
    mode: CheckpointMode = Field(
        default=CheckpointMode.ASYNC,
        description="Async: the loop stops only to copy the training state to host memory; the "
        "files are written behind the next stages, complete once every rank's part and the "
        "marker are durable (the next save and the job's end wait for it). Sync: the checkpoint "
        "stage ends with the checkpoint complete.",
    )


class ExportSpec(_Spec):
    """The trained policy as a Hugging Face directory (safetensors, config.json, tokenizer)."""

    path: str = Field(
        min_length=1,
        description="Directory written at the end of the run (replaced atomically); with "
        "withCheckpoints, also as iteration-NNNNNNNN/ under it with each checkpoint.",
    )
    with_checkpoints: bool = Field(
        default=False, description="Also export the policy with every checkpoint."
    )


DEFAULT_STARTUP_TIMEOUT_SECONDS = 900

# KubeRay names the RayCluster after the RayJob (which carries the RLJob's name) plus a suffix,
# and Services after that: it refuses RayJob names over 47 characters or not DNS-1035 labels.
MAX_NAME_LENGTH = 47
NAME_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        cel=f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        message=f"metadata.name must be at most {MAX_NAME_LENGTH} characters (KubeRay names "
        "the Ray cluster and its Services after it)",
        field_path=".metadata.name",
        check=lambda name: len(name) <= MAX_NAME_LENGTH,
    ),
    CrossFieldRule(
        cel=f"self.metadata.name.matches(r'{DNS_1035_LABEL_PATTERN}')",
        message="metadata.name must start with a letter and hold only lower-case letters, "
        "digits and '-' (a DNS-1035 label: KubeRay names a Service after it)",
        field_path=".metadata.name",
        check=lambda name: re.match(DNS_1035_LABEL_PATTERN, name) is not None,
    ),
)


def name_problems(name: str) -> list[tuple[str, str]]:
    """(field, message) for each NAME_RULES rule the RLJob's name breaks (admission checks the
    same rules at the CRD's root, so this finds something only under an older CRD)."""
    return [
        ("metadata.name", f"{r.message}; got {name!r}") for r in NAME_RULES if not r.check(name)
    ]


class RLJobSpec(_Spec):
    """A colocated RL job: FSDP training and a rollout engine on the same GPUs."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*SPEC_RULES))

    model: ModelSpec = Field(default_factory=ModelSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    volumes: Volumes = Field(
        default=[],
        description="Volumes of the Ray pods (head and workers). Supported sources: "
        + ", ".join(SUPPORTED_VOLUME_SOURCES)
        + f". Not {JOB_CONFIG_VOLUME} or {SHM_VOLUME} (the operator's own).",
    )
    volume_mounts: VolumeMounts = Field(
        default=[],
        description="Mounts of spec.volumes in the Ray containers (head and workers).",
    )
    env: EnvVars = Field(
        default=[],
        description="Environment of the Ray containers (head and workers): value, or valueFrom "
        "a secretKeyRef or configMapKeyRef (HF_TOKEN from a Secret). Not the names the "
        "operator sets: " + ", ".join(OPERATOR_ENV) + ".",
    )
    env_from: list[EnvFromSource] = Field(
        default=[],
        max_length=32,
        description="Secrets or ConfigMaps whose every key becomes an env var of the Ray "
        "containers (spec.env and the operator's own variables win on a name).",
    )
    suspend: bool = Field(
        default=False, description="true deletes the RayJob's pods and keeps the RLJob."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the Ray cluster (its pods) this long after the job finishes; the "
        "RayJob and the RLJob with its status stay. Unset means 0: as soon as it finishes.",
    )

    startup_timeout_seconds: int = Field(
        default=DEFAULT_STARTUP_TIMEOUT_SECONDS,
        ge=1,
        le=7 * 24 * 3600,
        description="A job whose Ray job is not running this long after it was created (or "
        "resumed) fails with reason StartupTimeout and the last cause seen; the operator then "
        "suspends its RayJob, so KubeRay deletes its pods (docs/status-and-events.md).",
    )
    backoff_limit: int = Field(
        default=0,
        ge=0,
        le=100,
        description="How many times KubeRay runs a failed Ray job again on a new Ray cluster "
        "(the RayJob's backoffLimit): a lost pod, a crashed rank. With spec.checkpoint "
        "(resume Auto) each run continues from the newest complete checkpoint "
        "(docs/checkpoints.md). OOMs are the OOM policy's (spec.oomPolicy), not this.",
    )
    memory_plan: MemoryPlanSpec = Field(
        default_factory=MemoryPlanSpec,
        description="Admission by the per-stage memory plan (docs/memory-plan.md).",
    )
    offload: OffloadMode = Field(
        default=OffloadMode.AUTO,
        description="Auto: offload optimizer state and training params only when, and only as "
        "much as, the memory plan says the engine needs (within training.offloadOptimizer and "
        "training.offloadParams). Always: offload as those two flags say.",
    )
    oom_policy: OOMPolicySpec = Field(
        default_factory=OOMPolicySpec,
        description="Bounded retries after a CUDA OOM (a container OOMKilled is not retried).",
    )
    checkpoint: CheckpointSpec | None = Field(
        default=None,
        description="Periodic checkpoints and resume from the newest (docs/checkpoints.md).",
    )
    export: ExportSpec | None = Field(
        default=None,
        description="The trained policy as a Hugging Face directory (docs/checkpoints.md).",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> RLJobSpec:
        _check_rules(self, SPEC_RULES, "spec")
        problem = _min_fraction_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the colocated loop: one per GPU; on CPU, cpuRanksPerWorker per worker."""
        return self.resources.workers * self.resources.ranks_per_worker


class Phase(StrEnum):
    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(_Spec):
    """metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class RayJobRef(_Spec):
    name: str
    job_status: str = ""
    job_deployment_status: str = ""


class AttemptKnobs(_Spec):
    """The memory knobs one attempt runs with (the OOM policy changes them between attempts;
    the spec keeps what the user wrote). The training knobs are None where the spec's stand."""

    mem_fraction_static: MemFraction
    wake_up: WakeUpSetting
    micro_batch_size: int | None = Field(default=None, ge=1)
    gradient_checkpointing: bool | None = None
    # Under Auto the knobs keep "Auto" (the driver resolves it on the real card) and carry the
    # margin explicitly: an OOM retry raises it by the overshoot it measured, so the next
    # attempt's choice is lower by what the last one lacked. None: spec.memoryPlan.margin.
    margin: float | None = Field(default=None, ge=0, lt=0.5)

    def apply(self, spec: RLJobSpec) -> RLJobSpec:
        """`spec` as this attempt runs it: the user's, with these knobs in place."""
        rollout = spec.rollout.model_copy(
            update={"mem_fraction_static": self.mem_fraction_static, "wake_up": self.wake_up}
        )
        training: dict[str, Any] = {}
        if self.micro_batch_size is not None:
            training["micro_batch_size"] = self.micro_batch_size
        if self.gradient_checkpointing is not None:
            training["gradient_checkpointing"] = self.gradient_checkpointing
        memory_plan = spec.memory_plan
        if self.margin is not None:
            memory_plan = memory_plan.model_copy(update={"margin": self.margin})
        return spec.model_copy(
            update={
                "rollout": rollout,
                "training": spec.training.model_copy(update=training),
                "memory_plan": memory_plan,
            }
        )


def status_apply_body(
    namespace: str, name: str, status: dict[str, Any], uid: str | None = None
) -> dict[str, Any]:
    """The body of a server-side apply of RLJob `name`'s status (the operator's and the driver's
    writes). With `uid` it is a precondition: the apiserver refuses the write (409) unless the
    RLJob of that name is still that object, so status computed for a job never lands on one
    applied again under its name meanwhile."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "status": status}


class ResumePoint(_Spec):
    """The checkpoint a run continued from (docs/checkpoints.md): `status.resumedFrom` (driver,
    with its attempt) and `status.attempts[].resumedFrom` (operator, without)."""

    iteration: int = Field(ge=0, description="The checkpoint's iteration.")
    path: str = Field(description="The checkpoint's directory.")
    attempt: int | None = Field(
        default=None, ge=1, description="status.resumedFrom: the attempt whose driver resumed."
    )


class CheckpointFailure(_Spec):
    """`status.checkpointFailure` (driver): a save that failed; the job ends Failed with reason
    CheckpointFailed and this error (docs/checkpoints.md)."""

    iteration: int = Field(ge=0, description="The iteration whose checkpoint failed.")
    path: str = Field(description="The directory it was written to (it has no COMPLETE marker).")
    rank: int = Field(ge=0, description="The first rank (lowest number) that failed.")
    error: str = Field(
        max_length=1024, description="The OS error, e.g. [Errno 28] No space left on device."
    )
    attempt: int | None = Field(default=None, ge=1, description="The attempt it happened in.")

    def describe(self) -> str:
        """One line for the Failed condition, status.cause and the driver's log."""
        return (
            f"the checkpoint of iteration {self.iteration} in {self.path} failed on rank "
            f"{self.rank}: {self.error}"
        )


# The Failed condition's reason (and the Warning Event's) when a checkpoint save failed.
REASON_CHECKPOINT_FAILED = "CheckpointFailed"


class Attempt(_Spec):
    """One `status.attempts` entry (operator-owned): a RayJob run with its knobs and outcome."""

    attempt: int = Field(ge=1)
    ray_job: str = Field(default="", description="The RayJob of this attempt.")
    mem_fraction_static: MemFraction
    wake_up: WakeUpSetting | None = None
    margin: float | None = Field(
        default=None,
        description="Auto: spec.memoryPlan.margin as this attempt ran it (an OOM retry raises "
        "it by the overshoot it measured).",
    )
    result: str = Field(
        default="", description="Running, Succeeded, Failed, CUDAOutOfMemory or OOMKilled."
    )
    micro_batch_size: int | None = Field(
        default=None, description="training.microBatchSize, where the OOM policy changed it."
    )
    gradient_checkpointing: bool | None = Field(
        default=None, description="training.gradientCheckpointing, where the policy changed it."
    )
    changed: str | None = Field(
        default=None,
        max_length=512,
        description="Which knob this attempt changed from the one before, and why.",
    )
    oom_stage: Stage | None = None
    oom_rank: int | None = None
    message: str = Field(default="", max_length=1024)
    started_at: str | None = Field(
        default=None,
        description="RFC 3339: when this attempt's RayJob was created.",
    )
    resumed_from: ResumePoint | None = Field(
        default=None,
        description="The checkpoint (iteration, path) this attempt last resumed from (absent: "
        "it started at iteration 0).",
    )

    @classmethod
    def ran_with(cls, number: int, knobs: AttemptKnobs, **fields: Any) -> Attempt:
        """Attempt `number` as it ran with `knobs` (the operator's entries, `rljob run`'s)."""
        return cls(
            attempt=number,
            mem_fraction_static=knobs.mem_fraction_static,
            wake_up=knobs.wake_up,
            micro_batch_size=knobs.micro_batch_size,
            gradient_checkpointing=knobs.gradient_checkpointing,
            margin=knobs.margin,
            **fields,
        )


class PlannedStage(_Spec):
    """One stage of `status.plan`: the predicted device peak of the worst rank."""

    name: Stage
    peak_bytes: int = Field(ge=0)
    peak_fraction: float = Field(ge=0)


class PlannedLoad(_Spec):
    """`status.plan.load`: the predicted start-up peak (models built and loaded, before
    iteration 0) of the worst rank, and the host bytes loading takes per worker pod."""

    peak_bytes: int = Field(ge=0)
    peak_fraction: float = Field(ge=0)
    host_bytes_per_node: int = Field(
        ge=0, description="Per worker pod: its ranks' slice buffers while they read the files."
    )


class PlanCandidate(_Spec):
    """One (wakeUp, memFractionStatic) the Auto choice planned."""

    wake_up: WakeUp
    mem_fraction_static: float
    worst_stage: Stage
    peak_bytes: int = Field(ge=0, description="The worst stage's predicted peak.")
    kv_tokens: int = Field(ge=0)
    kv_pool_bytes: int = Field(ge=0)
    fits: bool = Field(description="Every stage within the limit (capacity less the margin).")


MAX_PLAN_CANDIDATES = 8


class AutoStatus(_Spec):
    """What rollout Auto chose, against what, and why (rljob/plan.py auto_choice)."""

    margin: float = Field(description="spec.memoryPlan.margin as this attempt ran it.")
    limit_bytes: int = Field(ge=0, description="Capacity less the margin: no stage may pass it.")
    planned: int = Field(ge=0, description="Candidates planned (wakeUp modes x fractions).")
    reason: str = Field(default="", max_length=1024)
    candidates: list[PlanCandidate] = Field(
        default_factory=list,
        max_length=MAX_PLAN_CANDIDATES,
        description="Per wakeUp mode the chosen or best fitting candidate and the next one up "
        "that does not fit (bounded).",
    )


class PlanStatus(_Spec):
    """`status.plan`, written by the job's driver before iteration 1 (rljob/plan.py)."""

    capacity_bytes: int = Field(ge=0)
    wake_up: WakeUp
    mem_fraction_static: float
    fits: bool
    offload_optimizer: bool
    offload_params: bool
    stages: list[PlannedStage]
    largest_fitting_fraction: dict[str, float | None] = Field(
        default_factory=dict, description="wakeUp mode -> largest memFractionStatic that fits."
    )
    auto: AutoStatus | None = Field(
        default=None, description="Where rollout Auto chose the mode or fraction: how and why."
    )
    attempt: int | None = Field(
        default=None,
        ge=1,
        description="The OOM policy's attempt this plan was made for (a retry's overshoot is "
        "measured against its own attempt's plan only).",
    )
    load: PlannedLoad | None = Field(
        default=None, description="The start-up: policy and reference built and loaded."
    )


def oom_event_id(record: OOMRecord) -> str:
    """A stable key for one OOM entry (status.oomEvents is a map list keyed by it).

    CUDA OOMs are one per (rank, iteration, stage, time). OOMKilled entries aggregate every
    kill of one container, so their key is the pod and container.
    """
    if record.kind == "OOMKilled":
        return f"killed/{record.pod}/{record.container or '-'}"
    return (
        f"cuda/rank{record.rank if record.rank is not None else '-'}"
        f"/it{record.iteration if record.iteration is not None else '-'}"
        f"/{record.stage or '-'}/{record.time}"
    )


class OOMEvent(OOMRecord):
    """One `status.oomEvents` entry: an OOMRecord plus its key and, for OOMKilled, the kills
    aggregated into it. Each writer (operator: OOMKilled; driver: CUDAOutOfMemory) owns its
    own entries under server-side apply, because the list is a map keyed by `id`."""

    id: str = Field(
        min_length=1,
        max_length=512,
        description="Stable key of the entry (set from the record when not given).",
    )
    count: int | None = Field(
        default=None, ge=1, description="OOMKilled: kills of this container aggregated here."
    )
    restart_count: int | None = Field(
        default=None,
        ge=0,
        description="OOMKilled: the container's restartCount at the latest kill counted (so a "
        "kill seen again after an operator restart is not counted twice).",
    )

    @model_validator(mode="before")
    @classmethod
    def _with_id(cls, data: Any) -> Any:
        # Drivers hand over plain OOMRecords; they become entries with a content-derived key.
        if isinstance(data, OOMRecord) and not isinstance(data, OOMEvent):
            data = data.model_dump()
        if isinstance(data, dict) and not data.get("id"):
            record = OOMRecord.model_validate(
                {
                    k: v
                    for k, v in data.items()
                    if k not in ("id", "count", "restartCount", "restart_count")
                }
            )
            data = {**data, "id": oom_event_id(record)}
        return data


class MemoryPoint(_Spec):
    """One iteration of `status.memoryHistory`: per stage the worst rank's peak bytes."""

    iteration: int = Field(ge=0)
    peak_bytes: dict[str, int] = Field(
        default_factory=dict, description="Stage name -> the worst rank's peak bytes."
    )


# status.memoryHistory keeps this many iterations (the plot's window; bounded so status stays
# far below etcd's object size limit).
MAX_MEMORY_HISTORY = 100


def history_with(history: list[MemoryPoint], memory: MemorySummary | None) -> list[MemoryPoint]:
    """`history` with the latest iteration's memory (replacing a point of the same iteration),
    the last MAX_MEMORY_HISTORY iterations kept."""
    if memory is None:
        return history
    point = MemoryPoint(
        iteration=memory.iteration, peak_bytes={str(s.name): s.peak_bytes for s in memory.stages}
    )
    kept = [p for p in history if p.iteration != point.iteration]
    return sorted([*kept, point], key=lambda p: p.iteration)[-MAX_MEMORY_HISTORY:]


class CheckpointStatus(_Spec):
    """`status.checkpoint` (driver): the newest complete checkpoint."""

    iteration: int = Field(ge=0)
    path: str
    completed_at: str = Field(description="RFC 3339: when its COMPLETE marker was written.")
    bytes: int = Field(ge=0, description="Every rank's files together.")
    seconds: float = Field(
        ge=0,
        description="From the checkpoint stage's start until it was durable (its marker "
        "written): the slowest rank.",
    )
    blocked_seconds: float | None = Field(
        default=None,
        ge=0,
        description="How long the loop stood still for it: the checkpoint stage and any wait "
        "for its writer (slowest rank). Async: less than seconds; Sync: equal.",
    )


class ExportStatus(_Spec):
    """`status.export` (driver): the newest exported Hugging Face directory."""

    path: str
    iteration: int = Field(ge=0)


class RLJobStatus(_Spec):
    """Observed state. One writer per field: the operator owns phase, conditions, rayJob,
    attempts and OOMKilled entries; the job's driver owns iteration, memory, metrics and CUDA
    OOMs."""

    phase: Phase | None = None
    cause: str | None = Field(
        default=None,
        max_length=512,
        description="Why the job failed or is blocked, one short line (the Failed or PodsReady "
        "condition's reason and message); absent while nothing is wrong.",
    )
    observed_generation: int | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        description="metav1.Condition entries, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    ray_job: RayJobRef | None = None
    iteration: int | None = None
    reward_mean: float | None = None
    kl_mean: float | None = None
    memory: MemorySummary | None = None
    memory_history: list[MemoryPoint] = Field(
        default_factory=list,
        max_length=MAX_MEMORY_HISTORY,
        description=f"Per-stage peak bytes of the last {MAX_MEMORY_HISTORY} iterations "
        "(written by the driver; `kubectl rljob plot` draws it).",
    )
    metrics: list[IterationMetrics] = Field(
        default_factory=list,
        max_length=MAX_METRICS,
        description=f"Reward, loss, KL, entropy, lengths of the last {MAX_METRICS} iterations "
        "the current attempt finished (written by the driver; `kubectl rljob curve` draws it).",
    )
    oom_events: list[OOMEvent] = Field(
        default_factory=list,
        description="The latest OOMs of each kind (the operator keeps the OOMKilled entries, "
        "the driver the CUDAOutOfMemory ones); every OOM is also an Event.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    oom_counts: dict[str, int] = Field(
        default_factory=dict,
        description="All OOMs ever seen, by kind (oomEvents keeps the last N). Each key has "
        "its own writer: OOMKilled the operator, CUDAOutOfMemory the driver.",
        json_schema_extra={"x-kubernetes-map-type": "granular"},
    )
    attempts: list[Attempt] = Field(
        default_factory=list,
        description="Every attempt (the OOM policy's retries), first to last (operator).",
    )
    plan: PlanStatus | None = Field(
        default=None, description="The memory plan the driver computed before iteration 1."
    )
    checkpoint: CheckpointStatus | None = Field(
        default=None, description="The newest complete checkpoint (driver)."
    )
    export: ExportStatus | None = Field(
        default=None, description="The newest export of the trained policy (driver)."
    )
    resumed_from: ResumePoint | None = Field(
        default=None, description="The checkpoint the current run continued from (driver)."
    )
    checkpoint_failure: CheckpointFailure | None = Field(
        default=None, description="A checkpoint save that failed and ended the job (driver)."
    )
    announced: dict[str, str] = Field(
        default_factory=dict,
        description="The checkpoint news the operator has posted Events for, by kind (written "
        "with the Events, so an operator restart does not post them again).",
        json_schema_extra={"x-kubernetes-map-type": "granular"},
    )
    # Derived by the operator from memory and oomCounts, so `kubectl get` can show them
    # (printer columns take one scalar path each).
    worst_stage_fraction: float | None = Field(
        default=None, ge=0, description="Highest peak fraction of any stage in status.memory."
    )
    oom_total: int | None = Field(default=None, ge=0, description="Sum of status.oomCounts.")


JOB_CONFIG_FILE = "job.yaml"


class JobConfig(_Spec):
    """What the worker is given (the ConfigMap mounted at /etc/rljob/job.yaml): the validated
    spec plus the RLJob's identity, so the driver knows whose status to write."""

    name: str = Field(min_length=1, description="The RLJob's name.")
    namespace: str = Field(min_length=1, description="The RLJob's namespace.")
    uid: str | None = Field(
        default=None,
        description="The RLJob's uid: the driver writes the status of that object only (a job "
        "deleted and applied again under its name is another object).",
    )
    spec: RLJobSpec
    attempt: int = Field(default=1, ge=1, description="The OOM policy's attempt number.")
    knobs: AttemptKnobs | None = Field(
        default=None, description="This attempt's memory knobs, where they differ from spec."
    )

    @property
    def effective_spec(self) -> RLJobSpec:
        """The spec this attempt runs: the user's, with the attempt's knobs applied."""
        return self.spec if self.knobs is None else self.knobs.apply(self.spec)

    def to_yaml(self) -> str:
        return yaml.dump(
            self.model_dump(by_alias=True, mode="json"), Dumper=_SafeDumper, sort_keys=False
        )

    @classmethod
    def from_yaml(cls, text: str) -> JobConfig:
        return cls.model_validate(yaml.load(text, Loader=_SafeLoader))


# libyaml's safe dumper and loader where PyYAML was built with it (its wheels are): the same
# text as the pure-Python ones for these documents (the golden ConfigMaps), 5-9x faster; the
# operator renders and parses a job config on every reconcile.
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_manifest(doc: dict[str, Any]) -> tuple[str, RLJobSpec]:
    """Validate an RLJob manifest (as `kubectl apply` would take it, the name's CEL rules
    included); return (name, spec)."""
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise ValueError(
            f"expected apiVersion {API_VERSION} and kind {KIND}, got "
            f"{doc.get('apiVersion')!r} / {doc.get('kind')!r}"
        )
    name = str((doc.get("metadata") or {}).get("name") or "")
    if not name:
        raise ValueError("metadata.name is required")
    problems = name_problems(name)
    if problems:
        raise ValueError("; ".join(f"{field}: {message}" for field, message in problems))
    return name, RLJobSpec.model_validate(doc.get("spec") or {})


def load_manifest(path: Path) -> tuple[str, RLJobSpec]:
    """The one RLJob of a YAML file (other documents, a Namespace say, are skipped), validated
    as parse_manifest does. Every problem, the file's included, is an OSError or a ValueError
    (pydantic's ValidationError is one) whose text names the file or the field."""
    try:
        docs = [d for d in yaml.load_all(path.read_text(), Loader=_SafeLoader) if d]
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from error
    if not all(isinstance(d, dict) for d in docs):
        raise ValueError(f"{path}: every YAML document must be a mapping (a Kubernetes object)")
    rljobs = [d for d in docs if d.get("kind") == KIND]
    if len(rljobs) == 1:
        return parse_manifest(rljobs[0])
    if not rljobs and len(docs) == 1:
        return parse_manifest(docs[0])  # says which apiVersion/kind it has instead
    raise ValueError(f"{path}: expected exactly one RLJob document, found {len(rljobs)}")
