"""Checkpoints on the CPU (2 ranks, FSDP2 on gloo, the builtin tiny model, torch engine).

One straight run of 4 iterations (checkpoint every iteration, keep 2, export) against the same
job run to iteration 2 and then run again to 4 (it resumes from iteration 2's checkpoint): the
trained weights are bit-identical and the rewards per iteration equal. The runs are shared by
the tests below (module fixtures), so the whole file costs five short runs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.model_cache import fresh_model_cache

from rljob.api import CheckpointMode, RLJobSpec, parse_manifest
from rljob.metrics_file import METRICS_FILE, read_entries
from rljob.report import Stage
from rljob_worker.checkpoint import (
    MARKER,
    WRITER_START_ENV,
    checkpoint_dir,
    complete_checkpoints,
)
from rljob_worker.driver.local import LocalRun, run_local
from rljob_worker.loop import tensor_digest

pytestmark = pytest.mark.worker

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 4
STOP = 2


def _spec(root: Path, iterations: int, keep: int = 2, **extra: Any) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "ckpt"},
        "spec": {
            # float32: the export holds the master weights bit for bit.
            "model": {"path": "builtin:tiny-qwen2", "dtype": "float32"},
            "algorithm": {
                "name": "grpo",
                "groupSize": 2,
                "iterations": iterations,
                "learningRate": 1e-2,
                "klCoef": 0.05,
                "seed": 3,
                # A schedule and a decay: the resumed run must train each iteration at the
                # rate the straight run did (the schedule is a function of the iteration).
                "learningRateSchedule": "Cosine",
                "warmupIterations": 1,
                "minLearningRateRatio": 0.1,
                "weightDecay": 0.01,
            },
            "data": {"source": "builtin:digit", "trainBatchSize": 4, "maxResponseLength": 3},
            # Temperature 1: the rollout samples, so equal rewards need equal RNG use too.
            "rollout": {"engine": "torch", "weightSyncBucketMegabytes": 1},
            "training": {"microBatchSize": 2},
            "resources": {"workers": 1, "gpusPerWorker": 0},
            "checkpoint": {"path": str(root / "ckpt"), "everyIterations": 1, "keep": keep},
            "export": {"path": str(root / "export")},
            **extra,
        },
    }
    return parse_manifest(doc)[1]


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from fresh_model_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LocalRun]:
    root = tmp_path_factory.mktemp("straight")
    run = run_local(_spec(root, ITERATIONS), 2, "cpu", verify_weights=True)
    assert run.ok, run.errors
    return root, run


@pytest.fixture(scope="module")
def stopped_and_resumed(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, LocalRun, LocalRun]:
    root = tmp_path_factory.mktemp("resumed")
    first = run_local(_spec(root, STOP, keep=10), 2, "cpu")
    assert first.ok, first.errors
    shutil.copytree(root / "export", root / "export-at-2")
    # A save of iteration 3 that died before its marker: resume must not pick it.
    broken = checkpoint_dir(root / "ckpt", STOP + 1)
    shutil.copytree(checkpoint_dir(root / "ckpt", STOP), broken)
    (broken / MARKER).unlink()
    # The resumed run starts each writer in the checkpoint stage (the straight and the stopped
    # run: after the weight sync, the default); the ranks inherit the setting. The result
    # must be the same either way.
    before = os.environ.get(WRITER_START_ENV)
    os.environ[WRITER_START_ENV] = "stage"
    try:
        second = run_local(_spec(root, ITERATIONS, keep=10), 2, "cpu")
        assert second.ok, second.errors
    finally:
        if before is None:
            os.environ.pop(WRITER_START_ENV, None)
        else:
            os.environ[WRITER_START_ENV] = before
    return root, first, second


def _rewards(run: LocalRun) -> dict[int, float | None]:
    return {r.iteration: r.reward_mean for r in run.reports}


def test_resumed_run_ends_with_the_straight_runs_weights_and_rewards(
    straight: tuple[Path, LocalRun], stopped_and_resumed: tuple[Path, LocalRun, LocalRun]
) -> None:
    (straight_root, straight_run), (root, first, second) = straight, stopped_and_resumed
    assert second.resumed_from == STOP
    assert first.resumed_from is None
    # The resumed run starts with iteration 2's second half (its train is in the checkpoint).
    assert sorted({i.iteration for i in second.iterations}) == list(range(STOP, ITERATIONS + 1))
    # Its first iteration offloads the AdamW moments the checkpoint loaded before the engine
    # wakes (a fresh prologue has none to offload): without it a resumed GPU run's
    # wake_kv_cache lacked their bytes.
    resumed = next(i for i in second.iterations if i.iteration == STOP and i.rank == 0)
    assert "train" not in resumed.stages
    assert resumed.stages.index("offload_optimizer") < resumed.stages.index("wake_weights")
    fresh = next(i for i in straight_run.iterations if i.iteration == 0 and i.rank == 0)
    assert "offload_optimizer" not in fresh.stages
    rewards = _rewards(straight_run)
    assert {**_rewards(first), **_rewards(second)} == rewards
    # Each training iteration at its scheduled rate, in both (the resumed run's from iteration
    # 3; iteration 2's train is in the checkpoint): 1e-2 after the warmup, then falling.
    algorithm = _spec(root, ITERATIONS).algorithm
    scheduled = {i: algorithm.learning_rate_at(i) for i in range(1, ITERATIONS + 1)}
    assert scheduled[1] == pytest.approx(1e-2) and scheduled[2] == pytest.approx(1e-2)
    assert scheduled[4] < scheduled[3] < scheduled[2]
    for run in (straight_run, second):
        rates = {r.iteration: r.learning_rate for r in run.reports if r.learning_rate}
        assert rates == {i: pytest.approx(scheduled[i]) for i in rates}
    assert sorted(r.iteration for r in second.reports if r.learning_rate) == [3, 4]
    assert len(set(rewards.values())) > 1  # the rewards moved: equal is not trivially equal
    ours = load_file(str(root / "export" / "model.safetensors"))
    theirs = load_file(str(straight_root / "export" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    at_two = load_file(str(root / "export-at-2" / "model.safetensors"))
    assert any(not torch.equal(at_two[n], ours[n]) for n in ours)  # training moved them
    # metrics.jsonl beside the checkpoints holds the resumed job's whole history, as the
    # straight run's: iteration 2's line keeps the policy loss of its train stage (done by the
    # first run: the checkpoint holds it) beside the second run's rollout.
    ours_lines, theirs_lines = _metrics_lines(root), _metrics_lines(straight_root)
    assert [e["iteration"] for e in ours_lines] == list(range(ITERATIONS + 1))
    assert "policyLoss" in ours_lines[STOP]
    assert ours_lines == theirs_lines


def _metrics_lines(root: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's entries without the seconds (the two runs' clocks differ)."""
    entries = read_entries(root / "ckpt" / METRICS_FILE)
    return [{k: v for k, v in e.items() if k != "seconds"} for e in entries]


def test_an_unfinished_save_is_never_picked_and_is_replaced(
    stopped_and_resumed: tuple[Path, LocalRun, LocalRun],
) -> None:
    root, _, second = stopped_and_resumed
    assert second.resumed_from == STOP  # not 3, whose directory had no marker
    # Iteration 3 was saved again, whole, over the broken one; keep=10 kept every one.
    assert [i for i, _ in complete_checkpoints(root / "ckpt")] == [1, 2, 3, 4]


def test_keep_leaves_the_newest_complete_checkpoints(straight: tuple[Path, LocalRun]) -> None:
    root, run = straight
    assert [i for i, _ in complete_checkpoints(root / "ckpt")] == [3, 4]
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == [
        "iteration-00000003",
        "iteration-00000004",
        METRICS_FILE,  # every iteration's metrics: pruning leaves it
    ]
    status = run.status()
    assert status.checkpoint is not None and status.checkpoint.iteration == ITERATIONS
    assert status.checkpoint.bytes > 0 and status.checkpoint.seconds > 0
    assert status.export is not None and status.export.iteration == ITERATIONS
    # Every training iteration has a measured checkpoint stage, right after train.
    for iteration in range(1, ITERATIONS + 1):
        own = sorted(
            (s for s in run.samples if s.rank == 0 and s.iteration == iteration),
            key=lambda s: s.start_seconds,
        )
        assert [s.stage for s in own][:3] == [
            Stage.TRAIN,
            Stage.CHECKPOINT,
            Stage.OFFLOAD_OPTIMIZER,
        ]


def test_export_loads_and_holds_the_engines_last_weights(straight: tuple[Path, LocalRun]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, run = straight
    model: Any = AutoModelForCausalLM.from_pretrained(str(root / "export"))
    tokenizer = AutoTokenizer.from_pretrained(str(root / "export"))
    assert model.dtype == torch.float32
    # Bit for bit what the engine held after the last weight update (verify_weights digests).
    last = next(i for i in run.iterations if i.rank == 0 and i.iteration == ITERATIONS)
    assert last.weights is not None
    held = dict(model.named_parameters())
    for name, digest in last.weights.engine.items():
        assert tensor_digest(held[name].detach()) == digest, name
    # Greedy answers on fixed prompts: the exported model through transformers equals the
    # torch engine given the same weights.
    from rljob_worker.engines.base import SamplingParams
    from rljob_worker.engines.torch_engine import TorchEngine

    prompts = [tokenizer.encode(p) for p in ("say 7:", "say 3:", "1+2=")]
    engine = TorchEngine(str(root / "export"), device="cpu", dtype=torch.float32)
    engine.update_weights(list(held.items()))
    answers = engine.generate_with_logprobs(
        prompts, SamplingParams(max_new_tokens=4, temperature=0.0)
    )
    for prompt, answer in zip(prompts, answers, strict=True):
        output = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        assert output[0, len(prompt) :].tolist()[: len(answer.token_ids)] == list(answer.token_ids)


def test_two_ranks_checkpoint_resumes_resharded_on_one_rank(
    tmp_path: Path, stopped_and_resumed: tuple[Path, LocalRun, LocalRun]
) -> None:
    root, _, _ = stopped_and_resumed
    shutil.copytree(checkpoint_dir(root / "ckpt", STOP), checkpoint_dir(tmp_path / "ckpt", STOP))
    run = run_local(_spec(tmp_path, STOP), 1, "cpu")
    assert run.ok, run.errors
    assert run.resumed_from == STOP
    ours = load_file(str(tmp_path / "export" / "model.safetensors"))
    theirs = load_file(str(root / "export-at-2" / "model.safetensors"))
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


def test_a_writer_held_for_the_sync_still_completes_when_a_peer_fails_in_the_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RLJOB_CHECKPOINT_WRITER_START=after_sync, an OOM on rank 1 in iteration 2's wake_weights,
    right after that iteration's checkpoint stage: rank 1's drain releases its writer, whose
    collectives need rank 0's; rank 0 is blocked in the sync and never reaches the releasing
    boundary, so its writer must write on its own (after WRITER_HOLD_SECONDS), or iteration 2's
    checkpoint is lost and a retry resumes from 1 (seen in review before the hold had a
    timeout: only [1] complete, after 328 s)."""
    from rljob_worker.memory import OOMInjection

    monkeypatch.setenv(WRITER_START_ENV, "after_sync")
    spec = _spec(tmp_path, 3, keep=10)
    oom = OOMInjection(stage=Stage.WAKE_WEIGHTS, rank=1, iteration=2)
    run = run_local(spec, 2, "cpu", inject_oom=oom)
    assert not run.ok
    assert [i for i, _ in complete_checkpoints(tmp_path / "ckpt")] == [1, 2]


def _fail_weight_sync_in(iteration: int) -> None:
    """In this rank process: the weight sync of `iteration` raises, as an engine that died."""
    from rljob_worker import stages

    real = stages.StageMachine.wake_weights

    def wake_weights(self: stages.StageMachine) -> None:
        if self._iteration == iteration:
            raise RuntimeError("the engine died in the weight sync (injected)")
        real(self)

    stages.StageMachine.wake_weights = wake_weights  # type: ignore[method-assign]


def _failing_sync_rank(rank: int, init_method: str, root: str, results: Any) -> None:
    """One rank whose weight sync fails (not an OOM: an engine that died) in iteration 2,
    right after that iteration's checkpoint stage, whose writer is held back for the sync."""
    from support.ranks import gloo_rank

    from rljob_worker.loop import RankConfig, run_rank

    _fail_weight_sync_in(2)
    with gloo_rank(rank, 1, init_method, results):
        run_rank(_spec(Path(root), 3, keep=10), RankConfig(rank=rank, world_size=1))


def test_a_checkpoint_staged_before_a_failed_sync_is_still_written(tmp_path: Path) -> None:
    """Any failure, not only an OOM, lets a checkpoint staged in the same iteration complete
    before the process ends: its writer waits for the weight sync by default, and as a daemon
    thread it would die with the process, leaving a re-run one checkpoint further back."""
    from support.ranks import run_ranks

    out = run_ranks(_failing_sync_rank, 1, str(tmp_path))[0]
    assert "injected" in out.get("error", ""), out
    assert [i for i, _ in complete_checkpoints(tmp_path / "ckpt")] == [1, 2]


def _rank_failing_after_its_checkpoint(
    rank: int, init_method: str, root: str, failure: str, results: Any
) -> None:
    """One rank, Sync checkpoints (each complete when its stage ends), whose iteration 2 fails
    after that iteration's checkpoint: a CUDA OOM in the rollout, or an engine that died in the
    weight sync. Its events are kept; sending a checkpoint part alone then breaks the channel
    (after it was kept), as a driver's queue that is gone would."""
    from support.ranks import gloo_rank

    from rljob_worker.checkpoint import SavedCheckpoint
    from rljob_worker.loop import RankConfig, run_rank
    from rljob_worker.memory import OOMInjection

    events: list[Any] = []

    def emit(event: Any) -> None:
        events.append(event)
        if isinstance(event, SavedCheckpoint):
            raise BrokenPipeError("the driver's queue is gone (injected)")

    inject = None
    if failure == "oom":
        inject = OOMInjection(stage=Stage.ROLLOUT, rank=0, iteration=2)
    else:
        _fail_weight_sync_in(2)
    base = _spec(Path(root), 3, keep=10)
    assert base.checkpoint is not None and base.export is not None
    spec = base.model_copy(
        update={
            "checkpoint": base.checkpoint.model_copy(update={"mode": CheckpointMode.SYNC}),
            "export": base.export.model_copy(update={"with_checkpoints": True}),
        }
    )
    with gloo_rank(rank, 1, init_method, results) as out:
        try:
            result = run_rank(spec, RankConfig(rank=rank, world_size=1, inject_oom=inject), emit)
            out["oom"] = None if result.oom is None else result.oom.stage
        finally:
            out["events"] = events


@pytest.mark.parametrize("failure", ["oom", "error"])
def test_a_checkpoint_completed_before_its_iteration_fails_is_in_status(
    tmp_path: Path, failure: str
) -> None:
    """Iteration 2's checkpoint completes, then that iteration fails: the retry resumes from
    it, so status.checkpoint must name it (it stayed at iteration 1, without its
    CheckpointWritten Event), and status.export the export export.withCheckpoints wrote beside
    it (the resumed run does not write it again). A broken channel while reporting it hides
    not the failure."""
    from support.ranks import run_ranks

    out = run_ranks(_rank_failing_after_its_checkpoint, 1, str(tmp_path), failure)[0]
    if failure == "oom":
        assert out.get("oom") == Stage.ROLLOUT and "error" not in out, out
    else:
        assert "the engine died in the weight sync" in out.get("error", ""), out
    assert [i for i, _ in complete_checkpoints(tmp_path / "ckpt")] == [1, 2]
    run = LocalRun(world_size=1, device="cpu")
    for event in out["events"]:
        run.add(event)
    checkpoint = run.status().checkpoint
    assert checkpoint is not None
    assert (checkpoint.iteration, checkpoint.path) == (2, str(checkpoint_dir(tmp_path / "ckpt", 2)))
    export = run.status().export
    assert export is not None
    assert (export.iteration, export.path) == (2, str(tmp_path / "export" / "iteration-00000002"))


@pytest.mark.parametrize("resume", ["Auto", "Never"])
def test_oom_retry_resumes_from_the_newest_checkpoint_with_the_new_knobs(
    tmp_path: Path, resume: str
) -> None:
    """Also with resume Never: the retry continues from the checkpoints its own job wrote (a
    retry is no new run; it was refused as 'an earlier run's'), and a later `rljob run` is
    refused beside them. That run exports with every checkpoint too: the final export keeps
    the iteration-N exports under its path (it replaced the directory whole before)."""
    import json

    import yaml

    from rljob_worker.cli_run import main

    doc = yaml.safe_load((REPO / "examples" / "checkpoint-resume.yaml").read_text())
    doc["spec"]["checkpoint"]["path"] = str(tmp_path / "ckpt")
    doc["spec"]["checkpoint"]["resume"] = resume
    doc["spec"]["export"]["path"] = str(tmp_path / "export")
    doc["spec"]["export"]["withCheckpoints"] = resume == "Never"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    assert main([str(manifest), "--out", str(out), "--inject-oom", "train@iteration=3"]) == 0
    status = json.loads((out / "status.json").read_text())
    first, second = status["attempts"]
    assert (first["result"], first["oomStage"]) == ("CUDAOutOfMemory", "train")
    assert "resumedFrom" not in first
    # Iteration 3's train failed before its checkpoint: the retry continues from 2, not 0.
    resumed = {"iteration": 2, "path": str(checkpoint_dir(tmp_path / "ckpt", 2))}
    assert (second["result"], second["resumedFrom"], second["microBatchSize"]) == (
        "Succeeded",
        resumed,
        1,
    )
    assert status["resumedFrom"] == resumed  # the driver's field: the last attempt's resume
    assert status["checkpoint"]["iteration"] == 4
    assert status["export"] == {"path": str(tmp_path / "export"), "iteration": 4}
    reports = json.loads((out / "reports.json").read_text())
    assert [r["iteration"] for r in reports] == [2, 3, 4]
    # status.metrics and memoryHistory keep attempt 1's iterations before the resume point
    # (the curve from 0, as the cluster's driver keeps them), each iteration once.
    assert [m["iteration"] for m in status["metrics"]] == [0, 1, 2, 3, 4]
    assert [p["iteration"] for p in status["memoryHistory"]] == [0, 1, 2, 3, 4]
    if resume == "Auto":
        return
    exported = sorted(p.name for p in (tmp_path / "export").iterdir() if p.is_dir())
    assert exported == [f"iteration-{i:08d}" for i in (1, 2, 3, 4)]
    assert (tmp_path / "export" / "model.safetensors").is_file()
    again = tmp_path / "again"
    assert main([str(manifest), "--out", str(again)]) != 0
    cause = json.loads((again / "status.json").read_text())["cause"]
    assert "earlier run" in cause and "resume is Never" in cause, cause
