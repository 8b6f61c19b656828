"""The colocated loop for real on the CPU: 2 ranks, FSDP2 on gloo, the torch engine, local driver.

Every run here is >= 2 iterations (the second is where stage-ordering bugs show) and the
assertions read the recorded samples and reports, not logs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from support.model_cache import fresh_model_cache

from rljob.api import RLJobSpec, ValidationSpec, WakeUp, parse_manifest
from rljob.plan import TINY_QWEN2_CONFIG
from rljob.report import IterationReport, Stage
from rljob_worker.driver.local import LocalRun, run_local
from rljob_worker.memory import OOMInjection
from rljob_worker.model import build_tokenizer, load_causal_lm, resolve_model_path
from rljob_worker.stages import STAGED_ORDER, stage_order

REPO = Path(__file__).resolve().parents[2]
RANKS = 2
ITERATIONS = 2


def _spec(
    wake_up: str = "staged", model: str = "builtin:tiny-qwen2", **algorithm: Any
) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "worker-test"},
        "spec": {
            "model": {"path": model, "dtype": "bfloat16"},
            # A large learning rate so the weights visibly move between iterations.
            "algorithm": {
                "name": "grpo",
                "groupSize": 2,
                "iterations": ITERATIONS,
                "learningRate": 1e-2,
                "klCoef": 0.05,
                **algorithm,
            },
            "data": {"source": "builtin:arithmetic", "trainBatchSize": 4, "maxResponseLength": 6},
            "rollout": {"engine": "torch", "wakeUp": wake_up, "weightSyncBucketMegabytes": 1},
            "training": {"microBatchSize": 2},
            "resources": {"workers": 1, "gpusPerWorker": 0},
        },
    }
    return parse_manifest(doc)[1]


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from fresh_model_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def staged_run() -> LocalRun:
    return run_local(_spec(), RANKS, "cpu", verify_weights=True)


def test_validation_answers_held_out_prompts_and_leaves_the_training_as_it_was(
    staged_run: LocalRun,
) -> None:
    """spec.data.validation at every iteration, sampled (2 answers a prompt at temperature 1):
    the figures come from 6 prompts split over the ranks, and the training rollouts, losses
    and rewards are bit for bit those of the same job without validation (its sampling draws
    from a stream of its own, and nothing of it is trained on)."""
    spec = _spec()
    validation = ValidationSpec(
        source="builtin:arithmetic",
        every_iterations=1,
        max_prompts=6,
        samples_per_prompt=2,
        temperature=1.0,
    )
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"validation": validation})})
    run = run_local(spec, RANKS, "cpu")
    assert run.ok, run.errors

    def training(r: IterationReport) -> tuple[Any, ...]:
        return (r.iteration, r.reward_mean, r.reward_std, r.policy_loss, r.kl_mean, r.grad_norm)

    assert [training(r) for r in run.reports] == [training(r) for r in staged_run.reports]
    for report in run.reports:
        assert report.validation is not None, report.iteration
        assert report.validation.prompts == 6
        assert report.validation.reward_mean is not None
        assert 0 < (report.validation.response_length_mean or 0) <= 6  # maxResponseLength
    assert all(r.validation is None for r in staged_run.reports)


def _stages(run: LocalRun, rank: int, iteration: int) -> list[Stage]:
    own = [s for s in run.samples if s.rank == rank and s.iteration == iteration]
    return [s.stage for s in sorted(own, key=lambda s: s.start_seconds)]


def test_staged_run_succeeds_on_every_rank(staged_run: LocalRun) -> None:
    assert staged_run.ok, staged_run.errors
    assert sorted((i.rank, i.iteration) for i in staged_run.iterations) == [
        (rank, iteration) for rank in range(RANKS) for iteration in range(ITERATIONS + 1)
    ]


def test_each_rank_runs_the_staged_order_every_iteration(staged_run: LocalRun) -> None:
    for rank in range(RANKS):
        for iteration in range(ITERATIONS + 1):
            expected = list(stage_order(WakeUp.STAGED, iteration))
            assert _stages(staged_run, rank, iteration) == expected
    # No spec.checkpoint: no checkpoint stage (test_checkpoint_resume.py has it).
    assert list(stage_order(WakeUp.STAGED, 1)) == list(STAGED_ORDER)


def test_report_has_every_stage_for_every_rank(staged_run: LocalRun) -> None:
    reports = staged_run.reports
    assert [r.iteration for r in reports] == list(range(ITERATIONS + 1))
    for report in reports[1:]:
        seen = {(s.rank, s.stage) for s in report.samples}
        assert seen == {(rank, stage) for rank in range(RANKS) for stage in STAGED_ORDER}
        assert all(s.kind == "host" and s.device_total_bytes > 0 for s in report.samples)


def test_engine_weights_equal_training_weights_after_each_update(staged_run: LocalRun) -> None:
    _assert_engine_got_every_update(staged_run, resolve_model_path("builtin:tiny-qwen2"))


def _assert_engine_got_every_update(run: LocalRun, path: Path | str) -> None:
    names = {n for n, _ in load_causal_lm(path, torch.float32).named_parameters()}
    digests: dict[int, dict[str, str]] = {}
    for item in run.iterations:
        assert item.weights is not None
        assert set(item.weights.sent) == names, "every parameter is sent once per update"
        assert item.weights.mismatched == [], f"rank {item.rank} iteration {item.iteration}"
        # Every rank's engine holds the same full weights after the update.
        assert digests.setdefault(item.iteration, item.weights.engine) == item.weights.engine
    # Training moved the weights, so equality above is not the checkpoint matching itself.
    assert digests[1] != digests[0] and digests[2] != digests[1]


def _save_user_model(architecture: str, directory: Path) -> None:
    """A tiny Llama or Qwen3 saved with the builtin tokenizer, as a user's checkpoint folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    shape: dict[str, Any] = {
        **TINY_QWEN2_CONFIG,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(0)
    if architecture == "llama":
        # Llama's biases on and Llama 3.1's RoPE scaling, untied.
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}  # fmt: skip
        config = LlamaConfig(**{**shape, "tie_word_embeddings": False}, attention_bias=True,
                             mlp_bias=True, rope_parameters=rope)  # fmt: skip
        model: Any = LlamaForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=32))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_users_llama_or_qwen3_trains_and_its_engine_gets_every_update(
    architecture: str, tmp_path: Path
) -> None:
    """The whole loop on another decoder the torch engine runs, loaded from a folder."""
    _save_user_model(architecture, tmp_path)
    run = run_local(_spec(model=str(tmp_path)), RANKS, "cpu", verify_weights=True)
    assert run.ok, run.errors
    assert sorted((i.rank, i.iteration) for i in run.iterations) == [
        (rank, iteration) for rank in range(RANKS) for iteration in range(ITERATIONS + 1)
    ]
    _assert_engine_got_every_update(run, tmp_path)


def test_status_block_has_driver_fields_and_memory(staged_run: LocalRun) -> None:
    status = staged_run.status()
    assert status.iteration == ITERATIONS
    assert status.reward_mean is not None and 0 <= status.reward_mean <= 1
    assert status.kl_mean is not None and status.kl_mean > 0  # the policy left the reference
    assert status.memory is not None and status.memory.kind == "host"
    assert [s.name for s in status.memory.stages] == list(STAGED_ORDER)
    # The start-up, measured once on every rank (its first iteration carries it).
    assert {i.rank for i in staged_run.iterations if i.load is not None} == set(range(RANKS))
    load = status.memory.load
    assert load is not None and load.peak_bytes > 0 and load.host_peak_bytes > 0
    assert load.rank in range(RANKS) and load.seconds > 0
    assert status.oom_events == []
    dumped = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert {"iteration", "rewardMean", "klMean", "memory", "oomEvents"} <= dumped.keys()


def test_oom_on_one_rank_ends_the_run_without_hanging_or_losing_samples() -> None:
    inject = OOMInjection(Stage.WAKE_WEIGHTS, rank=1, iteration=2)
    run = run_local(_spec("single"), RANKS, "cpu", inject_oom=inject, grace_seconds=5)
    assert not run.ok
    (oom,) = run.ooms
    assert (oom.stage, oom.rank, oom.iteration) == (Stage.WAKE_WEIGHTS, 1, 2)
    assert oom.requested_bytes == inject.requested_bytes
    for rank in range(RANKS):
        for iteration in (0, 1):
            assert _stages(run, rank, iteration) == list(stage_order(WakeUp.SINGLE, iteration))
    # The failing rank measured up to and including the stage that failed.
    assert _stages(run, 1, 2) == [Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER, Stage.WAKE_WEIGHTS]
    status = run.status()
    assert status.iteration == 1
    assert status.oom_counts == {"CUDAOutOfMemory": 1}
    assert status.memory is not None and status.memory.iteration == 2


def test_a_driver_that_stops_mid_run_leaves_no_rank_running() -> None:
    """An on_event that raises (a listener's bug) or a Ctrl-C stops the driver: every rank is
    ended with it, none is left training (or, on GPUs, holding its device) after it returned."""
    import multiprocessing

    class ListenerBroke(RuntimeError):
        pass

    def broken(event: object) -> None:
        raise ListenerBroke(f"on {type(event).__name__}")

    with pytest.raises(ListenerBroke):
        run_local(_spec(), RANKS, "cpu", on_event=broken, grace_seconds=5)
    assert multiprocessing.active_children() == []


def test_cli_runs_the_example_and_writes_status_and_timeline(tmp_path: Path) -> None:
    from rljob_worker.cli_run import main

    out = tmp_path / "out"
    manifest = REPO / "examples" / "tiny-local.yaml"
    assert main([str(manifest), "--out", str(out), "--ranks", str(RANKS), "--verify-weights"]) == 0
    status = json.loads((out / "status.json").read_text())
    iterations = parse_manifest(yaml.safe_load(manifest.read_text()))[1]
    assert status["phase"] == "Succeeded"
    assert status["iteration"] == iterations.algorithm.iterations
    assert [s["name"] for s in status["memory"]["stages"]] == [str(s) for s in STAGED_ORDER]
    # The history `kubectl rljob plot` draws, as the driver keeps it in the cluster.
    history = status["memoryHistory"]
    assert [p["iteration"] for p in history] == list(range(status["iteration"] + 1))
    assert history[-1]["peakBytes"] == {
        s["name"]: s["peakBytes"] for s in status["memory"]["stages"]
    }
    assert (out / "status.yaml").read_text().startswith("status:")
    # Every rank's start-up in load.json; status.memory.load is the worst of them.
    loads = json.loads((out / "load.json").read_text())
    assert sorted(s["rank"] for s in loads) == list(range(RANKS))
    assert status["memory"]["load"]["peakBytes"] == max(s["devicePeakUsedBytes"] for s in loads)
    png = (out / "memory-timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # status.metrics (what `kubectl rljob curve` draws), one entry per iteration, as reported.
    reports = json.loads((out / "reports.json").read_text())
    assert [(m["iteration"], m["rewardMean"]) for m in status["metrics"]] == [
        (r["iteration"], pytest.approx(r["rewardMean"], rel=1e-4)) for r in reports
    ]
    assert "policyLoss" in status["metrics"][-1]
    # The example's validation (16 held-out prompts, greedy) at iterations 0 and 2.
    validated = [m["iteration"] for m in status["metrics"] if "validation" in m]
    assert validated == [0, iterations.algorithm.iterations]
    assert all(m["validation"]["prompts"] == 16 for m in status["metrics"] if "validation" in m)
    curve = (out / "learning-curve.png").read_bytes()
    assert curve[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(curve) < 200_000


def _with_oom_policy(tmp_path: Path, max_retries: int) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "tiny-local.yaml").read_text())
    doc["spec"]["rollout"]["wakeUp"] = "single"
    doc["spec"]["oomPolicy"] = {"maxRetries": max_retries, "fractionStep": 0.05, "minFraction": 0.5}
    manifest = tmp_path / "tiny-local-retry.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    return manifest


def test_cli_retries_an_oom_with_the_policys_knobs_and_records_both_attempts(
    tmp_path: Path,
) -> None:
    """`rljob run` is the operator too: an OOM in attempt 1 (injected, attempt 1 only) starts
    attempt 2 with wakeUp single switched to staged (switchToStaged), which completes."""
    from rljob_worker.cli_run import main

    out = tmp_path / "out"
    manifest = _with_oom_policy(tmp_path, max_retries=1)
    argv = [str(manifest), "--out", str(out), "--ranks", str(RANKS)]
    assert main([*argv, "--inject-oom", "wake_weights@rank=1@iteration=1"]) == 0
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded"
    first, second = status["attempts"]
    assert first["attempt"] == 1 and first["result"] == "CUDAOutOfMemory"
    assert (first["wakeUp"], first["memFractionStatic"]) == ("single", 0.85)
    assert (first["oomStage"], first["oomRank"]) == ("wake_weights", 1)
    assert "attempt 2 runs with rollout.wakeUp single -> staged" in first["message"]
    assert second == {
        "attempt": 2, "memFractionStatic": 0.85, "wakeUp": "staged", "result": "Succeeded",
        "rayJob": "", "message": "", "changed": "rollout.wakeUp single -> staged",
    }  # fmt: skip
    # Attempt 1's OOM stays in status, as the cluster's status keeps every attempt's.
    assert status["oomCounts"] == {"CUDAOutOfMemory": 1}
    [oom] = status["oomEvents"]
    assert (oom["stage"], oom["rank"], oom["iteration"]) == ("wake_weights", 1, 1)
    # The completed attempt's own iterations and stages: staged order.
    assert status["iteration"] == 2
    assert [s["name"] for s in status["memory"]["stages"]] == [str(s) for s in STAGED_ORDER]


def test_cli_without_retries_fails_on_the_oom_and_records_no_second_attempt(
    tmp_path: Path,
) -> None:
    from rljob_worker.cli_run import main

    out = tmp_path / "out"
    manifest = _with_oom_policy(tmp_path, max_retries=0)
    argv = [str(manifest), "--out", str(out), "--ranks", str(RANKS)]
    assert main([*argv, "--inject-oom", "wake_weights@rank=1@iteration=1"]) == 1
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Failed"
    assert status["cause"] == "CUDAOutOfMemory in stage wake_weights (rank 1, iteration 1)"
    assert status.get("attempts", []) == []
    assert status["oomCounts"] == {"CUDAOutOfMemory": 1}
