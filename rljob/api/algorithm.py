"""spec.algorithm: the RL algorithm (GRPO or PPO) and its hyperparameters."""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import ConfigDict, Field, model_validator

from rljob.api._base import CrossFieldRule, _cel_rules, _check_rules, _Spec


class AlgorithmName(StrEnum):
    GRPO = "grpo"
    PPO = "ppo"


GRPO_GROUP_RULE = CrossFieldRule(
    cel="self.name != 'grpo' || self.groupSize >= 2",
    message="grpo needs groupSize >= 2 (its advantage is relative to the group)",
    field_path=".groupSize",
    check=lambda a: a.name != AlgorithmName.GRPO or a.group_size >= 2,
)


class LearningRateSchedule(StrEnum):
    CONSTANT = "Constant"
    COSINE = "Cosine"


WARMUP_WITHIN_RULE = CrossFieldRule(
    cel="self.warmupIterations <= self.iterations",
    message="warmupIterations cannot exceed iterations: the rate would never reach learningRate",
    field_path=".warmupIterations",
    check=lambda a: a.warmup_iterations <= a.iterations,
)
MIN_RATE_NEEDS_COSINE_RULE = CrossFieldRule(
    cel="self.learningRateSchedule == 'Cosine' || self.minLearningRateRatio == 0.0",
    message="minLearningRateRatio is the floor of the Cosine schedule: set "
    "learningRateSchedule: Cosine, or leave it out (Constant keeps learningRate)",
    field_path=".minLearningRateRatio",
    check=lambda a: (
        a.learning_rate_schedule is LearningRateSchedule.COSINE or a.min_learning_rate_ratio == 0.0
    ),
)
ALGORITHM_RULES = (GRPO_GROUP_RULE, WARMUP_WITHIN_RULE, MIN_RATE_NEEDS_COSINE_RULE)


class AlgorithmSpec(_Spec):
    """The RL algorithm (verl: algorithm.* and actor_rollout_ref.actor.*)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*ALGORITHM_RULES))

    name: AlgorithmName = Field(
        default=AlgorithmName.GRPO,
        description="grpo: group-relative advantages (reward minus the group's mean, over its "
        "std). ppo: PPO-style clipped loss with batch-normalised advantages (no critic).",
    )
    group_size: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Responses sampled per prompt (verl: actor_rollout_ref.rollout.n). "
        "GRPO needs at least 2.",
    )
    learning_rate: float = Field(
        default=1e-6,
        gt=0,
        le=1,
        description="AdamW learning rate (verl: actor.optim.lr): the peak of the schedule.",
    )
    learning_rate_schedule: LearningRateSchedule = Field(
        default=LearningRateSchedule.CONSTANT,
        description="After the warmup, Constant keeps learningRate; Cosine lowers it over the "
        "remaining iterations along half a cosine towards learningRate x minLearningRateRatio "
        "(verl: optim.warmup_style). A function of the iteration: a resumed run continues it.",
    )
    warmup_iterations: int = Field(
        default=0,
        ge=0,
        description="Training iterations that raise the rate linearly: iteration i (from 1) "
        "trains at learningRate x i / N (verl: optim.lr_warmup_steps, whose first step trains "
        "at 0). 0: none.",
    )
    min_learning_rate_ratio: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="The Cosine schedule's floor as a share of learningRate (verl: "
        "optim.min_lr_ratio).",
    )
    weight_decay: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="AdamW's decoupled weight decay, on every parameter (verl: "
        "optim.weight_decay, 0.01 there).",
    )
    kl_coef: float = Field(
        default=0.001,
        ge=0,
        description="Coefficient of the KL term to the reference policy (verl: "
        "actor.kl_loss_coef). 0 disables the reference model.",
    )
    clip_ratio: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip range epsilon (verl: actor.clip_ratio)."
    )
    clip_ratio_high: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="The clip range's upper side, 1 + clipRatioHigh (DAPO's clip-higher, e.g. "
        "0.28; verl: actor.clip_ratio_high). Unset: clipRatio on both sides.",
    )
    group_std_normalization: bool = Field(
        default=True,
        description="grpo: divide each reward's difference from its group's mean by the "
        "group's std. false: the difference alone (Dr. GRPO; verl: "
        "algorithm.norm_adv_by_std_in_grpo).",
    )
    ppo_epochs: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Passes over each rollout's responses (verl: actor.ppo_epochs). The PPO "
        "ratio is against the log-probs before the first pass (docs/algorithm.md).",
    )
    ppo_mini_batches: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Optimizer steps per pass: each rank's responses are split into this many "
        "mini-batches (verl: train_batch_size / ppo_mini_batch_size). 1: one step per pass.",
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="Truncated importance sampling: weight each token's loss by "
        "min(p_trainer / p_engine, tisCap), correcting for the rollout engine's numerics "
        "(verl: tis_imp_ratio_cap, e.g. 2). Unset: off.",
    )
    iterations: int = Field(
        default=2,
        ge=1,
        description="Training iterations, each train -> sync -> rollout "
        "(verl: trainer.total_training_steps).",
    )
    seed: int = Field(default=0, ge=0, description="Seed for sampling and initialisation.")

    @model_validator(mode="after")
    def _cross_field(self) -> AlgorithmSpec:
        _check_rules(self, ALGORITHM_RULES, "spec.algorithm")
        return self

    def learning_rate_at(self, iteration: int) -> float:
        """The rate training iteration `iteration` (1..iterations; iteration 0 only rolls out)
        trains with: i / N of learningRate over the N warmup iterations, then learningRate
        (Constant), or (Cosine) from learningRate at the first iteration after the warmup down
        along half a cosine, as Hugging Face's get_cosine_schedule_with_warmup counts its steps
        from that iteration: floor + (peak - floor) x (1 + cos(pi x progress)) / 2, progress
        (i - 1 - N) / (iterations - N)."""
        peak, warmup = self.learning_rate, self.warmup_iterations
        if warmup and iteration <= warmup:
            return peak * max(iteration, 0) / warmup
        if self.learning_rate_schedule is LearningRateSchedule.CONSTANT:
            return peak
        floor = peak * self.min_learning_rate_ratio
        progress = (iteration - 1 - warmup) / (self.iterations - warmup)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
