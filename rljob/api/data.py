"""spec.data: where prompts come from (builtin sources or a file in the pod) and how they become
tokens.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from rljob.api._base import (
    CrossFieldRule,
    _builtin_rule,
    _cel_rules,
    _check_rules,
    _no_url_rule,
    _Spec,
    _with_rules,
)

# Builtin prompt sources the worker generates itself (rljob_worker.task).
BUILTIN_ARITHMETIC = "builtin:arithmetic"
# One digit named in the prompt ('say 7:'), rewarded by the response's first character: what the
# tiny builtin model learns on a CPU in a few dozen iterations (tests/worker/test_learns.py).
BUILTIN_DIGIT = "builtin:digit"
# Multi-step arithmetic whose answer needs the calculator tool (spec.rollout.mode multiTurn;
# docs/multi-turn.md).
BUILTIN_CALCULATOR = "builtin:calculator"
BUILTIN_DATA_SOURCES: tuple[str, ...] = (BUILTIN_ARITHMETIC, BUILTIN_DIGIT, BUILTIN_CALCULATOR)
BUILTIN_DATA_RULE = _builtin_rule("data source", BUILTIN_DATA_SOURCES)
DATA_URL_RULE = _no_url_rule(
    "use a builtin source or the path of a .jsonl, .json or .parquet file in the pod"
)
DataSource = Annotated[
    str, Field(min_length=1, max_length=4096), *_with_rules(BUILTIN_DATA_RULE, DATA_URL_RULE)
]
# A column, with dots reaching into nested columns (reward_model.ground_truth): no empty part.
DataKey = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^.]+(?:\.[^.]+)*$")]


class ChatTemplateMode(StrEnum):
    AUTO = "Auto"
    NONE = "None"


class PromptOverflow(StrEnum):
    REFUSE = "Refuse"
    TRUNCATE = "Truncate"


# Several samples of one prompt are alike only when they are drawn: greedy gives one answer.
VALIDATION_SAMPLES_RULE = CrossFieldRule(
    cel="self.samplesPerPrompt == 1 || self.temperature > 0.0",
    message="samplesPerPrompt above 1 needs a temperature above 0: greedy decoding (0) gives "
    "every sample of a prompt the same answer",
    field_path=".samplesPerPrompt",
    check=lambda s: s.samples_per_prompt == 1 or s.temperature > 0.0,
)


class ValidationSpec(_Spec):
    """Held-out prompts the policy answers at set iterations, scored by the job's reward and
    never trained on (verl: data.val_files and trainer.test_freq; docs/data-and-reward.md)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(VALIDATION_SAMPLES_RULE))

    source: DataSource = Field(
        description="As data.source (a builtin source or a .jsonl, .json or .parquet file in the "
        "pod), read with data's promptKey, answerKey, chatTemplate, maxPromptLength, "
        "promptOverflow and maxResponseLength.",
    )
    every_iterations: int = Field(
        default=5,
        ge=1,
        description="Validate at iteration 0 (before any update), at every N-th iteration and at "
        "the last, in the rollout stage after the training rollout (the engine is awake).",
    )
    max_prompts: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="A file's first N rows (all of them, if fewer); a builtin source's N "
        "problems (one fixed set, drawn apart from the training prompts). Split over the ranks.",
    )
    samples_per_prompt: int = Field(
        default=1, ge=1, le=64, description="Answers generated per prompt (verl: val_kwargs.n)."
    )
    temperature: float = Field(
        default=0.0,
        ge=0,
        description="0: greedy decoding (verl's validation default); otherwise sampled at this "
        "temperature, untruncated.",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> ValidationSpec:
        _check_rules(self, (VALIDATION_SAMPLES_RULE,), "spec.data.validation")
        return self


class DataSpec(_Spec):
    """Where prompts come from and how they become tokens (docs/data-and-reward.md)."""

    source: DataSource = Field(
        default=BUILTIN_ARITHMETIC,
        description="'builtin:arithmetic' generates addition prompts (no download); otherwise "
        "the path (in the pod: a mounted volume, or the image) of a .jsonl, .json (an array of "
        "objects, or JSON lines) or .parquet file. No URL schemes: the worker reads local files.",
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
        description="Prompts per iteration across all ranks (verl: data.train_batch_size); a "
        "multiple of the job's ranks.",
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
    validation: ValidationSpec | None = Field(
        default=None,
        description="Held-out prompts answered at iteration 0, every N-th and the last; their "
        "reward in status.metrics[].validation. Absent: no validation.",
    )
