"""Prompt sources with a verifiable reward: `builtin:arithmetic`, `builtin:digit` and JSONL files.

A task yields (prompt, answer) problems; the reward is 1.0 when the response's first line equals
the answer exactly, else a small format credit for answering with digits at all. `builtin:digit`
scores the response's first character instead (reward_function).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# The builtin names live in the shared API module, which admission checks data.source against.
from rljob.api import BUILTIN_ARITHMETIC as BUILTIN_ARITHMETIC
from rljob.api import BUILTIN_DATA_SOURCES, BUILTIN_PREFIX
from rljob.api import BUILTIN_DIGIT as BUILTIN_DIGIT


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    def sample(self, count: int, salt: int) -> list[Problem]:
        """`count` problems, the same for the same (seed, salt) on every rank and run."""
        ...


# Credit for a wrong answer, times the share of digits in it. Without it a randomly initialised
# model (the builtin one) never scores, every GRPO group is flat, and nothing ever trains.
FORMAT_CREDIT = 0.1


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the response's first line (stripped) is the answer; else FORMAT_CREDIT times
    the share of its characters that are digits (always below any exact match)."""
    first_line = response.split("\n", 1)[0].strip()
    if first_line == answer.strip():
        return 1.0
    if not first_line:
        return 0.0
    return FORMAT_CREDIT * sum(c.isdigit() for c in first_line) / len(first_line)


class ArithmeticTask:
    """Two-operand addition and subtraction, e.g. prompt '12+7=' with answer '19'."""

    def __init__(self, seed: int, max_operand: int = 99) -> None:
        self.seed = seed
        self.max_operand = max_operand

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        problems = []
        for _ in range(count):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if rng.random() < 0.5:
                problems.append(Problem(f"{a}+{b}=", str(a + b)))
            else:
                a, b = max(a, b), min(a, b)
                problems.append(Problem(f"{a}-{b}=", str(a - b)))
        return problems


class DigitTask:
    """'say 7:' with answer '7': the task the tiny random model learns on a CPU (issue 29).

    Small enough to learn in a few dozen iterations from scratch: the answer is one digit the
    prompt names, and first_char_reward pays for the first character, so each of the ~80 tokens
    of the builtin vocabulary that start with a digit is a partial answer the policy can find by
    sampling (about 2.5% of a uniform policy's samples start with any one digit).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        digits = [str(rng.randint(0, 9)) for _ in range(count)]
        return [Problem(f"say {d}:", d) for d in digits]


def first_char_reward(response: str, answer: str) -> float:
    """1.0 when the response's first non-blank character is the answer's; FORMAT_CREDIT when it
    is another digit (a random policy finds digits ten times as often as the one digit asked
    for, so the credit is the first step of a curriculum); else 0.0."""
    first, expected = response.lstrip()[:1], answer.strip()[:1]
    if first and first == expected:
        return 1.0
    return FORMAT_CREDIT if first.isdigit() else 0.0


def reward_function(source: str) -> Callable[[str, str], float]:
    """The reward of the spec's data.source: (response text, answer) -> score."""
    return first_char_reward if source == BUILTIN_DIGIT else exact_match_reward


class JsonlTask:
    """Rows of {"prompt": ..., "answer": ...} from a JSONL file, sampled with replacement."""

    def __init__(self, path: Path, seed: int) -> None:
        self.seed = seed
        self.problems: list[Problem] = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row or "answer" not in row:
                raise ValueError(f"{path}:{number}: each row needs 'prompt' and 'answer'")
            self.problems.append(Problem(str(row["prompt"]), str(row["answer"])))
        if not self.problems:
            raise ValueError(f"{path}: no rows")

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        return [rng.choice(self.problems) for _ in range(count)]


def make_task(source: str, seed: int) -> Task:
    """The task for the spec's data.source."""
    if source == BUILTIN_ARITHMETIC:
        return ArithmeticTask(seed)
    if source == BUILTIN_DIGIT:
        return DigitTask(seed)
    if source.startswith(BUILTIN_PREFIX):
        raise ValueError(
            f"unknown builtin data source {source!r}; the builtin sources are {BUILTIN_DATA_SOURCES}"
        )
    return JsonlTask(Path(source), seed)
