"""The stage machine: the order of one colocated iteration, and what each stage does.

Read top to bottom: the two orders (staged and single), then one method per stage. Every stage
runs inside the memory meter's boundary, so each is measured and an OOM names its stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from rljob.api import WakeUp
from rljob.report import Stage
from rljob_worker import allocator_report
from rljob_worker.engines.base import (
    TAG_CUDA_GRAPH,
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    RolloutEngine,
    ShardedWeights,
)
from rljob_worker.memory import MemoryMeter
from rljob_worker.staging import Staging
from rljob_worker.sync_send import Bucket
from rljob_worker.tp_shards import ShardedBucket
from rljob_worker.train import Experience, TrainStats
from rljob_worker.weight_sync import record_span

# Staged awake (docs/design.md, "The stage machine"): the engine's weights come back while the
# training params are still resident (they are the source of the update), but the KV cache only
# comes back once the training params are gone. Peak: max(train, train params + engine weights,
# engine weights + KV cache) instead of their sum.
STAGED_ORDER: tuple[Stage, ...] = (
    Stage.TRAIN,  # engine released; FSDP forward/backward/step
    Stage.OFFLOAD_OPTIMIZER,  # AdamW state to pinned CPU memory
    Stage.WAKE_WEIGHTS,  # resume engine weights; copy training weights in, bucket by bucket
    Stage.OFFLOAD_TRAIN,  # training params to CPU; empty_cache() before any resume
    Stage.WAKE_KV_CACHE,  # resume the KV cache into the memory the params left
    Stage.ROLLOUT,  # generate the next iteration's experience
    Stage.SLEEP,  # release KV cache and weights; training state back to the device
)

# The baseline: weights and KV cache resumed together while the training params are resident,
# so the update moment holds train params + engine weights + KV cache. There is no separate
# wake_kv_cache stage: the KV cache woke inside wake_weights.
SINGLE_ORDER: tuple[Stage, ...] = (
    Stage.TRAIN,
    Stage.OFFLOAD_OPTIMIZER,
    Stage.WAKE_WEIGHTS,  # resume weights AND KV cache, then update weights
    Stage.OFFLOAD_TRAIN,
    Stage.ROLLOUT,
    Stage.SLEEP,
)

# Before iteration 1 there is no experience to train on. Iteration 0 is the second half of an
# iteration: the engine starts released, wakes, takes the training weights (equal to its own,
# both come from the checkpoint, but a resumed weight region holds no contents), rolls out the
# first batch and sleeps. Its stages are measured like any other iteration's. A fresh run's
# AdamW has no moments yet (they are made by the first step), so its prologue has nothing to
# offload; a run resumed from a checkpoint has loaded them onto the device, so its prologue
# offloads them before the engine wakes (without it, on one H100 at Qwen2.5-1.5B and
# memFractionStatic 0.95, the resumed run's wake_kv_cache ran out of memory by the moments'
# 12 GB).
_TRAINING_STAGES = (Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER)


def stage_order(
    wake_up: WakeUp,
    iteration: int = 1,
    *,
    checkpoint: bool = False,
    resumed: bool = False,
) -> tuple[Stage, ...]:
    """The stages of an iteration for the spec's rollout.wakeUp (iteration 0: the prologue).

    `checkpoint` adds the checkpoint stage right after train: the training state (params and
    AdamW moments) is still on the device there; the stage copies it into the host buffers the
    offloads after it reuse (they then only free), and a writer thread writes the files from
    them behind the following stages (checkpoint.Keeper, docs/checkpoints.md). `resumed` (the first iteration of a run resumed
    from this iteration's checkpoint) is a prologue too: N's train is in the checkpoint, its
    rollout is not, and the moments the checkpoint loaded are offloaded first.
    """
    order = STAGED_ORDER if wake_up == WakeUp.STAGED else SINGLE_ORDER
    if iteration == 0 or resumed:
        skipped = (Stage.TRAIN,) if resumed else _TRAINING_STAGES
        return tuple(stage for stage in order if stage not in skipped)
    if checkpoint:
        return (order[0], Stage.CHECKPOINT, *order[1:])
    return order


class TrainerLike(Protocol):
    """What the machine needs from training (train.Trainer; tests use stand-ins)."""

    # Runs and records the training state's copies; the machine names the stages in its record
    # and picks the overlapped order by it (spec.training.overlapStaging).
    staging: Staging

    def train_step(self, experience: Experience, iteration: int | None = None) -> TrainStats: ...
    def offload_optimizer(self) -> None: ...
    def start_offload_optimizer(self) -> None: ...
    def finish_offloads(self) -> None: ...
    def load_optimizer(self) -> None: ...
    def offload_params(self) -> None: ...
    def load_params(self) -> None: ...
    def weight_buckets(
        self, bucket_bytes: int, dtype: torch.dtype, *, engine_casts: bool = False
    ) -> Iterator[Bucket]: ...
    def shard_buckets(
        self,
        bucket_bytes: int,
        dtype: torch.dtype,
        shard_world: int,
        *,
        own_as_stored: bool = True,
    ) -> Iterator[Bucket | ShardedBucket]: ...


@dataclass
class IterationOutcome:
    """What one iteration produced besides its memory samples (those go to the meter)."""

    iteration: int
    stages: tuple[Stage, ...]
    train: TrainStats | None
    experience: Experience | None
    # The training state's copies: "stage: start|wait transfer" in order (staging.Staging).
    staging: tuple[str, ...] = ()


def release_cublas_workspaces() -> None:
    """Free cuBLAS's per-handle workspaces (32 MiB each on an H100) before empty_cache().

    The backward thread's handle takes its workspace in the middle of training, out of a freed
    training block, and keeps it: that block's whole segment then stays reserved after
    empty_cache() (measured with RLJOB_ALLOCATOR_REPORT on an H100: 414 MiB at Qwen2.5-1.5B,
    278 MiB at 0.5B, 12 MiB at 3B), memory the KV cache resumed next cannot have. cuBLAS takes
    a new workspace at its next use, out of a fresh segment of its own size."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # torch's private hook
    if clear is not None:
        clear()


class StageMachine:
    """Drives one rank's trainer and engine through the stages, one iteration at a time."""

    def __init__(
        self,
        trainer: TrainerLike,
        engine: RolloutEngine,
        meter: MemoryMeter,
        rollout: Callable[[int], Experience],
        *,
        wake_up: WakeUp,
        bucket_bytes: int,
        engine_dtype: torch.dtype,
        offload_optimizer: bool = True,
        offload_params: bool = True,
        after_weight_update: Callable[[int, Bucket], None] | None = None,
        checkpoint: Callable[[int], None] | None = None,
        checkpoint_every: int = 0,
        between_stages: Callable[[Stage], None] | None = None,
    ) -> None:
        self.trainer = trainer
        self.engine = engine
        self.meter = meter
        self.rollout_fn = rollout
        self.wake_up = wake_up
        self.bucket_bytes = bucket_bytes
        self.engine_dtype = engine_dtype
        self.offload_optimizer_enabled = offload_optimizer
        self.offload_params_enabled = offload_params
        # Test hook: sees every bucket right after the engine took it (weights equality check).
        self.after_weight_update = after_weight_update
        # Saves iteration N's checkpoint (checkpoint.save) on every checkpoint_every-th one.
        self.checkpoint_fn = checkpoint
        self.checkpoint_every = checkpoint_every
        # Runs after every stage, given that stage, outside its measurement (checkpoint.Keeper.
        # poll: the ranks agree on how far an asynchronous checkpoint's writers are).
        self.between_stages = between_stages
        # The trainer's: its record names our stages, and its overlap picks the overlapped
        # order below (spec.training.overlapStaging; docs/performance.md).
        self.staging = trainer.staging
        self.experience: Experience | None = None
        self.weight_sync_seconds: float | None = None
        # The part of it spent in engine.update_weights (the hand-off to the engine); the rest
        # is the trainer's gather of full tensors per bucket, and the cache flush.
        self.weight_handoff_seconds: float | None = None
        self._train_stats: TrainStats | None = None
        self._iteration = 0
        self._actions: dict[Stage, Callable[[], None]] = {
            Stage.TRAIN: self.train,
            Stage.CHECKPOINT: self.checkpoint,
            Stage.OFFLOAD_OPTIMIZER: self.offload_optimizer,
            Stage.WAKE_WEIGHTS: self.wake_weights,
            Stage.OFFLOAD_TRAIN: self.offload_train,
            Stage.WAKE_KV_CACHE: self.wake_kv_cache,
            Stage.ROLLOUT: self.rollout,
            Stage.SLEEP: self.sleep,
        }

    def checkpoint_due(self, iteration: int) -> bool:
        return (
            self.checkpoint_fn is not None
            and self.checkpoint_every > 0
            and iteration > 0
            and iteration % self.checkpoint_every == 0
        )

    def run_iteration(self, iteration: int, resumed: bool = False) -> IterationOutcome:
        """One iteration in the spec's wake-up order; iteration 0 is the prologue (see above),
        and so is the first iteration of a resumed run (resumed=True).

        Expects the engine released and the training state on the device, and leaves them so;
        overlapped (self.staging.overlap), the offloaded moments come back only in train.
        """
        order = stage_order(
            self.wake_up, iteration, checkpoint=self.checkpoint_due(iteration), resumed=resumed
        )
        self._iteration, self._train_stats = iteration, None
        for stage in order:
            self.staging.stage = str(stage)
            with self.meter.stage(stage, iteration):
                self._actions[stage]()
            if self.between_stages is not None:
                self.between_stages(stage)
        return IterationOutcome(
            iteration, order, self._train_stats, self.experience, self.staging.take()
        )

    @property
    def _moments_leave_during_sync(self) -> bool:
        # Staged only: single resumes the KV cache with the weights, where the moments staying
        # through the sync would add to its largest peak (rljob.plan.stage_peaks).
        return self.staging.overlap and self.wake_up == WakeUp.STAGED

    # -- the stages, in staged order -----------------------------------------------------------

    def train(self) -> None:
        if self.experience is None:
            raise RuntimeError("train stage without experience: run iteration 0 first")
        if self.staging.overlap and self.offload_optimizer_enabled:
            # Overlapped: the moments come back during the first micro-batches' forward and
            # backward; the first optimizer step waits for them (Trainer.load_optimizer).
            self.trainer.load_optimizer()
        self._train_stats = self.trainer.train_step(self.experience, self._iteration)

    def checkpoint(self) -> None:
        assert self.checkpoint_fn is not None  # in the order only when due
        self.checkpoint_fn(self._iteration)

    def offload_optimizer(self) -> None:
        leaving = self.offload_optimizer_enabled and self._moments_leave_during_sync
        if self.offload_optimizer_enabled and not leaving:
            self.trainer.offload_optimizer()
        # The moments (and the gradients and activations freed since train) go back to the
        # device here, so the stage that releases them shows them as free device memory.
        if torch.cuda.is_available():
            release_cublas_workspaces()
            torch.cuda.empty_cache()
        if leaving:
            # The weight sync reads the params, not the moments: their copies run behind it
            # and offload_train frees them. Started after empty_cache(): its cudaFree waits
            # for the whole device, so a copy started before it would finish in this stage.
            self.trainer.start_offload_optimizer()

    def wake_weights(self) -> None:
        tags = (
            [TAG_WEIGHTS]
            if self.wake_up == WakeUp.STAGED
            else [TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH]
        )
        # Gradients, activations and the offloaded optimizer state were freed into torch's
        # caching allocator, which the memory saver cannot map: give them back to the device
        # before any resume (verl does the same before waking the engine), in both modes.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.engine.resume(tags)
        started, started_wall = time.perf_counter(), time.time()
        handoff = 0.0
        # In place, bucket by bucket: addresses stay valid (CUDA graphs) and at most two
        # buckets of full tensors exist at a time on top of the sharded params and engine
        # weights: the one handed over and the next, whose gather runs meanwhile
        # (Trainer.weight_buckets). No device synchronize here: a bucket arrives with its own
        # kernels done, and waiting for the next one's would serialize the two again.
        # An engine that casts what it loads (casts_weights) may be handed the trainer's own
        # fp32 shards where they need no gather (one rank): no cast on this side, no buffer.
        casts = bool(getattr(self.engine, "casts_weights", False))
        # One TP engine over every rank (ShardedWeights: TensorParallelEngine) is sent shard to
        # shard, unless each bucket's full tensors are wanted here (after_weight_update).
        sharded = self.engine if isinstance(self.engine, ShardedWeights) else None
        shard_world = sharded.shard_world if sharded and self.after_weight_update is None else None
        buckets: Iterator[Bucket | ShardedBucket] = iter(
            self.trainer.shard_buckets(
                self.bucket_bytes,
                self.engine_dtype,
                shard_world,
                own_as_stored=bool(sharded and sharded.shard_own_as_stored),
            )
            if shard_world
            else self.trainer.weight_buckets(
                self.bucket_bytes, self.engine_dtype, engine_casts=casts
            )
        )
        while True:
            waited = time.time()  # the spans are for bench/sync_trip.py (TIMINGS_ENV)
            bucket = next(buckets, None)
            record_span("next_bucket", waited, time.time())
            if bucket is None:
                break
            handing = time.perf_counter()
            if isinstance(bucket, ShardedBucket):
                assert sharded is not None  # only asked for of a ShardedWeights engine
                sharded.update_weights_sharded(bucket)
            else:
                self.engine.update_weights(bucket)
            handoff += time.perf_counter() - handing
            if self.after_weight_update is not None:
                assert not isinstance(bucket, ShardedBucket)  # never asked for with the hook
                self.after_weight_update(self._iteration, bucket)
            del bucket  # before the next gather: two buckets at most, as planned
        # Prefix caches computed with the old weights are wrong now.
        self.engine.flush_cache()
        if torch.cuda.is_available():
            synchronizing = time.time()
            torch.cuda.synchronize()
            record_span("synchronize", synchronizing, time.time())
        # The update alone (the stage also holds the resume): what benchmarks compare with HBM.
        self.weight_sync_seconds = time.perf_counter() - started
        self.weight_handoff_seconds = handoff
        record_span("sync", started_wall, time.time())

    def offload_train(self) -> None:
        self.trainer.finish_offloads()  # the moments whose copies ran behind the weight sync
        if self.offload_params_enabled:
            self.trainer.offload_params()
        # The freed params sit in torch's caching allocator, invisible to the memory saver:
        # unless they are given back to the device now, resuming the KV cache cannot use them
        # and OOMs (a known regression when this call was forgotten).
        if torch.cuda.is_available():
            release_cublas_workspaces()
            torch.cuda.empty_cache()
        # What stays reserved now is pinned by live blocks (RLJOB_ALLOCATOR_REPORT).
        allocator_report.write_report(self.meter.rank, self._iteration, Stage.OFFLOAD_TRAIN)

    def wake_kv_cache(self) -> None:
        # CUDA graphs wake with the KV cache: they are replayed only by the rollout, and SGLang
        # refuses to run with its graph memory released (measured with sglang 0.5.17).
        self.engine.resume([TAG_KV_CACHE, TAG_CUDA_GRAPH])

    def rollout(self) -> None:
        self.experience = self.rollout_fn(self._iteration)

    def sleep(self) -> None:
        if not self.staging.overlap:
            self.engine.release([TAG_CUDA_GRAPH, TAG_KV_CACHE, TAG_WEIGHTS])
            if self.offload_params_enabled:
                self.trainer.load_params()
            if self.offload_optimizer_enabled:
                self.trainer.load_optimizer()
            return
        # Overlapped: the params come back into the KV cache's memory while the engine's
        # weights are released (they do not fit beside the pool); the moments come back in
        # train. The device's later work waits for the params, the host does not.
        self.engine.release([TAG_CUDA_GRAPH, TAG_KV_CACHE])
        if self.offload_params_enabled:
            self.trainer.load_params()
        self.engine.release([TAG_WEIGHTS])
