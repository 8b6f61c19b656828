"""Prompt sources: `builtin:arithmetic`, `builtin:digit` (made here) and the user's file
(dataset.py), as tokens.

A task yields problems whose prompt is already encoded under spec.data's length rule, so the
rollout only batches them; a file's rows are all encoded and checked when the task is made.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# The builtin names live in the shared API module, which admission checks data.source against.
from rljob.api import BUILTIN_ARITHMETIC as BUILTIN_ARITHMETIC
from rljob.api import BUILTIN_CALCULATOR as BUILTIN_CALCULATOR
from rljob.api import (
    BUILTIN_DATA_SOURCES,
    BUILTIN_PREFIX,
    ChatTemplateMode,
    DataSpec,
    PromptOverflow,
)
from rljob.api import BUILTIN_DIGIT as BUILTIN_DIGIT


@dataclass(frozen=True)
class Problem:
    """One prompt and what the reward function is given with it."""

    prompt: str  # the text the model sees (after the chat template)
    answer: Any  # the ground truth, as the source holds it (verl passes it on unchanged)
    where: str  # names the row in messages: "train.jsonl line 7", "train.parquet row 6"
    data_source: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()


class Task(Protocol):
    def sample(self, count: int, salt: int) -> list[Problem]:
        """`count` problems, the same for the same (seed, salt) on every rank and run."""
        ...


class PromptTooLong(ValueError):
    """A prompt over spec.data.maxPromptLength with promptOverflow Refuse."""


@dataclass(frozen=True)
class PromptEncoder:
    """Text to token ids under spec.data's length rule."""

    tokenizer: Any
    max_prompt_length: int
    overflow: PromptOverflow

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= self.max_prompt_length:
            return tuple(ids)
        if self.overflow is PromptOverflow.TRUNCATE:
            # From the left: a chat template's generation prompt and the question are at the end.
            return tuple(ids[-self.max_prompt_length :])
        raise PromptTooLong(
            f"the prompt is {len(ids)} tokens, over spec.data.maxPromptLength="
            f"{self.max_prompt_length} (raise it, or set spec.data.promptOverflow: Truncate)"
        )


def arithmetic_problem(rng: random.Random, max_operand: int) -> tuple[str, str]:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        return f"{a}+{b}=", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}=", str(a - b)


class ArithmeticTask:
    """Two-operand addition and subtraction, e.g. prompt '12+7=' with answer '19'. Without an
    encoder its problems carry no token ids (the builtin tokenizer trains on their text)."""

    def __init__(
        self,
        seed: int,
        max_operand: int = 99,
        encode: Callable[[str], tuple[int, ...]] | None = None,
    ) -> None:
        self.seed = seed
        self.max_operand = max_operand
        self.encode = encode

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        problems = []
        for _ in range(count):
            prompt, answer = arithmetic_problem(rng, self.max_operand)
            ids = self.encode(prompt) if self.encode is not None else ()
            where = f"{BUILTIN_ARITHMETIC} {prompt!r}"
            problems.append(Problem(prompt, answer, where, BUILTIN_ARITHMETIC, prompt_ids=ids))
        return problems


class DigitTask:
    """'say 7:' with answer '7': the task the tiny random model learns on a CPU (issue 29).

    Small enough to learn in a few dozen iterations from scratch: the answer is one digit the
    prompt names, and the builtin rewards score its first character (rewards.first_char_reward),
    so each of the ~80 tokens of the builtin vocabulary that start with a digit is a partial
    answer the policy can find by sampling (about 2.5% of a uniform policy's samples start with
    any one digit).
    """

    def __init__(self, seed: int, encode: Callable[[str], tuple[int, ...]] | None = None) -> None:
        self.seed = seed
        self.encode = encode

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        problems = []
        for _ in range(count):
            digit = str(rng.randint(0, 9))
            prompt = f"say {digit}:"
            ids = self.encode(prompt) if self.encode is not None else ()
            where = f"{BUILTIN_DIGIT} {prompt!r}"
            problems.append(Problem(prompt, digit, where, BUILTIN_DIGIT, prompt_ids=ids))
        return problems


def calculator_problem(rng: random.Random) -> tuple[str, str]:
    """'What is 347 * 29 + 1183 * 7 - 452?': two products and a difference of 3-4 digit
    numbers, too long to do in one step, one calculator call away."""
    a, b = rng.randint(100, 999), rng.randint(11, 99)
    c, d = rng.randint(1000, 9999), rng.randint(3, 9)
    e = rng.randint(100, 999)
    return f"What is {a} * {b} + {c} * {d} - {e}?", str(a * b + c * d - e)


# Said in the prompt as well as in the template's tool list: a template without tools (the
# builtin model's) still shows the model the call's form.
CALCULATOR_INSTRUCTIONS = (
    'Use the calculator: <tool_call>{"name": "calculator", "arguments": {"expression": '
    '"2*3+4"}}</tool_call>. Then reply with "Answer: N".'
)


class CalculatorTask:
    """Multi-step arithmetic whose answer needs the calculator tool (mode multiTurn), as chat
    messages through the tokenizer's template (with the tools' schemas) where it has one."""

    def __init__(
        self,
        seed: int,
        encode: Callable[[str], tuple[int, ...]] | None = None,
        render: Callable[[list[dict[str, str]]], str] | None = None,
    ) -> None:
        self.seed, self.encode, self.render = seed, encode, render

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        problems = []
        for _ in range(count):
            question, answer = calculator_problem(rng)
            content = f"{question} {CALCULATOR_INSTRUCTIONS}"
            messages = [{"role": "user", "content": content}]
            prompt = self.render(messages) if self.render is not None else content
            ids = self.encode(prompt) if self.encode is not None else ()
            where = f"{BUILTIN_CALCULATOR} {question!r}"
            problems.append(Problem(prompt, answer, where, BUILTIN_CALCULATOR, prompt_ids=ids))
        return problems


def make_task(
    data: DataSpec, seed: int, tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> Task:
    """The task for spec.data; a file's rows are read, encoded and checked here (DatasetError).
    `tools` (mode multiTurn): the tool schemas the chat template is given with the messages."""
    encode = PromptEncoder(tokenizer, data.max_prompt_length, data.prompt_overflow)
    if data.source == BUILTIN_CALCULATOR:

        def render(messages: list[dict[str, str]]) -> str:
            if data.chat_template is ChatTemplateMode.NONE or not tokenizer.chat_template:
                return messages[-1]["content"]
            text: str = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
            return text

        return CalculatorTask(seed, encode=encode, render=render)
    if data.source == BUILTIN_ARITHMETIC:
        return ArithmeticTask(seed, encode=encode)
    if data.source == BUILTIN_DIGIT:
        return DigitTask(seed, encode=encode)
    if data.source.startswith(BUILTIN_PREFIX):
        raise ValueError(
            f"unknown builtin data source {data.source!r}; the builtin sources are "
            f"{BUILTIN_DATA_SOURCES}"
        )
    from rljob_worker.dataset import DatasetTask

    return DatasetTask(data, seed, tokenizer, encode, tools)
