"""The operator's per-RLJob memory in one process: no job leaves any of it behind, whichever of
its RLJob's and its children's last events comes last (issue 28), and a job applied again under
the same name sees nothing of the deleted one's children. Metrics: test_metrics.py.

The handlers run as kopf calls them, in this process; the apiserver they read and write is a
dict (`Store`, a stand-in: the control-plane layer runs the same paths on the real one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rljob.api import RLJobSpec
from rljob_operator import handlers, metrics, process_memos, render

pytestmark = pytest.mark.unit

LOG = logging.getLogger("test")
SPEC: dict[str, Any] = {
    "rollout": {"engine": "torch"},
    "resources": {"gpusPerWorker": 0, "cpuRanksPerWorker": 1},
}


class Store:
    """Stand-in for the apiserver's objects the handlers read and write, by name."""

    def __init__(self) -> None:
        self.rljobs: dict[str, dict[str, Any]] = {}
        self.rayjobs: dict[str, dict[str, Any]] = {}
        self.status_writes = 0

    def apply_status(self, ns: str, name: str, status: dict[str, Any], uid: str | None) -> None:
        job = self.rljobs[name]
        assert uid == job["metadata"]["uid"], "status written to another incarnation"
        job["status"] = status
        self.status_writes += 1


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    found = Store()
    kube = handlers.kube
    monkeypatch.setattr(kube, "get_rljob", lambda ns, name: found.rljobs.get(name))
    monkeypatch.setattr(kube, "get_rayjob", lambda ns, name: found.rayjobs.get(name))
    monkeypatch.setattr(kube, "get_config_map", lambda ns, name: None)
    monkeypatch.setattr(
        kube, "apply_status", lambda ns, name, status, uid=None: found.apply_status(
            ns, name, status, uid)
    )  # fmt: skip
    monkeypatch.setattr(kube, "post_cause_event", lambda *args: 1)
    monkeypatch.setattr(handlers.kopf, "event", lambda *args, **kwargs: None)
    yield found
    _reset()


def _reset() -> None:
    for registry in (
        process_memos.MIRRORED._seen,
        process_memos.APPLIED._held,
        process_memos.KILLS._seen,
    ):
        registry.clear()
    process_memos.CAUSES._live.clear()
    process_memos.CAUSES._announced.clear()
    metrics.JOBS._statuses.clear()


def _left() -> dict[str, int]:
    """Everything the process keeps per job, by registry (all 0: nothing left)."""
    return {
        "locks": len(process_memos.LOCKS),
        "mirrored": len(process_memos.MIRRORED._seen),
        "applied": len(process_memos.APPLIED._held),
        "causes": len(process_memos.CAUSES),
        "kills": len(process_memos.KILLS._seen),
        "metrics": len(metrics.JOBS._statuses),
    }


def _rljob(name: str, uid: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid}, "spec": SPEC}


def _rayjob(name: str, uid: str, job_status: str = "RUNNING") -> dict[str, Any]:
    owner = render.Owner(name=name, namespace="ns", uid=uid)
    meta = render.ray_job(owner, RLJobSpec.model_validate(SPEC))["metadata"]
    return {
        "metadata": {**meta, "uid": f"rayjob-{uid}", "creationTimestamp": "2026-11-26T00:00:00Z"},
        "status": {"jobStatus": job_status, "jobDeploymentStatus": "Running"},
    }


def _pod(name: str, uid: str, oom_killed: bool) -> dict[str, Any]:
    state = (
        {
            "terminated": {
                "reason": "OOMKilled",
                "exitCode": 137,
                "finishedAt": "2026-11-26T00:01:00Z",
            }
        }
        if oom_killed
        else {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}
    )
    return {
        "metadata": {
            "name": f"{name}-worker-0",
            "namespace": "ns",
            "labels": {
                render.JOB_LABEL: name,
                handlers.identity.JOB_UID_LABEL: uid,
                handlers.identity.ATTEMPT_LABEL: "1",
            },
        },
        "spec": {"containers": [{"name": "ray-worker"}]},
        "status": {
            "containerStatuses": [{"name": "ray-worker", "restartCount": 0, "state": state}]
        },
    }


def _rayjob_event(kind: str, body: dict[str, Any]) -> None:
    changed: Any = handlers.rayjob_changed  # kopf types it as its callback protocol
    labels = body["metadata"]["labels"]
    changed(type=kind, body=body, namespace="ns", labels=labels, logger=LOG)


def _pod_event(kind: str, body: dict[str, Any]) -> None:
    changed: Any = handlers.pod_changed
    meta = body["metadata"]
    changed(type=kind, body=body, name=meta["name"], namespace="ns", labels=meta["labels"],
            logger=LOG)  # fmt: skip


def _rljob_event(kind: str, body: dict[str, Any]) -> None:
    changed: Any = handlers.rljob_changed
    changed(type=kind, body=body, name=body["metadata"]["name"], namespace="ns", logger=LOG)


def _live_job(store: Store, name: str, uid: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job with a running RayJob, a pod that cannot pull its image and one OOMKilled."""
    store.rljobs[name] = _rljob(name, uid)
    rayjob = _rayjob(name, uid)
    store.rayjobs[name] = rayjob
    _rljob_event("ADDED", store.rljobs[name])
    _rayjob_event("ADDED", rayjob)
    _pod_event("MODIFIED", _pod(name, uid, oom_killed=False))
    oom = _pod(name, uid, oom_killed=True)
    oom["metadata"]["name"] += "-b"
    _pod_event("MODIFIED", oom)
    return rayjob, oom


def _children_go(rayjob: dict[str, Any], oom_pod: dict[str, Any]) -> None:
    """A job's children go: the RayJob held by KubeRay's finalizer (MODIFIED with
    deletionTimestamp), then DELETED; its pods change once more, then go."""
    terminating = {**rayjob, "metadata": {**rayjob["metadata"], "deletionTimestamp": "now"}}
    labels = rayjob["metadata"]["labels"]
    name, uid = labels[render.JOB_LABEL], labels[handlers.identity.JOB_UID_LABEL]
    _rayjob_event("MODIFIED", terminating)
    _rayjob_event("DELETED", terminating)
    _pod_event("MODIFIED", _pod(name, uid, oom_killed=False))
    _pod_event("DELETED", _pod(name, uid, oom_killed=False))
    _pod_event("DELETED", oom_pod)


@pytest.mark.parametrize("rljob_last", [False, True], ids=["rljob-first", "children-first"])
def test_a_thousand_deleted_jobs_leave_nothing_in_either_event_order(
    store: Store, rljob_last: bool
) -> None:
    for i in range(1000):
        name, uid = f"job-{i}", f"uid-{i}"
        rayjob, oom = _live_job(store, name, uid)
        assert store.rljobs[name]["status"]["phase"] == "Running"
        assert _left()["causes"] == 1 and _left()["kills"] == 1  # this job's, held while live
        rljob = store.rljobs[name]
        if rljob_last:
            _children_go(rayjob, oom)
        del store.rljobs[name], store.rayjobs[name]
        _rljob_event("DELETED", rljob)
        if not rljob_last:
            _children_go(rayjob, oom)
    assert _left() == dict.fromkeys(_left(), 0)


def test_a_job_applied_again_under_its_name_sees_nothing_of_the_deleted_ones_children(
    store: Store,
) -> None:
    old_rayjob, _ = _live_job(store, "again", "uid-old")
    old_rayjob["status"] = {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}
    _rayjob_event("MODIFIED", old_rayjob)
    assert store.rljobs["again"]["status"]["phase"] == "Succeeded"
    old = store.rljobs.pop("again")
    _rljob_event("DELETED", old)
    # Applied again while KubeRay's finalizer holds the old RayJob, which still says Succeeded.
    store.rljobs["again"] = _rljob("again", "uid-new")
    _rljob_event("ADDED", store.rljobs["again"])
    terminating = {**old_rayjob, "metadata": {**old_rayjob["metadata"], "deletionTimestamp": "t"}}
    _rayjob_event("MODIFIED", terminating)
    _rayjob_event("MODIFIED", old_rayjob)  # even one not marked deleted yet: another uid
    _pod_event("MODIFIED", _pod("again", "uid-old", oom_killed=True))
    _rayjob_event("DELETED", terminating)
    status = store.rljobs["again"].get("status") or {}
    assert status.get("phase") != "Succeeded" and not status.get("oomEvents"), status
    assert not status.get("rayJob")
    # The new job's own RayJob is mirrored.
    store.rayjobs["again"] = _rayjob("again", "uid-new")
    _rayjob_event("ADDED", store.rayjobs["again"])
    assert store.rljobs["again"]["status"]["phase"] == "Running"


def test_a_lock_lives_while_a_handler_holds_or_waits_for_it_and_is_the_same_for_all() -> None:
    held, waiting, order = threading.Event(), threading.Event(), []

    def second() -> None:
        waiting.set()
        with process_memos.LOCKS.hold("ns", "j"):
            order.append("second")

    with process_memos.LOCKS.hold("ns", "j"), process_memos.LOCKS.hold("ns", "j"):  # reentrant
        thread = threading.Thread(target=second)
        thread.start()
        waiting.wait(5)
        held.set()
        order.append("first")
        assert len(process_memos.LOCKS) == 1
    thread.join(5)
    assert order == ["first", "second"] and len(process_memos.LOCKS) == 0


def test_a_cause_that_clears_leaves_pods_ready_saying_nothing_is_wrong(store: Store) -> None:
    """The book drops a job whose last cause cleared (no state left behind); the status write of
    that change must still say the cause is gone, not keep it (a review found PodsReady kept
    ImagePullBackOff until the Ray job ran)."""
    store.rljobs["clears"] = _rljob("clears", "uid-c")
    rayjob = _rayjob("clears", "uid-c", job_status="")
    rayjob["status"]["jobDeploymentStatus"] = "Initializing"  # pods not running yet
    store.rayjobs["clears"] = rayjob
    _rayjob_event("ADDED", rayjob)
    _pod_event("MODIFIED", _pod("clears", "uid-c", oom_killed=False))

    def pods_ready() -> dict[str, Any]:
        conditions = store.rljobs["clears"]["status"]["conditions"]
        return next(c for c in conditions if c["type"] == "PodsReady")

    assert pods_ready()["reason"] == "ImagePullBackOff"
    fixed = _pod("clears", "uid-c", oom_killed=False)
    fixed["status"]["containerStatuses"][0]["state"] = {"running": {"startedAt": "t"}}
    _pod_event("MODIFIED", fixed)
    assert (
        pods_ready()["status"] == "False" and "no pod reports a problem" in pods_ready()["message"]
    )
    assert len(process_memos.CAUSES) == 0


def test_a_job_applied_again_never_runs_with_the_deleted_ones_spec(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job-config ConfigMap of a deleted RLJob of the same name (its garbage collection not
    done yet) holds that job's spec: it is not the new job's running spec. Read by name alone,
    the new job took it as its own, and where the garbage collector deleted the old ConfigMap
    between that read and the apply, the new job's ConfigMap was written with the old spec
    (then SpecApplied UpdateRefused, for good: the new ConfigMap is the new job's own)."""
    kube = handlers.kube
    old_owner = render.Owner(name="again", namespace="ns", uid="uid-old")
    old_spec = RLJobSpec.model_validate(
        {**SPEC, "resources": {**SPEC["resources"], "image": "example.com/old:1"}}
    )
    old_config = render.config_map(old_owner, old_spec)
    old_config["metadata"] |= {"uid": "cm-old", "resourceVersion": "1"}
    # The old ConfigMap is there when the handler reads the running spec, gone (garbage
    # collected) when it looks for children another job holds.
    monkeypatch.setattr(kube, "get_config_map", lambda ns, name: old_config)
    monkeypatch.setattr(kube, "get_child", lambda kind, ns, name: None)
    applied: dict[str, dict[str, Any]] = {}

    def apply(obj: dict[str, Any]) -> dict[str, Any]:
        stored = {**obj, "metadata": {**obj["metadata"], "uid": "u", "resourceVersion": "2"}}
        applied[obj["kind"]] = stored
        return stored

    monkeypatch.setattr(kube, "apply", apply)
    new_spec = {**SPEC, "resources": {**SPEC["resources"], "image": "example.com/new:2"}}
    store.rljobs["again"] = {**_rljob("again", "uid-new"), "spec": new_spec}
    reconcile: Any = handlers.reconcile
    reconcile(body=store.rljobs["again"], name="again", namespace="ns", uid="uid-new", logger=LOG)
    config = applied["ConfigMap"]["data"][handlers.render.JOB_CONFIG_FILE]
    assert "example.com/new:2" in config and "example.com/old:1" not in config
    spec_applied = next(
        c for c in store.rljobs["again"]["status"]["conditions"] if c["type"] == "SpecApplied"
    )
    assert spec_applied["status"] == "True", spec_applied


@pytest.mark.parametrize("deleting", [False, True], ids=["live", "being-deleted"])
def test_a_retry_of_a_job_being_deleted_applies_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch, deleting: bool
) -> None:
    """A retry recorded in status.attempts whose RayJob does not exist yet is applied by
    _follow_attempt; not for a job being deleted (held by kopf's finalizer while its timer
    watches it), whose new RayJob KubeRay would start a cluster for until the garbage collector
    removed it."""
    kube = handlers.kube
    monkeypatch.setattr(kube, "get_child", lambda kind, ns, name: None)
    applied: list[str] = []

    def apply(obj: dict[str, Any]) -> dict[str, Any]:
        applied.append(obj["kind"])
        return {**obj, "metadata": {**obj["metadata"], "uid": "u", "resourceVersion": "2"}}

    monkeypatch.setattr(kube, "apply", apply)
    job = _rljob("retried", "uid-r")
    retry = {"attempt": 2, "rayJob": "retried-a2", "memFractionStatic": 0.5}
    job["status"] = {"phase": "Pending", "attempts": [{"attempt": 1}, retry]}
    if deleting:
        job["metadata"]["deletionTimestamp"] = "2026-12-04T15:00:00Z"
    store.rljobs["retried"] = job
    handlers._follow_attempt("ns", "retried", LOG)
    assert ("RayJob" in applied) is not deleting, applied


def test_a_kill_whose_write_failed_is_recorded_from_the_pods_deletion(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's OOMKilled whose status write failed, and the pod then deleted with no change in
    between (a forced deletion): the DELETED event's last status still records the kill, once,
    and the process keeps nothing of the pod."""
    from kubernetes.client.exceptions import ApiException

    store.rljobs["gone"] = _rljob("gone", "uid-g")
    store.rayjobs["gone"] = _rayjob("gone", "uid-g")
    _rljob_event("ADDED", store.rljobs["gone"])
    kube = handlers.kube
    write = kube.apply_status

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ApiException(status=500, reason="etcd timeout")

    monkeypatch.setattr(kube, "apply_status", refuse)
    pod = _pod("gone", "uid-g", oom_killed=True)
    _pod_event("MODIFIED", pod)
    assert not store.rljobs["gone"].get("status", {}).get("oomEvents")
    monkeypatch.setattr(kube, "apply_status", write)
    _pod_event("DELETED", pod)
    events = store.rljobs["gone"].get("status", {}).get("oomEvents")
    assert [e["pod"] for e in events or []] == [pod["metadata"]["name"]], events
    _pod_event("DELETED", pod)  # a repeated event counts nothing twice
    assert store.rljobs["gone"]["status"]["oomEvents"] == events
    assert _left()["kills"] == 0


def _applying(monkeypatch: pytest.MonkeyPatch, store: Store, name: str, uid: str) -> list[Any]:
    """The job's ConfigMap in place (so the spec it runs with is known) and every apply
    recorded: the list of objects applied."""
    kube = handlers.kube
    owner = render.Owner(name=name, namespace="ns", uid=uid)
    config = render.config_map(owner, RLJobSpec.model_validate(SPEC))
    config["metadata"] |= {"uid": f"cm-{uid}", "resourceVersion": "1"}
    monkeypatch.setattr(kube, "get_config_map", lambda ns, n: config)
    monkeypatch.setattr(kube, "get_child", lambda kind, ns, n: None)
    applied: list[Any] = []

    def apply(obj: dict[str, Any]) -> dict[str, Any]:
        applied.append(obj)
        return {**obj, "metadata": {**obj["metadata"], "uid": "u", "resourceVersion": "2"}}

    monkeypatch.setattr(kube, "apply", apply)
    return applied


@pytest.mark.parametrize("job_status", ["RUNNING", "SUCCEEDED"])
def test_the_startup_timer_leaves_a_job_that_started_since_its_last_status_alone(
    store: Store, monkeypatch: pytest.MonkeyPatch, job_status: str
) -> None:
    """The timer's body says Starting past the deadline, but the RayJob runs (or has ended) by
    the time the timer reads it (its status write had failed, or it started just before the
    deadline): the job is not suspended nor failed for not starting; status mirrors the RayJob."""
    applied = _applying(monkeypatch, store, "late", "uid-l")
    job = _rljob("late", "uid-l")
    job["metadata"]["creationTimestamp"] = "2026-11-26T00:00:00Z"
    job["status"] = {"phase": "Starting"}
    store.rljobs["late"] = job
    rayjob = _rayjob("late", "uid-l", job_status)
    if job_status == "SUCCEEDED":
        rayjob["status"]["jobDeploymentStatus"] = "Complete"
    store.rayjobs["late"] = rayjob
    handlers._time_out(render.Owner(name="late", namespace="ns", uid="uid-l"), LOG)
    assert [o["kind"] for o in applied if (o.get("spec") or {}).get("suspend")] == []
    phase = store.rljobs["late"]["status"]["phase"]
    assert phase == ("Running" if job_status == "RUNNING" else "Succeeded"), phase


def test_the_startup_timer_suspends_a_job_still_starting_past_its_deadline(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above changes nothing for a job that is still not running."""
    applied = _applying(monkeypatch, store, "slow", "uid-s")
    job = _rljob("slow", "uid-s")
    job["metadata"]["creationTimestamp"] = "2026-11-26T00:00:00Z"
    job["status"] = {"phase": "Starting"}
    store.rljobs["slow"] = job
    rayjob = _rayjob("slow", "uid-s", "PENDING")
    rayjob["status"]["jobDeploymentStatus"] = "Initializing"
    store.rayjobs["slow"] = rayjob
    handlers._time_out(render.Owner(name="slow", namespace="ns", uid="uid-s"), LOG)
    assert [o["kind"] for o in applied if (o.get("spec") or {}).get("suspend")] == ["RayJob"]
    assert store.rljobs["slow"]["status"]["phase"] == "Failed"


def test_an_end_whose_write_failed_is_recorded_from_the_rayjobs_deletion_and_not_run_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RayJob's SUCCEEDED event's status write fails, then the RayJob is deleted (by a user,
    or by KubeRay's DELETE_RAYJOB_CR_AFTER_JOB_FINISHES): its terminating and DELETED events
    still show how it ended, and that is recorded; the operator's resume then applies no
    RayJob (the job is not run a second time). Before, both events were taken as "no RayJob":
    the job went back to Pending and a resume applied it again."""
    from kubernetes.client.exceptions import ApiException

    applied = _applying(monkeypatch, store, "done", "uid-d")
    store.rljobs["done"] = _rljob("done", "uid-d")
    running = _rayjob("done", "uid-d")
    store.rayjobs["done"] = running
    _rayjob_event("ADDED", running)
    assert store.rljobs["done"]["status"]["phase"] == "Running"
    ended = {**running, "status": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}}
    kube = handlers.kube
    write = kube.apply_status

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ApiException(status=500, reason="etcd timeout")

    monkeypatch.setattr(kube, "apply_status", refuse)
    _rayjob_event("MODIFIED", ended)
    assert store.rljobs["done"]["status"]["phase"] == "Running"  # the write failed
    monkeypatch.setattr(kube, "apply_status", write)
    terminating = {**ended, "metadata": {**ended["metadata"], "deletionTimestamp": "now"}}
    del store.rayjobs["done"]
    _rayjob_event("MODIFIED", terminating)
    _rayjob_event("DELETED", terminating)
    assert store.rljobs["done"]["status"]["phase"] == "Succeeded"
    reconcile: Any = handlers.reconcile
    reconcile(body=store.rljobs["done"], name="done", namespace="ns", uid="uid-d", logger=LOG)
    assert [o["kind"] for o in applied if o["kind"] == "RayJob"] == []
    assert store.rljobs["done"]["status"]["phase"] == "Succeeded"


def test_a_running_rayjob_deleted_leaves_its_job_pending(store: Store) -> None:
    """A RayJob deleted while its Ray job ran (not ended): its terminating event mirrors nothing
    and its DELETED event says the RayJob is gone, as before."""
    store.rljobs["cut"] = _rljob("cut", "uid-c")
    running = _rayjob("cut", "uid-c")
    store.rayjobs["cut"] = running
    _rayjob_event("ADDED", running)
    terminating = {**running, "metadata": {**running["metadata"], "deletionTimestamp": "now"}}
    _rayjob_event("MODIFIED", terminating)
    assert store.rljobs["cut"]["status"]["phase"] == "Running"
    del store.rayjobs["cut"]
    _rayjob_event("DELETED", terminating)
    assert store.rljobs["cut"]["status"]["phase"] == "Pending"


def test_an_invalid_update_of_a_live_job_is_refused_and_keeps_its_status(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running job whose spec is updated to a checkpoint path on no volume (a problem the
    handler finds, not the CRD): the update is refused (SpecApplied UpdateRefused, naming the
    field), the job stays Running with its RayJob and attempts as they were, and a later RayJob
    event is still mirrored. Before, the job went Failed (InvalidSpec) with its RayJob and
    attempts dropped from status, while its RayJob ran on."""
    _applying(monkeypatch, store, "live", "uid-v")
    job = _rljob("live", "uid-v")
    store.rljobs["live"] = job
    running = _rayjob("live", "uid-v")
    store.rayjobs["live"] = running
    _rayjob_event("ADDED", running)
    before = dict(job["status"])
    assert before["phase"] == "Running" and before["rayJob"]["name"] == "live"
    job["spec"] = {**SPEC, "checkpoint": {"path": "/nowhere/ckpt"}}
    reconcile: Any = handlers.reconcile
    reconcile(body=job, name="live", namespace="ns", uid="uid-v", logger=LOG)
    held = job["status"]
    assert held["phase"] == "Running", held
    assert held["rayJob"] == before["rayJob"]
    assert held.get("attempts") == before.get("attempts")
    spec_applied = next(c for c in held["conditions"] if c["type"] == "SpecApplied")
    assert spec_applied["status"] == "False" and spec_applied["reason"] == "UpdateRefused"
    assert "spec.checkpoint.path" in spec_applied["message"]
    # The OOM policy's step (an RLJob event, the timer) observes the job as it runs and keeps
    # the refusal: SpecApplied does not turn True for a spec that was never applied.
    handlers._follow_attempt("ns", "live", LOG)
    spec_applied = next(c for c in job["status"]["conditions"] if c["type"] == "SpecApplied")
    assert spec_applied["status"] == "False" and spec_applied["reason"] == "UpdateRefused"
    ended = {**running, "status": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}}
    store.rayjobs["live"] = ended
    _rayjob_event("MODIFIED", ended)
    assert job["status"]["phase"] == "Succeeded"


def test_a_stale_running_event_after_the_end_was_recorded_changes_nothing(
    store: Store,
) -> None:
    """The RayJob's end is recorded from a fresh read (a pod's cause changed), then the RayJob
    watch delivers its older RUNNING state: the job stays Succeeded, with no second Running and
    Succeeded transition. Before, the phase went Succeeded, Running, Succeeded."""
    store.rljobs["stale"] = _rljob("stale", "uid-t")
    running = _rayjob("stale", "uid-t")
    ended = {**running, "status": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}}
    store.rayjobs["stale"] = ended
    _pod_event("MODIFIED", _pod("stale", "uid-t", oom_killed=False))  # reads the RayJob
    assert store.rljobs["stale"]["status"]["phase"] == "Succeeded"
    writes = store.status_writes
    _rayjob_event("MODIFIED", running)
    assert store.rljobs["stale"]["status"]["phase"] == "Succeeded"
    assert store.status_writes == writes
