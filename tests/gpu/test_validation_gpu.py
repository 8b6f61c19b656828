"""spec.data.validation and the learning-rate schedule with the real `sglang.Engine` on one GPU
(marker gpu): the held-out prompts are answered greedily inside the staged rollout stage, before
the engine's release, and the scheduled rates reach the optimizer.

The update is switched off (learning rate 1e-12: Adam's steps are below float32's spacing at
the weights' size, as tests/worker/test_learns.py does it), so every validation sees the same
weights: greedy answers must then be the same at every validated iteration. A sampled decode, or
a validation that read the radix cache of the one before, would show as a difference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.sglang_gpu import builtin_model_copy, sglang_gpu_missing

from rljob.api import parse_manifest
from rljob.report import Stage

if (missing := sglang_gpu_missing()) is not None:
    pytest.skip(missing, allow_module_level=True)

from rljob_worker.driver.local import run_local

ITERATIONS = 3
PROMPTS = 12


def test_greedy_validation_on_sglang_repeats_on_frozen_weights_and_the_rates_follow_the_schedule(
    tmp_path: Path,
) -> None:
    model = builtin_model_copy(tmp_path / "tiny-qwen2")
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "validation-sglang"},
        "spec": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "algorithm": {"groupSize": 4, "iterations": ITERATIONS, "learningRate": 1.0e-12,
                          "learningRateSchedule": "Cosine", "warmupIterations": 1,
                          "minLearningRateRatio": 0.1, "clipRatioHigh": 0.28},
            "data": {"source": "builtin:arithmetic", "trainBatchSize": 4, "maxResponseLength": 16,
                     "validation": {"source": "builtin:arithmetic", "everyIterations": 2,
                                    "maxPrompts": PROMPTS}},
            "rollout": {"engine": "sglang", "wakeUp": "staged", "memFractionStatic": 0.3},
            "resources": {"gpusPerWorker": 1},
        },
    }  # fmt: skip
    spec = parse_manifest(doc)[1]
    run = run_local(spec, 1, "cuda", verify_weights=True)
    assert run.ok, run.errors
    reports = run.reports
    assert [r.iteration for r in reports] == list(range(ITERATIONS + 1))

    validated = {r.iteration: r.validation for r in reports if r.validation is not None}
    assert sorted(validated) == [0, 2, 3]  # iteration 0, every 2nd, the last
    answers = set()
    for iteration, figures in validated.items():
        assert figures is not None and figures.prompts == PROMPTS, iteration
        assert figures.reward_mean is not None and 0.0 <= figures.reward_mean <= 1.0
        assert figures.response_length_mean is not None and 0 < figures.response_length_mean <= 16
        answers.add((figures.reward_mean, figures.correct_share, figures.response_length_mean,
                     figures.truncated_share))  # fmt: skip
    assert len(answers) == 1, validated  # greedy on the same weights: the same answers

    for report in reports[1:]:
        assert report.learning_rate == pytest.approx(
            spec.algorithm.learning_rate_at(report.iteration), rel=1e-9
        ), report.iteration
        stages = [s.stage for s in report.samples]
        assert stages == [Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER, Stage.WAKE_WEIGHTS,
                          Stage.OFFLOAD_TRAIN, Stage.WAKE_KV_CACHE, Stage.ROLLOUT, Stage.SLEEP]  # fmt: skip
    print("\n" + "\n".join(
        f"iteration {r.iteration}: lr {r.learning_rate}, reward {r.reward_mean}, validation {r.validation}"
        for r in reports
    ))  # fmt: skip
