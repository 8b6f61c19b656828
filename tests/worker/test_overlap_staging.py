"""spec.training.overlapStaging on the CPU (2 ranks, FSDP2 on gloo, the builtin tiny model,
torch engine, offload Always): the overlapped order against the synchronous one.

On the CPU every copy is done where it starts, so the overlapped order runs with synchronous
copies: the weights after every update and the rewards must be the same bit for bit, and each
rank's record of the copies (staging.Staging) must be the order written out below. The two runs
are shared by the tests (module fixture).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.model_cache import fresh_model_cache

from rljob.api import RLJobSpec, parse_manifest
from rljob_worker.driver.local import LocalRun, run_local

pytestmark = pytest.mark.worker

RANKS = 2
ITERATIONS = 2


def _spec(overlap: str) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "overlap"},
        "spec": {
            # float32: the weights the engine is sent are the master weights bit for bit.
            "model": {"path": "builtin:tiny-qwen2", "dtype": "float32"},
            "algorithm": {
                "name": "grpo",
                "groupSize": 2,
                "iterations": ITERATIONS,
                "learningRate": 1e-2,  # the weights visibly move between iterations
                "klCoef": 0.05,
            },
            "data": {"source": "builtin:arithmetic", "trainBatchSize": 4, "maxResponseLength": 6},
            "rollout": {"engine": "torch", "wakeUp": "staged", "weightSyncBucketMegabytes": 1},
            "training": {"microBatchSize": 1, "overlapStaging": overlap},
            "offload": "Always",
            "resources": {"workers": 1, "gpusPerWorker": 0},
        },
    }
    return parse_manifest(doc)[1]


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from fresh_model_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def runs() -> dict[str, LocalRun]:
    return {
        overlap: run_local(_spec(overlap), RANKS, "cpu", verify_weights=True)
        for overlap in ("On", "Off")
    }


def test_overlap_on_and_off_give_the_same_weights_and_rewards(runs: dict[str, LocalRun]) -> None:
    on, off = runs["On"], runs["Off"]
    assert on.ok and off.ok, (on.errors, off.errors)

    def by_key(run: LocalRun) -> dict[tuple[int, int], object]:
        return {(i.rank, i.iteration): i for i in run.iterations}

    ours, theirs = by_key(on), by_key(off)
    assert (
        sorted(ours)
        == sorted(theirs)
        == [(rank, iteration) for rank in range(RANKS) for iteration in range(ITERATIONS + 1)]
    )
    for key, report in ours.items():
        other = theirs[key]
        assert report.weights is not None and other.weights is not None  # type: ignore[attr-defined]
        assert report.weights.sent == other.weights.sent, key  # type: ignore[attr-defined]
        assert report.reward_sum == other.reward_sum, key  # type: ignore[attr-defined]
        assert report.loss == other.loss, key  # type: ignore[attr-defined]
    # The weights moved: iteration 2's update sends other weights than iteration 1's.
    first, last = ours[(0, 1)], ours[(0, ITERATIONS)]
    assert first.weights.sent != last.weights.sent  # type: ignore[attr-defined]


# Iteration 0 is the prologue (no moments yet); iteration 1's train makes the moments (nothing
# to bring back); from iteration 2 on the steady order.
PARAMS_OUT = ["offload_train: start params to host", "offload_train: wait params to host"]
OVERLAPPED = {
    0: [*PARAMS_OUT, "sleep: start params to device", "sleep: wait params to device"],
    1: [
        "offload_optimizer: start optimizer to host",  # runs behind the weight sync
        "offload_train: wait optimizer to host",  # the host waits, then frees the moments
        *PARAMS_OUT,
        "sleep: start params to device",  # the device waits, the host releases the weights
        "sleep: wait params to device",
    ],
    2: [
        "train: start optimizer to device",  # behind the first micro-batches
        "train: wait optimizer to device before optimizer.step()",
        "offload_optimizer: start optimizer to host",
        "offload_train: wait optimizer to host",
        *PARAMS_OUT,
        "sleep: start params to device",
        "sleep: wait params to device",
    ],
}
SYNCHRONOUS_STEADY = [
    "offload_optimizer: start optimizer to host",
    "offload_optimizer: wait optimizer to host",
    *PARAMS_OUT,
    "sleep: start params to device",
    "sleep: wait params to device",
    "sleep: start optimizer to device",
    "sleep: wait optimizer to device",
]
SYNCHRONOUS = {0: OVERLAPPED[0], 1: SYNCHRONOUS_STEADY, 2: SYNCHRONOUS_STEADY}


@pytest.mark.parametrize(("overlap", "expected"), [("On", OVERLAPPED), ("Off", SYNCHRONOUS)])
def test_each_copy_starts_and_is_waited_for_where_the_order_says(
    runs: dict[str, LocalRun], overlap: str, expected: dict[int, list[str]]
) -> None:
    run = runs[overlap]
    assert run.ok, run.errors
    for report in run.iterations:
        assert list(report.staging) == expected[report.iteration], (report.rank, report.iteration)
