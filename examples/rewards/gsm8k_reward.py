"""A user reward function for examples/custom-reward.yaml, in verl's shape (compute_score).

rljob loads it in every rank (its own process, spec.reward.timeoutSeconds per call) and calls it
once per response; it may return a number or {"score": number, ...}.
"""

from __future__ import annotations

import re
from typing import Any

# The answer after GSM8K's "#### ", else the last number in the response.
_HASHES = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _answer(text: str) -> str | None:
    found = _HASHES.findall(text) or _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """1 for the right number, 0.1 for a '#### ' line with a wrong one (the format), else 0."""
    answer = _answer(solution_str)
    correct = answer is not None and float(answer) == float(ground_truth)
    formatted = "####" in solution_str
    return {"score": 1.0 if correct else 0.1 if formatted else 0.0, "formatted": float(formatted)}
