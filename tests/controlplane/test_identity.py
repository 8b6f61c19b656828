"""A job is its uid (issue 28), against the real apiserver (and its garbage collector) with the
operator as a process: an RLJob deleted and applied again under its name starts clean while
the old one's RayJob is still held by a finalizer, nothing of the old children reaches it (a
RayJob that still says Succeeded, an old pod's OOMKilled, the old driver's status write), and
the OOM policy matches OOMs to attempts by number and retries with the knob that failed.

Stand-ins, named: `write_rayjob_status_as_kuberay_would` (KubeRay's status), a finalizer the
test holds on the old RayJob (KubeRay's own, which it removes once the cluster is torn down),
pods created by the test with the labels KubeRay copies from the RayJob's template, the
kubelet's OOMKilled (`write_pod_status_as_kubelet_would`), and the driver's CUDA OOM record
(`publish_oom_as_driver_would`, the driver's own publisher with the job's token).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import test_operator
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rljob_helpers import Operator, pod_labels, wait_for
from test_oom_retry import (
    CPU_SPEC,
    fail_attempt,
    job_config,
    job_token,
    publish_oom_as_driver_would,
)
from test_operator import condition, create, custom, get, status_of
from test_operator import write_rayjob_status_as_kuberay_would as kuberay_writes
from test_telemetry import write_pod_status_as_kubelet_would

from rljob.api import GROUP, PLURAL, VERSION, RLJobStatus
from rljob.report import Stage
from rljob_worker.publish import JobGone, StatusPublisher

admin = test_operator.admin
operator = test_operator.operator

# test_oom_retry's CPU job (one rank, the tiny model) with the OOM policy on.
SPEC: dict[str, Any] = {**CPU_SPEC, "oomPolicy": {"maxRetries": 2}}
HOLD = "test.rljob.dev/held-like-kuberay"


def uid_of(admin: client.ApiClient, namespace: str, name: str) -> str:
    return str((get(admin, namespace, PLURAL, name) or {})["metadata"]["uid"])


def hold(admin: client.ApiClient, namespace: str, rayjob: str) -> None:
    """A finalizer on the RayJob, as KubeRay keeps one until it has torn the cluster down."""
    custom(admin).patch_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", rayjob, {"metadata": {"finalizers": [HOLD]}}
    )


def release(admin: client.ApiClient, namespace: str, rayjob: str) -> None:
    custom(admin).patch_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", rayjob, {"metadata": {"finalizers": None}}
    )


def pod(admin: client.ApiClient, namespace: str, job: str, name: str) -> None:
    """A worker pod of the job's current incarnation, labelled as KubeRay labels it."""
    body: Any = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": pod_labels(admin, namespace, job)},
        "spec": {"containers": [{"name": "ray-worker", "image": "rljob/worker:test",
                                 "resources": {"limits": {"memory": "1Gi", "cpu": "1"}}}]},
    }  # fmt: skip
    client.CoreV1Api(admin).create_namespaced_pod(namespace, body)


def delete_rljob(admin: client.ApiClient, namespace: str, name: str) -> None:
    """`kubectl delete rljob NAME`: background propagation, the garbage collector takes the rest."""
    custom(admin).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background"
    )
    wait_for(f"RLJob {name} gone", lambda: get(admin, namespace, PLURAL, name) is None)


@pytest.mark.parametrize(
    ("old_end", "new_end", "held_seconds", "max_retries"),
    [
        (("SUCCEEDED", "Complete", "Succeeded"), ("FAILED", "Failed", "Failed"), 20.0, 2),
        # OOM policy off: the old run fails with its OOM (on, the policy would retry it).
        (("FAILED", "Failed", "Failed"), ("SUCCEEDED", "Complete", "Succeeded"), 3.0, 0),
    ],
    ids=["succeeded-then-failed-held-20s", "failed-then-succeeded"],
)
def test_a_job_deleted_and_applied_again_runs_anew_and_keeps_nothing_of_the_old_run(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str,
    old_end: tuple[str, str, str], new_end: tuple[str, str, str], held_seconds: float,
    max_retries: int,
) -> None:  # fmt: skip
    name, spec = "again", {**SPEC, "oomPolicy": {"maxRetries": max_retries}}
    create(admin, namespace, name, spec)
    old_uid = uid_of(admin, namespace, name)
    old_rayjob = wait_for("the first RayJob", lambda: get(admin, namespace, "rayjobs", name))
    hold(admin, namespace, name)
    pod(admin, namespace, name, "again-old-worker")
    token = job_token(plane, admin, namespace, name)
    # The old run: a CUDA OOM in its status (the policy records its attempt), then its end.
    publish_oom_as_driver_would(token, namespace, name, old_rayjob, Stage.ROLLOUT)
    kuberay_writes(admin, namespace, name, old_end[0], old_end[1])
    wait_for(f"phase {old_end[2]}", lambda: status_of(admin, namespace, name).get("phase")
             == old_end[2])  # fmt: skip
    assert status_of(admin, namespace, name).get("oomEvents")

    delete_rljob(admin, namespace, name)
    wait_for(
        "the old RayJob terminating",
        lambda: (get(admin, namespace, "rayjobs", name) or {})["metadata"].get("deletionTimestamp"),
    )
    create(admin, namespace, name, spec)
    new_uid = uid_of(admin, namespace, name)
    assert new_uid != old_uid
    # What the old children do meanwhile: KubeRay writes the held RayJob's status (its outcome,
    # a change, so a MODIFIED event), the old pod is OOMKilled, the old driver writes status.
    custom(admin).patch_namespaced_custom_object_status(
        "ray.io", "v1", namespace, "rayjobs", name,
        {"status": {"jobStatus": old_end[0], "jobDeploymentStatus": old_end[1],
                    "message": "tearing the Ray cluster down"}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    write_pod_status_as_kubelet_would(admin, namespace, "again-old-worker", restarts=0)
    old_driver = StatusPublisher.from_env_or_kubeconfig(
        namespace, name, str(token), uid=old_uid, attempt=1
    )
    with pytest.raises((JobGone, ApiException)):
        old_driver.publish(RLJobStatus(iteration=7))

    def waiting() -> dict[str, Any] | None:
        created = condition(admin, namespace, name, "Created")
        return created if "waiting for it to be deleted" in created.get("message", "") else None

    assert old_uid in wait_for("the new job waiting for the old RayJob", waiting)["message"]
    deadline = time.monotonic() + held_seconds
    while time.monotonic() < deadline:  # held: the new job must neither end nor adopt it
        current = status_of(admin, namespace, name)
        assert current.get("phase") in (None, "Pending"), current
        assert not current.get("oomEvents") and not current.get("oomCounts"), current
        # The new job's own attempt 1 (the policy is on), not yet started: nothing of the old.
        assert [(a["attempt"], a["result"], a.get("startedAt")) for a in
                current.get("attempts") or []] in ([], [(1, "Running", None)]), current  # fmt: skip
        assert current.get("iteration") is None, current
        time.sleep(1.0)
    assert (get(admin, namespace, "rayjobs", name) or {})["metadata"]["ownerReferences"][0][
        "uid"
    ] == old_uid

    release(admin, namespace, name)
    rayjob = wait_for(
        "the new RayJob",
        lambda: (
            (r := get(admin, namespace, "rayjobs", name))
            and r["metadata"]["ownerReferences"][0]["uid"] == new_uid
            and r
        ),
    )
    assert rayjob["metadata"]["labels"]["rljob.dev/job-uid"] == new_uid
    assert job_config(admin, namespace, name).uid == new_uid
    started = wait_for(
        "the new RayJob mirrored",
        lambda: (s := status_of(admin, namespace, name)).get("rayJob") and s,
    )
    if max_retries:
        (attempt,) = started["attempts"]
        assert attempt["startedAt"] == rayjob["metadata"]["creationTimestamp"]
        assert (attempt["attempt"], attempt["result"]) == (1, "Running")
    assert not started.get("oomEvents") and not started.get("oomCounts")
    assert started.get("iteration") is None
    # The new job's own pod is heard (the same path that ignored the old one).
    pod(admin, namespace, name, "again-new-worker")
    write_pod_status_as_kubelet_would(admin, namespace, "again-new-worker", restarts=0)
    killed = wait_for(
        "the new pod's OOMKilled",
        lambda: (s := status_of(admin, namespace, name)).get("oomEvents") and s["oomEvents"],
    )
    assert [e["pod"] for e in killed] == ["again-new-worker"] and killed[0]["attempt"] == 1
    kuberay_writes(admin, namespace, name, new_end[0], new_end[1])
    wait_for(f"phase {new_end[2]}", lambda: status_of(admin, namespace, name).get("phase")
             == new_end[2])  # fmt: skip


def test_oom_retries_change_the_knob_of_the_stage_that_failed_whatever_the_drivers_clock(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """Attempt 1 runs out of memory in train: the engine is released there, so attempt 2 runs
    with half the micro-batch; attempt 2 runs out in wake_kv_cache, reported by a driver whose
    clock is 30 s behind (its OOM looks older than attempt 2's RayJob): attempt 3 runs with a
    lower memFractionStatic."""
    create(admin, namespace, "knobs", SPEC)
    token = job_token(plane, admin, namespace, "knobs")
    fail_attempt(admin, token, namespace, "knobs", "knobs", stage=Stage.TRAIN, skew_seconds=30)
    wait_for("RayJob knobs-a2", lambda: get(admin, namespace, "rayjobs", "knobs-a2"))
    second = job_config(admin, namespace, "knobs")
    assert second.attempt == 2 and second.effective_spec.training.micro_batch_size == 1
    assert second.effective_spec.rollout.mem_fraction_static == 0.85
    fail_attempt(admin, token, namespace, "knobs", "knobs-a2", skew_seconds=-30)
    wait_for("RayJob knobs-a3", lambda: get(admin, namespace, "rayjobs", "knobs-a3"))
    third = job_config(admin, namespace, "knobs").effective_spec
    assert (third.training.micro_batch_size, third.rollout.mem_fraction_static) == (1, 0.8)
    one, two, three = wait_for(
        "three attempts",
        lambda: len(a := status_of(admin, namespace, "knobs").get("attempts") or []) == 3 and a,
    )
    assert (one["result"], one["oomStage"]) == ("CUDAOutOfMemory", "train")
    assert two["changed"] == "training.microBatchSize 2 -> 1" and two["microBatchSize"] == 1
    assert (two["result"], two["oomStage"]) == ("CUDAOutOfMemory", "wake_kv_cache")
    assert three["changed"] == "rollout.memFractionStatic 0.85 -> 0.8"
    assert (three["memFractionStatic"], three["microBatchSize"]) == (0.8, 1)
    ooms = status_of(admin, namespace, "knobs")["oomEvents"]
    assert sorted(e["attempt"] for e in ooms) == [1, 2]
