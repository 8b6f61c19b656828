"""The colocated loop on one GPU: staged versus single wake-up, measured (marker gpu).

A ~90M-parameter Qwen2 with the builtin tokenizer, FSDP2 on NCCL, the torch engine in real
torch_memory_saver regions; 2 iterations in each mode through the local driver.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rljob.api import RLJobSpec, WakeUp, parse_manifest
from rljob.report import IterationReport, Stage
from rljob_worker.driver.local import LocalRun, run_local
from rljob_worker.model import load_tokenizer, resolve_model_path
from rljob_worker.stages import stage_order

GiB = 2**30
ITERATIONS = 2
MEM_FRACTION_STATIC = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builtin tokenizer with a larger Qwen2, so stage memory differences are visible."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    builtin = Path(resolve_model_path("builtin:tiny-qwen2"))
    tokenizer = load_tokenizer(builtin)
    directory = tmp_path_factory.mktemp("qwen2-90m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, directory / name)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def _spec(model: Path, wake_up: WakeUp) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": f"gpu-{wake_up}"},
        "spec": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "algorithm": {"groupSize": 4, "iterations": ITERATIONS, "learningRate": 1e-4},
            "data": {"trainBatchSize": 4, "maxResponseLength": 16},
            "rollout": {
                "engine": "torch",
                "wakeUp": str(wake_up),
                "memFractionStatic": MEM_FRACTION_STATIC,
                "weightSyncBucketMegabytes": 64,
            },
            "resources": {"gpusPerWorker": 1},
        },
    }
    return parse_manifest(doc)[1]


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> dict[WakeUp, LocalRun]:
    return {
        mode: run_local(_spec(model_dir, mode), 1, "cuda", verify_weights=True) for mode in WakeUp
    }


def _latest(run: LocalRun) -> IterationReport:
    return run.reports[-1]


def _peak(report: IterationReport, stage: Stage) -> int:
    return max(s.device_peak_used_bytes for s in report.samples if s.stage == stage)


def _print_figures(runs: dict[WakeUp, LocalRun]) -> None:
    for mode, run in runs.items():
        report = _latest(run)
        first = report.samples[0]
        print(
            f"\n{mode}: {first.device}, {first.device_total_bytes / GiB:.2f} GiB, iteration {report.iteration}"
        )
        for sample in report.samples:
            print(
                f"  {sample.stage:<18} peak used {sample.device_peak_used_bytes / GiB:7.3f} GiB  "
                f"end used {sample.device_used_bytes / GiB:7.3f} GiB  "
                f"peak allocated {sample.peak_allocated_bytes / GiB:6.3f} GiB  {sample.seconds:.3f}s"
            )


def test_both_modes_run_two_iterations_with_weights_synced(runs: dict[WakeUp, LocalRun]) -> None:
    _print_figures(runs)
    for mode, run in runs.items():
        assert run.ok, (mode, run.errors, run.ooms)
        for item in run.iterations:
            assert list(item.stages) == [str(s) for s in stage_order(mode, item.iteration)]
            assert item.weights is not None and item.weights.mismatched == []
        assert all(s.kind == "cuda" for s in run.samples)


def test_released_memory_shows_up_as_free_device_memory(runs: dict[WakeUp, LocalRun]) -> None:
    for run in runs.values():
        report = _latest(run)
        used = {s.stage: s.device_used_bytes for s in report.samples}
        total = report.samples[0].device_total_bytes
        # The KV pool is about memFractionStatic of the device; sleep gives it back.
        assert used[Stage.ROLLOUT] - used[Stage.SLEEP] > (MEM_FRACTION_STATIC - 0.1) * total


def test_staged_wake_up_peaks_below_single_wake_up(runs: dict[WakeUp, LocalRun]) -> None:
    staged, single = _latest(runs[WakeUp.STAGED]), _latest(runs[WakeUp.SINGLE])
    single_peak = _peak(single, Stage.WAKE_WEIGHTS)
    assert _peak(staged, Stage.WAKE_WEIGHTS) < single_peak
    assert _peak(staged, Stage.WAKE_KV_CACHE) < single_peak
