"""Smoke tests of the control plane every other layer relies on: pinned versions, KubeRay CRDs and
operator, RBAC per ServiceAccount, garbage collection, the Job controller, no leftover processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.pki import token_kubeconfig_yaml
from support.plane import REPO, Binaries, ControlPlane, KubeRayOperator, pinned_versions
from support.processes import wait_for


def _output(*argv: object) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _items(plane: ControlPlane, *args: str) -> list[dict[str, Any]]:
    return list(plane.kubectl_json("get", *args)["items"])


def test_binaries_report_the_pinned_versions() -> None:
    versions = pinned_versions()
    bins = Binaries.locate()
    assert _output(bins.kube_apiserver, "--version").split() == [
        "Kubernetes",
        versions["K8S_VERSION"],
    ]
    assert _output(bins.kube_controller_manager, "--version").split()[-1] == versions["K8S_VERSION"]
    client = json.loads(_output(bins.kubectl, "version", "--client", "-o", "json"))
    assert client["clientVersion"]["gitVersion"] == versions["K8S_VERSION"]
    assert _output(bins.helm, "version", "--short").strip().startswith(versions["HELM_VERSION"])


def test_apiserver_serves_the_pinned_version_and_refuses_unknown_tokens(
    plane: ControlPlane, tmp_path: Path
) -> None:
    server = plane.kubectl_json("version")["serverVersion"]
    assert server["gitVersion"] == pinned_versions()["K8S_VERSION"]
    bogus = tmp_path / "bogus.kubeconfig"
    bogus.write_text(token_kubeconfig_yaml(plane.server, plane.ca_pem, "nobody", "not-a-token"))
    refused = plane.kubectl("get", "namespaces", kubeconfig=bogus, check=False)
    assert refused.returncode != 0
    assert "Unauthorized" in refused.stderr


def test_kuberay_rayjob_crd_of_the_pinned_release_is_established(plane: ControlPlane) -> None:
    plane.install_kuberay_crds()
    crd = plane.kubectl_json("get", "crd", "rayjobs.ray.io")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert [v["name"] for v in crd["spec"]["versions"] if v["served"] and v["storage"]] == ["v1"]
    names = plane.kubectl("api-resources", "--api-group=ray.io", "-o", "name").stdout.split()
    assert {"rayjobs.ray.io", "rayclusters.ray.io", "rayservices.ray.io"} <= set(names)


def test_can_i_answers_per_service_account_as_its_role_binding_says(
    plane: ControlPlane, namespace: str
) -> None:
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "read-configmaps", "namespace": namespace},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "reader", "namespace": namespace},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "read-configmaps",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
    }
    plane.apply_yaml(yaml.safe_dump_all([role, binding]))
    reader = plane.sa_kubeconfig(namespace, "reader")
    stranger = plane.sa_kubeconfig(namespace, "stranger")

    def can_i(kubeconfig: Path, verb: str, resource: str) -> str:
        args = ("auth", "can-i", verb, resource, "-n", namespace)
        return plane.kubectl(*args, kubeconfig=kubeconfig, check=False).stdout.strip()

    assert can_i(reader, "list", "configmaps") == "yes"
    assert can_i(reader, "delete", "configmaps") == "no"
    assert can_i(reader, "list", "secrets") == "no"
    assert can_i(stranger, "list", "configmaps") == "no"
    # The real request is decided the same way, not only the access review.
    assert plane.kubectl("get", "configmaps", "-n", namespace, kubeconfig=reader).returncode == 0
    denied = plane.kubectl("get", "secrets", "-n", namespace, kubeconfig=reader, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()


def _deployment(name: str, namespace: str, owner: dict[str, str] | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if owner:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            },
        },
    }


def test_deployment_owned_by_a_configmap_is_garbage_collected_with_it(
    plane: ControlPlane, namespace: str
) -> None:
    plane.kubectl("create", "configmap", "owner", "-n", namespace)
    uid = plane.kubectl_json("get", "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
    plane.apply_yaml(
        yaml.safe_dump_all(
            [_deployment("owned", namespace, owner), _deployment("unowned", namespace, None)]
        )
    )
    # The deployment controller works too: it gives the owned Deployment a ReplicaSet.
    wait_for(
        "the deployment controller to create a ReplicaSet",
        lambda: _items(plane, "replicasets", "-n", namespace, "-l", "app=owned"),
        timeout=60,
    )
    plane.kubectl("delete", "configmap", "owner", "-n", namespace)

    def deployments() -> set[str]:
        return {d["metadata"]["name"] for d in _items(plane, "deployments", "-n", namespace)}

    wait_for(
        "the garbage collector to delete the owned Deployment",
        lambda: "owned" not in deployments(),
        timeout=60,
    )
    assert deployments() == {"unowned"}


def test_job_controller_creates_the_jobs_pod_which_stays_pending_without_a_kubelet(
    plane: ControlPlane, namespace: str
) -> None:
    plane.kubectl("create", "job", "hello", "--image=busybox", "-n", namespace, "--", "true")
    pods = wait_for(
        "the job controller to create a Pod",
        lambda: _items(plane, "pods", "-n", namespace, "-l", "job-name=hello"),
        timeout=60,
    )
    assert pods[0]["metadata"]["ownerReferences"][0]["kind"] == "Job"
    assert pods[0]["status"]["phase"] == "Pending"
    assert pods[0]["spec"]["serviceAccountName"] == "default"


def _ray_pod_template(container_name: str) -> dict[str, Any]:
    # The image is never pulled: no kubelet here.
    return {"spec": {"containers": [{"name": container_name, "image": "rayproject/ray:2.46.0"}]}}


def test_kuberay_operator_turns_a_rayjob_into_a_raycluster_service_and_pods(
    plane: ControlPlane, namespace: str, kuberay: KubeRayOperator
) -> None:
    assert plane.start_kuberay_operator() is kuberay  # one operator per plane
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "smoke", "namespace": namespace},
        "spec": {
            "entrypoint": "python -c 'print(1)'",
            "rayClusterSpec": {
                "headGroupSpec": {"rayStartParams": {}, "template": _ray_pod_template("ray-head")},
                "workerGroupSpecs": [
                    {
                        "groupName": "workers",
                        "replicas": 1,
                        "minReplicas": 1,
                        "maxReplicas": 1,
                        "rayStartParams": {},
                        "template": _ray_pod_template("ray-worker"),
                    }
                ],
            },
        },
    }
    plane.apply_yaml(yaml.safe_dump(rayjob))
    uid = plane.kubectl_json("get", "rayjob", "smoke", "-n", namespace)["metadata"]["uid"]
    clusters = wait_for(
        "KubeRay to create the RayCluster",
        lambda: _items(plane, "rayclusters", "-n", namespace),
        timeout=90,
    )
    assert clusters[0]["metadata"]["ownerReferences"][0]["uid"] == uid
    cluster = clusters[0]["metadata"]["name"]
    by_cluster = f"ray.io/cluster={cluster}"

    def head_and_worker_pods() -> list[dict[str, Any]] | None:
        pods = _items(plane, "pods", "-n", namespace, "-l", by_cluster)
        return pods if len(pods) >= 2 else None

    pods = wait_for("KubeRay to create the head and worker pods", head_and_worker_pods, timeout=90)
    node_types = sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in pods)
    assert node_types == ["head", "worker"], node_types
    assert {p["status"]["phase"] for p in pods} == {"Pending"}
    services = _items(plane, "services", "-n", namespace, "-l", by_cluster)
    assert any(s["metadata"]["name"].endswith("head-svc") for s in services), services
    status = wait_for(
        "KubeRay to report the RayJob's deployment status",
        lambda: plane.kubectl_json("get", "rayjob", "smoke", "-n", namespace).get("status"),
        timeout=60,
    )
    assert status["jobDeploymentStatus"] == "Initializing"  # head pod never becomes ready
    assert kuberay.alive(), kuberay.log_tail()


_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from support.processes import start_process
process = start_process("sleeper", {argv!r}, Path({log_dir!r}))
print(process.pid, flush=True)
time.sleep(300)
"""


def _live_group_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are not zombies (PID 1 here may never reap them)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(entry.name))
    return members


@pytest.mark.parametrize(
    ("signum", "argv"),
    [
        # SIGTERM: the handler stops the whole process group (the shell and its child).
        (signal.SIGTERM, ["sh", "-c", "sleep 300 & sleep 300; wait"]),
        # SIGKILL: no handler runs; the kernel's parent-death signal takes the component down.
        (signal.SIGKILL, ["sleep", "300"]),
    ],
    ids=["sigterm", "sigkill"],
)
def test_components_die_with_the_test_process(
    signum: signal.Signals, argv: list[str], tmp_path: Path
) -> None:
    code = _CHILD.format(tests=str(REPO / "tests"), argv=argv, log_dir=str(tmp_path))
    runner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True
    )
    assert runner.stdout is not None
    pid = int(runner.stdout.readline())
    assert pid in _live_group_members(pid)
    runner.send_signal(signum)
    runner.wait(timeout=30)
    wait_for(
        f"{argv} to die after {signum.name}",
        lambda: not _live_group_members(pid),
        timeout=15,
    )
