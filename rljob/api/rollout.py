"""spec.rollout: the rollout engine sharing the GPUs with training, its memory fraction and
wake-up mode, sampling, and the multiTurn settings (tools, turns, budgets).
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, model_validator

from rljob.api._base import (
    BUILTIN_PREFIX,
    CrossFieldRule,
    ValueRule,
    _cel_rules,
    _check_rules,
    _Spec,
    _unique,
    _with_rules,
    immutable,
)
from rljob.api.reward import REWARD_FUNCTION_PATTERN


class EngineName(StrEnum):
    SGLANG = "sglang"
    TORCH = "torch"


class WakeUp(StrEnum):
    STAGED = "staged"
    SINGLE = "single"


# `Auto` for rollout.memFractionStatic and rollout.wakeUp: the memory plan chooses on the card
# the job got (rljob/plan/auto.py auto_choice; docs/zero-tuning.md). The spec and the attempt's
# knobs keep "Auto"; only the driver's resolved spec, which the stage machine and engine run, and
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


def _number_or_auto(number: dict[str, object], word: str = AUTO) -> dict[str, object]:
    """The CRD's schema of an untyped "Auto"-or-number field (or `word`-or-number: fsGroup's
    "None"): `number`'s bounds apply to numbers only (UNTYPED_SCHEMA above)."""
    return {
        UNTYPED_SCHEMA: {
            "x-kubernetes-preserve-unknown-fields": True,
            # No bound applies to a boolean either: `not` keeps true and false out.
            "anyOf": [
                {"enum": [word]},
                {**number, **_IMPOSSIBLE_FOR_NON_NUMBERS, "not": {"enum": [True, False]}},
            ],
        }
    }


def _only_numbers_or_auto(field: str, allowed: str, word: str = AUTO) -> BeforeValidator:
    """Before pydantic's number types, which take true as 1 and "0.5" as 0.5: the CRD refuses
    both, so `rljob run` does too."""

    def check(value: object) -> object:
        if isinstance(value, bool) or (isinstance(value, str) and value != word):
            raise ValueError(f"{field} must be {word} or {allowed}")
        return value

    return BeforeValidator(check)


MemFraction = Annotated[
    float | Literal["Auto"],
    Field(json_schema_extra=_number_or_auto(
        {"minimum": 0, "exclusiveMinimum": True, "maximum": 1, "exclusiveMaximum": True}
    )),
    _only_numbers_or_auto("memFractionStatic", "a number in (0, 1)"),
    AfterValidator(_fraction_or_auto),
]  # fmt: skip


def _megabytes_or_auto(value: int | str) -> int | str:
    if value != AUTO and not (
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65536
    ):
        raise ValueError("weightSyncBucketMegabytes must be Auto or an integer in [1, 65536]")
    return value


# An integer in [1, 65536], or Auto: untyped as MemFraction is, the number branch whole.
BucketMegabytes = Annotated[
    int | Literal["Auto"],
    Field(json_schema_extra=_number_or_auto({"minimum": 1, "maximum": 65536, "multipleOf": 1})),
    _only_numbers_or_auto("weightSyncBucketMegabytes", "an integer in [1, 65536]"),
    AfterValidator(_megabytes_or_auto),
]


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


class MultiTurnSchedule(StrEnum):
    """How the multi-turn rollout sends its turns (docs/multi-turn.md, "Which schedule")."""

    ASYNC = "async"
    TURN_BY_TURN = "turnByTurn"


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


class PartialRolloutSpec(_Spec):
    """spec.rollout.multiTurn.partialRollout: a rollout that does not wait for its slowest
    conversations (docs/multi-turn.md#partial-rollout)."""

    over_sample: float = Field(
        default=0.25,
        gt=0,
        le=4,
        description="Groups under way beyond those an iteration trains, as a fraction of them "
        "(rounded up): each rollout keeps prompts x (1 + overSample) groups going, stops once "
        "the prompts' number of groups have ended, trains the oldest of those, and pauses the "
        "rest (requests aborted, sampled tokens kept) to go on first in the next rollout.",
    )

    def groups_under_way(self, prompts: int) -> int:
        """The groups a rollout keeps going when it trains `prompts` groups: prompts plus
        prompts x overSample rounded up (100 x 0.07 is 7, not float's 7.000000000000001 -> 8)."""
        return prompts + math.ceil(round(prompts * self.over_sample, 9))


PARTIAL_NEEDS_ASYNC_RULE = CrossFieldRule(
    cel="!has(self.partialRollout) || self.schedule == 'async'",
    message="partialRollout needs schedule async (turnByTurn has no conversation to pause "
    "mid-way): set schedule: async, or remove partialRollout",
    field_path=".partialRollout",
    check=lambda m: m.partial_rollout is None or m.schedule is MultiTurnSchedule.ASYNC,
)


class MultiTurnSpec(_Spec):
    """Conversations of several turns with tools (spec.rollout.mode multiTurn; docs/multi-turn.md)."""

    model_config = ConfigDict(
        json_schema_extra=_cel_rules(TOOL_RESPONSE_FITS_RULE, PARTIAL_NEEDS_ASYNC_RULE)
    )

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
    schedule: MultiTurnSchedule = Field(
        default=MultiTurnSchedule.ASYNC,
        description="async: every conversation at its own pace, each turn sent as soon as "
        "its tools answered. turnByTurn: turn k of the open conversations as one batch "
        "(maxConcurrentConversations at a time, each group's tools before the next group), "
        "then turn k+1. Both send the same requests with the same per-turn seeds; the "
        "engine's batching can still change what is sampled. Which is faster depends on the "
        "model, the conversations and the tools' latency: docs/multi-turn.md#which-schedule.",
    )
    tools: Annotated[list[ToolName], AfterValidator(_unique(lambda t: t, "tool"))] = Field(
        default=[BUILTIN_TOOL_CALCULATOR],
        min_length=1,
        max_length=32,
        description="The tools the model may call: builtin:calculator (arithmetic), "
        "builtin:python (a Python expression in a child process with time and memory limits), "
        "or FILE_OR_MODULE:callable taking the call's arguments as keywords and returning text. "
        "Each once.",
        # A repeat is refused at apply (the apiserver's "Duplicate value"), not by every rank.
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    partial_rollout: PartialRolloutSpec | None = Field(
        default=None,
        description="Set to stop each rollout once enough whole groups have ended, carrying "
        "the conversations still under way over to the next rollout (slime's partial rollout; "
        "their tokens then come from more than one policy, with the sampling policy's "
        "log-probs kept for algorithm.tisCap). Unset: every conversation ends in its rollout. "
        "docs/multi-turn.md#partial-rollout.",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> MultiTurnSpec:
        _check_rules(
            self, (TOOL_RESPONSE_FITS_RULE, PARTIAL_NEEDS_ASYNC_RULE), "spec.rollout.multiTurn"
        )
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
# The torch engine runs on one device (rljob_worker.engines refuses more at the engine's start).
TORCH_ONE_DEVICE_RULE = CrossFieldRule(
    cel="self.engine != 'torch' || self.tensorParallelSize == 1",
    message="engine torch runs on one device: set tensorParallelSize 1, or use engine sglang",
    field_path=".tensorParallelSize",
    check=lambda r: r.engine is not EngineName.TORCH or r.tensor_parallel_size == 1,
)
ROLLOUT_RULES: tuple[CrossFieldRule, ...] = (
    STAGED_NEEDS_TAGS_RULE,
    TORCH_ONE_DEVICE_RULE,
    MULTI_TURN_NEEDS_MODE_RULE,
    MULTI_TURN_ONE_GPU_ENGINE_RULE,
)


class RolloutSpec(_Spec):
    """The rollout engine that shares the GPUs with training (verl: actor_rollout_ref.rollout)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*ROLLOUT_RULES))

    engine: EngineName = Field(
        default=EngineName.SGLANG,
        description="sglang: the production engine. torch: the reference engine on "
        "transformers' weights, for Qwen2, Qwen3, Llama and Mistral decoders (CPU runs, tests "
        "and measurement; not a production engine). Immutable after creation.",
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
    weight_sync_bucket_megabytes: BucketMegabytes = Field(
        default=512,
        description="Size of one weight-update bucket in MiB "
        "(verl: rollout.update_weights_bucket_megabytes). On one GPU with an engine that casts "
        "what it loads (the torch engine; sglang's default hand-off) the trainer's own weights "
        "go in one request and no bucket is made (docs/weight-sync.md). Auto: the memory plan "
        "picks, on the card the job got and after the rollout's own Auto, the largest of the "
        "whole model in the engine's dtype (one bucket), 4096, 2048 and 1024 whose every stage "
        "fits within spec.memoryPlan.margin with the offload the smallest needs, else 512 "
        "(docs/zero-tuning.md).",
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
