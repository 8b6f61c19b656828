"""spec.algorithm: the RL algorithm (GRPO or PPO) and its hyperparameters."""

from __future__ import annotations

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


class AlgorithmSpec(_Spec):
    """The RL algorithm (verl: algorithm.* and actor_rollout_ref.actor.*)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(GRPO_GROUP_RULE))

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
        default=1e-6, gt=0, le=1, description="AdamW learning rate (verl: actor.optim.lr)."
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
        _check_rules(self, (GRPO_GROUP_RULE,), "spec.algorithm")
        return self
