"""The builtin rewards on typical answers, and what a reward function may return."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from rljob.api import BUILTIN_REWARDS
from rljob_worker.rewards import (
    BUILTINS,
    FORMAT_CREDIT,
    RewardValueError,
    exact_match,
    extract_number,
    numeric,
    score_of,
)


def test_every_builtin_the_api_admits_exists() -> None:
    assert set(BUILTINS) == set(BUILTIN_REWARDS)


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1.0),
        ("#### 72", "72", 1.0),
        ("#### 1,234 dollars", "1234", 1.0),
        ("The answer is \\boxed{12}.", "12", 1.0),
        ("so $x = \\boxed{\\frac{3}{4}}$", "0.75", 1.0),
        ("\\boxed{3/4}", "3/4", 1.0),
        ("\\boxed{3/4}", "0.75", 1.0),
        ("It drops to -3.5 degrees.", "-3.5", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("The total is $1,234.00", "1234", 1.0),
        ("50%", "50", 1.0),
        ("First 7, then 12, finally 19", "19", 1.0),
        # Wrong answers and no answer are 0, not errors.
        ("#### 71", "72", 0.0),
        ("The answer is \\boxed{12}, not 13", "13", 0.0),  # \boxed wins over the last number
        ("\\boxed{\\sqrt{2}}", "1.41", 0.0),  # an expression is not a number
        ("I do not know.", "72", 0.0),
        ("", "72", 0.0),
        ("0.333", "1/3", 0.0),  # compared exactly, as fractions
        ("3,4", "34", 0.0),  # not a thousands group: two numbers, the last is 4
        # A ground truth given as a number, or as GSM8K's full solution.
        ("#### 72", 72, 1.0),
        ("#### 0.5", 0.5, 1.0),
        ("#### 72", "She sold 48+24.\n#### 72", 1.0),
    ],
)
def test_numeric_reads_the_answer_and_compares_numbers(response: str, truth: Any,
                                                       score: float) -> None:  # fmt: skip
    assert numeric("gsm8k", response, truth, {}) == score


@pytest.mark.parametrize("truth", ["seventy-two", "", None, ["72"], True])
def test_numeric_refuses_a_ground_truth_that_is_no_number(truth: Any) -> None:
    with pytest.raises(ValueError, match=r"ground truth .* is not a number"):
        numeric("gsm8k", "#### 72", truth, {})


def test_extract_number_handles_nested_braces_and_an_unclosed_box() -> None:
    assert extract_number("\\boxed{\\frac{1}{2}}") == Fraction(1, 2)
    assert extract_number("\\boxed{12") == 12  # unclosed: fall back to the last number


def test_exact_match_is_todays_reward() -> None:
    assert exact_match("", " 46\nmore", "46", {}) == 1.0
    assert exact_match("", "45", 46, {}) == FORMAT_CREDIT  # the truth compared as text
    assert exact_match("", "ab", "46", {}) == 0.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, (1.0, {})),
        (0.25, (0.25, {})),
        (True, (1.0, {})),
        ({"score": 0.5, "acc": True, "note": "text is dropped"}, (0.5, {"acc": 1.0})),
    ],
)
def test_score_of_takes_numbers_and_score_dicts(value: Any, expected: Any) -> None:
    assert score_of(value) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("1.0", r"returned '1.0' \(str\)"),
        (None, r"returned 'None' \(NoneType\)"),
        (math.nan, r"returned 'nan' \(float\)"),
        ({"acc": 1.0}, "returned a dict without 'score' .keys: acc."),
        ({"score": "high"}, r"returned 'high' \(str\)"),
    ],
)
def test_score_of_refuses_what_is_not_a_score(value: Any, match: str) -> None:
    with pytest.raises(RewardValueError, match=match):
        score_of(value)


def test_score_of_takes_numpy_bools_and_scalars_and_refuses_numpy_arrays() -> None:
    assert score_of(np.isclose(0.1 + 0.2, 0.3)) == (1.0, {})  # np.True_
    assert score_of(np.float64(0.5) == 1.0) == (0.0, {})  # np.False_
    assert score_of(np.int64(2)) == (2.0, {})
    assert score_of({"score": np.float32(0.25), "exact": np.True_}) == (0.25, {"exact": 1.0})
    with pytest.raises(RewardValueError, match=r"returned '\[1. 0.\]' \(numpy.ndarray\)"):
        score_of(np.array([1.0, 0.0]))
    with pytest.raises(RewardValueError, match=r"returned 'nan' \(numpy.float64\)"):
        score_of(np.float64("nan"))
