"""`rljob run` with rollout Auto on the builtin model (issue 35), CPU: 2 ranks on gloo, 2
iterations. On CPU Auto plans against spec.memoryPlan.gpuMemory (else the host's memory): it
picks, records the choice in status.plan, runs it, and a retry after an OOM raises the margin."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from rljob.api import AUTO, WakeUp
from rljob.report import Stage
from rljob_worker.stages import stage_order

pytestmark = pytest.mark.worker

REPO = Path(__file__).parents[2]


def _run_tiny_with_an_oom(
    tmp_path: Path, rollout: Mapping[str, object], gpu_memory: str, inject: str | None
) -> dict:
    """`rljob run` of examples/tiny-local.yaml on 2 ranks with these rollout knobs,
    spec.memoryPlan.gpuMemory, one OOM retry allowed and `inject` on the first attempt (None:
    no OOM); exit status 0 asserted; the status.json it wrote."""
    from rljob_worker.cli_run import main

    doc = yaml.safe_load((REPO / "examples" / "tiny-local.yaml").read_text())
    doc["spec"]["rollout"].update(rollout)
    doc["spec"]["memoryPlan"] = {"gpuMemory": gpu_memory}
    doc["spec"]["oomPolicy"] = {"maxRetries": 1}
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    argv = [str(manifest), "--out", str(out), "--ranks", "2"]
    assert main([*argv, "--inject-oom", inject] if inject else argv) == 0
    return json.loads((out / "status.json").read_text())


def test_rljob_run_with_auto_picks_records_runs_and_retries_with_a_larger_margin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollout = {"memFractionStatic": AUTO, "wakeUp": AUTO}
    status = _run_tiny_with_an_oom(tmp_path, rollout, "80Gi", "wake_kv_cache@rank=1@iteration=1")
    assert status["phase"] == "Succeeded"
    plan = status["plan"]
    auto = plan["auto"]
    # Planned on the declared card, with the default margin raised once by the retry.
    assert plan["capacityBytes"] == 80 << 30
    assert auto["margin"] > 0.015 and auto["limitBytes"] == int((80 << 30) * (1 - auto["margin"]))
    assert auto["planned"] == 2 * 99
    chosen = [
        c
        for c in auto["candidates"]
        if (c["wakeUp"], c["memFractionStatic"]) == (plan["wakeUp"], plan["memFractionStatic"])
    ]
    assert chosen and chosen[0]["fits"]
    # The tiny model's KV pool fits whole at any fraction: staged, at the lowest fraction that
    # gives the largest pool (ties go to the lower fraction).
    assert plan["wakeUp"] == "staged"
    # The ranks ran the choice: staged's stages, every iteration.
    assert [s["name"] for s in status["memory"]["stages"]] == [
        str(s) for s in stage_order(WakeUp.STAGED)
    ]  # no spec.checkpoint: no checkpoint stage
    first, second = status["attempts"]
    assert (first["memFractionStatic"], first["wakeUp"], first["margin"]) == (AUTO, AUTO, 0.015)
    assert (first["result"], first["oomStage"]) == ("CUDAOutOfMemory", str(Stage.WAKE_KV_CACHE))
    assert second["margin"] == auto["margin"] and second["result"] == "Succeeded"
    assert second["changed"].startswith(f"memoryPlan.margin 0.015 -> {auto['margin']}: ")
    printed = capsys.readouterr().out
    assert "rollout Auto chose wakeUp staged" in printed


def test_a_retry_plans_on_the_capacity_the_ranks_measured_and_says_the_spec_is_off(
    tmp_path: Path,
) -> None:
    """Issue 31: spec.memoryPlan.gpuMemory says a card 4x the size of what the ranks measure
    (on CPU: the host's memory); after an injected OOM the retry is planned on the measured
    capacity, and the attempt's message says how far off the spec was."""
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rollout = {"memFractionStatic": 0.9, "wakeUp": "staged"}
    status = _run_tiny_with_an_oom(
        tmp_path, rollout, str(4 * host), "wake_kv_cache@rank=0@iteration=1"
    )
    measured = status["memory"]["capacityBytes"]
    assert abs(measured - host) / host < 0.01  # the ranks measured this machine
    first, second = status["attempts"]
    assert first["result"] == "CUDAOutOfMemory" and second["result"] == "Succeeded"
    assert second["memFractionStatic"] < 0.9  # the policy stepped the fraction down
    assert f"planned on the card the ranks measured, {measured} bytes" in first["message"]
    assert f"spec.memoryPlan.gpuMemory={4 * host} is 75% off" in first["message"]


def test_rljob_run_with_the_bucket_auto_runs_the_bucket_the_plan_chose(tmp_path: Path) -> None:
    """weightSyncBucketMegabytes Auto beside a fixed mode and fraction: the driver resolves it
    with the plan (the tiny model is smaller than the smallest bucket Auto takes, so 512) and
    the ranks' weight syncs run with it, every iteration."""
    rollout = {"memFractionStatic": 0.5, "wakeUp": "staged", "weightSyncBucketMegabytes": AUTO}
    status = _run_tiny_with_an_oom(tmp_path, rollout, "80Gi", None)
    assert status["phase"] == "Succeeded"
    auto = status["plan"]["auto"]
    assert auto["weightSyncBucketMegabytes"] == 512
    assert "weight-sync bucket 512 MiB" in auto["reason"]
    assert (status["plan"]["wakeUp"], status["plan"]["memFractionStatic"]) == ("staged", 0.5)
    assert [a["result"] for a in status["attempts"]] == ["Succeeded"]
    assert status["iteration"] == 2
