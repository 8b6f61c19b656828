"""One train stage's policy update: the rollout as padded batches, the log-probs before the update,
and PPO epochs over mini-batches with a global token-mean loss (docs/algorithm.md).

Collective: every rank runs it with the same number of responses (so the same number of
mini-batches, micro-batches and all-reduces) on its FSDP2-sharded policy.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from rljob.api import AlgorithmName, RLJobSpec
from rljob_worker.rl_math import (
    TokenLogprobs,
    batch_advantages,
    clipped_policy_loss,
    global_token_count,
    group_advantages,
    kl_to_reference,
    rank_loss,
    token_logprobs,
    truncated_importance_weights,
)

NON_CUDNN_ATTENTION = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

log = logging.getLogger(__name__)


@dataclass
class Experience:
    """One rank's rollout: prompts, sampled responses, rewards, and which prompt each came from.

    `logprobs` are the engine's log-probs of each trained response token as it sampled it
    (empty when the engine gave none: then neither the mismatch nor the TIS correction is
    computed).

    `loss_masks` (multi-turn, agentic/driver.py): per response token, 1 where the model sampled
    it and 0 where the template or a tool put it; only the 1s are trained, and `logprobs` then
    has one entry per 1. Empty: every response token is sampled (single-turn).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float]
    group_ids: list[int]
    logprobs: list[list[float]] = field(default_factory=list)
    loss_masks: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    def trained(self, row: int) -> list[bool]:
        """Which of response `row`'s tokens the update trains on."""
        if not self.loss_masks:
            return [True] * len(self.response_ids[row])
        mask = self.loss_masks[row]
        if len(mask) != len(self.response_ids[row]):
            raise ValueError(
                f"response {row}: {len(mask)} loss-mask entries for "
                f"{len(self.response_ids[row])} tokens"
            )
        return [bool(m) for m in mask]

    @property
    def trained_tokens(self) -> int:
        return sum(sum(self.trained(row)) for row in range(len(self)))

    def sequence_lengths(self) -> list[int]:
        """Each row's prompt + response tokens: the length it pads to in a micro-batch."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True)]


@dataclass(frozen=True)
class TrainStats:
    """One rank's sums over every optimizer step of one train stage.

    Sums, not means, so that the driver's sum over ranks divided by the summed token count is
    the global per-token mean (driver.iteration_reports). `token_steps` counts every response
    token once per epoch; `response_tokens` once.
    """

    response_tokens: int
    token_steps: int
    policy_loss_sum: float
    kl_sum: float | None
    entropy_sum: float
    clipped_tokens: int
    # sum over response tokens of |logp_engine - logp_trainer| before the update (None: the
    # engine gave no log-probs).
    logprob_mismatch_sum: float | None
    # Global (the same on every rank): the mean pre-clip gradient norm of the steps taken (None:
    # every step was skipped for a gradient that was not finite).
    grad_norm: float | None
    learning_rate: float
    optimizer_steps: int
    # Steps not taken: the global gradient norm was inf or NaN (_step). Same on every rank.
    skipped_steps: int = 0
    # Where the stage's seconds went (PassClock's parts: old_logprobs, ref_logprobs, setup,
    # forward_backward, optimizer_step), as verl reports timing_s per pass. Not summed over
    # ranks: each rank's own.
    pass_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        """Per-token surrogate loss of this rank (the PPO objective, KL not included)."""
        return self.policy_loss_sum / max(self.token_steps, 1)

    @property
    def kl_mean(self) -> float | None:
        return None if self.kl_sum is None else self.kl_sum / max(self.token_steps, 1)


@dataclass(frozen=True)
class ResponseBatch:
    """Right-padded prompt+response rows; `mask` marks, in the shifted-by-one log-prob layout
    [rows, length - 1], the positions whose next token is a trained response token (all of a
    single-turn response; the sampled ones of a multi-turn trajectory)."""

    rows: tuple[int, ...]
    input_ids: torch.Tensor
    attention: torch.Tensor  # 1 on the real tokens (the model needs no mask: forward_logprobs)
    mask: torch.Tensor


def response_batch(
    experience: Experience, rows: Sequence[int], pad_id: int, device: torch.device
) -> ResponseBatch:
    sequences = [experience.prompt_ids[i] + experience.response_ids[i] for i in rows]
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    response = torch.zeros((len(rows), length), dtype=torch.bool)
    for row, i in enumerate(rows):
        prompt, answer = len(experience.prompt_ids[i]), len(experience.response_ids[i])
        input_ids[row, : prompt + answer] = torch.tensor(sequences[row])
        attention[row, : prompt + answer] = 1
        response[row, prompt : prompt + answer] = torch.tensor(
            experience.trained(i), dtype=torch.bool
        )
    # Targets are shifted by one: log-prob position t is the model's prediction of token t+1,
    # so response token t+1 is scored at position t (the first response token at prompt-1).
    return ResponseBatch(
        tuple(rows), input_ids.to(device), attention.to(device), response[:, 1:].to(device)
    )


def per_row_to_mask(values: Sequence[torch.Tensor], batch: ResponseBatch) -> torch.Tensor:
    """Per-response values (one per response token, in order) laid out like batch.mask."""
    full = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)
    full[batch.mask] = torch.cat([values[i].to(full.device) for i in batch.rows])
    return full


def forward_logprobs(
    model: torch.nn.Module, batch: ResponseBatch, temperature: float
) -> TokenLogprobs:
    """The rows' token log-probs. The rows are right-padded, so causal attention alone keeps a
    real token from seeing any pad (pads only follow it) and positions count from 0 either way:
    the model is given no mask, which lets SDPA take its causal kernel (PolicyUpdate.run keeps
    it off cuDNN's). The pads' own outputs differ, and batch.mask leaves them out."""
    logits = model(input_ids=batch.input_ids, attention_mask=None, use_cache=False)
    return token_logprobs(logits.logits[:, :-1], batch.input_ids[:, 1:], temperature)


class PassClock:
    """Seconds between marks, summed per part name; on CUDA each mark first waits for the
    device, so a part is the kernels it queued, not only their launch. The marks sit where the
    update already waits for the device (log-probs read back, loss sums as floats), so they add
    no wait of their own worth the name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._last
        self._last = now


def split_rows(rows: Sequence[int], parts: int) -> list[list[int]]:
    """`rows` in `parts` consecutive runs whose sizes differ by at most one (first ones longer)."""
    size, longer = divmod(len(rows), parts)
    out, start = [], 0
    for part in range(parts):
        end = start + size + (part < longer)
        out.append(list(rows[start:end]))
        start = end
    return out


def chunks(rows: Sequence[int], size: int) -> list[list[int]]:
    return [list(rows[i : i + size]) for i in range(0, len(rows), size)]


def pack_rows(lengths: Sequence[int], rows: Sequence[int], budget: int) -> list[list[int]]:
    """`rows` longest first, cut into consecutive micro-batches whose padded tokens (rows x the
    longest of them) stay within `budget`: short sequences ride many to a micro-batch, and a
    micro-batch pads each row only up to similar lengths (verl's use_dynamic_bsz). A row longer
    than the budget goes alone."""
    order = sorted(rows, key=lambda row: (-lengths[row], row))
    packed: list[list[int]] = []
    for row in order:
        # Sorted longest first: a micro-batch's first row is its longest.
        if packed and (len(packed[-1]) + 1) * lengths[packed[-1][0]] <= budget:
            packed[-1].append(row)
        else:
            packed.append([row])
    return packed


def split_to(packed: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """`packed` cut further until it has `count` micro-batches: the one of most padded tokens
    (of those with two rows or more) is halved each time, so each stays within its budget."""
    out = [list(batch) for batch in packed]
    while len(out) < count:
        splittable = [i for i, batch in enumerate(out) if len(batch) > 1]
        if not splittable:
            raise ValueError(f"{sum(map(len, out))} rows cannot make {count} micro-batches")
        i = max(splittable, key=lambda j: len(out[j]) * lengths[out[j][0]])
        half = len(out[i]) // 2
        out[i : i + 1] = [out[i][:half], out[i][half:]]
    return out


def agreed_counts(counts: list[int], device: torch.device) -> list[int]:
    """The most micro-batches any rank packed, per mini-batch (one all-reduce). Collective: FSDP's
    all-gathers and reduce-scatters run once per micro-batch, so every rank runs as many."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return counts
    agreed = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return [int(c) for c in agreed.tolist()]


class PolicyUpdate:
    """The update of one train stage on one rank: build once per rollout, then run()."""

    def __init__(
        self,
        spec: RLJobSpec,
        model: torch.nn.Module,
        reference: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        pad_id: int,
        device: torch.device,
        pack: bool = True,
    ) -> None:
        self.spec, self.model, self.reference, self.optimizer = spec, model, reference, optimizer
        self.pad_id, self.device = pad_id, device
        self.temperature = spec.rollout.sampling.temperature
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.pack = pack

    def micro_batches(
        self, experience: Experience, groups: list[list[int]]
    ) -> list[list[list[int]]]:
        """Each group of rows (a mini-batch, or all rows) as micro-batches of row indices.

        Packed (the default): sorted by length and filled up to microBatchSize sequences of this
        rank's longest one (pack_rows), so a rollout of mixed lengths runs fewer, fuller
        micro-batches while none holds more padded tokens than microBatchSize of its longest
        rows would: the memory plan's bound (microBatchSize at the longest sequence the spec
        allows) holds, and a rollout of equal lengths is cut exactly as before. The counts are
        agreed across ranks (agreed_counts). The gradient is the same either way: the loss is a
        sum over tokens divided by the global count (rank_loss). Unpacked: consecutive runs of
        microBatchSize rows."""
        micro = self.spec.training.micro_batch_size
        if not self.pack:
            return [chunks(rows, micro) for rows in groups]
        lengths = experience.sequence_lengths()
        budget = micro * max(lengths, default=1)
        packed = [pack_rows(lengths, rows, budget) for rows in groups]
        counts = agreed_counts([len(p) for p in packed], self.device)
        return [split_to(p, lengths, count) for p, count in zip(packed, counts, strict=True)]

    def _batches(
        self, experience: Experience, micro_batches: list[list[int]]
    ) -> list[ResponseBatch]:
        return [
            response_batch(experience, rows, self.pad_id, self.device) for rows in micro_batches
        ]

    @torch.no_grad()
    def _logprobs_of(
        self, model: torch.nn.Module, experience: Experience, micro_batches: list[list[int]]
    ) -> list[torch.Tensor]:
        """Each response's token log-probs under `model` as it is now (no gradient), by row.

        In eval mode: transformers wraps each layer in gradient checkpointing while the model
        is in training mode, a cost a pass without gradient gets nothing for (on an H100 at 3B
        the policy's pass took 2.5x the reference's over the same rows; the reference is in
        eval mode, and in bf16). Qwen2's dropout is 0, so the log-probs are the same in either
        mode. run() sets train mode again before the update."""
        model.eval()
        values: dict[int, torch.Tensor] = {}
        for batch in self._batches(experience, micro_batches):
            logprobs = forward_logprobs(model, batch, self.temperature).logprobs
            for position, row in enumerate(batch.rows):
                values[row] = logprobs[position][batch.mask[position]]
        return [values[row] for row in range(len(experience))]

    def _advantages(self, experience: Experience) -> torch.Tensor:
        rewards = torch.tensor(experience.rewards, dtype=torch.float32, device=self.device)
        if self.spec.algorithm.name == AlgorithmName.GRPO:
            groups = torch.tensor(experience.group_ids, device=self.device)
            return group_advantages(
                rewards, groups, by_std=self.spec.algorithm.group_std_normalization
            )
        return batch_advantages(rewards)

    def run(self, experience: Experience) -> TrainStats:
        # Every attention kernel but cuDNN's, for the forwards and the backward's recomputed
        # ones alike (all inside this block). On an H100 (torch 2.11) SDPA picked cuDNN for the
        # training forwards, whose host side took ~1.2 ms a call at the changing shapes of
        # packed micro-batches (3B: 36 calls a forward), a quarter of the CPU time of a train
        # stage that the CPU bounded; flash attention's causal kernel computes the same.
        with sdpa_kernel(NON_CUDNN_ATTENTION):
            return self._run(experience)

    def _run(self, experience: Experience) -> TrainStats:
        algorithm = self.spec.algorithm
        parts = algorithm.ppo_mini_batches
        if parts > len(experience):
            raise ValueError(
                f"spec.algorithm.ppoMiniBatches={parts} is more than the {len(experience)} "
                "responses each rank trains on per iteration; lower it or raise "
                "data.trainBatchSize or algorithm.groupSize"
            )
        clock = PassClock(self.device)
        advantages = self._advantages(experience)
        # One plan for every pass: the whole rollout for the log-prob passes, then each
        # mini-batch's micro-batches (the same every epoch).
        minis = split_rows(range(len(experience)), parts)
        whole, *steps = self.micro_batches(experience, [list(range(len(experience))), *minis])
        # The policy that sampled, as the trainer computes it: the PPO ratio's denominator, fixed
        # for every epoch and mini-batch of this rollout (verl's old_log_prob). At the first step
        # the ratio is exactly 1; later steps' ratios measure how far the updates moved.
        old = self._logprobs_of(self.model, experience, whole)
        clock.mark("old_logprobs")
        ref = None
        if self.reference is not None:
            ref = self._logprobs_of(self.reference, experience, whole)
            clock.mark("ref_logprobs")
        engine = [torch.tensor(v) for v in experience.logprobs] if experience.logprobs else None
        mismatch = (
            sum(float((e.to(o.device) - o).abs().sum()) for e, o in zip(engine, old, strict=True))
            if engine is not None
            else None
        )
        tokens = experience.trained_tokens
        sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clipped": 0.0, "tokens": 0.0}
        norms: list[float] = []
        self.model.train()
        clock.mark("setup")
        for _epoch in range(algorithm.ppo_epochs):
            for micro_batches in steps:
                batches = self._batches(experience, micro_batches)
                global_tokens = global_token_count(
                    torch.stack([b.mask.sum() for b in batches]).sum()
                )
                self.optimizer.zero_grad(set_to_none=True)
                for batch in batches:
                    self._accumulate(batch, advantages, old, ref, engine, global_tokens, sums)
                clock.mark("forward_backward")
                norms.append(self._step())
                clock.mark("optimizer_step")
        taken = [n for n in norms if math.isfinite(n)]
        return TrainStats(
            response_tokens=tokens,
            token_steps=int(sums["tokens"]),
            policy_loss_sum=sums["loss"],
            kl_sum=sums["kl"] if ref is not None else None,
            entropy_sum=sums["entropy"],
            clipped_tokens=int(sums["clipped"]),
            logprob_mismatch_sum=mismatch,
            grad_norm=sum(taken) / len(taken) if taken else None,
            learning_rate=float(self.optimizer.param_groups[0]["lr"]),
            optimizer_steps=len(taken),
            skipped_steps=len(norms) - len(taken),
            pass_seconds=clock.seconds,
        )

    def _accumulate(
        self,
        batch: ResponseBatch,
        advantages: torch.Tensor,
        old: list[torch.Tensor],
        ref: list[torch.Tensor] | None,
        engine: list[torch.Tensor] | None,
        global_tokens: int,
        sums: dict[str, float],
    ) -> None:
        """Forward and backward of one micro-batch; its gradient adds to the mini-batch's."""
        algorithm, mask = self.spec.algorithm, batch.mask
        current = forward_logprobs(self.model, batch, self.temperature)
        old_logprobs = per_row_to_mask(old, batch)
        policy = clipped_policy_loss(
            current.logprobs, old_logprobs, advantages[list(batch.rows), None],
            algorithm.clip_ratio, algorithm.clip_ratio_high,
        )  # fmt: skip
        token_loss = policy.loss
        if algorithm.tis_cap is not None and engine is not None:
            weights = truncated_importance_weights(
                old_logprobs, per_row_to_mask(engine, batch), algorithm.tis_cap
            )
            token_loss = token_loss * weights
        sums["loss"] += float((token_loss.detach() * mask).sum())
        if ref is not None:
            token_kl = kl_to_reference(current.logprobs, per_row_to_mask(ref, batch))
            token_loss = token_loss + algorithm.kl_coef * token_kl
            sums["kl"] += float((token_kl.detach() * mask).sum())
        rank_loss(token_loss, mask, global_tokens, self.world).backward()
        sums["entropy"] += float((current.entropy * mask).sum())
        sums["clipped"] += float((policy.clipped & mask).sum())
        sums["tokens"] += float(mask.sum())

    def _step(self) -> float:
        """Clip the gradient, step, free the gradient; the norm before clipping (global).

        A norm that is not finite (an overflow in one micro-batch's backward) skips the step,
        as verl's actor does: clipping would scale every gradient by max / inf into NaN, and
        AdamW would write NaN into the weights the engine then samples with. The norm is the
        same on every rank, so all skip together."""
        from torch.distributed.tensor import DTensor

        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.spec.training.max_grad_norm
        )
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        norm = float(grad_norm)
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            log.warning("optimizer step skipped: the gradient norm is %s", norm)
        # Gradients are not needed until the next step: free them now, not at offload.
        self.optimizer.zero_grad(set_to_none=True)
        return norm
