"""spec.algorithm's learning-rate schedule (warmup, then Constant or Cosine) and weight decay,
against values computed by hand, and the trainer's optimizer taking them at each train stage."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from rljob.api import AlgorithmSpec, LearningRateSchedule


def _algorithm(**fields: Any) -> AlgorithmSpec:
    return AlgorithmSpec(learning_rate=1e-3, iterations=10, **fields)


def test_constant_with_warmup_rises_by_equal_steps_then_holds() -> None:
    algorithm = _algorithm(warmup_iterations=4)
    # 1/4, 2/4, 3/4, 4/4 of 1e-3, then 1e-3 to the end.
    assert [algorithm.learning_rate_at(i) for i in range(1, 7)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    )
    assert algorithm.learning_rate_at(10) == 1e-3
    assert _algorithm().learning_rate_at(1) == 1e-3  # no warmup: the rate from the start


def test_cosine_falls_from_the_peak_after_the_warmup_towards_its_floor() -> None:
    """10 iterations, 2 of warmup, floor 0.1 x 1e-3 = 1e-4. After the warmup the progress is
    (i - 1 - 2) / 8: iteration 3 is at 0 (the peak), 6 at 3/8, 10 at 7/8.
    cos(3 pi / 8) = 0.382683: 1e-4 + 9e-4 x 1.382683 / 2 = 7.22207e-4.
    cos(7 pi / 8) = -0.923880: 1e-4 + 9e-4 x 0.076120 / 2 = 1.34254e-4."""
    algorithm = _algorithm(
        learning_rate_schedule=LearningRateSchedule.COSINE,
        warmup_iterations=2,
        min_learning_rate_ratio=0.1,
    )
    rates = {i: algorithm.learning_rate_at(i) for i in range(1, 11)}
    assert rates[1] == pytest.approx(5e-4) and rates[2] == pytest.approx(1e-3)
    assert rates[3] == pytest.approx(1e-3)
    assert rates[6] == pytest.approx(7.22207e-4, rel=1e-5)
    assert rates[10] == pytest.approx(1.34254e-4, rel=1e-5)
    assert all(rates[i] > rates[i + 1] for i in range(3, 10))  # falling all the way
    assert all(r >= 1e-4 for r in rates.values())
    # Without a warmup or a floor: iteration 1 at the peak, iteration 10 at (1 + cos(9 pi / 10)) / 2.
    plain = _algorithm(learning_rate_schedule=LearningRateSchedule.COSINE)
    assert plain.learning_rate_at(1) == pytest.approx(1e-3)
    assert plain.learning_rate_at(10) == pytest.approx(1e-3 * (1 + math.cos(0.9 * math.pi)) / 2)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"warmup_iterations": 11}, "warmupIterations"),
        ({"min_learning_rate_ratio": 0.1}, "minLearningRateRatio"),
    ],
)
def test_a_schedule_that_cannot_be_meant_is_refused(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match=rf"spec\.algorithm\.{named}: "):
        _algorithm(**fields)


def test_each_iteration_steps_at_its_scheduled_rate_with_decoupled_weight_decay() -> None:
    """The trainer's optimizer (train.make_optimizer) stepped as train_step sets its rate. One
    AdamW step from zero moments moves a weight by lr x g / (|g| + eps) (the bias-corrected
    moments are g and g^2) and first decays it by lr x weightDecay x w: from w = 2 with
    g = 0.5 at the rate of warmup iteration 1 (1e-3 / 2): 2 - 5e-4 x 0.05 x 2 - 5e-4 x 0.5 /
    (0.5 + 1e-8) = 1.99945."""
    from rljob_worker.train import make_optimizer, set_learning_rate

    algorithm = _algorithm(warmup_iterations=2, weight_decay=0.05)
    weight = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    optimizer = make_optimizer([weight], algorithm)
    assert optimizer.param_groups[0]["weight_decay"] == 0.05
    set_learning_rate(optimizer, algorithm.learning_rate_at(1))
    weight.grad = torch.tensor([0.5], dtype=torch.float64)
    optimizer.step()
    assert weight.item() == pytest.approx(
        2 - 5e-4 * 0.05 * 2 - 5e-4 * 0.5 / (0.5 + 1e-8), abs=1e-12
    )
    without = make_optimizer([torch.nn.Parameter(torch.ones(1))], _algorithm())
    assert without.param_groups[0]["weight_decay"] == 0.0  # none unless set
