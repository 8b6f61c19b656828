"""The rollout-engine interface the stage machine drives, and the memory tags it uses.

An engine shares its GPU with FSDP training, so it must release and resume its memory by tag
(weights, KV cache, CUDA graphs) with stable addresses, and take weights in place, bucket by
bucket. SGLang's Engine and the torch reference engine both fit it without change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rljob_worker.tp_shards import ShardedBucket

# Memory tags, with SGLang's spelling (sglang.srt.constants GPU_MEMORY_TYPE_*).
TAG_WEIGHTS = "weights"
TAG_KV_CACHE = "kv_cache"
TAG_CUDA_GRAPH = "cuda_graph"
ALL_TAGS: tuple[str, ...] = (TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH)


@dataclass(frozen=True)
class SamplingParams:
    """What one generate call samples with (from the spec's rollout.sampling)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None


# Requests a batch may hold with a seed of their own each (request_seed).
REQUEST_SEED_BITS = 20


def request_seed(seed: int, index: int) -> int:
    """Request `index`'s seed in a batch of `seed`: the seed above REQUEST_SEED_BITS, the index
    below, so no two (seed, index) pairs meet. The loop's batch seeds of neighbouring ranks and
    iterations differ by 1 (loop.py), and seed + index would give rank r's request k + 1 rank
    r + 1's request k's seed: the same random stream. sglang's batches and the multi-turn
    driver's turns both take their seeds from here."""
    return ((seed << REQUEST_SEED_BITS) + index % (1 << REQUEST_SEED_BITS)) % (1 << 63)


@dataclass(frozen=True)
class Completion:
    """One sampled response: its token ids (without the prompt) and, per token, the log-prob
    the engine drew it with (logits / temperature), the behaviour policy of the PPO update."""

    token_ids: list[int]
    logprobs: list[float]
    # Prompt tokens the engine found in its prefix cache (sglang's meta_info cached_tokens);
    # None where the engine has no prefix cache (torch).
    cached_tokens: int | None = None
    # Stopped by abort_requests() before its end: token_ids are what it had sampled by then
    # (the partial rollout keeps them and goes on from them in the next rollout).
    aborted: bool = False


def token_ids(completions: Sequence[Completion]) -> list[list[int]]:
    """The responses' token ids alone (what generate() returns)."""
    return [c.token_ids for c in completions]


class ColocatedEngine:
    """What every engine class shares (a RolloutEngine still implements the rest): the two facts
    the stage machine reads, and generate() as generate_with_logprobs() without the log-probs."""

    _kv_capacity_tokens: int
    _released: AbstractSet[str]

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds, as sized from mem_fraction_static."""
        return self._kv_capacity_tokens

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags whose memory is given back right now."""
        return frozenset(self._released)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[int]]:
        """Sample one response (token ids, without the prompt) for each prompt."""
        return token_ids(self.generate_with_logprobs(prompts, sampling))

    def generate_with_logprobs(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Completion]:
        raise NotImplementedError(f"{type(self).__name__} must sample with log-probs")


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine colocated with training on one rank's GPU(s)."""

    @property
    def released_tags(self) -> frozenset[str]:
        """The tags whose memory is released right now."""
        ...

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds, as sized from mem_fraction_static."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[int]]:
        """Sample one response (token ids, without the prompt) for each prompt."""
        ...

    def generate_with_logprobs(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Completion]:
        """generate(), with the log-prob of every sampled token (the rollout uses this)."""
        ...

    def release(self, tags: Sequence[str]) -> None:
        """Give the memory of these tags back to the device; contents are lost."""
        ...

    def resume(self, tags: Sequence[str]) -> None:
        """Re-acquire the memory of these tags at the same addresses."""
        ...

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of full (unsharded) named tensors into the engine's weights in place."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes computed with the old weights."""
        ...

    def shutdown(self) -> None:
        """Free everything; the engine is unusable afterwards."""
        ...


@runtime_checkable
class ShardedWeights(Protocol):
    """An engine that takes weights shard to shard (rljob_worker.tp_shards): one tensor-parallel
    engine over all of the job's ranks (TensorParallelEngine)."""

    @property
    def shard_world(self) -> int | None:
        """The ranks the trainer's buckets may be sharded over (its TP size), or None where
        this engine takes only full tensors."""
        ...

    @property
    def shard_own_as_stored(self) -> bool:
        """Whether a sharded bucket may carry each rank's own blocks where its shards lie
        (tp_shards: the trainer's storage, cast by the engine's loader) instead of in its
        buffer."""
        ...

    def update_weights_sharded(self, bucket: ShardedBucket) -> None:
        """Load one bucket sent shard to shard; collective over the engine's ranks."""
        ...


@runtime_checkable
class AsyncGenerate(Protocol):
    """What the multi-turn rollout needs of an engine (agentic/driver.py): one request at a time
    from asyncio code, token ids in, token ids and their log-probs out."""

    async def async_generate(
        self, input_ids: Sequence[int], sampling: SamplingParams
    ) -> Completion:
        """Sample a continuation of input_ids (up to sampling.max_new_tokens tokens)."""
        ...

    def abort_requests(self) -> None:
        """Stop every request in flight: each async_generate returns soon with what it has
        sampled so far, marked `aborted` (none sampled for one still queued). Requests sent
        afterwards run as usual (call it again for those)."""
        ...
