"""spec.data: where prompts come from (builtin sources or a file in the pod) and how they become
tokens.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from rljob.api._base import _builtin_rule, _no_url_rule, _Spec, _with_rules

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
