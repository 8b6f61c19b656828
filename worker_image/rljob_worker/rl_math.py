"""The arithmetic of one policy update: advantages, the clipped surrogate, the KL penalty, log-probs
under the sampling temperature, and the global token-mean. docs/algorithm.md gives the formulas.

Pure functions of tensors; the two that all-reduce (batch_advantages, global_token_count) say so.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

# verl's bounds (core_algos.kl_penalty "low_var_kl" and compute_policy_loss): the log-ratio is
# clamped before exp, so one token whose policies disagree wildly cannot overflow to inf (and
# its gradient to NaN), and the k3 value itself is clamped, so it cannot dominate the loss.
LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, by_std: bool = True
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (0 for a flat group).
    `by_std` False: the difference alone (Dr. GRPO; verl's norm_adv_by_std_in_grpo False).

    In float64, and a group whose rewards are all equal gets exactly 0: in float32 the mean of
    eight rewards of 0.1 is off by one ulp, its std is ~7e-9, and (r - mean) / (std + 1e-6)
    came out -0.0074 for every member, a push on responses that earned nothing different."""
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for group in group_ids.unique():
        members = group_ids == group
        group_rewards = rewards[members].double()
        if group_rewards.numel() < 2 or bool((group_rewards == group_rewards[0]).all()):
            continue  # flat or alone: nothing to learn from
        centred = group_rewards - group_rewards.mean()
        advantages[members] = (
            centred / (group_rewards.std(unbiased=False) + eps) if by_std else centred
        )
    return advantages.to(rewards.dtype)


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values)
    return values


def batch_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PPO-style without a critic: rewards normalised over the whole batch of all ranks.

    Two passes in float64, each one all-reduce: the global mean first, then the sum of squared
    deviations from it. E[x^2] - E[x]^2 in float32 cancels catastrophically when the rewards
    are large and close together (and can come out negative). Collective.
    """
    values = rewards.double()
    first = _all_reduce_sum(torch.stack([values.sum(), values.new_tensor(values.numel())]))
    mean = first[0] / first[1]
    squares = _all_reduce_sum(((values - mean) ** 2).sum().reshape(1))
    std = (squares[0] / first[1]).sqrt()
    return ((values - mean) / (std + eps)).to(rewards.dtype)


class PolicyLoss(NamedTuple):
    """Per-token surrogate to minimise, and where the clipped term was the one taken."""

    loss: torch.Tensor
    clipped: torch.Tensor


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float,
    clip_ratio_high: float | None = None,
) -> PolicyLoss:
    """Per-token PPO clipped surrogate -min(r A, clip(r, 1-e, 1+e_high) A), r = exp(logp -
    old); e_high is e unless given (DAPO's clip-higher: a larger upper bound lets unlikely
    tokens with A > 0 grow further before their gradient stops).

    `clipped` marks the tokens whose clipped term is strictly the smaller objective (verl's
    pg_clipfrac): there the gradient is zero. Advantages broadcast over tokens.
    """
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - clip_ratio, 1 + high) * advantages
    return PolicyLoss(torch.maximum(unclipped, clipped), (clipped > unclipped).detach())


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - logp.

    Non-negative and unbiased; d is clamped to +-LOG_RATIO_CLAMP before exp and the result to
    at most KL_CLAMP (verl's low_var_kl), so one far-off token cannot blow the loss up.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-KL_CLAMP, KL_CLAMP)


def truncated_importance_weights(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(pi_trainer / pi_engine, cap) per token, without gradient (verl's tis_imp_ratio_cap).

    The engine sampled the tokens; the trainer's own log-probs of them (before the update) are
    the policy the loss assumes. Weighting by their ratio corrects for the difference (bf16
    kernels, other attention code), truncated so a rare token cannot take over the update.
    """
    log_ratio = (trainer_logprobs - engine_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap).detach()


class TokenLogprobs(NamedTuple):
    logprobs: torch.Tensor
    entropy: torch.Tensor


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> TokenLogprobs:
    """log p(target) and the entropy of p, with p = softmax(logits / temperature), in float32.

    The engines sample from logits / temperature (engines/paged_decoder.sample_next, sglang):
    the policy being trained is that distribution, so its log-probs are taken the same way.
    The entropy is a metric only: no gradient.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: training log-probs need temperature > 0")
    log_probs = F.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.gather(log_probs, -1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return TokenLogprobs(chosen, entropy)


def global_token_count(mask: torch.Tensor) -> int:
    """Response tokens of `mask` summed over every rank (one all-reduce). Collective."""
    count = mask.sum().to(torch.float64).reshape(1)
    return int(_all_reduce_sum(count).item())


def rank_loss(
    token_loss: torch.Tensor, mask: torch.Tensor, global_tokens: int, world_size: int
) -> torch.Tensor:
    """This rank's share of the global token-mean: sum over its tokens / global tokens * world.

    FSDP2's reduce-scatter averages the ranks' gradients (divides their sum by the world size),
    so scaling by world_size makes the reduced gradient that of sum(all tokens) / global_tokens:
    every token weighs the same whichever rank sampled it, however unequal the ranks' lengths.
    """
    return (token_loss * mask).sum() * (world_size / max(global_tokens, 1))
