"""The operator as a real process (`python -m rljob_operator.main`) under its own ServiceAccount
bound to exactly the rules in rljob_operator/rbac.py, against the real apiserver.

KubeRay's status writes are played by `write_rayjob_status_as_kuberay_would` (a stand-in: the
test writes the RayJob's status subresource with the fields KubeRay sets), except in
test_real_kuberay_turns_the_rayjob_into_a_raycluster, where the real KubeRay operator runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rljob_helpers import (
    CPU_SPEC,
    Operator,
    admin_kubeconfig,
    api_client,
    grant_operator_rbac,
    install_rljob_crds,
    rljob,
    wait_for,
)

from rljob.api import GROUP, PLURAL, VERSION

SA_NAMESPACE, SA_NAME = "rljob-system", "rljob-operator"
ROLE = "rljob-operator-test"


@pytest.fixture(scope="module")
def admin(plane: Any) -> client.ApiClient:
    install_rljob_crds(plane)
    plane.install_kuberay_crds()
    return api_client(admin_kubeconfig(plane))


@pytest.fixture(scope="module")
def operator(plane: Any, admin: client.ApiClient, tmp_path_factory: Any) -> Iterator[Operator]:
    proc = Operator(
        grant_operator_rbac(plane, SA_NAMESPACE, SA_NAME, ROLE),
        tmp_path_factory.mktemp("op") / "operator.log",
    )
    proc.start()
    yield proc
    proc.stop()
    plane.kubectl("delete", "clusterrolebinding", ROLE, "clusterrole", ROLE, "--ignore-not-found")


def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def create(
    admin: client.ApiClient, namespace: str, name: str, spec: dict[str, Any]
) -> dict[str, Any]:
    body: dict[str, Any] = custom(admin).create_namespaced_custom_object(  # type: ignore[assignment]
        GROUP, VERSION, namespace, PLURAL, rljob(name, spec)
    )
    return body


def get(admin: client.ApiClient, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
    group, version = (GROUP, VERSION) if plural == PLURAL else ("ray.io", "v1")
    try:
        found: dict[str, Any] = custom(admin).get_namespaced_custom_object(  # type: ignore[assignment]
            group, version, namespace, plural, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return found


def status_of(admin: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return (get(admin, namespace, PLURAL, name) or {}).get("status") or {}


def condition(admin: client.ApiClient, namespace: str, name: str, ctype: str) -> dict[str, Any]:
    conditions = status_of(admin, namespace, name).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), {})


def phase_is(admin: client.ApiClient, namespace: str, name: str, phase: str) -> Callable[[], bool]:
    return lambda: status_of(admin, namespace, name).get("phase") == phase


def ray_items(admin: client.ApiClient, namespace: str, plural: str) -> list[dict[str, Any]]:
    found: dict[str, Any] = custom(admin).list_namespaced_custom_object(  # type: ignore[assignment]
        "ray.io", "v1", namespace, plural
    )
    return list(found["items"])


def rayjob_suspend_is(
    admin: client.ApiClient, namespace: str, name: str, suspend: bool
) -> Callable[[], bool]:
    return lambda: (get(admin, namespace, "rayjobs", name) or {})["spec"]["suspend"] is suspend


def write_rayjob_status_as_kuberay_would(
    admin: client.ApiClient, namespace: str, name: str, job_status: str, deployment: str
) -> None:
    """Stand-in for KubeRay's controller: write the RayJob status fields it owns."""
    custom(admin).patch_namespaced_custom_object_status(
        "ray.io", "v1", namespace, "rayjobs", name,
        {"status": {"jobStatus": job_status, "jobDeploymentStatus": deployment}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


def events_for(admin: client.ApiClient, namespace: str, name: str) -> set[str]:
    events = client.CoreV1Api(admin).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=RLJob"
    )
    return {str(e.reason) for e in events.items}


def test_create_makes_owned_children_with_the_rendered_shape(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    uid = create(admin, namespace, "shape", CPU_SPEC)["metadata"]["uid"]
    rayjob = wait_for("RayJob shape", lambda: get(admin, namespace, "rayjobs", "shape"))
    assert rayjob["spec"]["submissionMode"] == "K8sJobMode"
    workers = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["rayStartParams"]["num-cpus"] == "2"
    assert rayjob["metadata"]["ownerReferences"][0]["uid"] == uid
    # The Role and RoleBinding are applied after the RayJob (children.AFTER_RAYJOB); Created is
    # written once every child is, so the children are read after it.
    created = wait_for(
        "Created=True",
        lambda: condition(admin, namespace, "shape", "Created").get("status") == "True",
    )
    assert created
    core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
    for child in (
        core.read_namespaced_config_map("shape-job-config", namespace),
        core.read_namespaced_service_account("shape-job", namespace),
        rbac.read_namespaced_role("shape-job", namespace),
        rbac.read_namespaced_role_binding("shape-job", namespace),
    ):
        assert child.metadata is not None and child.metadata.owner_references
        assert child.metadata.owner_references[0].uid == uid
    assert status_of(admin, namespace, "shape")["observedGeneration"] == 1


def test_rayjob_transitions_show_in_phase_conditions_and_events(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "life", CPU_SPEC)
    wait_for("RayJob life", lambda: get(admin, namespace, "rayjobs", "life"))
    for job_status, deployment, phase in [
        ("PENDING", "Initializing", "Starting"),
        ("RUNNING", "Running", "Running"),
        ("SUCCEEDED", "Complete", "Succeeded"),
    ]:
        write_rayjob_status_as_kuberay_would(admin, namespace, "life", job_status, deployment)
        wait_for(f"phase {phase}", phase_is(admin, namespace, "life", phase))
    status = status_of(admin, namespace, "life")
    assert status["rayJob"] == {
        "name": "life",
        "jobStatus": "SUCCEEDED",
        "jobDeploymentStatus": "Complete",
    }
    assert wait_for(
        "Events",
        lambda: (
            {"RayJobCreated", "RayJobRunning", "RayJobSucceeded"}
            <= events_for(admin, namespace, "life")
        ),
    )


def test_failed_rayjob_is_a_failed_phase_and_a_warning(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "fails", CPU_SPEC)
    wait_for("RayJob fails", lambda: get(admin, namespace, "rayjobs", "fails"))
    write_rayjob_status_as_kuberay_would(admin, namespace, "fails", "FAILED", "Failed")
    wait_for("phase Failed", lambda: status_of(admin, namespace, "fails").get("phase") == "Failed")
    assert condition(admin, namespace, "fails", "Failed")["reason"] == "RayJobFailed"
    assert wait_for(
        "RayJobFailed Event", lambda: "RayJobFailed" in events_for(admin, namespace, "fails")
    )


def test_checkpoints_on_no_volume_fail_the_job_as_invalid_and_create_nothing(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """Admitted (the models also check `rljob run`'s manifests, which have no volumes), then
    refused by the operator: on the container's own filesystem a re-run starts over and the
    export goes with the pod (operator/rljob_operator/storage.py)."""
    create(admin, namespace, "novol", {**CPU_SPEC, "checkpoint": {"path": "/ckpt"}})
    wait_for("phase Failed", phase_is(admin, namespace, "novol", "Failed"))
    failed = condition(admin, namespace, "novol", "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    assert "spec.checkpoint.path: /ckpt is on no volume" in failed["message"], failed
    assert get(admin, namespace, "rayjobs", "novol") is None


def _claim(name: str, mode: str) -> client.V1PersistentVolumeClaim:
    return client.V1PersistentVolumeClaim(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PersistentVolumeClaimSpec(
            access_modes=[mode],
            resources=client.V1VolumeResourceRequirements(requests={"storage": "1Gi"}),
        ),
    )


def test_a_read_write_once_claim_on_the_jobs_pods_is_one_warning_event(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """Every pod of the job mounts every volume, and a ReadWriteOnce claim attaches to one node:
    a Warning Event names the claim (once, across reconciles); a ReadWriteMany one is quiet."""
    core = client.CoreV1Api(admin)
    core.create_namespaced_persistent_volume_claim(namespace, _claim("once", "ReadWriteOnce"))
    core.create_namespaced_persistent_volume_claim(namespace, _claim("many", "ReadWriteMany"))
    volumes = {
        "volumes": [
            {"name": "ckpt", "persistentVolumeClaim": {"claimName": "once"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "many"}},
        ],
        "volumeMounts": [
            {"name": "ckpt", "mountPath": "/ckpt"},
            {"name": "data", "mountPath": "/data"},
        ],
    }
    spec = {**CPU_SPEC, **volumes, "checkpoint": {"path": "/ckpt/run"}}
    uid = create(admin, namespace, "rwo", spec)["metadata"]["uid"]
    wait_for("RayJob rwo", lambda: get(admin, namespace, "rayjobs", "rwo"))

    def warnings() -> list[client.CoreV1Event]:
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=rwo,reason=VolumeAccessMode"
        )
        return list(events.items)

    wait_for("VolumeAccessMode Event", lambda: len(warnings()) == 1)
    (event,) = warnings()
    assert event.type == "Warning" and event.involved_object.uid == uid
    assert str(event.message).startswith(
        "persistentVolumeClaim once (volume ckpt) is ReadWriteOnce: it attaches to one node, "
        "and the job's 2 pods"
    ), event.message
    # Another reconcile (a spec change) posts nothing more.
    custom(admin).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "rwo", {"spec": {"suspend": True}}
    )
    wait_for("RayJob suspended", rayjob_suspend_is(admin, namespace, "rwo", True))
    assert len(warnings()) == 1


def test_suspend_round_trips_to_the_rayjob(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "susp", CPU_SPEC)
    wait_for("RayJob susp", lambda: get(admin, namespace, "rayjobs", "susp"))
    for suspend, deployment, phase in [
        (True, "Suspended", "Suspended"),
        (False, "Running", "Running"),
    ]:
        custom(admin).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "susp", {"spec": {"suspend": suspend}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        wait_for(f"RayJob suspend={suspend}", rayjob_suspend_is(admin, namespace, "susp", suspend))
        write_rayjob_status_as_kuberay_would(
            admin, namespace, "susp", "RUNNING" if not suspend else "", deployment
        )
        wait_for(f"phase {phase}", phase_is(admin, namespace, "susp", phase))


def test_update_that_cannot_apply_is_refused_with_condition_and_event(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "refuse", CPU_SPEC)
    before = wait_for("RayJob refuse", lambda: get(admin, namespace, "rayjobs", "refuse"))
    custom(admin).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "refuse", {"spec": {"algorithm": {"iterations": 50}}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    refused = wait_for(
        "SpecApplied=False",
        lambda: (
            condition(admin, namespace, "refuse", "SpecApplied").get("reason") == "UpdateRefused"
        ),
    )
    assert refused
    assert (
        "spec.algorithm.iterations"
        in condition(admin, namespace, "refuse", "SpecApplied")["message"]
    )
    assert wait_for(
        "UpdateRefused Event", lambda: "UpdateRefused" in events_for(admin, namespace, "refuse")
    )
    after = get(admin, namespace, "rayjobs", "refuse") or {}
    assert after["metadata"]["generation"] == before["metadata"]["generation"]


def test_a_name_kuberay_would_refuse_is_refused_at_admission(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """Issue 17: the operator used to accept it and fail it (InvalidSpec); now the CRD's root
    CEL rule refuses it at apply, naming metadata.name, and nothing is created."""
    name = "n" * 48  # KubeRay refuses RayJob names over 47 characters
    with pytest.raises(ApiException) as info:
        create(admin, namespace, name, CPU_SPEC)
    assert info.value.status == 422
    assert "metadata.name must be at most 47 characters" in str(info.value.body)
    assert get(admin, namespace, "rayjobs", name) is None


def test_delete_cascades_to_every_child(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "gone", CPU_SPEC)
    wait_for("RayJob gone", lambda: get(admin, namespace, "rayjobs", "gone"))
    custom(admin).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "gone", propagation_policy="Foreground"
    )
    core = client.CoreV1Api(admin)

    def all_gone() -> bool:
        configmaps = core.list_namespaced_config_map(
            namespace, label_selector="rljob.dev/job=gone"
        ).items
        accounts = core.list_namespaced_service_account(
            namespace, label_selector="rljob.dev/job=gone"
        ).items
        return get(admin, namespace, "rayjobs", "gone") is None and not configmaps and not accounts

    assert wait_for("children garbage-collected", all_gone, timeout=60)


def test_restart_creates_no_duplicate_and_keeps_status(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "again", CPU_SPEC)
    first = wait_for("RayJob again", lambda: get(admin, namespace, "rayjobs", "again"))
    write_rayjob_status_as_kuberay_would(admin, namespace, "again", "RUNNING", "Running")
    wait_for(
        "phase Running", lambda: status_of(admin, namespace, "again").get("phase") == "Running"
    )
    before = status_of(admin, namespace, "again")
    offset = len(operator.log.read_text())
    operator.stop()
    operator.start()
    # The resume pass re-applies the children; handlers.reconcile logs each RLJob it finished.
    marker = f"reconciled RLJob {namespace}/again"
    wait_for("operator resumed the RLJob", lambda: marker in operator.log.read_text()[offset:])
    assert [r["metadata"]["name"] for r in ray_items(admin, namespace, "rayjobs")] == ["again"]
    again = get(admin, namespace, "rayjobs", "again") or {}
    assert again["metadata"]["uid"] == first["metadata"]["uid"]
    after = status_of(admin, namespace, "again")
    assert after["phase"] == "Running"
    assert {c["type"]: c["lastTransitionTime"] for c in after["conditions"]} == {
        c["type"]: c["lastTransitionTime"] for c in before["conditions"]
    }


def test_a_finished_jobs_rayjob_deleted_leaves_it_finished_and_not_run_again(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """A user, or KubeRay run with DELETE_RAYJOB_CR_AFTER_JOB_FINISHES, deletes the RayJob of a
    finished job: the RLJob stays Succeeded (no StartupTimeout, no 'never created'), and neither
    that event nor the operator's resume applies the RayJob again (the job would run twice)."""
    create(admin, namespace, "done", CPU_SPEC)
    wait_for("RayJob done", lambda: get(admin, namespace, "rayjobs", "done"))
    write_rayjob_status_as_kuberay_would(admin, namespace, "done", "SUCCEEDED", "Complete")
    wait_for("phase Succeeded", phase_is(admin, namespace, "done", "Succeeded"))
    before = status_of(admin, namespace, "done")
    custom(admin).delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "done")
    wait_for("RayJob gone", lambda: get(admin, namespace, "rayjobs", "done") is None)
    offset = len(operator.log.read_text())
    operator.stop()
    operator.start()
    marker = f"reconciled RLJob {namespace}/done"
    wait_for("operator resumed the RLJob", lambda: marker in operator.log.read_text()[offset:])
    time.sleep(3.0)  # the DELETED event and the resume are both handled by now
    assert get(admin, namespace, "rayjobs", "done") is None
    after = status_of(admin, namespace, "done")
    assert after["phase"] == "Succeeded"
    assert after["rayJob"] == before["rayJob"]
    assert {c["type"]: (c["status"], c["reason"]) for c in after["conditions"]} == {
        c["type"]: (c["status"], c["reason"]) for c in before["conditions"]
    }


def test_a_rayjob_name_another_job_holds_is_refused_not_taken_over(
    operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """RLJob `exp`'s OOM retry runs as RayJob `exp-a2`, which is also the RayJob of an RLJob
    named `exp-a2`: applying with force would take the other job's RayJob over. Played here
    with a RayJob `held` owned by RLJob `holder`: RLJob `held` fails, saying whose it is, and
    the RayJob stays the holder's."""
    holder = create(admin, namespace, "holder", CPU_SPEC)
    theirs = wait_for("RayJob holder", lambda: get(admin, namespace, "rayjobs", "holder"))
    copy = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": "held",
            "namespace": namespace,
            "ownerReferences": theirs["metadata"]["ownerReferences"],
        },
        "spec": {**theirs["spec"], "suspend": True},
    }
    custom(admin).create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", copy)
    create(admin, namespace, "held", CPU_SPEC)
    wait_for("phase Failed", phase_is(admin, namespace, "held", "Failed"))
    failed = condition(admin, namespace, "held", "Failed")
    assert failed["reason"] == "RayJobRefused"
    assert "the operator refused RayJob held" in failed["message"]
    assert "belongs to RLJob holder" in failed["message"]
    after = get(admin, namespace, "rayjobs", "held") or {}
    assert [r["uid"] for r in after["metadata"]["ownerReferences"]] == [holder["metadata"]["uid"]]
    assert after["metadata"].get("labels", {}).get("rljob.dev/job") != "held"


def test_operator_account_cannot_use_a_verb_it_was_not_granted(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "forbid", CPU_SPEC)
    wait_for("RayJob forbid", lambda: get(admin, namespace, "rayjobs", "forbid"))
    as_operator = api_client(operator.kubeconfig)
    with pytest.raises(ApiException) as info:
        custom(as_operator).delete_namespaced_custom_object(
            "ray.io", "v1", namespace, "rayjobs", "forbid"
        )
    assert info.value.status == 403
    with pytest.raises(ApiException) as info:
        client.CoreV1Api(as_operator).list_namespaced_secret(namespace)
    assert info.value.status == 403
    assert get(admin, namespace, "rayjobs", "forbid") is not None


def test_real_kuberay_turns_the_rayjob_into_a_raycluster(
    kuberay: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "real", CPU_SPEC)
    rayjob = wait_for("RayJob real", lambda: get(admin, namespace, "rayjobs", "real"))
    clusters = wait_for(
        "RayCluster from KubeRay",
        lambda: ray_items(admin, namespace, "rayclusters"),
        timeout=90,
    )
    assert clusters[0]["metadata"]["ownerReferences"][0]["uid"] == rayjob["metadata"]["uid"]
    wait_for(
        "RLJob mirrors KubeRay's deployment status",
        lambda: status_of(admin, namespace, "real").get("rayJob", {}).get("jobDeploymentStatus"),
        timeout=60,
    )


def test_apply_returns_the_rayjob_it_creates_and_then_the_same_one(
    plane: Any, admin: client.ApiClient, namespace: str
) -> None:
    """kube.apply must return the stored object on 201 (create) as on 200 (update): the
    generated client returned None on 201, which made every create write status twice."""
    from kubernetes import config

    from rljob.api import RLJobSpec
    from rljob_operator import kube, render

    config.load_kube_config(str(admin_kubeconfig(plane)))
    uid = create(admin, namespace, "applied", CPU_SPEC)["metadata"]["uid"]
    rayjob = render.ray_job(
        render.Owner(name="applied", namespace=namespace, uid=uid),
        RLJobSpec.model_validate(CPU_SPEC),
    )
    # A name no operator reconciles, so this apply is the one that creates it.
    rayjob["metadata"]["name"] = "applied-directly"
    stored = kube.apply(rayjob)
    assert stored is not None and stored["metadata"]["name"] == "applied-directly"
    assert stored["metadata"]["uid"]
    again = kube.apply(rayjob)
    assert again is not None and again["metadata"]["uid"] == stored["metadata"]["uid"]
