"""Nothing stuck in silence (issue 17), against the real apiserver with the operator as a process:
a child the apiserver refuses fails the RLJob with its message, a transient refusal is retried and
said so, what KubeRay, the scheduler and the kubelet report about the job's pods reaches the RLJob
(PodsReady, one aggregated Event per cause), and the startup deadline fails a job that never runs.

The plane has no scheduler and no kubelet: their writes are played by
`write_unschedulable_as_scheduler_would` and `write_pod_waiting_as_kubelet_would` (rljob_helpers).
KubeRay is real where a test takes the `kuberay` fixture.
"""

from __future__ import annotations

import io
import time
from contextlib import redirect_stdout
from typing import Any

import test_operator
from kubernetes import client
from rljob_helpers import (
    CPU_SPEC,
    Operator,
    admin_kubeconfig,
    deny_in_namespace,
    pod_labels,
    wait_for,
    write_pod_waiting_as_kubelet_would,
    write_unschedulable_as_scheduler_would,
)
from test_operator import (  # helpers of the operator tests
    condition,
    create,
    get,
    status_of,
    write_rayjob_status_as_kuberay_would,
)

from rljob import kubectl_plugin

# The operator tests' fixtures (module scope: one operator process for this module too).
admin = test_operator.admin
operator = test_operator.operator


def warning_events(admin: client.ApiClient, namespace: str, name: str) -> list[Any]:
    events = client.CoreV1Api(admin).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=RLJob"
    )
    return [e for e in events.items if e.type == "Warning"]


def reasons(admin: client.ApiClient, namespace: str, name: str) -> list[str]:
    return [str(e.reason) for e in warning_events(admin, namespace, name)]


def job_pods(admin: client.ApiClient, namespace: str, job: str) -> list[str]:
    pods = client.CoreV1Api(admin).list_namespaced_pod(
        namespace, label_selector=f"rljob.dev/job={job}"
    )
    return sorted(str(p.metadata.name) for p in pods.items if p.metadata)


def test_a_refused_rayjob_fails_the_rljob_quoting_the_apiserver(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    policy = deny_in_namespace(plane, namespace, "rayjobs", "Invalid")  # HTTP 422
    create(admin, namespace, "refused", CPU_SPEC)
    wait_for(
        "phase Failed", lambda: status_of(admin, namespace, "refused").get("phase") == "Failed"
    )
    failed = condition(admin, namespace, "refused", "Failed")
    assert failed["status"] == "True" and failed["reason"] == "RayJobRefused"
    assert "HTTP 422" in failed["message"] and policy in failed["message"], failed
    assert get(admin, namespace, "rayjobs", "refused") is None
    assert wait_for(
        "RayJobRefused Warning", lambda: "RayJobRefused" in reasons(admin, namespace, "refused")
    )
    shown = plane.kubectl("get", "rlj", "refused", "-n", namespace).stdout
    assert "Failed" in shown and "RayJobRefused" in shown, shown


def test_a_transient_refusal_is_retried_and_the_rljob_says_so(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    policy = deny_in_namespace(plane, namespace, "rayjobs", "Forbidden")  # HTTP 403
    create(admin, namespace, "retried", CPU_SPEC)
    retrying = wait_for(
        "SpecApplied=False ApplyRetrying",
        lambda: (
            condition(admin, namespace, "retried", "SpecApplied").get("reason") == "ApplyRetrying"
            and condition(admin, namespace, "retried", "SpecApplied")
        ),
    )
    assert "HTTP 403" in retrying["message"] and "retrying in" in retrying["message"]
    assert status_of(admin, namespace, "retried").get("phase") != "Failed"
    plane.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy)
    wait_for("RayJob after the retry", lambda: get(admin, namespace, "rayjobs", "retried"), 60)
    wait_for(
        "SpecApplied=True",
        lambda: condition(admin, namespace, "retried", "SpecApplied").get("status") == "True",
    )
    assert condition(admin, namespace, "retried", "Created")["status"] == "True"


def test_pods_kuberay_cannot_create_show_as_pods_ready_and_one_event(
    kuberay: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """Issue 17's missing PriorityClass: the apiserver refuses the head pod, in a loop."""
    spec = {**CPU_SPEC, "resources": {**CPU_SPEC["resources"], "priorityClassName": "no-such"}}
    create(admin, namespace, "noprio", spec)
    pods_ready = wait_for(
        "PodsReady=False FailedCreateHeadPod",
        lambda: (
            condition(admin, namespace, "noprio", "PodsReady").get("reason")
            == "FailedCreateHeadPod"
            and condition(admin, namespace, "noprio", "PodsReady")
        ),
        timeout=90,
    )
    assert pods_ready["status"] == "False"
    assert "raycluster/noprio-" in pods_ready["message"] and "no-such" in pods_ready["message"]
    assert "FailedCreateHeadPod" in status_of(admin, namespace, "noprio")["cause"]
    wait_for("the Event", lambda: "FailedCreateHeadPod" in reasons(admin, namespace, "noprio"))
    # KubeRay keeps failing (its requeue loop); the cause stays one Event.
    wait_for(
        "KubeRay to fail again",
        lambda: (
            len([e for e in client.CoreV1Api(admin).list_namespaced_event(namespace).items
                 if e.reason == "FailedToCreateHeadPod"]) >= 2
            or sum(int(e.count or 1) for e in client.CoreV1Api(admin).list_namespaced_event(
                namespace).items if e.reason == "FailedToCreateHeadPod") >= 2
        ),
        timeout=60,
    )  # fmt: skip
    assert reasons(admin, namespace, "noprio").count("FailedCreateHeadPod") == 1


def test_image_pull_and_unschedulable_pods_reach_the_rljob_once_each(
    kuberay: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "pull", CPU_SPEC)
    pods = wait_for("KubeRay's head and worker pods", lambda: (
        p if len(p := job_pods(admin, namespace, "pull")) == 2 else None), timeout=90)  # fmt: skip
    head = next(p for p in pods if "head" in p)
    worker = next(p for p in pods if p != head)
    core = client.CoreV1Api(admin)
    # The kubelet alternates ErrImagePull and ImagePullBackOff while the pull keeps failing.
    for reason in ("ErrImagePull", "ImagePullBackOff", "ErrImagePull", "ImagePullBackOff"):
        write_pod_waiting_as_kubelet_would(
            core, namespace, head, reason, 'Back-off pulling image "ghcr.io/rljob/worker:0.1.0"'
        )
    write_unschedulable_as_scheduler_would(
        core, namespace, worker, "0/3 nodes are available: 3 Insufficient cpu."
    )
    ready = wait_for(
        "PodsReady names the head pod",
        lambda: (c := condition(admin, namespace, "pull", "PodsReady")).get("reason")
        == "ImagePullBackOff" and "Unschedulable" in c.get("message", "") and c,
    )  # fmt: skip
    assert ready["status"] == "False"
    assert f"pod/{head}" in ready["message"] and f"pod/{worker}" in ready["message"]
    wait_for(
        "one Event per cause",
        lambda: {"ImagePullBackOff", "Unschedulable"} <= set(reasons(admin, namespace, "pull")),
    )
    write_pod_waiting_as_kubelet_would(core, namespace, head, "ErrImagePull", "pull failed")
    write_unschedulable_as_scheduler_would(core, namespace, worker, "0/3 nodes: still no cpu")
    wait_for(
        "the operator saw the repeats",
        lambda: "still no cpu" in condition(admin, namespace, "pull", "PodsReady")["message"],
    )
    assert sorted(reasons(admin, namespace, "pull")) == ["ImagePullBackOff", "Unschedulable"]


def test_the_startup_deadline_fails_the_job_with_its_last_cause_and_suspends_it(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "late", {**CPU_SPEC, "startupTimeoutSeconds": 5})
    wait_for("RayJob late", lambda: get(admin, namespace, "rayjobs", "late"))
    write_rayjob_status_as_kuberay_would(admin, namespace, "late", "", "Initializing")
    # A head pod as KubeRay would create it, left unplaced as the scheduler would report.
    core = client.CoreV1Api(admin)
    pod: Any = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "late-head", "labels": pod_labels(admin, namespace, "late")},
        "spec": {"containers": [{"name": "ray-head", "image": "ghcr.io/rljob/worker:0.1.0"}]},
    }  # fmt: skip
    core.create_namespaced_pod(namespace, pod)
    write_unschedulable_as_scheduler_would(core, namespace, "late-head", "0/1 nodes: no GPU")
    failed = wait_for(
        "Failed StartupTimeout",
        lambda: (c := condition(admin, namespace, "late", "Failed")).get("reason")
        == "StartupTimeout" and c,
        timeout=40,
    )  # fmt: skip
    assert status_of(admin, namespace, "late")["phase"] == "Failed"
    assert "Unschedulable" in failed["message"] and "late-head" in failed["message"]
    rayjob = get(admin, namespace, "rayjobs", "late") or {}
    assert rayjob["spec"]["suspend"] is True  # KubeRay deletes the pods (docs/status-and-events.md)
    wait_for(
        "StartupTimeout Warning", lambda: "StartupTimeout" in reasons(admin, namespace, "late")
    )
    # KubeRay reports the suspension; the job stays Failed, not Suspended.
    write_rayjob_status_as_kuberay_would(admin, namespace, "late", "", "Suspended")
    wait_for(
        "the suspension mirrored",
        lambda: condition(admin, namespace, "late", "Suspended").get("status") == "True",
    )
    assert status_of(admin, namespace, "late")["phase"] == "Failed"
    out = io.StringIO()
    with redirect_stdout(out):
        code = kubectl_plugin.main(
            ["--kubeconfig", str(admin_kubeconfig(plane)), "describe", "late", "-n", namespace]
        )
    assert code == 0
    first = out.getvalue().splitlines()[0]
    assert first.startswith("Failed") and "StartupTimeout" in first, out.getvalue()


def test_a_causes_event_counts_on_across_an_operator_restart(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """The Event of a cause counts the pods it hit, and a restarted operator (which lists every
    pod again) neither counts a pod twice nor starts again from the pods still there."""
    create(admin, namespace, "recount", CPU_SPEC)
    wait_for("RayJob recount", lambda: get(admin, namespace, "rayjobs", "recount"))
    core = client.CoreV1Api(admin)

    def failing_worker(pod: str) -> None:
        body: Any = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "labels": pod_labels(admin, namespace, "recount")},
            "spec": {"containers": [{"name": "ray-worker", "image": "ghcr.io/rljob/none:0"}]},
        }  # fmt: skip
        core.create_namespaced_pod(namespace, body)
        write_pod_waiting_as_kubelet_would(core, namespace, pod, "ErrImagePull", "not found")

    def pull_event() -> Any:
        found = [e for e in warning_events(admin, namespace, "recount")
                 if e.reason == "ImagePullBackOff"]  # fmt: skip
        assert len(found) <= 1, [e.message for e in found]
        return found[0] if found else None

    failing_worker("recount-w-0")
    failing_worker("recount-w-1")
    wait_for("the Event counts 2", lambda: (e := pull_event()) is not None and e.count == 2)
    # KubeRay replaces a worker pod: w-0 goes (counted, no longer listed at the next start).
    core.delete_namespaced_pod("recount-w-0", namespace, grace_period_seconds=0)
    wait_for("w-0 gone", lambda: "recount-w-0" not in job_pods(admin, namespace, "recount"))
    offset = len(operator.log.read_text())
    operator.stop()
    operator.start()
    marker = f"reconciled RLJob {namespace}/recount"
    wait_for("operator resumed the RLJob", lambda: marker in operator.log.read_text()[offset:])
    time.sleep(3.0)  # the pods listed at start are handled by now
    assert pull_event().count == 2  # w-1 again: counted already (the old code wrote 1 here)
    failing_worker("recount-w-2")
    event = wait_for("the Event counts 3", lambda: (e := pull_event()).count == 3 and e)
    assert "(3 objects)" in event.message
