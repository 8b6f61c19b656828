"""Prompt sources: `builtin:arithmetic`, `builtin:digit` (made here) and the user's file
(dataset.py), as tokens.

A task yields problems whose prompt is already encoded under spec.data's length rule, so the
rollout only batches them; a file's rows, and the builtin sources' prompts, are all encoded and
checked when the task is made.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
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

# What messages call the file a task reads: the training prompts' or the validation prompts'.
SOURCE_FIELD = "spec.data.source"
VALIDATION_FIELD = "spec.data.validation.source"
# The builtin sources' validation problems: one fixed set, drawn with a salt no training
# iteration uses (theirs are iteration * ranks + rank, from 0).
VALIDATION_SALT = -1


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


def refuse_long_builtin_prompts(
    source: str,
    prompts: Iterable[tuple[str, str]],
    encode: PromptEncoder,
    source_field: str = SOURCE_FIELD,
) -> None:
    """With promptOverflow Refuse, PromptTooLong naming the longest of a builtin source's
    prompts ((label, text) pairs) when any is over maxPromptLength: checked when the task is
    made, as a file's rows are, not at the iteration that first draws a long one."""
    if encode.overflow is not PromptOverflow.REFUSE:
        return
    pairs = list(prompts)
    # One batched call, the tokenizer's own loop: 15,050 calls of one prompt took 0.36 s of a
    # start with the builtin model's tokenizer, this 0.28 s.
    encoded = encode.tokenizer([text for _, text in pairs], add_special_tokens=False).input_ids
    lengths = [(len(ids), label) for ids, (label, _) in zip(encoded, pairs, strict=True)]
    over = [(tokens, label) for tokens, label in lengths if tokens > encode.max_prompt_length]
    if not over:
        return
    tokens, label = max(over, key=lambda length: length[0])
    raise PromptTooLong(
        f"{source_field} {source}: {len(over)} of the {len(lengths)} prompts checked cannot "
        f"be used: the longest, {label}, is {tokens} tokens, over spec.data.maxPromptLength="
        f"{encode.max_prompt_length} (raise it to {tokens}, or set spec.data.promptOverflow: "
        "Truncate)"
    )


def arithmetic_question(a: int, b: int, plus: bool) -> tuple[str, str]:
    return (f"{a}+{b}=", str(a + b)) if plus else (f"{a}-{b}=", str(a - b))


def arithmetic_problem(rng: random.Random, max_operand: int) -> tuple[str, str]:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        return arithmetic_question(a, b, plus=True)
    return arithmetic_question(max(a, b), min(a, b), plus=False)


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

    def checked_prompts(self) -> Iterator[tuple[str, str]]:
        """Every prompt it makes (15,050 at max_operand 99), as (label, text)."""
        operands = range(self.max_operand + 1)
        for a, b in itertools.product(operands, operands):
            for plus in (True, False) if a >= b else (True,):
                prompt, _ = arithmetic_question(a, b, plus)
                yield repr(prompt), prompt


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
            prompt = digit_prompt(digit)
            ids = self.encode(prompt) if self.encode is not None else ()
            where = f"{BUILTIN_DIGIT} {prompt!r}"
            problems.append(Problem(prompt, digit, where, BUILTIN_DIGIT, prompt_ids=ids))
        return problems

    def checked_prompts(self) -> Iterator[tuple[str, str]]:
        """Every prompt it makes (ten), as (label, text)."""
        for digit in range(10):
            prompt = digit_prompt(str(digit))
            yield repr(prompt), prompt


def digit_prompt(digit: str) -> str:
    return f"say {digit}:"


# The bounds of a, b, c, d and e in 'What is a * b + c * d - e?'; each keeps its digit count.
CALCULATOR_OPERANDS = ((100, 999), (11, 99), (1000, 9999), (3, 9), (100, 999))


def calculator_question(a: int, b: int, c: int, d: int, e: int) -> tuple[str, str]:
    return f"What is {a} * {b} + {c} * {d} - {e}?", str(a * b + c * d - e)


def calculator_problem(rng: random.Random) -> tuple[str, str]:
    """'What is 347 * 29 + 1183 * 7 - 452?': two products and a difference of 3-4 digit
    numbers, too long to do in one step, one calculator call away."""
    return calculator_question(*(rng.randint(low, high) for low, high in CALCULATOR_OPERANDS))


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
            prompt = self._prompt(question)
            ids = self.encode(prompt) if self.encode is not None else ()
            where = f"{BUILTIN_CALCULATOR} {question!r}"
            problems.append(Problem(prompt, answer, where, BUILTIN_CALCULATOR, prompt_ids=ids))
        return problems

    def _prompt(self, question: str) -> str:
        content = f"{question} {CALCULATOR_INSTRUCTIONS}"
        messages = [{"role": "user", "content": content}]
        return self.render(messages) if self.render is not None else content

    def checked_prompts(self) -> Iterator[tuple[str, str]]:
        """Its prompts with every operand at a bound (32), as (label, text). Each operand keeps
        its digit count, so every prompt has the same characters but for the digits, which the
        tokenizers in use (Qwen's one per digit, Llama 3's up to three) count alike: a
        tokenizer that merges digits unevenly is still refused by `sample`, mid-run."""
        for operands in itertools.product(*CALCULATOR_OPERANDS):
            question, _ = calculator_question(*operands)
            yield repr(question), self._prompt(question)


def make_task(
    data: DataSpec,
    seed: int,
    tokenizer: Any,
    tools: list[dict[str, Any]] | None = None,
    source_field: str = SOURCE_FIELD,
) -> Task:
    """The task for spec.data; a file's rows are read, encoded and checked here (DatasetError),
    and a builtin source's prompts against maxPromptLength (PromptTooLong, with Refuse).
    `tools` (mode multiTurn): the tool schemas the chat template is given with the messages."""
    encode = PromptEncoder(tokenizer, data.max_prompt_length, data.prompt_overflow)
    task: ArithmeticTask | DigitTask | CalculatorTask
    if data.source == BUILTIN_CALCULATOR:

        def render(messages: list[dict[str, str]]) -> str:
            if data.chat_template is ChatTemplateMode.NONE or not tokenizer.chat_template:
                return messages[-1]["content"]
            text: str = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
            return text

        task = CalculatorTask(seed, encode=encode, render=render)
    elif data.source == BUILTIN_ARITHMETIC:
        task = ArithmeticTask(seed, encode=encode)
    elif data.source == BUILTIN_DIGIT:
        task = DigitTask(seed, encode=encode)
    elif data.source.startswith(BUILTIN_PREFIX):
        raise ValueError(
            f"unknown builtin data source {data.source!r}; the builtin sources are "
            f"{BUILTIN_DATA_SOURCES}"
        )
    else:
        from rljob_worker.dataset import DatasetTask

        return DatasetTask(data, seed, tokenizer, encode, tools, source_field)
    refuse_long_builtin_prompts(data.source, task.checked_prompts(), encode, source_field)
    return task


def validation_problems(
    data: DataSpec, seed: int, tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> list[Problem]:
    """spec.data.validation's problems, the same on every rank and run: a file's first
    maxPrompts rows (read and checked as data.source's are, under data's keys and length
    rule), or maxPrompts problems of a builtin source drawn apart from the training prompts."""
    validation = data.validation
    if validation is None:
        return []
    held_out = data.model_copy(update={"source": validation.source, "validation": None})
    task = make_task(held_out, seed, tokenizer, tools, VALIDATION_FIELD)
    rows: list[Problem] | None = getattr(task, "problems", None)  # a file's (DatasetTask)
    if rows is not None:
        return rows[: validation.max_prompts]
    return task.sample(validation.max_prompts, salt=VALIDATION_SALT)
