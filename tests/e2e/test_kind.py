"""The whole chain on a kind cluster built on this machine (hack/images.sh, hack/kind.sh): the
rljob and KubeRay operators from their Helm charts, the CPU worker image, pods that really run.

Each test gets its own namespace; on failure everything is dumped to out/e2e/<test>/.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
from cluster import (
    OPERATOR_NAMESPACE,
    ROOT,
    Cluster,
    dump,
    kind_cluster,
    tiny_job,
    wait_for,
)
from kubernetes import client

from rljob.report import Stage

# A tiny job on one 2-CPU kind worker: image start, Ray start and two iterations of the loop.
FINISH_SECONDS = 900.0
PODS_SECONDS = 300.0
GONE_SECONDS = 180.0
# What a fresh namespace holds before any job: not a job's leftovers.
NAMESPACE_DEFAULTS = {"configmap/kube-root-ca.crt", "serviceaccount/default"}


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return kind_cluster()


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = cluster.create_namespace(f"e2e-{uuid.uuid4().hex[:6]}")
    yield name
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        print(f"logs: {cluster.collect_logs(name, request.node.name)}")
    cluster.delete_namespace(name)


def finished(
    cluster: Cluster, namespace: str, name: str, seconds: float = FINISH_SECONDS
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = cluster.status(namespace, name)
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    return wait_for(f"RLJob {name} to finish", probe, seconds, every=5)


def ray_pods_running(cluster: Cluster, namespace: str) -> dict[str, str] | None:
    """{pod: node-type} once the head and a worker pod are both Running, else None."""
    running = {
        str(p["metadata"]["name"]): str(p["metadata"]["labels"]["ray.io/node-type"])
        for p in cluster.pods(namespace)
        if p["status"].get("phase") == "Running"
        and "ray.io/node-type" in (p["metadata"].get("labels") or {})
    }
    return running if {"head", "worker"} <= set(running.values()) else None


def objects_left(cluster: Cluster, namespace: str) -> list[str]:
    found = cluster.kubectl(
        "get", "rayjobs,rayclusters,pods,services,jobs,configmaps,serviceaccounts,roles,rolebindings",
        "-n", namespace, "-o", "name",
    )  # fmt: skip
    left = []
    for name in found.split():
        resource, _, obj = name.partition("/")  # e.g. rayjob.ray.io/tiny-local
        if f"{resource.split('.')[0]}/{obj}" not in NAMESPACE_DEFAULTS:
            left.append(name)
    return left


def children(cluster: Cluster, namespace: str) -> dict[str, str]:
    """{kind/name: uid} of everything the operator made for a job (the pods are KubeRay's)."""
    out = cluster.kubectl(
        "get", "rayjobs,configmaps,serviceaccounts,roles,rolebindings", "-n", namespace,
        "-o", "jsonpath={range .items[*]}{.kind}/{.metadata.name}={.metadata.uid}{'\\n'}{end}",
    )  # fmt: skip
    found = dict(line.split("=", 1) for line in out.splitlines() if line)
    return {k: v for k, v in found.items() if k.lower() not in NAMESPACE_DEFAULTS}


def pods_ready_false(cluster: Cluster, namespace: str, name: str, reason: str) -> dict[str, Any]:
    """The RLJob's PodsReady=False condition with this reason, once the operator set it."""

    def probe() -> dict[str, Any] | None:
        for c in cluster.status(namespace, name).get("conditions") or []:
            if c["type"] == "PodsReady" and c["status"] == "False" and c["reason"] == reason:
                return dict(c)
        return None

    return wait_for(f"PodsReady=False {reason}", probe, PODS_SECONDS)


def test_tiny_example_runs_two_iterations_to_succeeded_with_host_memory_of_every_rank(
    cluster: Cluster, namespace: str
) -> None:
    name = "tiny-local"
    cluster.apply(tiny_job(name, cluster.worker_image), namespace)

    rayjob = wait_for(
        "the RayJob and RayCluster",
        lambda: (
            cluster.status(namespace, name).get("rayJob", {}).get("name")
            and cluster.kubectl("get", "rayclusters", "-n", namespace, "-o", "name").strip()
        ),
        PODS_SECONDS,
    )
    assert rayjob
    pods = wait_for(
        "head and worker pods Running", lambda: ray_pods_running(cluster, namespace), PODS_SECONDS
    )

    status = finished(cluster, namespace, name)
    assert status["phase"] == "Succeeded", dump(status)
    assert status["iteration"] == 2, dump(status)
    memory = status["memory"]
    assert memory["capacityBytes"] > 0 and memory["device"], dump(memory)
    stages = {s["name"]: s for s in memory["stages"]}
    assert {Stage.TRAIN.value, Stage.ROLLOUT.value} <= set(stages), dump(memory)
    assert all(s["peakBytes"] > 0 for s in memory["stages"]), dump(memory)
    # Every rank reported: the worst rank per stage is one of the job's two CPU ranks.
    assert {s["rank"] for s in memory["stages"]} <= {0, 1}, dump(memory)

    describe = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "kubectl-rljob"), "--kubeconfig", str(cluster.kubeconfig),
         "describe", name, "-n", namespace],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert describe.returncode == 0, describe.stderr
    assert "Succeeded" in describe.stdout and Stage.TRAIN.value in describe.stdout, describe.stdout

    reasons = {e["reason"] for e in cluster.events(namespace, name)}
    assert {"RayJobCreated", "RayJobSucceeded"} <= reasons, reasons
    assert pods, "the Ray pods never ran"


def test_worker_oomkilled_appears_in_status_and_as_warning_within_5s(
    cluster: Cluster, namespace: str
) -> None:
    """A worker limit far below what Ray and two torch ranks need: the kernel kills it."""
    name = "tiny-oom"
    # /dev/shm counts against the limit, so the CRD wants sharedMemory <= memory.
    job = tiny_job(name, cluster.worker_image, memory="400Mi", sharedMemory="64Mi")
    # KubeRay deletes the Ray cluster as soon as the failed job ends (the example's TTL is 0):
    # keep its pods a minute, so the kubelet's OOMKilled is still there to be seen (once it was
    # gone within the poll of a loaded machine, while the RLJob had recorded it).
    job["spec"]["ttlSecondsAfterFinished"] = 60
    cluster.apply(job, namespace)

    def kubelet_reported() -> tuple[str, str, float] | None:
        for pod in cluster.pods(namespace):
            for cs in pod["status"].get("containerStatuses") or []:
                for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                    if (state.get("terminated") or {}).get("reason") == "OOMKilled":
                        return str(pod["metadata"]["name"]), str(cs["name"]), time.monotonic()
        return None

    pod, container, seen_at = wait_for(
        "an OOMKilled container", kubelet_reported, PODS_SECONDS, every=0.5
    )

    def in_status() -> dict[str, Any] | None:
        for entry in cluster.status(namespace, name).get("oomEvents") or []:
            if entry.get("kind") == "OOMKilled" and entry.get("pod") == pod:
                return dict(entry)
        return None

    entry = wait_for("the OOMKilled entry in status.oomEvents", in_status, 30, every=0.25)
    delay = time.monotonic() - seen_at
    assert delay <= 5.0, f"status.oomEvents got the kill {delay:.1f}s after the kubelet reported it"
    assert entry["container"] == container, dump(entry)
    assert entry.get("limitBytes") == 400 * 2**20, dump(entry)

    def warnings() -> list[dict[str, Any]]:
        return [
            e
            for e in cluster.events(namespace, name)
            if e["type"] == "Warning" and "OOMKilled" in (e.get("reason") or "")
        ]

    # kopf posts Events from its own queue after the status write: the Warning may come a moment
    # after the entry (seen in a CI run: the status check passed, the Event landed ~1 s later).
    posted = wait_for("the OOMKilled Warning", warnings, 10, every=0.25)
    assert time.monotonic() - seen_at <= 10.0
    assert pod in (posted[0].get("message") or ""), [
        (e["reason"], e.get("message")) for e in posted
    ]


def test_suspend_stops_the_pods_resume_runs_again_delete_removes_every_child(
    cluster: Cluster, namespace: str
) -> None:
    name = "tiny-suspend"
    cluster.apply(tiny_job(name, cluster.worker_image), namespace)
    wait_for("Ray pods Running", lambda: ray_pods_running(cluster, namespace), PODS_SECONDS)

    cluster.patch_spec(namespace, name, {"suspend": True})
    wait_for("no pods while suspended", lambda: not cluster.pods(namespace), GONE_SECONDS)
    wait_for(
        "phase Suspended",
        lambda: cluster.status(namespace, name).get("phase") == "Suspended",
        GONE_SECONDS,
    )

    cluster.patch_spec(namespace, name, {"suspend": False})
    wait_for(
        "Ray pods Running after resume", lambda: ray_pods_running(cluster, namespace), PODS_SECONDS
    )
    status = finished(cluster, namespace, name)
    assert status["phase"] == "Succeeded", dump(status)
    assert status["iteration"] == 2, dump(status)

    assert objects_left(cluster, namespace), "the RLJob had no children to delete"
    cluster.kubectl("delete", "rljob", name, "-n", namespace, "--wait=true")
    wait_for("every child and pod gone", lambda: not objects_left(cluster, namespace), GONE_SECONDS)


def test_a_job_deleted_and_applied_again_while_its_pods_terminate_runs_anew_to_succeeded(
    cluster: Cluster, namespace: str
) -> None:
    """Issue 28: `kubectl delete` then `kubectl apply` under the same name while the old Ray
    pods are still terminating and KubeRay's finalizer holds the old RayJob. The new RLJob
    waits for the old children to go, never adopts them, and runs to Succeeded on its own."""
    name = "tiny-again"
    cluster.apply(tiny_job(name, cluster.worker_image), namespace)
    wait_for("Ray pods Running", lambda: ray_pods_running(cluster, namespace), PODS_SECONDS)
    old_uid = cluster.kubectl("get", "rljob", name, "-n", namespace, "-o",
                              "jsonpath={.metadata.uid}").strip()  # fmt: skip
    cluster.kubectl("delete", "rljob", name, "-n", namespace, "--wait=false")
    wait_for(
        "the old RLJob gone",
        lambda: not cluster.kubectl("get", "rljobs", "-n", namespace, "-o", "name").strip(),
        GONE_SECONDS,
    )
    assert cluster.pods(namespace), "the old pods were gone before the job was applied again"
    cluster.apply(tiny_job(name, cluster.worker_image), namespace)
    new_uid = cluster.kubectl("get", "rljob", name, "-n", namespace, "-o",
                              "jsonpath={.metadata.uid}").strip()  # fmt: skip
    assert new_uid and new_uid != old_uid
    status = finished(cluster, namespace, name)
    assert status["phase"] == "Succeeded", dump(status)
    assert status["iteration"] == 2 and not status.get("oomEvents"), dump(status)
    owner = cluster.kubectl("get", "rayjob", name, "-n", namespace, "-o",
                            "jsonpath={.metadata.ownerReferences[0].uid}").strip()  # fmt: skip
    assert owner == new_uid, (owner, new_uid, old_uid)


def test_operator_killed_mid_job_the_job_goes_on_nothing_created_twice_no_status_lost(
    cluster: Cluster, namespace: str
) -> None:
    name = "tiny-kill"
    cluster.apply(tiny_job(name, cluster.worker_image), namespace)
    wait_for("Ray pods Running", lambda: ray_pods_running(cluster, namespace), PODS_SECONDS)
    before = children(cluster, namespace)
    status_before = cluster.status(namespace, name)
    assert before and status_before.get("phase"), (before, status_before)

    old = cluster.kubectl(
        "get", "pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=rljob", "-o", "name"
    ).split()
    assert len(old) == 1, old
    cluster.kubectl("delete", "-n", OPERATOR_NAMESPACE, old[0], "--grace-period=0", "--force")
    cluster.kubectl("-n", OPERATOR_NAMESPACE, "rollout", "status", "deploy/rljob", "--timeout=180s")

    status = finished(cluster, namespace, name)
    assert status["phase"] == "Succeeded", dump(status)
    after = children(cluster, namespace)
    assert after == before, f"children recreated or lost:\nbefore {before}\nafter {after}"
    for field in ("phase", "conditions", "rayJob", "observedGeneration", "iteration", "memory"):
        assert field in status, f"status.{field} lost: {dump(status)}"
    for field in status_before:
        assert field in status, f"status.{field} was there before the kill and is gone now"


DRIVER_RBAC_PROBE = """
import json, sys
from kubernetes import client, config
config.load_incluster_config()
api = client.CustomObjectsApi()
core = client.CoreV1Api()
ns, own, other = sys.argv[1], sys.argv[2], sys.argv[3]
def attempt(call):
    try:
        call()
        return 200
    except client.ApiException as e:
        return e.status
status = api.get_namespaced_custom_object_status("rljob.dev", "v1alpha1", ns, "rljobs", own)["status"]
print(json.dumps({
    "own_status": attempt(lambda: api.patch_namespaced_custom_object_status(
        "rljob.dev", "v1alpha1", ns, "rljobs", own, {"status": {"iteration": status.get("iteration", 0)}})),
    "other_status": attempt(lambda: api.patch_namespaced_custom_object_status(
        "rljob.dev", "v1alpha1", ns, "rljobs", other, {"status": {"iteration": 0}})),
    "own_spec": attempt(lambda: api.patch_namespaced_custom_object(
        "rljob.dev", "v1alpha1", ns, "rljobs", own, {"spec": {"suspend": False}})),
    "list_secrets": attempt(lambda: core.list_namespaced_secret(ns)),
    "delete_pods": attempt(lambda: core.delete_collection_namespaced_pod(ns, dry_run="All")),
    "create_configmap": attempt(lambda: core.create_namespaced_config_map(ns, {"metadata": {"name": "x"}}, dry_run="All")),
}))
"""


def test_driver_service_account_patches_its_own_status_and_nothing_else(
    cluster: Cluster, namespace: str
) -> None:
    name, other = "tiny-rbac", "tiny-other"
    # A long job, so the head pod is there for the probe; the other RLJob never gets pods (its
    # head and worker ask for more than the node has, so neither takes this job's CPUs).
    cluster.apply(tiny_job(other, cluster.worker_image, cpu="64", headCpu="64"), namespace)
    job = tiny_job(name, cluster.worker_image)
    job["spec"]["algorithm"]["iterations"] = 50
    cluster.apply(job, namespace)
    pods = wait_for("Ray pods Running", lambda: ray_pods_running(cluster, namespace), PODS_SECONDS)
    head = next(pod for pod, role in pods.items() if role == "head")
    out = cluster.kubectl(
        "exec", "-n", namespace, head, "-c", "ray-head", "--",
        "python", "-c", DRIVER_RBAC_PROBE, namespace, name, other,
    )  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {
        "own_status": 200,
        "other_status": 403,
        "own_spec": 403,
        "list_secrets": 403,
        "delete_pods": 403,
        "create_configmap": 403,
    }, result


def test_missing_image_reaches_the_rljob_as_image_pull_back_off_naming_the_pod(
    cluster: Cluster, namespace: str
) -> None:
    name = "tiny-nopull"
    cluster.apply(tiny_job(name, "rljob.local/no-such-image:0"), namespace)
    condition = pods_ready_false(cluster, namespace, name, "ImagePullBackOff")
    names = [p["metadata"]["name"] for p in cluster.pods(namespace)]
    assert any(pod in condition["message"] for pod in names), (condition, names)


def test_worker_asking_more_cpu_than_the_node_has_reaches_the_rljob_as_unschedulable(
    cluster: Cluster, namespace: str
) -> None:
    """The scheduler, not a test, marks the worker pod Unschedulable (64 CPUs asked of a 2-CPU
    node); the operator names that pod in PodsReady=False."""
    name = "tiny-huge"
    cluster.apply(tiny_job(name, cluster.worker_image, cpu="64"), namespace)

    def unschedulable_pods() -> list[str]:
        return [
            str(p["metadata"]["name"])
            for p in cluster.pods(namespace)
            for c in p["status"].get("conditions") or []
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
        ]

    condition = pods_ready_false(cluster, namespace, name, "Unschedulable")
    pods = wait_for("the scheduler's Unschedulable pod", unschedulable_pods, 30)
    assert any(pod in condition["message"] for pod in pods), (condition, pods)
    assert "cpu" in condition["message"], condition


def test_cluster_runs_kubelet_v1_34_on_two_ready_nodes(cluster: Cluster) -> None:
    """The nodes are real kubelets (v1.34) that went Ready on this host, two of them."""
    nodes = cluster.nodes()
    assert len(nodes) >= 2, [n["metadata"]["name"] for n in nodes]
    for node in nodes:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]
        assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("v1.34"), node["status"]


# The checkpoint job: enough iterations that the worker pod is deleted while it runs (after
# iteration CUT's checkpoint), few enough that both Ray clusters' runs stay short.
# (About 2 s an iteration on the 2-CPU kind worker: a first run of 10 ended before the pod
# deletion took effect.)
CKPT_ITERATIONS = 30
CUT = 2
# kind's default StorageClass (hack/images/default-storage.yaml): rancher's local-path
# provisioner makes a hostPath PersistentVolume, a directory on the node that the claim's first
# pod was scheduled to (volumeBindingMode WaitForFirstConsumer).
PROVISIONER = "rancher.io/local-path"
PROVISION_SECONDS = 120.0


def _on_node(node: str, *argv: str) -> str:
    """A command inside the kind node's container (the node is a docker container here)."""
    done = subprocess.run(["docker", "exec", node, *argv], capture_output=True, text=True)
    assert done.returncode == 0, f"{argv} on {node}: {done.stderr}"
    return done.stdout


def _claimed_volume(cluster: Cluster, namespace: str, claim: str) -> dict[str, Any] | None:
    """The PersistentVolume bound to the claim, or None while it is unbound."""
    pvc = json.loads(cluster.kubectl("get", "pvc", claim, "-n", namespace, "-o", "json"))
    volume = pvc["spec"].get("volumeName")
    if pvc["status"].get("phase") != "Bound" or not volume:
        return None
    return cast(dict[str, Any], json.loads(cluster.kubectl("get", "pv", volume, "-o", "json")))


def provisioned_directory(cluster: Cluster, namespace: str, claim: str) -> tuple[str, str, str]:
    """(volume, node, directory on that node) of the volume the local-path provisioner made for
    the claim; fails unless that provisioner made it (no hand-made PersistentVolume passes)."""
    pv = wait_for(
        f"claim {claim} bound",
        lambda: _claimed_volume(cluster, namespace, claim),
        PROVISION_SECONDS,
    )
    annotations = pv["metadata"].get("annotations") or {}
    assert annotations.get("pv.kubernetes.io/provisioned-by") == PROVISIONER, dump(pv)
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    (node,) = terms[0]["matchExpressions"][0]["values"]
    return str(pv["metadata"]["name"]), str(node), str(pv["spec"]["hostPath"]["path"])


@pytest.fixture
def checkpoint_claim(
    cluster: Cluster, namespace: str, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A PersistentVolumeClaim `ckpt` in the namespace, of the default StorageClass (none named):
    the provisioner makes its volume once a pod uses it. After a passed test the job and claim
    are deleted and the volume must go too (reclaimPolicy Delete: the provisioner's teardown pod
    removes the directory); after a failed one the namespace's deletion does it, once its logs
    are collected."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "ckpt"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    cluster.apply(claim, namespace)
    yield "ckpt"
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        return
    volume, node, directory = provisioned_directory(cluster, namespace, "ckpt")
    # The claim's protection keeps it until the job's pods, which mount it, are gone.
    cluster.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=false")
    cluster.kubectl("delete", "pvc", "ckpt", "-n", namespace, "--wait=false")
    wait_for(
        f"volume {volume} deleted by the provisioner",
        lambda: not cluster.kubectl("get", "pv", volume, "--ignore-not-found", "-o", "name"),
        PROVISION_SECONDS + GONE_SECONDS,
    )
    left = subprocess.run(["docker", "exec", node, "test", "-e", directory], check=False)
    assert left.returncode == 1, f"{directory} is still on {node} after its volume was deleted"


# Two Ray clusters start one after the other on one 2-CPU node: a loaded machine took 10 minutes
# for one (the layer's per-test limit is 1200 s).
@pytest.mark.timeout(2700)
def test_worker_pod_deleted_mid_run_resumes_from_its_checkpoint_on_a_pvc_to_succeeded(
    cluster: Cluster, namespace: str, checkpoint_claim: str
) -> None:
    """spec.checkpoint on a PersistentVolumeClaim, spec.backoffLimit 1: the worker pod deleted
    after iteration CUT's checkpoint fails the Ray job, KubeRay runs it again on a new Ray
    cluster, and that run resumes from the newest complete checkpoint (status.resumedFrom, the
    attempt's resumedFrom, an Event) to Succeeded, with the export on the volume. A Secret's
    value reaches the worker's environment (env valueFrom secretKeyRef). The claim is
    provisioned by kind's local-path provisioner, the directory made writable for uid 1000."""
    name = "ckpt-e2e"
    secret_value = uuid.uuid4().hex
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(name="e2e-secret"), string_data={"token": secret_value}
    )
    cluster.core.create_namespaced_secret(namespace, secret)
    job = tiny_job(name, cluster.worker_image)
    spec = job["spec"]
    spec["algorithm"]["iterations"] = CKPT_ITERATIONS
    spec["checkpoint"] = {"path": "/ckpt/checkpoints", "everyIterations": 1, "keep": 2}
    spec["export"] = {"path": "/ckpt/export"}
    spec["backoffLimit"] = 1
    spec["startupTimeoutSeconds"] = 1800
    spec["volumes"] = [{"name": "ckpt", "persistentVolumeClaim": {"claimName": checkpoint_claim}}]
    spec["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
    spec["env"] = [
        {
            "name": "E2E_SECRET",
            "valueFrom": {"secretKeyRef": {"name": "e2e-secret", "key": "token"}},
        }
    ]
    cluster.apply(job, namespace)

    pods = wait_for(
        "head and worker pods Running", lambda: ray_pods_running(cluster, namespace), PODS_SECONDS
    )
    worker = next(p for p, kind in pods.items() if kind == "worker")
    _, node, directory = provisioned_directory(cluster, namespace, checkpoint_claim)
    # The provisioner's setup script made it 0777: the worker, uid 1000, writes in it.
    assert _on_node(node, "stat", "-c", "%a", directory).strip() == "777", directory
    env = cluster.kubectl("exec", "-n", namespace, worker, "--", "printenv", "E2E_SECRET")
    assert env.strip() == secret_value

    def saved() -> int | None:
        iteration = (cluster.status(namespace, name).get("checkpoint") or {}).get("iteration")
        return iteration if iteration is not None and iteration >= CUT else None

    cut_at = wait_for(f"checkpoint of iteration {CUT}", saved, FINISH_SECONDS, every=0.5)
    assert cut_at < CKPT_ITERATIONS, "the job finished before its worker pod could be deleted"
    # At once (no grace period): the ranks must not finish while the container stops.
    cluster.kubectl("delete", "pod", "-n", namespace, worker, "--grace-period=0", "--force")
    assert (cluster.status(namespace, name).get("iteration") or 0) < CKPT_ITERATIONS

    status = finished(cluster, namespace, name, seconds=2 * FINISH_SECONDS)
    assert status["phase"] == "Succeeded", dump(status)
    assert status["iteration"] == CKPT_ITERATIONS, dump(status)
    resumed = status["resumedFrom"]
    assert resumed["iteration"] >= cut_at and resumed["attempt"] == 1, dump(status)
    assert resumed["path"] == f"/ckpt/checkpoints/iteration-{resumed['iteration']:08d}"
    first = status["attempts"][0]
    assert first["resumedFrom"] == {"iteration": resumed["iteration"], "path": resumed["path"]}
    assert status["checkpoint"]["iteration"] == CKPT_ITERATIONS, dump(status)
    assert status["export"] == {"path": "/ckpt/export", "iteration": CKPT_ITERATIONS}
    # The export and the newest checkpoints are on the volume (the node's directory).
    files = _on_node(node, "find", directory, "-maxdepth", "2").split()
    assert f"{directory}/export/model.safetensors" in files, files
    assert f"{directory}/checkpoints/iteration-{CKPT_ITERATIONS:08d}" in files, files
    # The Ray head's driver kept every iteration's metrics beside the checkpoints, each once and
    # in order across both Ray runs: the second continued the first's lines before its checkpoint.
    text = _on_node(node, "cat", f"{directory}/checkpoints/metrics.jsonl")
    entries = [json.loads(line) for line in text.splitlines()]
    assert [e["iteration"] for e in entries] == list(range(CKPT_ITERATIONS + 1)), text
    reasons = {e["reason"] for e in cluster.events(namespace, name)}
    assert {"ResumedFromCheckpoint", "CheckpointWritten", "ExportWritten"} <= reasons, reasons
    table = cluster.kubectl("get", "rljobs", name, "-n", namespace)
    header, row = table.splitlines()[:2]
    column = header.index("CHECKPOINT")  # by position: an empty column (OOMS) has no word
    assert row[column:].split()[0] == str(CKPT_ITERATIONS), table
