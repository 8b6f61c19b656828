"""The torch reference rollout engine: Qwen2 weights and a paged KV pool in memory-saver regions.

For CPU runs, tests and measurement where SGLang cannot run; it is not the product's engine.

Interface notes for the stage machine (base.RolloutEngine, unchanged; additions only):
- release(["weights"]) discards the weights, as SGLang does: after resume(["weights"]) the engine
  refuses to generate until update_weights has covered every parameter again.
- "cuda_graph" is accepted by release/resume and is a no-op: this engine captures no CUDA graphs.
- Added: TorchEngine.weight_bytes, kv_pool_bytes, parameter_names(), data_ptrs(), released_tags.

KV pool sizing, as SGLang does it (model_runner: rest = free-after-weights - total * (1 - f)):
  kv_pool_bytes = mem_fraction_static * device_total_bytes - weight_bytes
SGLang measures free memory after loading its weights, which equals the formula above when the
engine is created before any training state is on the device; this engine always uses the
formula, so its capacity does not depend on what else happened to be resident at creation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from rljob_worker.engines.base import (
    ALL_TAGS,
    TAG_CUDA_GRAPH,
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    ColocatedEngine,
    Completion,
    SamplingParams,
)
from rljob_worker.engines.paged_decoder import (
    NULL_BLOCK,
    BlockAllocator,
    DecoderShape,
    forward_paged,
    sample_next,
)
from rljob_worker.saver import MemorySaver, make_saver

log = logging.getLogger(__name__)

# Pool size where there is no device total to take a fraction of (CPU) and none was given.
CPU_FALLBACK_KV_CAPACITY_TOKENS = 4096
DEFAULT_BLOCK_SIZE = 16
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


class KVCapacityError(RuntimeError):
    """A request cannot fit the KV pool even alone, or the pool has no room at all."""


def kv_pool_capacity_tokens(
    mem_fraction_static: float,
    device_total_bytes: int,
    weight_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
) -> int:
    """Tokens of KV pool for a fraction of the device, after the engine's weights (see module doc).

    Rounded down to whole blocks.
    """
    if not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static={mem_fraction_static} must be in (0, 1)")
    pool_bytes = int(mem_fraction_static * device_total_bytes) - weight_bytes
    tokens = (max(pool_bytes, 0) // kv_bytes_per_token) // block_size * block_size
    if tokens == 0:
        raise KVCapacityError(
            f"mem_fraction_static={mem_fraction_static} of {device_total_bytes / 2**30:.2f} GiB "
            f"leaves {pool_bytes / 2**30:.2f} GiB after {weight_bytes / 2**30:.2f} GiB of engine "
            f"weights: not one {block_size}-token KV block fits; raise mem_fraction_static"
        )
    return tokens


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"torch engine: dtype {dtype!r} is not a torch dtype name")
    return resolved


class TorchEngine(ColocatedEngine):
    """A RolloutEngine on one device (see module doc for release and sizing semantics)."""

    # update_weights copies each tensor into its weight, casting to the weight's dtype: the
    # stage may hand it the trainer's master-dtype shards (Trainer.weight_buckets).
    casts_weights = True

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        mem_fraction_static: float = 0.85,
        kv_capacity_tokens: int | None = None,
        device_total_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_running_requests: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        saver: MemorySaver | None = None,
    ) -> None:
        """Load model_path with transformers' from_pretrained and allocate the KV pool.

        kv_capacity_tokens, when given, overrides the fraction-based size. device_total_bytes
        defaults to the CUDA device's total memory; on CPU without either, the pool holds
        CPU_FALLBACK_KV_CAPACITY_TOKENS.
        """
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.block_size = block_size
        self.max_running_requests = max_running_requests
        self._saver = saver if saver is not None else make_saver(str(self.device))
        self._released: set[str] = set()
        self._stale_weights: set[str] = set()
        self._shut_down = False
        self._batcher: _Batcher | None = None
        # async_generate: how long a batch waits for more requests before it starts (0: only
        # those sent in the same pass of the event loop). bench/multi_turn.py --batch-window.
        self.batch_window_seconds = 0.0

        # Load on the host through the real from_pretrained path, then copy each tensor into
        # memory allocated inside the "weights" region: only the engine's own tensors are there.
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=_as_dtype(dtype) if dtype is not None else "auto"
        )
        self.config = hf_model.config
        self.shape = DecoderShape.from_config(self.config)
        self.dtype = _as_dtype(dtype) if dtype is not None else hf_model.dtype
        self._params: dict[str, torch.Tensor] = {}
        with self._saver.region(TAG_WEIGHTS):
            for name, value in hf_model.named_parameters():
                target = torch.empty(value.shape, dtype=self.dtype, device=self.device)
                self._params[name] = target.copy_(value.detach())
        del hf_model
        # Tied embeddings: one tensor under both names, so lm_head.weight is an alias.
        self._aliases: dict[str, str] = {}
        if _LM_HEAD not in self._params:
            self._params[_LM_HEAD] = self._params[_EMBED]
            self._aliases[_LM_HEAD] = _EMBED
        self.weight_bytes = sum(self._params[n].nbytes for n in self.parameter_names())

        if eos_token_ids is None:
            eos = getattr(self.config, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)

        per_token = self.shape.kv_bytes_per_token(self.dtype)
        if kv_capacity_tokens is not None:
            capacity = kv_capacity_tokens // block_size * block_size
        elif device_total_bytes is not None or self.device.type == "cuda":
            total = device_total_bytes or torch.cuda.mem_get_info(self.device)[1]
            capacity = kv_pool_capacity_tokens(
                mem_fraction_static, total, self.weight_bytes, per_token, block_size
            )
        else:
            capacity = CPU_FALLBACK_KV_CAPACITY_TOKENS
        if capacity < block_size:
            raise KVCapacityError(
                f"KV capacity {capacity} tokens is below one block ({block_size})"
            )
        self._kv_capacity_tokens = capacity
        self._allocator = BlockAllocator(capacity // block_size)
        # [K/V, layer, slot, kv head, head dim]; one extra block for the null block.
        pool_shape = (
            2,
            self.shape.num_layers,
            (self._allocator.num_blocks + 1) * block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        )
        if self.device.type == "cuda" and self._saver.releases_device_memory:
            # As on resume: a failed mapping inside the memory saver can end the process instead
            # of raising, so say it the way torch would while the caller can still report it.
            pool_bytes = math.prod(pool_shape) * self.dtype.itemsize
            self._check_free_bytes(pool_bytes, f"KV pool of {capacity} tokens")
        with self._saver.region(TAG_KV_CACHE):
            self._kv_pool = torch.empty(pool_shape, dtype=self.dtype, device=self.device)
        self.kv_pool_bytes = self._kv_pool.nbytes
        log.info(
            "torch engine: %s on %s, %.1f MiB weights, KV pool %d tokens (%.1f MiB)",
            model_path,
            self.device,
            self.weight_bytes / 2**20,
            capacity,
            self.kv_pool_bytes / 2**20,
        )

    # -- introspection -------------------------------------------------------------------------

    def parameter_names(self) -> list[str]:
        """Names update_weights accepts (transformers' named_parameters; tied aliases excluded)."""
        return [n for n in self._params if n not in self._aliases]

    def data_ptrs(self) -> dict[str, int]:
        """Device address of every weight and of the KV pool (stable across release/resume)."""
        ptrs = {n: self._params[n].data_ptr() for n in self.parameter_names()}
        ptrs["kv_pool"] = self._kv_pool.data_ptr()
        return ptrs

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's own weight tensors (read-only use: tests compare them with training's)."""
        return ((n, self._params[n]) for n in self.parameter_names())

    # -- RolloutEngine -------------------------------------------------------------------------

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._require_alive()
        if TAG_WEIGHTS in self._released:
            raise RuntimeError(
                "torch engine: update_weights while weights are released; resume first"
            )
        targets: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        names: list[str] = []
        for name, value in bucket:  # the whole bucket checked before any weight changes
            canonical = self._aliases.get(name, name)
            target = self._params.get(canonical)
            if target is None:
                known = ", ".join(self.parameter_names()[:4])
                raise KeyError(
                    f"torch engine: unknown weight {name!r} (the engine has "
                    f"{len(self.parameter_names())} weights named like {known}, ...)"
                )
            if value.shape != target.shape:
                raise ValueError(
                    f"torch engine: weight {name!r} has shape {tuple(value.shape)}, "
                    f"the engine's is {tuple(target.shape)} (send full, unsharded tensors)"
                )
            targets.append(target)
            values.append(value)
            names.append(canonical)
        # In place: the addresses stay, so anything holding them (graphs, views) stays valid.
        # One foreach copy per bucket rather than a copy_ call (and its host time) per tensor.
        with torch.no_grad():
            torch._foreach_copy_(targets, values)
        self._stale_weights.difference_update(names)

    def release(self, tags: Sequence[str]) -> None:
        self._require_alive()
        self._check_tags(tags)
        already = [t for t in tags if t in self._released]
        if already:
            raise RuntimeError(f"torch engine: {already} already released")
        for tag in tags:
            if tag != TAG_CUDA_GRAPH:
                self._saver.pause(tag)
            if tag == TAG_KV_CACHE:
                self._allocator.reset()
            self._released.add(tag)

    def resume(self, tags: Sequence[str]) -> None:
        self._require_alive()
        self._check_tags(tags)
        not_released = [t for t in tags if t not in self._released]
        if not_released:
            raise RuntimeError(f"torch engine: {not_released} not released; nothing to resume")
        self._check_room_to_resume(tags)
        for tag in tags:
            if tag != TAG_CUDA_GRAPH:
                self._saver.resume(tag)
            if tag == TAG_WEIGHTS:
                # The region has no CPU backup (SGLang's default): the contents are gone.
                self._stale_weights = set(self.parameter_names())
            self._released.discard(tag)

    def flush_cache(self) -> None:
        self._require_alive()
        self._allocator.reset()

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        self._params.clear()
        del self._kv_pool
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def generate_with_logprobs(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Completion]:
        """Sample responses in waves of requests whose reserved KV blocks fit the pool together.

        Each request reserves blocks for prompt + max_new_tokens when its wave starts (simpler
        than SGLang's on-demand allocation with retraction; the pool bounds concurrency alike).
        """
        return self._generate_rows(prompts, [sampling.max_new_tokens] * len(prompts), sampling)

    def _generate_rows(
        self,
        prompts: Sequence[Sequence[int]],
        limits: Sequence[int],
        sampling: SamplingParams,
        stop: Callable[[], bool] | None = None,
    ) -> list[Completion]:
        """generate_with_logprobs with each prompt's own max_new_tokens (`limits`); once `stop()`
        is true (checked every step) the rows still sampling end, aborted, with what they have."""
        self._require_alive()
        if self._released & {TAG_WEIGHTS, TAG_KV_CACHE}:
            raise RuntimeError(
                f"torch engine: generate while {sorted(self._released)} released; resume first"
            )
        if self._stale_weights:
            raise RuntimeError(
                f"torch engine: weights were released and resumed, and {len(self._stale_weights)} "
                f"of them were not updated since (e.g. {sorted(self._stale_weights)[0]!r}); "
                "call update_weights with every parameter before generating"
            )
        if min(limits, default=1) < 1:
            raise ValueError(f"max_new_tokens={min(limits)} must be >= 1")
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        outputs: list[Completion | None] = [None] * len(prompts)
        for wave in self._plan_waves(prompts, limits):
            if stop is not None and stop():
                answers = [Completion([], [], aborted=True) for _ in wave]
            else:
                answers = self._generate_wave(
                    [list(prompts[i]) for i in wave], [limits[i] for i in wave], sampling,
                    generator, stop,
                )  # fmt: skip
            for index, answer in zip(wave, answers, strict=True):
                outputs[index] = answer
        return [o for o in outputs if o is not None]

    async def async_generate(
        self, input_ids: Sequence[int], sampling: SamplingParams
    ) -> Completion:
        """One request from asyncio code: requests that arrive together are generated as one
        batch in a worker thread (the event loop goes on running tools meanwhile), each with
        its own max_new_tokens; the RolloutEngine's multi-turn path (agentic/driver.py)."""
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.loop is not loop:
            self._batcher = _Batcher(self, loop)
        return await self._batcher.submit(list(input_ids), sampling)

    def abort_requests(self) -> None:
        """Every async_generate request sent so far ends at the running batch's next step (or
        at once, if still waiting for a batch) with what it has sampled, marked aborted."""
        if self._batcher is not None:
            self._batcher.abort()

    # -- internals -----------------------------------------------------------------------------

    def _blocks_for(self, prompt_len: int, max_new_tokens: int) -> int:
        return math.ceil((prompt_len + max_new_tokens) / self.block_size)

    def _plan_waves(
        self, prompts: Sequence[Sequence[int]], limits: Sequence[int]
    ) -> list[list[int]]:
        waves: list[list[int]] = [[]]
        used = 0
        for index, prompt in enumerate(prompts):
            max_new_tokens = limits[index]
            if len(prompt) == 0:
                raise ValueError(f"torch engine: prompt {index} is empty")
            need = self._blocks_for(len(prompt), max_new_tokens)
            if need > self._allocator.num_blocks:
                raise KVCapacityError(
                    f"torch engine: prompt {index} needs {len(prompt)} + {max_new_tokens} = "
                    f"{len(prompt) + max_new_tokens} tokens of KV, the pool holds "
                    f"{self.kv_capacity_tokens} (raise mem_fraction_static or shorten the request)"
                )
            full = used + need > self._allocator.num_blocks or (
                self.max_running_requests is not None
                and len(waves[-1]) >= self.max_running_requests
            )
            if full and waves[-1]:
                waves.append([])
                used = 0
            waves[-1].append(index)
            used += need
        return [w for w in waves if w]

    def _generate_wave(
        self,
        prompts: list[list[int]],
        limits: list[int],
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stop: Callable[[], bool] | None = None,
    ) -> list[Completion]:
        device, bs = self.device, self.block_size
        batch = len(prompts)
        lens = [len(p) for p in prompts]
        reserved = [
            self._allocator.allocate(self._blocks_for(n, limit))
            for n, limit in zip(lens, limits, strict=True)
        ]
        try:
            width = max(len(r) for r in reserved)
            tables = torch.full((batch, width), NULL_BLOCK, dtype=torch.long)
            for row, blocks in enumerate(reserved):
                tables[row, : len(blocks)] = torch.tensor(blocks)
            block_tables = tables.to(device)
            # Contents are arbitrary after creation or resume; masked keys read the null block.
            self._kv_pool[:, :, : bs * (NULL_BLOCK + 1)].zero_()

            # Prefill: right-padded prompts; padded positions write nowhere that is read.
            steps = max(lens)
            tokens = torch.zeros((batch, steps), dtype=torch.long)
            for row, prompt in enumerate(prompts):
                tokens[row, : len(prompt)] = torch.tensor(prompt)
            kv_lens = torch.tensor(lens, device=device)
            positions = torch.arange(steps, device=device).expand(batch, steps)
            logits = forward_paged(
                self._params,
                self.shape,
                self._kv_pool,
                block_tables,
                tokens.to(device),
                positions,
                kv_lens,
                kv_lens - 1,
                positions < kv_lens[:, None],
                bs,
            )
            responses: list[list[int]] = [[] for _ in range(batch)]
            logprobs: list[list[float]] = [[] for _ in range(batch)]
            active = list(range(batch))
            for _step in range(max(limits)):
                next_tokens, next_logprobs = sample_next(logits, sampling, generator)
                still: list[int] = []
                for row, token, logprob in zip(
                    active, next_tokens.tolist(), next_logprobs.tolist(), strict=True
                ):
                    responses[row].append(token)
                    logprobs[row].append(logprob)
                    if token not in self.eos_token_ids and len(responses[row]) < limits[row]:
                        still.append(row)
                if not still:
                    break
                if stop is not None and stop():  # abort_requests(): the rest end here
                    aborted = set(still)
                    return [
                        Completion(r, lp, aborted=row in aborted)
                        for row, (r, lp) in enumerate(zip(responses, logprobs, strict=True))
                    ]
                keep = [active.index(r) for r in still] if len(still) < len(active) else None
                rows = torch.tensor(still, device=device)
                if keep is not None:
                    next_tokens = next_tokens[torch.tensor(keep, device=device)]
                active = still
                # The new token sits at position len(prompt) + tokens generated before it.
                pos = torch.tensor([lens[r] + len(responses[r]) - 1 for r in active], device=device)
                logits = forward_paged(
                    self._params,
                    self.shape,
                    self._kv_pool,
                    block_tables[rows],
                    next_tokens[:, None],
                    pos[:, None],
                    pos + 1,
                    torch.zeros_like(pos),
                    None,
                    bs,
                )
            return [Completion(r, lp) for r, lp in zip(responses, logprobs, strict=True)]
        finally:
            for blocks in reserved:
                self._allocator.free(blocks)

    def _check_room_to_resume(self, tags: Sequence[str]) -> None:
        """Raise torch's OOM error, with its wording, when the tags cannot fit the free memory.

        A failed mapping inside torch_memory_saver's resume does not raise a Python error (it can
        end the process), so the stage machine would lose the OOM's stage; checking first keeps
        it. The tensors' bytes are a lower bound of what the mapping needs (segments round up).
        """
        if self.device.type != "cuda" or not self._saver.releases_device_memory:
            return
        sizes = {TAG_WEIGHTS: self.weight_bytes, TAG_KV_CACHE: self.kv_pool_bytes}
        self._check_free_bytes(sum(sizes.get(tag, 0) for tag in tags), f"resuming {list(tags)}")

    def _check_free_bytes(self, needed_bytes: int, what: str) -> None:
        """Raise torch's OOM error, in its wording, when `needed_bytes` exceed the device's free
        memory (`what` says what they are for)."""
        free, total = torch.cuda.mem_get_info(self.device)
        if needed_bytes > free:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. torch engine: {what}. Tried to allocate {needed_bytes} "
                f"bytes. GPU {self.device.index or 0} has a total capacity of {total} bytes of "
                f"which {free} bytes is free."
            )

    def _check_tags(self, tags: Sequence[str]) -> None:
        unknown = [t for t in tags if t not in ALL_TAGS]
        if unknown:
            raise ValueError(
                f"torch engine: unknown memory tags {unknown}; known: {list(ALL_TAGS)}"
            )

    def _require_alive(self) -> None:
        if self._shut_down:
            raise RuntimeError("torch engine: used after shutdown()")


class _Batcher:
    """Collects the async_generate requests of one event loop and runs them in batches.

    Requests that arrive while a batch runs wait for the next one: what sglang's scheduler does
    continuously, this does per batch (the reference engine has no continuous batching). Each
    batch runs in a worker thread, so tools and other conversations keep the loop busy.
    """

    def __init__(self, engine: TorchEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future[Completion]]] = []
        self._running: asyncio.Task[None] | None = None
        self.batches = 0
        # abort() counts up; a batch stops once the count passes the one it was taken at, and
        # requests waiting for a batch when it does are answered at once.
        self._aborts = 0
        self._waiting_aborts: list[int] = []  # the count each pending request was sent at

    def abort(self) -> None:
        self._aborts += 1

    def _aborted_since(self, count: int) -> bool:
        return self._aborts > count

    async def submit(self, input_ids: list[int], sampling: SamplingParams) -> Completion:
        future: asyncio.Future[Completion] = self.loop.create_future()
        self._pending.append((input_ids, sampling, future))
        self._waiting_aborts.append(self._aborts)
        if self._running is None or self._running.done():
            self._running = self.loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            # One pass of the loop first: requests sent in the same step join this batch; with a
            # window, those that come within it too (fewer, larger batches).
            await asyncio.sleep(self.engine.batch_window_seconds)
            taken, self._pending = self._pending, []
            sent_at, self._waiting_aborts = self._waiting_aborts, []
            taken_at = self._aborts
            for (_, _, future), count in zip(taken, sent_at, strict=True):
                if count < taken_at and not future.done():  # aborted before its batch
                    future.set_result(Completion([], [], aborted=True))
            # Requests sample alike but for max_new_tokens (and the seed: the first one's).
            groups: dict[SamplingParams, list[int]] = {}
            for index, (_, sampling, future) in enumerate(taken):
                if future.done():
                    continue
                key = dataclasses.replace(sampling, max_new_tokens=1, seed=None)
                groups.setdefault(key, []).append(index)
            for rows in groups.values():
                first = taken[rows[0]][1]
                try:
                    answers = await asyncio.to_thread(
                        self.engine._generate_rows,
                        [taken[i][0] for i in rows],
                        [taken[i][1].max_new_tokens for i in rows],
                        dataclasses.replace(first, seed=first.seed),
                        functools.partial(self._aborted_since, taken_at),
                    )
                except Exception as error:  # every waiting request gets the failure
                    for i in rows:
                        if not taken[i][2].done():
                            taken[i][2].set_exception(error)
                    continue
                self.batches += 1
                for i, answer in zip(rows, answers, strict=True):
                    if not taken[i][2].done():
                        taken[i][2].set_result(answer)
