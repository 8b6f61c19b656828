"""The stage machine's order, its OOM boundary at every stage, and weight-sync bucketing.

Driven on the CPU with stand-ins for the trainer and engine that record what they are asked to
do (the real ones are exercised by tests/worker); the memory meter is the real one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import pytest
import torch

from rljob.api import WakeUp
from rljob.report import STAGE_ORDER, Stage
from rljob_worker.engines.base import Completion
from rljob_worker.memory import MemoryMeter, OOMInjection, StageOOM, parse_oom_message
from rljob_worker.rl_math import batch_advantages, group_advantages
from rljob_worker.stages import SINGLE_ORDER, STAGED_ORDER, StageMachine, stage_order
from rljob_worker.staging import Staging
from rljob_worker.tp_shards import ShardedBucket
from rljob_worker.train import Experience, NamedTensors, TrainStats, plan_buckets

REAL_OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 512.00 MiB is free. Including non-PyTorch memory, this process has 78.68 GiB "
    "memory in use."
)


class RecordingTrainer:
    """Stand-in for train.Trainer: records calls into a shared log; two tiny named tensors."""

    def __init__(
        self, log: list[str], fail_with: BaseException | None = None, overlap: bool = False
    ) -> None:
        self.log = log
        self.fail_with = fail_with
        self.staging = Staging(torch.device("cpu"), overlap)

    def train_step(self, experience: Experience, iteration: int | None = None) -> TrainStats:
        self.log.append("train_step")
        if self.fail_with is not None:
            raise self.fail_with
        return TrainStats(
            response_tokens=1,
            token_steps=1,
            policy_loss_sum=0.0,
            kl_sum=None,
            entropy_sum=0.0,
            clipped_tokens=0,
            logprob_mismatch_sum=None,
            grad_norm=0.0,
            learning_rate=0.0,
            optimizer_steps=1,
        )

    def offload_optimizer(self) -> None:
        self.log.append("offload_optimizer")

    def start_offload_optimizer(self) -> None:
        self.log.append("start_offload_optimizer")

    def finish_offloads(self) -> None:
        self.log.append("finish_offloads")

    def load_optimizer(self) -> None:
        self.log.append("load_optimizer")

    def offload_params(self) -> None:
        self.log.append("offload_params")

    def load_params(self) -> None:
        self.log.append("load_params")

    def weight_buckets(
        self, bucket_bytes: int, dtype: torch.dtype, *, engine_casts: bool = False
    ) -> Iterator[NamedTensors]:
        self.log.append("gather" + (" for an engine that casts" if engine_casts else ""))
        yield [("a", torch.zeros(2, dtype=dtype)), ("b", torch.ones(2, dtype=dtype))]

    def shard_buckets(
        self,
        bucket_bytes: int,
        dtype: torch.dtype,
        shard_world: int,
        *,
        own_as_stored: bool = True,
    ) -> Iterator[ShardedBucket]:
        # As sync_send.shard_bucket gives it: a payload name and this rank's bytes.
        stored = ", own blocks as stored" if own_as_stored else ""
        self.log.append(f"gather sharded over {shard_world}{stored}")
        yield ShardedBucket(["a", "b"], "rljob-tp-bucket:{}", torch.zeros(4, dtype=torch.uint8))


class RecordingEngine:
    """Stand-in for a RolloutEngine: records calls into the same log."""

    kv_capacity_tokens = 64

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self._released: set[str] = set()

    @property
    def released_tags(self) -> frozenset[str]:
        return frozenset(self._released)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: object) -> list[list[int]]:
        return [[1] for _ in prompts]

    def generate_with_logprobs(
        self, prompts: Sequence[Sequence[int]], sampling: object
    ) -> list[Completion]:
        return [Completion([1], [-0.5]) for _ in prompts]

    def release(self, tags: Sequence[str]) -> None:
        self._released.update(tags)
        self.log.append(f"release:{'+'.join(tags)}")

    def resume(self, tags: Sequence[str]) -> None:
        self._released.difference_update(tags)
        self.log.append(f"resume:{'+'.join(tags)}")

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.log.append(f"update:{'+'.join(n for n, _ in bucket)}")

    def flush_cache(self) -> None:
        self.log.append("flush_cache")

    def shutdown(self) -> None:
        self.log.append("shutdown")


def _machine(
    wake_up: WakeUp,
    inject: OOMInjection | None = None,
    fail_with: BaseException | None = None,
    checkpoint_every: int = 0,
    overlap: bool = False,
) -> tuple[StageMachine, MemoryMeter, list[str]]:
    log: list[str] = []

    def rollout(iteration: int) -> Experience:
        log.append("generate")
        return Experience([[1]], [[2]], [1.0], [0])

    meter = MemoryMeter(rank=0, device=torch.device("cpu"), inject=inject)
    machine = StageMachine(
        RecordingTrainer(log, fail_with, overlap),
        RecordingEngine(log),
        meter,
        rollout,
        wake_up=wake_up,
        bucket_bytes=1 << 20,
        engine_dtype=torch.float32,
        checkpoint=lambda iteration: log.append(f"save {iteration}"),
        checkpoint_every=checkpoint_every,
    )
    return machine, meter, log


@pytest.mark.parametrize(
    ("wake_up", "order"), [(WakeUp.STAGED, STAGED_ORDER), (WakeUp.SINGLE, SINGLE_ORDER)]
)
def test_machine_runs_stages_in_order_and_iteration_zero_skips_training(
    wake_up: WakeUp, order: tuple[Stage, ...]
) -> None:
    machine, meter, _ = _machine(wake_up)
    for iteration in range(3):
        outcome = machine.run_iteration(iteration)
        assert outcome.stages == stage_order(wake_up, iteration)
    measured = [(s.iteration, s.stage) for s in meter.samples]
    first = [s for s in order if s not in (Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER)]
    assert measured == [(0, s) for s in first] + [(1, s) for s in order] + [(2, s) for s in order]


def test_an_engine_that_casts_is_asked_for_buckets_it_may_cast() -> None:
    """An engine that says it casts what it loads (casts_weights) gets buckets asked for with
    engine_casts, so the trainer may hand its master-dtype shards; others never do."""
    machine, _, log = _machine(WakeUp.STAGED)
    machine.run_iteration(0)
    assert "gather" in log
    machine, _, log = _machine(WakeUp.STAGED)
    machine.engine.casts_weights = True  # type: ignore[attr-defined]
    machine.run_iteration(0)
    assert "gather for an engine that casts" in log and "gather" not in log


class ShardedRecordingEngine(RecordingEngine):
    """A RecordingEngine that takes buckets shard to shard (ShardedWeights), as one
    TensorParallelEngine over every rank does."""

    shard_world = 2
    shard_own_as_stored = True

    def update_weights_sharded(self, bucket: ShardedBucket) -> None:
        self.log.append(f"sharded update:{'+'.join(bucket.names)}")


def test_an_engine_over_every_rank_is_sent_buckets_shard_to_shard_unless_a_hook_reads_them() -> (
    None
):
    machine, _, log = _machine(WakeUp.STAGED)
    machine.engine = ShardedRecordingEngine(log)
    machine.run_iteration(0)
    assert "gather sharded over 2, own blocks as stored" in log and "sharded update:a+b" in log
    assert "update:a+b" not in log
    # The engine's choice (every rank's switch) decides whether the own blocks go as stored.
    machine, _, log = _machine(WakeUp.STAGED)
    machine.engine = engine = ShardedRecordingEngine(log)
    engine.shard_own_as_stored = False
    machine.run_iteration(0)
    assert "gather sharded over 2" in log and "sharded update:a+b" in log
    # A hook that reads each bucket's full tensors (--verify-weights) gets full buckets.
    machine, _, log = _machine(WakeUp.STAGED)
    machine.engine = ShardedRecordingEngine(log)
    seen: list[list[str]] = []
    machine.after_weight_update = lambda _, bucket: seen.append([n for n, _ in bucket])
    machine.run_iteration(0)
    assert "gather" in log and "update:a+b" in log and seen == [["a", "b"]]


def test_staged_order_is_the_canonical_stage_order() -> None:
    assert stage_order(WakeUp.STAGED, 1, checkpoint=True) == STAGE_ORDER
    assert tuple(s for s in STAGE_ORDER if s is not Stage.CHECKPOINT) == STAGED_ORDER
    assert Stage.WAKE_KV_CACHE not in SINGLE_ORDER


@pytest.mark.parametrize("wake_up", [WakeUp.STAGED, WakeUp.SINGLE])
def test_a_resumed_prologue_offloads_the_loaded_moments_before_the_engine_wakes(
    wake_up: WakeUp,
) -> None:
    fresh = stage_order(wake_up, 0)
    resumed = stage_order(wake_up, 3, resumed=True)
    assert Stage.OFFLOAD_OPTIMIZER not in fresh and Stage.TRAIN not in fresh
    assert resumed == (Stage.OFFLOAD_OPTIMIZER, *fresh)
    machine, _, log = _machine(wake_up)
    machine.run_iteration(3, resumed=True)
    assert log[0] == "offload_optimizer" and log[-1] == "load_optimizer"


def test_staged_resumes_kv_cache_only_after_training_params_left() -> None:
    machine, _, log = _machine(WakeUp.STAGED)
    machine.run_iteration(0)
    log.clear()
    machine.run_iteration(1)
    assert log == [
        "train_step",
        "offload_optimizer",
        "resume:weights",
        "gather",
        "update:a+b",
        "flush_cache",
        "finish_offloads",
        "offload_params",
        "resume:kv_cache+cuda_graph",
        "generate",
        "release:cuda_graph+kv_cache+weights",
        "load_params",
        "load_optimizer",
    ]


def test_overlapped_staged_order_moves_the_state_behind_the_sync_the_release_and_train() -> None:
    machine, _, log = _machine(WakeUp.STAGED, overlap=True)
    machine.run_iteration(0)
    assert log[-3:] == ["release:cuda_graph+kv_cache", "load_params", "release:weights"]
    log.clear()
    machine.run_iteration(1)
    assert log == [
        "load_optimizer",  # arrives during forward/backward; the optimizer step waits
        "train_step",
        "start_offload_optimizer",  # its copies run behind the weight sync
        "resume:weights",
        "gather",
        "update:a+b",
        "flush_cache",
        "finish_offloads",  # the moments freed once copied, before the KV cache wakes
        "offload_params",
        "resume:kv_cache+cuda_graph",
        "generate",
        "release:cuda_graph+kv_cache",
        "load_params",  # into the KV cache's memory, while the weights are released
        "release:weights",
    ]


def test_the_moments_leave_after_the_stage_empties_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """empty_cache() frees segments with cudaFree, which waits for every stream of the device:
    the moments' copies to the host start after it, or they would finish inside this stage
    instead of behind the weight sync."""
    machine, _, log = _machine(WakeUp.STAGED, overlap=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    monkeypatch.setattr(
        "rljob_worker.stages.release_cublas_workspaces", lambda: log.append("release_cublas")
    )
    machine.offload_optimizer()
    assert log == ["release_cublas", "empty_cache", "start_offload_optimizer"]


def test_overlapped_single_order_keeps_the_moments_offload_in_its_stage() -> None:
    machine, _, log = _machine(WakeUp.SINGLE, overlap=True)
    machine.run_iteration(0)
    log.clear()
    machine.run_iteration(1)
    assert log.index("offload_optimizer") < log.index("resume:weights+kv_cache+cuda_graph")
    assert "start_offload_optimizer" not in log
    assert log[0] == "load_optimizer" and log[-1] == "release:weights"


def test_single_resumes_weights_and_kv_cache_together_while_params_are_resident() -> None:
    machine, _, log = _machine(WakeUp.SINGLE)
    machine.run_iteration(0)
    log.clear()
    machine.run_iteration(1)
    assert (
        log.index("resume:weights+kv_cache+cuda_graph")
        < log.index("update:a+b")
        < log.index("offload_params")
    )
    assert not [entry for entry in log if entry.startswith("resume:kv_cache")]


@pytest.mark.parametrize("wake_up", list(WakeUp))
def test_checkpoint_stage_runs_after_train_only_when_due(wake_up: WakeUp) -> None:
    machine, meter, log = _machine(wake_up, checkpoint_every=2)
    for iteration in range(5):
        outcome = machine.run_iteration(iteration)
        due = iteration in (2, 4)
        assert (Stage.CHECKPOINT in outcome.stages) == due
        if due:
            assert outcome.stages[:3] == (Stage.TRAIN, Stage.CHECKPOINT, Stage.OFFLOAD_OPTIMIZER)
    assert [entry for entry in log if entry.startswith("save")] == ["save 2", "save 4"]
    assert [s.iteration for s in meter.samples if s.stage is Stage.CHECKPOINT] == [2, 4]


def test_a_resumed_run_starts_with_the_second_half_of_its_checkpoints_iteration() -> None:
    machine, _, log = _machine(WakeUp.STAGED, checkpoint_every=1)
    outcome = machine.run_iteration(2, resumed=True)
    # The prologue's stages, after offloading the moments the checkpoint loaded.
    assert outcome.stages == (Stage.OFFLOAD_OPTIMIZER, *stage_order(WakeUp.STAGED, 0))
    assert outcome.train is None and "save 2" not in log
    assert Stage.CHECKPOINT in machine.run_iteration(3).stages


def test_train_without_a_first_rollout_is_refused() -> None:
    machine, _, _ = _machine(WakeUp.STAGED)
    with pytest.raises(RuntimeError, match="iteration 0"):
        machine.run_iteration(1)


@pytest.mark.parametrize("stage", list(STAGE_ORDER))
def test_oom_injected_in_a_stage_is_reported_with_that_stage(stage: Stage) -> None:
    inject = OOMInjection(stage=stage, iteration=1, requested_bytes=3 << 30)
    machine, meter, _ = _machine(WakeUp.STAGED, inject=inject, checkpoint_every=1)
    machine.run_iteration(0)
    with pytest.raises(StageOOM) as caught:
        machine.run_iteration(1)
    record = caught.value.record
    assert (record.stage, record.iteration, record.rank) == (stage, 1, 0)
    assert record.kind == "CUDAOutOfMemory"
    assert record.requested_bytes == 3 << 30
    assert record.free_bytes is not None and record.free_bytes > 0
    assert str(stage) in str(caught.value)
    # Nothing measured before the OOM is lost, and the failing stage is measured too.
    reached = STAGE_ORDER[: STAGE_ORDER.index(stage) + 1]
    assert [s.stage for s in meter.samples if s.iteration == 1] == list(reached)
    assert len([s for s in meter.samples if s.iteration == 0]) == 5


def test_oom_raised_inside_a_stage_is_parsed_from_the_allocator_message() -> None:
    machine, meter, _ = _machine(WakeUp.STAGED, fail_with=torch.OutOfMemoryError(REAL_OOM_MESSAGE))
    machine.run_iteration(0)
    with pytest.raises(StageOOM) as caught:
        machine.run_iteration(1)
    record = caught.value.record
    assert record.stage == Stage.TRAIN
    assert record.requested_bytes == int(1.5 * 2**30)
    assert record.free_bytes == 512 * 2**20
    assert meter.samples[-1].stage == Stage.TRAIN


def test_cublas_allocation_failure_is_recorded_as_an_oom_of_its_stage() -> None:
    error = RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    )
    machine, _, _ = _machine(WakeUp.STAGED, fail_with=error)
    machine.run_iteration(0)
    with pytest.raises(StageOOM) as caught:
        machine.run_iteration(1)
    assert caught.value.record.stage == Stage.TRAIN
    assert caught.value.record.kind == "CUDAOutOfMemory"
    # cuBLAS names no size: the message says what is known, not "requested None bytes".
    record = caught.value.record
    assert record.requested_bytes is None and record.free_bytes is not None
    assert f"(iteration 1, rank 0): {record.free_bytes} bytes free. " in str(caught.value)
    assert "None" not in str(caught.value)


def test_other_runtime_errors_are_not_taken_for_an_oom() -> None:
    machine, _, _ = _machine(WakeUp.STAGED, fail_with=RuntimeError("shape mismatch"))
    machine.run_iteration(0)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        machine.run_iteration(1)


def test_other_errors_pass_the_boundary_unchanged_and_are_still_measured() -> None:
    machine, meter, _ = _machine(WakeUp.STAGED, fail_with=KeyError("boom"))
    machine.run_iteration(0)
    with pytest.raises(KeyError):
        machine.run_iteration(1)
    assert meter.samples[-1].stage == Stage.TRAIN


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("rollout", OOMInjection(Stage.ROLLOUT)),
        ("train@rank=1@iteration=2", OOMInjection(Stage.TRAIN, rank=1, iteration=2)),
        ("", None),
    ],
)
def test_oom_injection_parses_stage_and_qualifiers(
    value: str, expected: OOMInjection | None
) -> None:
    assert OOMInjection.from_env(value) == expected


def test_oom_injection_only_fires_for_its_rank() -> None:
    inject = OOMInjection(Stage.SLEEP, rank=1)
    assert inject.applies(Stage.SLEEP, rank=1, iteration=5)
    assert not inject.applies(Stage.SLEEP, rank=0, iteration=5)
    assert not inject.applies(Stage.ROLLOUT, rank=1, iteration=5)


def test_parse_oom_message_reads_requested_and_free_bytes() -> None:
    assert parse_oom_message(REAL_OOM_MESSAGE) == (int(1.5 * 2**30), 512 * 2**20)
    assert parse_oom_message("CUDA error: out of memory") == (None, None)


def test_host_sample_is_marked_host_and_has_the_same_shape() -> None:
    meter = MemoryMeter(rank=3, device=torch.device("cpu"))
    with meter.stage(Stage.ROLLOUT, iteration=7):
        held = torch.ones(4 << 20)  # 16 MiB, so the process RSS has something to show
    del held
    (sample,) = meter.samples
    assert (sample.kind, sample.device, sample.rank, sample.iteration) == ("host", "cpu", 3, 7)
    assert sample.peak_allocated_bytes >= sample.allocated_bytes - (64 << 20)
    assert (
        0 < sample.device_used_bytes <= sample.device_peak_used_bytes <= sample.device_total_bytes
    )


# -- bucketing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "bucket", "expected"),
    [
        ([("a", 4), ("b", 4), ("c", 4)], 8, [["a", "b"], ["c"]]),
        ([("a", 10), ("b", 1)], 4, [["a"], ["b"]]),  # larger than a bucket: travels alone
        ([("a", 1), ("b", 1)], 100, [["a", "b"]]),
        ([], 8, []),
    ],
)
def test_plan_buckets_table(
    sizes: list[tuple[str, int]], bucket: int, expected: list[list[str]]
) -> None:
    assert plan_buckets(sizes, bucket) == expected


@pytest.mark.parametrize("bucket_bytes", [1, 4096, 40_000, 1 << 20, 1 << 30])
def test_bucketing_covers_every_parameter_of_a_qwen2_once_within_the_bucket_size(
    bucket_bytes: int,
) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    sizes = [(n, p.numel() * 2) for n, p in model.named_parameters()]
    buckets = plan_buckets(sizes, bucket_bytes)
    flat = [name for bucket in buckets for name in bucket]
    assert sorted(flat) == sorted(n for n, _ in sizes)
    assert len(flat) == len(set(flat))
    size = dict(sizes)
    for bucket in buckets:
        assert len(bucket) == 1 or sum(size[n] for n in bucket) <= bucket_bytes


def test_plan_buckets_refuses_a_non_positive_size() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([("a", 1)], 0)


# -- advantages --------------------------------------------------------------------------------


def test_group_advantages_are_relative_to_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0])
    advantages = group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    assert advantages[0] > 0 > advantages[1]
    assert torch.allclose(advantages[2:], torch.zeros(2))


def test_batch_advantages_normalise_over_the_batch() -> None:
    advantages = batch_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert abs(float(advantages.mean())) < 1e-6
    assert abs(float(advantages.std(unbiased=False)) - 1.0) < 1e-4
