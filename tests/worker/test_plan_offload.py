"""Plan-driven offload on the CPU loop (issue 19): 2 ranks, FSDP2 on gloo, >= 2 iterations.

spec.offload Auto offloads only what the memory plan says the KV pool needs (on CPU the plan
runs against spec.memoryPlan.gpuMemory); Always keeps the flags' behaviour; onMisfit Reject
fails before any engine starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.model_cache import fresh_model_cache

from rljob.api import RLJobSpec, parse_manifest
from rljob.report import Stage
from rljob_worker.driver.local import LocalRun, run_local

pytestmark = pytest.mark.worker

RANKS = 2
ITERATIONS = 2


def _spec(**spec: Any) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "plan-offload"},
        "spec": {
            "model": {"path": "builtin:tiny-qwen2", "dtype": "bfloat16"},
            "algorithm": {"groupSize": 2, "iterations": ITERATIONS, "klCoef": 0.05},
            "data": {"trainBatchSize": 4, "maxResponseLength": 6},
            "rollout": {"engine": "torch", "memFractionStatic": 0.5},
            "training": {"microBatchSize": 2},
            "resources": {"workers": 1, "gpusPerWorker": 0, "cpuRanksPerWorker": RANKS},
            **spec,
        },
    }
    return parse_manifest(doc)[1]


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from fresh_model_cache(tmp_path_factory)


def _offloads(run: LocalRun) -> set[tuple[bool | None, bool | None]]:
    return {(i.offload_optimizer, i.offload_params) for i in run.iterations}


def _train_iterations(run: LocalRun) -> set[int]:
    return {s.iteration for s in run.samples if s.stage == Stage.TRAIN}


def test_auto_offloads_nothing_where_the_plan_fits_without_and_always_offloads_both() -> None:
    # 80 GiB holds the tiny model's training state under a 0.5 KV pool: Auto moves nothing.
    auto = run_local(_spec(offload="Auto", memoryPlan={"gpuMemory": "80Gi"}), RANKS, "cpu")
    assert auto.ok, auto.errors
    assert _train_iterations(auto) == set(range(1, ITERATIONS + 1))
    assert _offloads(auto) == {(False, False)}
    # Rank 0's plan rides on iteration 0's report (status.plan, before iteration 1).
    plans = [i.plan for i in auto.iterations if i.plan is not None]
    assert [(i.rank, i.iteration) for i in auto.iterations if i.plan is not None] == [(0, 0)]
    assert plans[0].fits and plans[0].capacity_bytes == 80 << 30
    assert not plans[0].offload_optimizer and not plans[0].offload_params
    assert [str(s.name) for s in plans[0].stages][:2] == ["train", "offload_optimizer"]

    always = run_local(_spec(offload="Always", memoryPlan={"gpuMemory": "80Gi"}), RANKS, "cpu")
    assert always.ok, always.errors
    assert _train_iterations(always) == set(range(1, ITERATIONS + 1))
    assert _offloads(always) == {(True, True)}


def test_reject_fails_before_the_engine_starts() -> None:
    run = run_local(
        _spec(memoryPlan={"gpuMemory": "1Gi", "onMisfit": "Reject"}), RANKS, "cpu", grace_seconds=5
    )
    assert not run.ok and not run.samples  # no stage ran
    assert any("spec.memoryPlan.onMisfit=Reject" in e for e in run.errors.values()), run.errors
