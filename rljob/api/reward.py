"""spec.reward: how a response is scored (a builtin or a user FILE_OR_MODULE:callable)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import Field

from rljob.api._base import ValueRule, _Spec, _with_rules

# Reward functions the worker has itself (rljob_worker.reward); anything else is FILE:callable.
BUILTIN_EXACT_MATCH = "exactMatch"
BUILTIN_NUMERIC = "numeric"
BUILTIN_REWARDS: tuple[str, ...] = (BUILTIN_EXACT_MATCH, BUILTIN_NUMERIC)
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
RewardFunction = Annotated[
    str,
    Field(min_length=1, max_length=4096),
    *_with_rules(REWARD_BUILTIN_RULE, REWARD_CALLABLE_RULE),
]


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
    parallel_calls: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Calls of a user function run at once on each rank, each in a process of "
        "its own (each loads the function, and its memory counts against the worker "
        "container's). Raise it for a slow function (a sandbox, a judge behind an API): a "
        "rollout's responses are scored that many at a time. The builtins run in the rank.",
    )
    on_error: RewardOnError = Field(
        default=RewardOnError.FAIL,
        description="A call that raises, times out or returns no number: Fail ends the job "
        "with the row, the response and the error; Zero scores it 0 and counts it in the "
        "iteration's report.",
    )
