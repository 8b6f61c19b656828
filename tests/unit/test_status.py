"""Unit tests of status computation: RayJob states (as KubeRay reports them) to phase and
conditions, transitions for Events, refused updates, and the derived printer-column fields."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.api import RLJobSpec
from rljob_operator.status import (
    FAILED,
    PODS_READY,
    REASON_INVALID_SPEC,
    REASON_UPDATE_REFUSED,
    RUNNING,
    SPEC_APPLIED,
    SUCCEEDED,
    SUSPENDED,
    Observed,
    applied_after_update,
    compute,
    differs,
    refused_fields,
)

SPEC = RLJobSpec.model_validate({})
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def rayjob(job_status: str = "", deployment: str = "", **extra: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "j"},
        "status": {"jobStatus": job_status, "jobDeploymentStatus": deployment, **extra},
    }


def observe(rj: dict[str, Any] | None, spec: RLJobSpec = SPEC, **kw: Any) -> Observed:
    return Observed(generation=3, spec=spec, applied_spec=spec, rayjob=rj, **kw)


def by_type(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


@pytest.mark.parametrize(
    ("rj", "phase", "true_conditions"),
    [
        (None, "Pending", {SPEC_APPLIED}),
        (rayjob(), "Pending", {"Created", SPEC_APPLIED}),
        (rayjob("", "Initializing"), "Starting", {"Created", SPEC_APPLIED}),
        (rayjob("PENDING", "Running"), "Starting", {"Created", SPEC_APPLIED}),
        (
            rayjob("RUNNING", "Running"),
            "Running",
            {"Created", PODS_READY, RUNNING, SPEC_APPLIED},
        ),
        (
            rayjob("SUCCEEDED", "Complete"),
            "Succeeded",
            {"Created", PODS_READY, SUCCEEDED, SPEC_APPLIED},
        ),
        (rayjob("FAILED", "Failed"), "Failed", {"Created", FAILED, SPEC_APPLIED}),
        (rayjob("STOPPED", "Failed"), "Failed", {"Created", FAILED, SPEC_APPLIED}),
        # KubeRay 1.6 follows a stopped Ray job to Complete (`ray job logs --follow` exits 0)
        (rayjob("STOPPED", "Complete"), "Failed", {"Created", FAILED, SPEC_APPLIED}),
        (rayjob("", "ValidationFailed"), "Failed", {"Created", FAILED, SPEC_APPLIED}),
        (rayjob("", "Suspended"), "Suspended", {"Created", SUSPENDED, SPEC_APPLIED}),
        (rayjob("RUNNING", "Suspending"), "Suspended", {"Created", SUSPENDED, SPEC_APPLIED}),
    ],
)
def test_rayjob_state_maps_to_phase_and_conditions(
    rj: dict[str, Any] | None, phase: str, true_conditions: set[str]
) -> None:
    status, _ = compute(observe(rj), T0)
    assert status["phase"] == phase
    assert {c["type"] for c in status["conditions"] if c["status"] == "True"} == true_conditions
    assert status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])


def test_rayjob_block_mirrors_kuberay_fields() -> None:
    status, _ = compute(observe(rayjob("RUNNING", "Running")), T0)
    assert status["rayJob"] == {
        "name": "j",
        "jobStatus": "RUNNING",
        "jobDeploymentStatus": "Running",
    }


def test_failure_message_comes_from_kuberay() -> None:
    status, transitions = compute(
        observe(rayjob("FAILED", "Failed", message="driver exited 1")), T0
    )
    assert by_type(status)[FAILED]["message"] == "driver exited 1"
    (failed,) = [t for t in transitions if t.type == FAILED]
    assert failed.event_type == "Warning"


# KubeRay's message for a failed Ray job is Ray's: the exit code, then the job log's tail, whose
# last line is the driver's (rljob_worker/driver/ray_main.py).
RAY_TAIL = (
    "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 "
    "chars):\n2026-01-01 00:00:00,000 INFO rljob_worker.driver: iteration 3\n"
    '  File "/opt/rljob/train.py", line 88, in step\nRuntimeError: boom\n'
)
WHY = "rank 1 (node n-1) failed in stage train of iteration 3: RuntimeError: boom"


@pytest.mark.parametrize(
    ("message", "failed_message"),
    [
        (RAY_TAIL + f"rljob driver: RLJob j failed: {WHY}\n", WHY),
        (RAY_TAIL + f"rljob driver: RLJob j failed: {WHY}\r\n\n", WHY),
        (
            RAY_TAIL + "rljob driver: RLJob j failed: the driver: RayActorError: queue died\n",
            "the driver: RayActorError: queue died",
        ),
        ("driver exited 1", "driver exited 1"),  # no driver line: KubeRay's as it is
    ],
    ids=["driver-line", "crlf", "the-driver-raised", "no-driver-line"],
)
def test_the_failed_message_is_the_drivers_why_not_rays_log_tail(
    message: str, failed_message: str
) -> None:
    status, _ = compute(observe(rayjob("FAILED", "Failed", message=message)), T0)
    assert by_type(status)[FAILED]["message"] == failed_message
    assert status["cause"] == f"RayJobFailed: {failed_message}"


@pytest.mark.parametrize(
    "message",
    [
        "Job entrypoint command failed with exit code 1, last available logs:\n"
        'Traceback (most recent call last):\n  File "x.py", line 3\nRuntimeError: boom',
        "exit code 1\r\n\n\tRuntimeError: " + "y" * 300,
    ],
)
def test_the_cause_column_is_one_line_however_the_message_breaks(message: str) -> None:
    status, _ = compute(observe(rayjob("FAILED", "Failed", message=message)), T0)
    cause = status["cause"]
    assert cause.splitlines() == [cause] and "  " not in cause and "\t" not in cause
    assert cause.startswith(f"RayJobFailed: {message.split()[0]} ") and len(cause) <= 120


def test_transition_time_moves_only_when_status_changes() -> None:
    first, _ = compute(observe(rayjob("PENDING", "Running")), T0)
    again, transitions = compute(
        observe(rayjob("PENDING", "Running"), previous_conditions=first["conditions"]), T1
    )
    assert transitions == []
    assert again == first
    running, transitions = compute(
        observe(rayjob("RUNNING", "Running"), previous_conditions=first["conditions"]), T1
    )
    assert [(t.type, t.status) for t in transitions] == [(RUNNING, "True")]
    assert by_type(running)[RUNNING]["lastTransitionTime"] == T1
    assert by_type(running)["Created"]["lastTransitionTime"] == T0


def test_invalid_spec_fails_naming_the_field() -> None:
    obs = Observed(
        generation=1,
        spec=SPEC,
        applied_spec=None,
        rayjob=None,
        problems=[("metadata.name", "must be at most 47 characters")],
    )
    status, transitions = compute(obs, T0)
    assert status["phase"] == "Failed"
    assert by_type(status)[FAILED]["reason"] == REASON_INVALID_SPEC
    assert "metadata.name" in by_type(status)[FAILED]["message"]
    assert any(t.type == FAILED and t.status == "True" for t in transitions)


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"suspend": True}, []),
        ({"ttlSecondsAfterFinished": 60}, []),
        ({"algorithm": {"learningRate": 0.5}}, ["spec.algorithm.learningRate"]),
        (
            {"suspend": True, "data": {"trainBatchSize": 64, "source": "/x.jsonl"}},
            ["spec.data.source", "spec.data.trainBatchSize"],
        ),
    ],
)
def test_only_suspend_and_ttl_apply_to_a_live_job(
    change: dict[str, Any], refused: list[str]
) -> None:
    new = RLJobSpec.model_validate(change)
    assert refused_fields(new, SPEC) == refused
    applied = applied_after_update(new, SPEC)
    assert applied.suspend == new.suspend
    assert applied.ttl_seconds_after_finished == new.ttl_seconds_after_finished
    assert refused_fields(applied, SPEC) == []


def test_refused_update_is_a_false_spec_applied_condition_naming_fields() -> None:
    new = RLJobSpec.model_validate({"algorithm": {"iterations": 50}})
    obs = Observed(generation=2, spec=new, applied_spec=SPEC, rayjob=rayjob("RUNNING", "Running"))
    status, _ = compute(obs, T0)
    applied = by_type(status)[SPEC_APPLIED]
    assert (applied["status"], applied["reason"]) == ("False", REASON_UPDATE_REFUSED)
    assert "spec.algorithm.iterations" in applied["message"]
    assert status["phase"] == "Running"


def test_printer_column_fields_derive_from_driver_fields() -> None:
    memory = {
        "stages": [
            {"name": "train", "peakFraction": 0.5},
            {"name": "rollout", "peakFraction": 0.93},
        ]
    }
    status, _ = compute(
        observe(rayjob(), memory=memory, oom_counts={"OOMKilled": 2, "CUDAOutOfMemory": 3}), T0
    )
    assert status["worstStageFraction"] == 0.93
    assert status["oomTotal"] == 5


def test_differs_ignores_fields_the_operator_does_not_own() -> None:
    computed, _ = compute(observe(rayjob("RUNNING", "Running")), T0)
    current = {**computed, "iteration": 7, "memory": {"stages": []}}
    assert not differs(current, computed)
    assert differs({**current, "phase": "Starting"}, computed)
