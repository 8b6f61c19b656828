"""The policy update's arithmetic against values computed by hand (the arithmetic is in the
comments): the clipped surrogate, the clamped k3 KL, advantages, temperature-scaled log-probs,
the batch's masks, the rank's share of the global token-mean, and whole updates of a bigram model.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.bigram import Bigram

from rljob.api import RLJobSpec
from rljob_worker.driver import combined_variance
from rljob_worker.policy_update import Experience, PolicyUpdate, response_batch, split_rows
from rljob_worker.rl_math import (
    batch_advantages,
    clipped_policy_loss,
    group_advantages,
    kl_to_reference,
    rank_loss,
    token_logprobs,
    truncated_importance_weights,
)

EPS_ADV = 1e-6  # the advantages' epsilon: a group of rewards {1, 0} gives +-0.5 / 0.500001


# -- clipped surrogate -------------------------------------------------------------------------

# clip 0.2: loss = max(-r A, -clip(r, 0.8, 1.2) A); the gradient wrt logp is -r A where the
# unclipped term is taken, 0 where the clipped one is (strictly).
CLIP_CASES = [
    # ratio, A, loss, clipped, d loss / d logp
    (1.5, 1.0, -1.2, True, 0.0),  # max(-1.5, -1.2): clipped above for a good token
    (1.5, -1.0, 1.5, False, 1.5),  # max(1.5, 1.2): a bad token made likelier is never clipped
    (0.5, 1.0, -0.5, False, -0.5),  # max(-0.5, -0.8): a good token made rarer is never clipped
    (0.5, -1.0, 0.8, True, 0.0),  # max(0.5, 0.8): clipped below for a bad token
    (1.1, 2.0, -2.2, False, -2.2),  # inside the range both terms are -2.2
    (1.0, 3.0, -3.0, False, -3.0),  # on-policy (the first step): loss -A, gradient -A
]


@pytest.mark.parametrize(("ratio", "advantage", "loss", "clipped", "grad"), CLIP_CASES)
def test_clipped_policy_loss_inside_and_outside_the_clip(
    ratio: float, advantage: float, loss: float, clipped: bool, grad: float
) -> None:
    old = torch.tensor([math.log(0.4)])
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    result = clipped_policy_loss(logprobs, old, torch.tensor([advantage]), clip_ratio=0.2)
    result.loss.sum().backward()
    assert result.loss.item() == pytest.approx(loss, abs=1e-6)
    assert bool(result.clipped.item()) is clipped
    assert logprobs.grad is not None
    assert logprobs.grad.item() == pytest.approx(grad, abs=1e-6)


@pytest.mark.parametrize(
    ("ratio", "advantage", "high", "loss", "clipped", "grad"),
    [
        # clip-higher 0.28: a ratio of 1.25 with A > 0 is inside [0.8, 1.28]: loss -1.25 x 2,
        # gradient -r A = -2.5 (clipRatio 0.2 alone would clip it at 1.2: loss -2.4, gradient 0).
        (1.25, 2.0, 0.28, -2.5, False, -2.5),
        (1.25, 2.0, None, -2.4, True, 0.0),
        # Past the higher bound the clip holds: 1.4 -> 1.28 x 2 = -2.56, gradient 0.
        (1.4, 2.0, 0.28, -2.56, True, 0.0),
        # The lower side stays 1 - clipRatio: r 0.7 with A < 0 -> max(0.7 x 1, 0.8 x 1) = 0.8.
        (0.7, -1.0, 0.28, 0.8, True, 0.0),
    ],
)
def test_clip_higher_widens_only_the_upper_side(
    ratio: float, advantage: float, high: float | None, loss: float, clipped: bool, grad: float
) -> None:
    old = torch.tensor([math.log(0.4)])
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    result = clipped_policy_loss(logprobs, old, torch.tensor([advantage]), 0.2, high)
    result.loss.sum().backward()
    assert result.loss.item() == pytest.approx(loss, abs=1e-6)
    assert bool(result.clipped.item()) is clipped
    assert logprobs.grad is not None
    assert logprobs.grad.item() == pytest.approx(grad, abs=1e-6)


# -- KL to the reference -----------------------------------------------------------------------


def test_k3_kl_of_halving_a_probability() -> None:
    # p = 0.5, p_ref = 0.25: d = log(0.25 / 0.5) = -0.693147; exp(d) - d - 1 = 0.5 + 0.693147 - 1
    kl = kl_to_reference(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert kl.item() == pytest.approx(0.193147, abs=1e-6)
    same = kl_to_reference(torch.tensor([-1.3]), torch.tensor([-1.3]))
    assert same.item() == 0.0


@pytest.mark.parametrize("log_ratio", [-30.0, 30.0, 100.0])
def test_k3_kl_is_clamped_to_ten_with_a_finite_gradient(log_ratio: float) -> None:
    # d = -30: exp(-20) + 20 - 1 = 19 (d clamped to -20 first) -> clamped to 10.
    # d = 100: unclamped exp(100) is inf in float32 (and its gradient NaN); clamped to 10.
    logprobs = torch.tensor([0.0], requires_grad=True)
    kl = kl_to_reference(logprobs, torch.tensor([log_ratio]))
    kl.sum().backward()
    assert kl.item() == 10.0
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()


def test_truncated_importance_weights_cap_the_ratio() -> None:
    # trainer 0.5 / engine 0.25 = 2 -> capped at 1.5; trainer 0.2 / engine 0.4 = 0.5 (kept)
    trainer = torch.tensor([math.log(0.5), math.log(0.2)])
    engine = torch.tensor([math.log(0.25), math.log(0.4)])
    weights = truncated_importance_weights(trainer, engine, cap=1.5)
    assert weights.tolist() == pytest.approx([1.5, 0.5], abs=1e-6)


# -- advantages --------------------------------------------------------------------------------


def test_group_advantages_for_a_mixed_a_flat_and_a_single_member_group() -> None:
    # group 0 {1, 0}: mean 0.5, std 0.5 -> +-0.5 / (0.5 + 1e-6) = +-0.999998
    # group 1 {0.5, 0.5}: flat, std 0 -> 0 / 1e-6 = 0; group 2 {2}: alone, std 0 -> 0
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0])
    advantages = group_advantages(rewards, torch.tensor([0, 0, 1, 1, 2]))
    expected = [0.5 / (0.5 + EPS_ADV), -0.5 / (0.5 + EPS_ADV), 0.0, 0.0, 0.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-7)


def test_group_advantages_without_the_std_are_the_differences_from_the_mean() -> None:
    # Dr. GRPO: group 0 {1, 0, 0, 0}: mean 0.25 -> 0.75, -0.25 x 3 (with the std, 0.433013:
    # 1.732047, -0.577349); group 1 {0.5, 0.5}: flat -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    plain = group_advantages(rewards, groups, by_std=False)
    assert plain.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0], abs=1e-7)
    scaled = group_advantages(rewards, groups)
    assert scaled[:2].tolist() == pytest.approx([1.732047, -0.577349], abs=1e-5)


def test_batch_advantages_by_hand() -> None:
    # [1, 2, 3, 4]: mean 2.5, variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25, std 1.118034
    advantages = batch_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert advantages.tolist() == pytest.approx([-1.341641, -0.447214, 0.447214, 1.341641], 1e-5)


def test_batch_advantages_do_not_cancel_for_large_close_rewards() -> None:
    # 10000 + [1, 2, 3, 4]: the same deviations. In float32, E[x^2] - E[x]^2 subtracts two
    # numbers near 1e8 whose spacing is 8: the old formula gave a variance of 0 or of 8, not 1.25.
    advantages = batch_advantages(torch.tensor([10001.0, 10002.0, 10003.0, 10004.0]))
    assert advantages.tolist() == pytest.approx([-1.341641, -0.447214, 0.447214, 1.341641], 1e-5)


def test_rank_figures_combine_into_the_variance_of_the_union() -> None:
    # {1, 2}: n 2, mean 1.5, m2 0.5; {3, 4, 5}: n 3, mean 4, m2 2; union 1..5: mean 3,
    # m2 = 4 + 1 + 0 + 1 + 4 = 10
    assert combined_variance([(2, 1.5, 0.5), (3, 4.0, 2.0)]) == pytest.approx((5, 3.0, 10.0))


# -- log-probs, masks and the token-mean -------------------------------------------------------


def test_token_logprobs_divide_the_logits_by_the_temperature() -> None:
    # logits [ln 4, ln 2, 0]: at T = 1 the probabilities are 4/7, 2/7, 1/7; log(4/7) = -0.559616
    # and the entropy -(4/7 ln 4/7 + 2/7 ln 2/7 + 1/7 ln 1/7) = 0.955700.
    # At T = 0.5 the logits double: 16 : 4 : 1, so log p(0) = log(16/21) = -0.271934.
    logits = torch.tensor([[math.log(4.0), math.log(2.0), 0.0]])
    target = torch.tensor([0])
    at_one = token_logprobs(logits, target, temperature=1.0)
    assert at_one.logprobs.item() == pytest.approx(math.log(4 / 7), abs=1e-6)
    assert at_one.entropy.item() == pytest.approx(0.955700, abs=1e-6)
    assert token_logprobs(logits, target, 0.5).logprobs.item() == pytest.approx(-0.271934, 1e-5)
    with pytest.raises(ValueError, match="temperature > 0"):
        token_logprobs(logits, target, 0.0)


def test_batch_masks_mark_the_positions_that_predict_response_tokens() -> None:
    # Row 0: prompt [5, 6], response [7, 8, 9]: log-prob position t predicts token t + 1, so
    # positions 1, 2, 3 (predicting 7, 8, 9) are the response's. Row 1: prompt [1], response [2]:
    # position 0 predicts 2. Pads (0) are outside the attention and the mask.
    experience = Experience([[5, 6], [1]], [[7, 8, 9], [2]], [1.0, 0.0], [0, 0])
    batch = response_batch(experience, [0, 1], pad_id=0, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert batch.attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.mask.tolist() == [[False, True, True, True], [True, False, False, False]]


def test_rank_loss_is_the_ranks_share_of_the_global_token_mean() -> None:
    # Tokens 1, 3, 4 of this rank are responses, 6 on all 2 ranks: (1 + 3 + 4) / 6 * 2 = 8/3
    # (FSDP then averages the 2 ranks' gradients, giving the gradient of sum / 6).
    loss = rank_loss(
        torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        torch.tensor([[True, False], [True, True]]),
        global_tokens=6,
        world_size=2,
    )
    assert loss.item() == pytest.approx(8 / 3)


def test_split_rows_into_near_equal_mini_batches() -> None:
    assert split_rows(range(7), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_rows(range(4), 1) == [[0, 1, 2, 3]]


# -- whole updates of a bigram model -----------------------------------------------------------


def _spec(**algorithm: object) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {"algorithm": {"klCoef": 0, "clipRatio": 0.2, **algorithm}, "training": {}}
    )


# Two responses to prompt [0] (one group): [1, 2] rewarded 1, [2] rewarded 0, so A = +-0.999998.
# Three response tokens: (current 0 -> 1, A+), (1 -> 2, A+), (0 -> 2, A-). The table starts at
# zero: every p = 1/3 and the first step is on-policy (ratio 1).
BIGRAM = Experience([[0], [0]], [[1, 2], [2]], [1.0, 0.0], [0, 0], [[-1.0, -1.0], [-1.0]])
A = 0.5 / (0.5 + EPS_ADV)


def _update(spec: RLJobSpec) -> tuple[Bigram, PolicyUpdate]:
    model = Bigram()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return model, PolicyUpdate(spec, model, None, optimizer, pad_id=0, device=torch.device("cpu"))


def test_one_update_step_by_hand() -> None:
    # Loss = (1/3) sum -A_i log p_i = (-A - A + A) / 3 = -1/3 (ratio 1).
    # d loss / d logits at a token = (1/3)(-A)(onehot(y) - p), p = (1/3, 1/3, 1/3):
    #   row 0 (tokens after 0): -(e1 - p) + (e2 - p) = (0, -1, 1), / 3
    #   row 1 (after 1): -(e2 - p) = (1/3, 1/3, -2/3), / 3 = (1/9, 1/9, -2/9); row 2: none
    # norm sqrt(2/9 + 6/81) = sqrt(24/81) = 0.544331 < maxGradNorm 1: not clipped.
    # SGD with lr 1: table = -gradient.
    model, update = _update(_spec())
    stats = update.run(BIGRAM)
    assert stats.optimizer_steps == 1 and stats.token_steps == 3 and stats.response_tokens == 3
    assert stats.loss == pytest.approx(-A / 3, abs=1e-6)
    assert stats.clipped_tokens == 0
    assert stats.grad_norm == pytest.approx(math.sqrt(24 / 81) * A, abs=1e-6)
    assert stats.learning_rate == 1.0
    # entropy of the uniform p over 3 tokens: ln 3, at each of the 3 tokens
    assert stats.entropy_sum == pytest.approx(3 * math.log(3), abs=1e-5)
    # |engine - trainer| = |-1 - ln(1/3)| = 0.098612 at each of the 3 tokens
    assert stats.logprob_mismatch_sum == pytest.approx(3 * (math.log(3) - 1), abs=1e-5)
    expected = torch.tensor([[0.0, 1 / 3, -1 / 3], [-1 / 9, -1 / 9, 2 / 9], [0.0, 0.0, 0.0]])
    assert torch.allclose(model.table.detach(), expected * A, atol=1e-6)


def test_second_epoch_ratio_is_real_and_clips() -> None:
    # After the first step (above) the ratios against the pre-update log-probs are
    #   p(1|0) = e^(1/3) / (1 + e^(1/3) + e^(-1/3)) = 0.448441 -> r = 1.345323 (A+): clipped, -1.2
    #   p(2|1) = e^(2/9) / (2 e^(-1/9) + e^(2/9)) = 0.411005 -> r = 1.233014 (A+): clipped, -1.2
    #   p(2|0) = e^(-1/3) / (...)               = 0.230237 -> r = 0.690712 (A-): clipped, 0.8
    # so epoch 2's loss sums to -1.6 A, every token clipped, zero gradient (the table stays).
    # Over both epochs: loss sum (-A) + (-1.6 A) = -2.6 A over 6 token-steps, grad norm
    # (0.544331 + 0) / 2.
    model, update = _update(_spec(ppoEpochs=2))
    stats = update.run(BIGRAM)
    assert stats.optimizer_steps == 2 and stats.token_steps == 6
    assert stats.policy_loss_sum == pytest.approx(-2.6 * A, abs=1e-5)
    assert stats.clipped_tokens == 3
    assert stats.grad_norm == pytest.approx(math.sqrt(24 / 81) * A / 2, abs=1e-6)
    expected = torch.tensor([[0.0, 1 / 3, -1 / 3], [-1 / 9, -1 / 9, 2 / 9], [0.0, 0.0, 0.0]])
    assert torch.allclose(model.table.detach(), expected * A, atol=1e-6)


def test_clip_ratio_high_reaches_the_update() -> None:
    # The second epoch above with clipRatioHigh 0.4: the two A+ ratios (1.345323, 1.233014) are
    # inside [0.8, 1.4] now, unclipped (-r A each); the A- one (0.690712) is still clipped at
    # the lower 0.8. Epoch 2's loss sum -(1.345323 + 1.233014) A + 0.8 A = -1.778337 A; with
    # epoch 1's -A: -2.778337 A, and one clipped token.
    _, update = _update(_spec(ppoEpochs=2, clipRatioHigh=0.4))
    stats = update.run(BIGRAM)
    assert stats.policy_loss_sum == pytest.approx(-2.778337 * A, abs=1e-5)
    assert stats.clipped_tokens == 1


def test_without_the_group_std_the_step_is_the_plain_differences() -> None:
    # groupStdNormalization false (Dr. GRPO): A = +-0.5 (1 and 0 around their mean 0.5), so
    # the loss is (-0.5 - 0.5 + 0.5) / 3 and the step is the by-hand one above scaled by 0.5.
    model, update = _update(_spec(groupStdNormalization=False))
    stats = update.run(BIGRAM)
    assert stats.loss == pytest.approx(-0.5 / 3, abs=1e-6)
    expected = torch.tensor([[0.0, 1 / 3, -1 / 3], [-1 / 9, -1 / 9, 2 / 9], [0.0, 0.0, 0.0]])
    assert torch.allclose(model.table.detach(), expected * 0.5, atol=1e-6)


def test_more_mini_batches_than_responses_is_refused() -> None:
    _, update = _update(_spec(ppoMiniBatches=3))
    with pytest.raises(ValueError, match="ppoMiniBatches=3 is more than the 2 responses"):
        update.run(BIGRAM)


def test_a_flat_group_of_inexact_rewards_gets_exactly_zero_advantage() -> None:
    # 0.1 has no exact float32 form: the float32 mean of eight of them is one ulp off and the
    # old code gave every member -0.0074 (seen in a 40-iteration arithmetic run's flat groups).
    rewards = torch.full((8,), 0.1, dtype=torch.float32)
    advantages = group_advantages(rewards, torch.zeros(8, dtype=torch.long))
    assert advantages.dtype == torch.float32 and bool((advantages == 0).all())


def test_the_update_says_where_its_seconds_went() -> None:
    """TrainStats.pass_seconds (verl's timing_s per pass): each part the update ran, once per
    name, summed over its mini-batches and epochs, within the update's own wall time; the
    reference's pass only with a reference."""
    import copy
    import time

    model, update = _update(_spec(ppoEpochs=2))
    began = time.perf_counter()
    stats = update.run(BIGRAM)
    wall = time.perf_counter() - began
    parts = stats.pass_seconds
    assert set(parts) == {"old_logprobs", "setup", "forward_backward", "optimizer_step"}
    assert all(seconds >= 0 for seconds in parts.values()) and sum(parts.values()) <= wall
    with_reference = PolicyUpdate(_spec(klCoef=0.1), model, copy.deepcopy(model),
                                  torch.optim.SGD(model.parameters(), lr=1.0), pad_id=0,
                                  device=torch.device("cpu"))  # fmt: skip
    assert "ref_logprobs" in with_reference.run(BIGRAM).pass_seconds


def test_a_gradient_that_is_not_finite_skips_the_step_and_is_counted() -> None:
    # One entry of the gradient overflows (as a bf16 backward can): clipping would scale every
    # entry by maxGradNorm / inf into NaN and the step would write NaN into the weights.
    model, update = _update(_spec(ppoEpochs=2))

    def overflow_first(grad: torch.Tensor) -> torch.Tensor:
        if not overflowed:
            overflowed.append(True)
            grad = grad.clone()
            grad[0, 1] = float("inf")
        return grad

    overflowed: list[bool] = []
    model.table.register_hook(overflow_first)
    stats = update.run(BIGRAM)
    assert torch.isfinite(model.table).all()
    # Epoch 1's step was skipped (the table stayed at zero), so epoch 2 is on-policy and takes
    # the step by hand of test_one_update_step_by_hand.
    assert (stats.optimizer_steps, stats.skipped_steps) == (1, 1)
    assert stats.grad_norm == pytest.approx(math.sqrt(24 / 81) * A, abs=1e-6)
    expected = torch.tensor([[0.0, 1 / 3, -1 / 3], [-1 / 9, -1 / 9, 2 / 9], [0.0, 0.0, 0.0]])
    assert torch.allclose(model.table.detach(), expected * A, atol=1e-6)
