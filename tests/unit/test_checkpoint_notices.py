"""The operator's checkpoint Events (notices.py) and the attempt's resumedFrom (attempts.py):
pure functions of status, so a re-read or a restart posts nothing twice."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from rljob_operator import attempts, notices
from rljob_operator.status import checkpoint_failure, startup_deadline

CHECKPOINT = {
    "iteration": 2, "path": "/c/iteration-00000002", "completedAt": "2026-11-26T05:00:00Z",
    "bytes": 3 * 2**20, "seconds": 0.25,
}  # fmt: skip
RESUMED = {"iteration": 1, "path": "/c/iteration-00000001", "attempt": 2}
FAILURE = {"iteration": 3, "path": "/c/iteration-00000003", "rank": 1, "attempt": 2,
           "error": "[Errno 30] Read-only file system: '/c/iteration-00000003'"}  # fmt: skip


def test_each_news_is_pending_until_announced_then_never_again() -> None:
    status: dict[str, Any] = {"checkpoint": CHECKPOINT, "resumedFrom": RESUMED,
                              "export": {"path": "/e", "iteration": 2},
                              "checkpointFailure": FAILURE}  # fmt: skip
    news = notices.pending(status)
    assert [(n.reason, n.type) for n in news] == [
        ("ResumedFromCheckpoint", "Normal"), ("CheckpointWritten", "Normal"),
        ("ExportWritten", "Normal"), ("CheckpointFailed", "Warning"),
    ]  # fmt: skip
    assert news[0].message == (
        "attempt 2 resumed from the checkpoint of iteration 1 (/c/iteration-00000001)"
    )
    assert news[1].message == (
        "checkpoint of iteration 2 complete in /c/iteration-00000002 (3.0 MiB, 0.25 s)"
    )
    assert "failed on rank 1: [Errno 30] Read-only file system" in news[3].message
    status["announced"] = notices.announced_after(status, news)
    assert notices.pending(status) == []
    # A newer checkpoint is news again; the rest stays announced.
    status["checkpoint"] = {**CHECKPOINT, "iteration": 3, "completedAt": "2026-11-26T05:01:00Z"}
    assert [n.reason for n in notices.pending(status)] == ["CheckpointWritten"]


def test_no_news_writes_no_announced_map() -> None:
    assert notices.pending({"iteration": 4}) == []
    assert notices.announced_after({"iteration": 4}, []) == {}


def test_resumed_from_goes_to_the_attempt_whose_driver_resumed() -> None:
    listed = [{"attempt": 1, "result": "CUDAOutOfMemory"}, {"attempt": 2, "result": "Running"}]
    out = attempts.with_resume(listed, {"resumedFrom": RESUMED})
    assert "resumedFrom" not in out[0]
    assert out[1]["resumedFrom"] == {"iteration": 1, "path": "/c/iteration-00000001"}
    # A later resume of the same attempt (suspend and resume) replaces it.
    later = {**RESUMED, "iteration": 5, "path": "/c/iteration-00000005"}
    assert attempts.with_resume(out, {"resumedFrom": later})[1]["resumedFrom"]["iteration"] == 5
    assert attempts.with_resume(listed, {}) == listed


def test_a_checkpoint_failure_counts_only_for_its_own_attempt() -> None:
    assert checkpoint_failure({"checkpointFailure": FAILURE}, 2) is not None
    assert checkpoint_failure({"checkpointFailure": FAILURE}, 3) is None
    assert checkpoint_failure({}, 1) is None


@pytest.mark.parametrize(
    ("limit", "failed", "job_status", "deployment", "expected"),
    [
        (0, 0, "FAILED", "Running", attempts.FAILED),  # no backoffLimit: failed at once
        (1, 0, "FAILED", "Running", attempts.RUNNING),  # KubeRay waits for the submitter
        (1, 1, "FAILED", "Retrying", attempts.RUNNING),
        (1, 1, "", "New", attempts.RUNNING),  # the new Ray cluster's run
        (1, 1, "FAILED", "Running", attempts.FAILED),  # the retry failed too: none left
        (1, 0, "FAILED", "Failed", attempts.FAILED),  # KubeRay's final word
        (1, 1, "SUCCEEDED", "Complete", attempts.SUCCEEDED),
    ],
)
def test_a_ray_job_kuberay_will_run_again_is_not_failed(
    limit: int, failed: int, job_status: str, deployment: str, expected: str
) -> None:
    rayjob = {
        "spec": {"backoffLimit": limit},
        "status": {"jobStatus": job_status, "jobDeploymentStatus": deployment, "failed": failed},
    }
    assert attempts.ended(rayjob) == expected


def test_the_startup_clock_starts_again_when_a_job_that_ran_stops_running() -> None:
    """KubeRay's retry (spec.backoffLimit): the new Ray cluster gets the whole startup timeout
    from when the job stopped running, not from the RLJob's creation."""
    job: dict[str, Any] = {
        "metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"startupTimeoutSeconds": 60},
        "status": {"phase": "Starting", "conditions": [
            {"type": "Running", "status": "False", "lastTransitionTime": "2026-01-01T00:20:00Z"}]},
    }  # fmt: skip
    assert startup_deadline(job) == datetime.datetime(2026, 1, 1, 0, 21, tzinfo=datetime.UTC)


def test_a_large_checkpoints_size_reads_in_gib() -> None:
    """A 7B job's checkpoint (91 GB, fp32 weights and Adam's two moments) in the Event: GiB,
    not 86784.0 MiB."""
    big = {**CHECKPOINT, "bytes": 91 * 10**9, "seconds": 48.0}
    [news] = notices.pending({"checkpoint": big})
    assert news.message.endswith("(84.75 GiB, 48.00 s)"), news.message
