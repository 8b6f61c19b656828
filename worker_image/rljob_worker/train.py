"""FSDP2 training of the policy: GRPO / PPO-style loss, AdamW, offload and weight-sync buckets.

The Trainer owns the sharded policy (and frozen reference), moves optimizer state and params
between device and CPU on the stage machine's request, and gathers full tensors bucket by bucket.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rljob.api import AlgorithmName, RLJobSpec
from rljob_worker.model import load_causal_lm, torch_dtype

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class Experience:
    """One rank's rollout: prompts, sampled responses, rewards, and which prompt each came from."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float]
    group_ids: list[int]

    def __len__(self) -> int:
        return len(self.response_ids)


@dataclass(frozen=True)
class TrainStats:
    loss: float
    kl_mean: float | None
    grad_norm: float
    response_tokens: int


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group named tensors, in order, into buckets of at most `bucket_bytes`.

    A tensor larger than a bucket travels alone; every name lands in exactly one bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, nbytes in sizes:
        if current and filled + nbytes > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(name)
        filled += nbytes
    if current:
        buckets.append(current)
    return buckets


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (0 for a flat group)."""
    advantages = torch.zeros_like(rewards)
    for group in group_ids.unique():
        members = group_ids == group
        group_rewards = rewards[members]
        std = (
            group_rewards.std(unbiased=False)
            if group_rewards.numel() > 1
            else rewards.new_tensor(0.0)
        )
        advantages[members] = (group_rewards - group_rewards.mean()) / (std + eps)
    return advantages


def batch_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PPO-style without a critic: rewards normalised over the whole batch of all ranks."""
    stats = torch.stack([rewards.sum(), (rewards**2).sum(), rewards.new_tensor(rewards.numel())])
    if dist.is_initialized():
        dist.all_reduce(stats)
    total, total_sq, count = stats.tolist()
    mean = total / count
    std = max(total_sq / count - mean**2, 0.0) ** 0.5
    return (rewards - mean) / (std + eps)


def clipped_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_ratio: float
) -> torch.Tensor:
    """Per-token PPO clipped surrogate (to minimise); advantages broadcast over tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * advantages
    return -torch.minimum(unclipped, clipped)


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): non-negative, unbiased, low variance."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def _shard(model: torch.nn.Module, mesh: DeviceMesh, dtype: torch.dtype) -> None:
    # One FSDP unit per decoder layer (transformers names them in _no_split_modules), then the
    # root for embeddings, final norm and head: the layer-by-layer all-gather FSDP is built for.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _move(module: torch.nn.Module, device: torch.device) -> None:
    # Through nn.Module's own signature: transformers' typing of PreTrainedModel.to is narrower.
    module.to(device)


def _response_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, shape [batch, seq-1], in float32."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2, input_ids[:, 1:, None]).squeeze(2)


class Trainer:
    """The sharded policy of one rank; every method is collective (all ranks call it together)."""

    def __init__(self, spec: RLJobSpec, model_path: Path | str, device: torch.device, pad_id: int):
        self.spec = spec
        self.device = device
        self.pad_id = pad_id
        self.compute_dtype = torch_dtype(spec.model.dtype)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.mesh = init_device_mesh(device.type, (world,))
        # Master weights in float32; FSDP casts to the spec's dtype for compute.
        self.model = load_causal_lm(model_path, torch.float32)
        _move(self.model, device)
        if spec.training.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        _shard(self.model, self.mesh, self.compute_dtype)
        self.reference: torch.nn.Module | None = None
        if spec.algorithm.kl_coef > 0:
            self.reference = load_causal_lm(model_path, torch.float32)
            _move(self.reference, device)
            self.reference.requires_grad_(False).eval()
            _shard(self.reference, self.mesh, self.compute_dtype)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.algorithm.learning_rate, weight_decay=0.0
        )
        self._pinned: dict[tuple[int, str], torch.Tensor] = {}
        self.optimizer_on_device = True
        self.params_on_device = True

    # -- training ----------------------------------------------------------------------------

    def _batch(self, experience: Experience, rows: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Right-padded prompt+response ids, attention mask and a mask of response positions."""
        sequences = [experience.prompt_ids[i] + experience.response_ids[i] for i in rows]
        length = max(len(s) for s in sequences)
        input_ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), length), dtype=torch.long)
        response = torch.zeros((len(rows), length), dtype=torch.bool)
        for row, i in enumerate(rows):
            prompt, answer = len(experience.prompt_ids[i]), len(experience.response_ids[i])
            input_ids[row, : prompt + answer] = torch.tensor(sequences[row])
            attention[row, : prompt + answer] = 1
            response[row, prompt : prompt + answer] = True
        # Targets are shifted by one: position t of the log-probs predicts token t+1.
        return input_ids.to(self.device), attention.to(self.device), response[:, 1:].to(self.device)

    def train_step(self, experience: Experience) -> TrainStats:
        """One optimizer step over the rank's experience, in micro-batches."""
        algorithm = self.spec.algorithm
        rewards = torch.tensor(experience.rewards, dtype=torch.float32, device=self.device)
        if algorithm.name == AlgorithmName.GRPO:
            groups = torch.tensor(experience.group_ids, device=self.device)
            advantages = group_advantages(rewards, groups)
        else:
            advantages = batch_advantages(rewards)
        micro = self.spec.training.micro_batch_size
        chunks = [
            list(range(i, min(i + micro, len(experience))))
            for i in range(0, len(experience), micro)
        ]
        total_tokens = max(sum(len(r) for r in experience.response_ids), 1)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = kl_sum = 0.0
        for rows in chunks:
            input_ids, attention, mask = self._batch(experience, rows)
            logprobs = _response_logprobs(self.model, input_ids, attention)
            # One update per rollout batch: the sampling policy is the current one, so the old
            # log-probs are today's, detached (the ratio is 1 but its gradient is the PPO one).
            token_loss = clipped_policy_loss(
                logprobs, logprobs.detach(), advantages[rows, None], algorithm.clip_ratio
            )
            if self.reference is not None:
                with torch.no_grad():
                    ref_logprobs = _response_logprobs(self.reference, input_ids, attention)
                token_kl = kl_to_reference(logprobs, ref_logprobs)
                token_loss = token_loss + algorithm.kl_coef * token_kl
                kl_sum += float((token_kl.detach() * mask).sum())
            loss = (token_loss * mask).sum() / total_tokens
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.spec.training.max_grad_norm
        )
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        # Gradients are not needed until the next train stage: free them now, not at offload.
        self.optimizer.zero_grad(set_to_none=True)
        return TrainStats(
            loss=loss_sum,
            kl_mean=kl_sum / total_tokens if self.reference is not None else None,
            grad_norm=float(grad_norm),
            response_tokens=total_tokens,
        )

    # -- offload -----------------------------------------------------------------------------

    def _move_state(self, to_device: bool) -> None:
        # Pinned host buffers are kept per state tensor: pinning is slow, reusing them is not,
        # and pinned memory makes the copies asynchronous.
        pin = self.device.type == "cuda"
        target = self.device if to_device else torch.device("cpu")
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state: dict[str, Any] = self.optimizer.state.get(param, {})
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor) or key == "step":
                        continue  # AdamW keeps `step` on the CPU already
                    state[key] = self._moved(id(param), key, value, target, pin)
        if pin:
            torch.cuda.synchronize(self.device)

    def _moved(
        self, param_id: int, key: str, value: torch.Tensor, target: torch.device, pin: bool
    ) -> torch.Tensor:
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.device == target:
            return value
        if target.type == "cpu" and pin:
            buffer = self._pinned.get((param_id, key))
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty_like(local, device="cpu", pin_memory=True)
                self._pinned[(param_id, key)] = buffer
            moved = buffer.copy_(local, non_blocking=True)
        else:
            moved = local.to(target, non_blocking=pin)
        if isinstance(value, DTensor):
            return DTensor.from_local(
                moved,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        return moved

    def offload_optimizer(self) -> None:
        """AdamW moments to (pinned) CPU memory."""
        self._move_state(to_device=False)
        self.optimizer_on_device = False

    def load_optimizer(self) -> None:
        self._move_state(to_device=True)
        self.optimizer_on_device = True

    def _modules(self) -> list[torch.nn.Module]:
        return [self.model] + ([self.reference] if self.reference is not None else [])

    def offload_params(self) -> None:
        """Sharded params (policy and reference) to CPU; FSDP2 modules support .to() directly."""
        for module in self._modules():
            _move(module, torch.device("cpu"))
        self.params_on_device = False

    def load_params(self) -> None:
        for module in self._modules():
            _move(module, self.device)
        self.params_on_device = True

    # -- weight sync -------------------------------------------------------------------------

    def weight_buckets(self, bucket_bytes: int, dtype: torch.dtype) -> Iterator[NamedTensors]:
        """Full (unsharded) tensors in the engine's dtype, one bucket at a time.

        Only one bucket of full tensors exists at once: that bound is what the bucket size
        buys. Collective: every rank gathers the same bucket in the same order.
        """
        params = dict(self.model.named_parameters())
        element = torch.empty((), dtype=dtype).element_size()
        sizes = [(name, p.numel() * element) for name, p in params.items()]
        for names in plan_buckets(sizes, bucket_bytes):
            bucket: NamedTensors = []
            for name in names:
                param = params[name].detach()
                full = param.full_tensor() if isinstance(param, DTensor) else param
                bucket.append((name, full.to(dtype)))
            yield bucket
            del bucket
