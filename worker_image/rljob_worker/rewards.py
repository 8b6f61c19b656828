"""The builtin reward functions and the rule for what a reward function may return (pure).

Imported by the reward's child process too, so nothing here imports torch.
`numeric` reads `\\boxed{...}` first, then `#### N`, then the last number, and compares exactly
as fractions: `\\boxed{3/4}`, `\\frac{3}{4}` and `0.75` are one number; `1,234` is 1234.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from numbers import Real
from typing import Any

from rljob.api import BUILTIN_DIGIT, BUILTIN_EXACT_MATCH, BUILTIN_NUMERIC

# Credit for a wrong answer, times the share of digits in it. Without it a randomly initialised
# model (the builtin one) never scores, every GRPO group is flat, and nothing ever trains.
FORMAT_CREDIT = 0.1


class RewardValueError(TypeError):
    """A reward function returned something that is not a score."""


def _numpy_bool_as_bool(value: Any) -> Any:
    """numpy's bool (what np.isclose and == on numpy values return) as Python's bool; anything
    else unchanged. numpy registers its ints and floats as numbers.Real but not its bool, and
    is not imported here: the reward's child may run in an image without it."""
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):  # numpy 2, numpy 1
        return bool(value)
    return value


def score_of(value: Any) -> tuple[float, dict[str, float]]:
    """(score, extra metrics) of what a reward function returned: a finite real number (a bool,
    numpy's too, counts as 1 or 0), or a mapping with a number under "score" and numbers for its
    other keys."""
    extras: dict[str, float] = {}
    score = value
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardValueError(
                f"returned a dict without 'score' (keys: {', '.join(map(str, value))})"
            )
        score = value["score"]
        for key, extra in value.items():
            extra = _numpy_bool_as_bool(extra)
            if key != "score" and isinstance(extra, Real) and math.isfinite(extra):
                extras[str(key)] = float(extra)
    score = _numpy_bool_as_bool(score)
    if not isinstance(score, Real) or not math.isfinite(score):
        # Named with its module (numpy.ndarray): numpy's bool printed as "(bool)", as if a
        # Python bool had been refused.
        kind = type(score)
        name = (
            kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
        )
        raise RewardValueError(
            f"returned {str(score)[:80]!r} ({name}); a reward function returns "
            "a finite number or {'score': number, ...}"
        )
    return float(score), extras


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the response's first line (stripped) is the answer; else FORMAT_CREDIT times
    the share of its characters that are digits (always below any exact match)."""
    first_line = response.split("\n", 1)[0].strip()
    if first_line == answer.strip():
        return 1.0
    if not first_line:
        return 0.0
    return FORMAT_CREDIT * sum(c.isdigit() for c in first_line) / len(first_line)


def first_char_reward(response: str, answer: str) -> float:
    """1.0 when the response's first non-blank character is the answer's; FORMAT_CREDIT when it
    is another digit (a random policy finds digits ten times as often as the one digit asked
    for, so the credit is the first step of a curriculum); else 0.0."""
    first, expected = response.lstrip()[:1], answer.strip()[:1]
    if first and first == expected:
        return 1.0
    return FORMAT_CREDIT if first.isdigit() else 0.0


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """exact_match_reward; on `builtin:digit`, whose answer is one character, the first
    character (first_char_reward): the task the tiny model learns on a CPU."""
    if data_source == BUILTIN_DIGIT:
        return first_char_reward(solution_str, str(ground_truth))
    return exact_match_reward(solution_str, str(ground_truth))


# A decimal number: thousands groups of exactly three digits ("1,234"), or plain digits.
_DECIMAL = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER = re.compile(rf"(?:{_DECIMAL})(?:\s*/\s*(?:{_DECIMAL}))?")
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_HASHES = re.compile(r"####\s*([^\n]*)")


def parse_number(text: str) -> Fraction | None:
    """The exact value of text that is one number (decimal, a/b, \\frac{a}{b}, with $, % or a
    final '.' around it), else None: an expression (\\sqrt{2}, x+1) is not a number."""
    text = text.strip().strip("$").replace("\\$", "").replace("\\!", "").replace("\\,", "")
    text = text.removesuffix("\\%").removesuffix("%").removesuffix(".").strip()
    frac = _FRAC.match(text)
    if frac:
        sign, top, bottom = frac.groups()
        text = f"{sign}{top}/{bottom}"
    if not _NUMBER.fullmatch(text):
        return None
    top, _, bottom = text.replace(",", "").replace(" ", "").partition("/")
    try:
        value = Fraction(top) / Fraction(bottom) if bottom else Fraction(top)
    except ZeroDivisionError:
        return None
    return value


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced (\\boxed{\\frac{3}{4}})."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def extract_number(text: str) -> Fraction | None:
    """The answer a response gives: its last \\boxed{} (which must hold one number), else its
    last '#### ' line's first number (GSM8K), else the last number in it."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return parse_number(boxed)
    hashes = _HASHES.findall(text)
    if hashes:
        found = _NUMBER.search(hashes[-1])
        return parse_number(found.group()) if found else None
    numbers = _NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def numeric(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """1.0 when the response's answer equals the ground truth as a number, else 0.0. A ground
    truth that is no number (nor a solution ending in '#### N') is an error, not a 0."""
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | Real):
        raise ValueError(f"ground truth {ground_truth!r} is not a number")
    truth = parse_number(str(ground_truth))
    if truth is None:
        truth = extract_number(str(ground_truth)) if "####" in str(ground_truth) else None
    if truth is None:
        raise ValueError(f"ground truth {str(ground_truth)[:80]!r} is not a number")
    return 1.0 if extract_number(solution_str) == truth else 0.0


BUILTINS: dict[str, Callable[[str, str, Any, Any], float]] = {
    BUILTIN_EXACT_MATCH: exact_match,
    BUILTIN_NUMERIC: numeric,
}
