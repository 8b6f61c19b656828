"""The colocated loop on two GPUs of one host: FSDP2 sharded over NCCL, one engine per rank.

Runs on nvidia-h200-x2 through the device tool; on a machine with fewer GPUs it is skipped
with that reason (the gpu layer only).
"""

from __future__ import annotations

import pytest
import torch

from rljob.api import WakeUp, parse_manifest
from rljob.report import Stage
from rljob_worker.driver.local import run_local
from rljob_worker.stages import stage_order

RANKS = 2
ITERATIONS = 2

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < RANKS, reason=f"needs {RANKS} GPUs on one host"
)


def test_two_ranks_on_nccl_run_staged_iterations_with_a_memory_report_per_rank() -> None:
    _, spec = parse_manifest(
        {
            "apiVersion": "rljob.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "two-gpus"},
            "spec": {
                "model": {"path": "builtin:tiny-qwen2", "dtype": "bfloat16"},
                "algorithm": {"groupSize": 4, "iterations": ITERATIONS, "learningRate": 1e-4},
                "data": {"trainBatchSize": 4, "maxResponseLength": 16},
                "rollout": {"engine": "torch", "wakeUp": "staged", "memFractionStatic": 0.5},
                "resources": {"gpusPerWorker": RANKS},
            },
        }
    )
    run = run_local(spec, RANKS, "cuda", verify_weights=True)
    assert run.ok, (run.errors, run.ooms)

    assert isinstance(spec.rollout.wake_up, WakeUp)  # not Auto: the manifest names it
    staged = [str(s) for s in stage_order(spec.rollout.wake_up)]
    for iteration in range(1, ITERATIONS + 1):
        items = [i for i in run.iterations if i.iteration == iteration]
        assert sorted(i.rank for i in items) == [0, 1]
        for item in items:
            assert list(item.stages) == staged
            assert item.weights is not None and not item.weights.mismatched
        # FSDP gathers the same full tensors on every rank: the engines hold identical weights.
        assert items[0].weights is not None and items[1].weights is not None
        assert items[0].weights.engine == items[1].weights.engine

    latest = run.reports[-1]
    for rank in range(RANKS):
        own = [s for s in latest.samples if s.rank == rank]
        assert {s.stage for s in own} == set(Stage) - {Stage.CHECKPOINT}  # no spec.checkpoint
        assert all(s.kind == "cuda" and s.device_total_bytes > 0 for s in own)
        for s in own:
            print(
                f"rank {rank} {s.stage:<18} peak {s.device_peak_used_bytes / 2**30:6.2f} GiB "
                f"of {s.device_total_bytes / 2**30:.2f} GiB on {s.device} ({s.seconds:.3f}s)"
            )
