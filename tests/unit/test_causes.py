"""Unit tests of causes.py (pods and RayClusters in, one-line causes out; the per-job book and
its Event aggregation) and of the status they become (PodsReady, standing failures, deadline)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from rljob.api import RLJobSpec
from rljob_operator.causes import (
    SOURCES_KEPT,
    CauseBook,
    counted,
    event_message,
    event_name,
    ordered,
    pod_causes,
    raycluster_causes,
)
from rljob_operator.status import ApplyFailure, Observed, compute, startup_deadline, timed_out

T0 = "2026-01-01T00:00:00Z"
SPEC = RLJobSpec.model_validate({})


def pod(status: dict[str, Any], name: str = "j-head") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def waiting(reason: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "ray-head",
        "restartCount": 3,
        "state": {"waiting": {"reason": reason}},
        **extra,
    }


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (
            {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": "0/3 nodes"}]},
            "Unschedulable",
        ),
        ({"containerStatuses": [waiting("ErrImagePull")]}, "ImagePullBackOff"),
        ({"containerStatuses": [waiting("ImagePullBackOff")]}, "ImagePullBackOff"),
        ({"containerStatuses": [waiting("InvalidImageName")]}, "InvalidImageName"),
        (
            {"containerStatuses": [waiting(
                "CrashLoopBackOff", lastState={"terminated": {"exitCode": 2, "reason": "Error"}})]},
            "CrashLoopBackOff",
        ),
        (
            {"containerStatuses": [{"name": "ray-head", "state": {
                "terminated": {"exitCode": 1, "reason": "Error", "message": "no module ray"}}}]},
            "ContainerFailed",
        ),
        ({"phase": "Failed", "reason": "DeadlineExceeded"}, "DeadlineExceeded"),
    ],
)  # fmt: skip
def test_pod_status_becomes_one_named_cause(status: dict[str, Any], reason: str) -> None:
    (cause,) = pod_causes(pod(status))
    assert cause.reason == reason
    assert cause.source == "pod/j-head"
    assert cause.line.startswith(f"{reason} on pod/j-head")


@pytest.mark.parametrize(
    "status",
    [
        {},
        {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]},
        {"containerStatuses": [{"name": "c", "state": {"waiting": {"reason": "ContainerCreating"}}}]},
        {"containerStatuses": [{"name": "c", "state": {"terminated": {"exitCode": 0}}}]},
        {"containerStatuses": [{"name": "c", "state": {
            "terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]},
    ],
)  # fmt: skip
def test_healthy_starting_finished_or_oomkilled_pods_have_no_cause(status: dict[str, Any]) -> None:
    assert pod_causes(pod(status)) == []


def test_kuberay_replica_failure_is_a_cause_and_its_absence_none() -> None:
    failing = {
        "metadata": {"name": "j-abc"},
        "status": {"conditions": [{"type": "ReplicaFailure", "status": "True",
                                   "reason": "FailedCreateHeadPod", "message": "forbidden"}]},
    }  # fmt: skip
    (cause,) = raycluster_causes(failing)
    assert (cause.reason, cause.source) == ("FailedCreateHeadPod", "raycluster/j-abc")
    assert raycluster_causes({"metadata": {"name": "j-abc"}, "status": {}}) == []


def test_the_book_announces_each_cause_once_and_counts_the_objects_it_hit() -> None:
    book = CauseBook()
    assert book.current("ns", "j", "u1") is None
    pull = pod_causes(pod({"containerStatuses": [waiting("ErrImagePull")]}, "w-0"))
    assert book.observe("ns", "j", "u1", "pod/w-0", pull)
    assert not book.observe("ns", "j", "u1", "pod/w-0", pull)  # the same again: no change
    (first,) = book.unannounced("ns", "j", "u1")
    assert (first.cause.reason, first.sources) == ("ImagePullBackOff", ("pod/w-0",))
    again = pod_causes(pod({"containerStatuses": [waiting("ImagePullBackOff")]}, "w-0"))
    book.observe("ns", "j", "u1", "pod/w-0", again)
    assert book.unannounced("ns", "j", "u1") == []  # the kubelet's flapping is one cause
    book.observe(
        "ns",
        "j",
        "u1",
        "pod/w-1",
        pod_causes(pod({"containerStatuses": [waiting("ErrImagePull")]}, "w-1")),
    )
    (second,) = book.unannounced("ns", "j", "u1")
    assert second.sources == ("pod/w-1",) and event_name("j", "u1", second.cause.key) == event_name(
        "j", "u1", first.cause.key
    )
    assert book.observe("ns", "j", "u1", "pod/w-0", [])
    assert [c.source for c in book.current("ns", "j", "u1") or []] == ["pod/w-1"]
    book.forget("ns", "j", "u1")
    assert book.current("ns", "j", "u1") is None


def rayjob(deployment: str = "Initializing") -> dict[str, Any]:
    return {"metadata": {"name": "j"}, "status": {"jobDeploymentStatus": deployment}}


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_pods_ready_names_the_most_telling_cause_and_the_cause_column_follows() -> None:
    causes = pod_causes(pod({"conditions": [{"type": "PodScheduled", "status": "False",
                                            "reason": "Unschedulable"}],
                            "containerStatuses": [waiting("ImagePullBackOff")]}))  # fmt: skip
    status, transitions = compute(Observed(1, SPEC, SPEC, rayjob(), causes=ordered(causes)), T0)
    ready = conditions(status)["PodsReady"]
    assert (ready["status"], ready["reason"]) == ("False", "ImagePullBackOff")
    assert "Unschedulable" in ready["message"]
    assert status["phase"] == "Starting" and status["cause"].startswith("ImagePullBackOff")
    assert not [t for t in transitions if t.type == "PodsReady"]  # causes have their own Events


def test_a_refused_child_fails_the_job_and_stands_until_a_reconcile_applies() -> None:
    refused = ApplyFailure("RayJob", "j", "HTTP 422: denied by policy")
    status, transitions = compute(Observed(2, SPEC, SPEC, None, apply_failure=refused), T0)
    failed = conditions(status)["Failed"]
    assert (status["phase"], failed["reason"]) == ("Failed", "RayJobRefused")
    assert "HTTP 422: denied by policy" in failed["message"]
    assert [t.event_type for t in transitions if t.type == "Failed"] == ["Warning"]
    later = Observed(2, SPEC, SPEC, None, previous_conditions=status["conditions"])
    assert compute(later, T0)[0]["phase"] == "Failed"  # a RayJob event does not undo it
    fixed = Observed(2, SPEC, SPEC, rayjob(), previous_conditions=status["conditions"],
                     reconciled=True)  # fmt: skip
    assert compute(fixed, T0)[0]["phase"] == "Starting"


def test_a_transient_failure_says_it_retries_and_does_not_fail() -> None:
    retry = ApplyFailure("RayJob", "j", "HTTP 503: etcd", retry_in_seconds=20)
    status, _ = compute(Observed(1, SPEC, SPEC, None, apply_failure=retry), T0)
    applied = conditions(status)["SpecApplied"]
    assert (applied["status"], applied["reason"]) == ("False", "ApplyRetrying")
    assert "retrying in 20s" in applied["message"] and status["phase"] == "Pending"


def test_startup_timeout_fails_with_the_last_cause_and_stays_failed() -> None:
    causes = pod_causes(pod({"containerStatuses": [waiting("ImagePullBackOff")]}))
    first, _ = compute(Observed(1, SPEC, SPEC, rayjob(), causes=causes), T0)
    expired = Observed(1, SPEC, SPEC, rayjob(), previous_conditions=first["conditions"],
                       causes=causes, startup_expired=True)  # fmt: skip
    status, transitions = compute(expired, T0)
    failed = conditions(status)["Failed"]
    assert (status["phase"], failed["reason"]) == ("Failed", "StartupTimeout")
    assert "last cause: ImagePullBackOff on pod/j-head" in failed["message"]
    assert "StartupTimeout" in [t.reason for t in transitions]
    assert timed_out(status)
    suspended = Observed(
        1, SPEC, SPEC, rayjob("Suspended"), previous_conditions=status["conditions"]
    )
    assert compute(suspended, T0)[0]["phase"] == "Failed"


@pytest.mark.parametrize("deployment", ["Suspending", "Suspended"])
def test_a_timed_out_job_is_suspended_for_its_startup_timeout_not_by_its_user(
    deployment: str,
) -> None:
    """The operator suspends the RayJob of a job that did not start in time: Suspended says
    StartupTimeout (and its Event with it), while a suspend the user asked for stays theirs."""
    expired, _ = compute(Observed(1, SPEC, SPEC, rayjob(), startup_expired=True), T0)
    status, transitions = compute(
        Observed(1, SPEC, SPEC, rayjob(deployment), previous_conditions=expired["conditions"]), T0
    )
    suspended = conditions(status)["Suspended"]
    assert (suspended["status"], suspended["reason"]) == ("True", "StartupTimeout")
    assert "did not start" in suspended["message"]
    assert [t.reason for t in transitions if t.type == "Suspended"] == ["StartupTimeout"]
    by_user = SPEC.model_copy(update={"suspend": True})
    status, _ = compute(Observed(1, by_user, by_user, rayjob(deployment)), T0)
    assert conditions(status)["Suspended"]["reason"] == "SuspendedByUser"


def test_the_deadline_runs_from_creation_or_resume_and_stops_once_running() -> None:
    job: dict[str, Any] = {
        "metadata": {"creationTimestamp": T0},
        "spec": {"startupTimeoutSeconds": 60},
        "status": {"phase": "Starting", "conditions": [
            {"type": "Suspended", "status": "False", "lastTransitionTime": "2026-01-01T00:10:00Z"}]},
    }  # fmt: skip
    assert startup_deadline(job) == datetime.datetime(2026, 1, 1, 0, 11, tzinfo=datetime.UTC)
    job["status"]["phase"] = "Running"
    assert startup_deadline(job) is None


def test_a_job_applied_again_under_its_name_gets_events_of_its_own() -> None:
    """Same name, new object (new uid): a new Event, not the old object's count bumped (which
    `kubectl describe rljob`, matching the uid, would not show)."""
    assert event_name("j", "uid-1", "ImagePullBackOff/worker") != event_name(
        "j", "uid-2", "ImagePullBackOff/worker"
    )
    assert event_name("j", "uid-1", "k").startswith("j.cause.")


def test_a_retracted_announcement_is_announced_again() -> None:
    book = CauseBook()
    book.observe(
        "ns",
        "j",
        "u1",
        "pod/w-0",
        pod_causes(pod({"containerStatuses": [waiting("ErrImagePull")]}, "w-0")),
    )
    (news,) = book.unannounced("ns", "j", "u1")
    book.retract("ns", "j", "u1", news)  # the Event was not written (apiserver trouble)
    assert book.unannounced("ns", "j", "u1") == [news]
    assert book.unannounced("ns", "j", "u1") == []


def test_an_events_count_goes_on_from_the_sources_it_counted() -> None:
    assert counted(None, 0, ("pod/a", "pod/b")) == (2, ["pod/a", "pod/b"])
    # A restarted operator sees pod/a and pod/b again: counted already, nothing to write.
    assert counted(["pod/a", "pod/b"], 2, ("pod/b", "pod/a")) is None
    # Then pod/c: the count goes on from the Event's, not from this process's two.
    assert counted(["pod/a", "pod/b"], 2, ("pod/a", "pod/b", "pod/c")) == (
        3, ["pod/a", "pod/b", "pod/c"])  # fmt: skip
    # An Event from before the annotation keeps its count and counts every source as new.
    assert counted([], 5, ("pod/a",)) == (6, ["pod/a"])
    many = tuple(f"pod/w-{i}" for i in range(SOURCES_KEPT + 10))
    count, listed = counted(None, 0, many) or (0, [])
    assert count == SOURCES_KEPT + 10 and listed == list(many[-SOURCES_KEPT:])
    # A process passes each source once (CauseBook): past SOURCES_KEPT a new one still adds 1.
    assert counted(listed, count, ("pod/new",)) == (count + 1, [*listed[1:], "pod/new"])
    assert event_message("pull failed", 1) == "pull failed"
    assert event_message("pull failed", 3) == "pull failed (3 objects)"
