"""spec.training.overlapStaging on one GPU (marker gpu): the copies really run on a side stream.

The builtin tiny model in float32 (the weights the engine is sent are the master weights), FSDP2
on NCCL, the torch engine, offload Always, 2 iterations: Off twice (the GPU run is reproducible
at all; where it is not, the comparison below could not tell) and On once, which must give the
same weights after every update and the same rewards, with its copies recorded in the
overlapped order (tests/worker/test_overlap_staging.py has the order written out).
"""

from __future__ import annotations

import pytest

from rljob.api import RLJobSpec, parse_manifest
from rljob_worker.driver.local import LocalRun, run_local

pytestmark = pytest.mark.gpu

ITERATIONS = 2


def _spec(overlap: str) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": f"overlap-{overlap.lower()}"},
        "spec": {
            "model": {"path": "builtin:tiny-qwen2", "dtype": "float32"},
            "algorithm": {"groupSize": 4, "iterations": ITERATIONS, "learningRate": 1e-3},
            "data": {"trainBatchSize": 4, "maxResponseLength": 16},
            "rollout": {"engine": "torch", "wakeUp": "staged", "memFractionStatic": 0.5},
            "training": {"microBatchSize": 2, "overlapStaging": overlap},
            "offload": "Always",
            "resources": {"gpusPerWorker": 1},
        },
    }
    return parse_manifest(doc)[1]


def _outcome(run: LocalRun) -> dict[int, tuple[object, float]]:
    assert run.ok, run.errors
    return {
        i.iteration: (i.weights.sent if i.weights else None, i.reward_sum) for i in run.iterations
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, LocalRun]:
    return {
        name: run_local(_spec(name.split("-")[0]), 1, "cuda", verify_weights=True)
        for name in ("Off", "Off-again", "On")
    }


def test_overlap_on_gives_the_weights_and_rewards_of_off_bit_for_bit(
    runs: dict[str, LocalRun],
) -> None:
    off = _outcome(runs["Off"])
    assert _outcome(runs["Off-again"]) == off, "the GPU run is not reproducible by itself"
    assert _outcome(runs["On"]) == off
    assert off[1][0] != off[ITERATIONS][0]  # the updates moved the weights


def test_on_runs_the_overlapped_order_on_the_side_stream(runs: dict[str, LocalRun]) -> None:
    last = next(i for i in runs["On"].iterations if i.iteration == ITERATIONS)
    assert last.staging[:3] == (
        "train: start optimizer to device",
        "train: wait optimizer to device before optimizer.step()",
        "offload_optimizer: start optimizer to host",
    )
    assert "sleep: start params to device" in last.staging
