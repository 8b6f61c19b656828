"""Helpers shared by the RLJob control-plane tests: API clients on the test plane, CRD install,
and waiting with a deadline (never an unbounded sleep loop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from support.processes import wait_for  # also re-exported for the tests

from rljob.api import GROUP, PLURAL, VERSION
from rljob_operator.rbac import operator_cluster_role

ROOT = Path(__file__).parents[2]


def admin_kubeconfig(plane: Any) -> Path:
    # tests/support/plane.py names the admin kubeconfig `kubeconfig`.
    return Path(plane.kubeconfig)


def api_client(kubeconfig: Path) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kubeconfig))


def install_rljob_crds(plane: Any) -> None:
    """Apply the checked-in CRDs (idempotent) and wait until they are served."""
    for name in ("rljob.dev_rljobs.yaml", "kopf-peering.yaml"):
        plane.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / name)
        )
    plane.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        f"crd/{PLURAL}.{GROUP}", "crd/clusterkopfpeerings.kopf.dev",
    )  # fmt: skip


def grant_operator_rbac(plane: Any, namespace: str, service_account: str, role: str) -> Path:
    """The operator's identity as the chart gives it: a ServiceAccount in its namespace bound to
    a ClusterRole with exactly rbac.py's rules; returns that account's kubeconfig (TokenRequest)."""
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    plane.apply_yaml(yaml.safe_dump_all([ns, operator_cluster_role(role), binding]))
    kubeconfig: Path = plane.sa_kubeconfig(namespace, service_account)
    return kubeconfig


def rljob(name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": spec or {},
    }


def write_pod_waiting_as_kubelet_would(
    core: client.CoreV1Api, namespace: str, pod: str, reason: str, message: str
) -> None:
    """Stand-in for the kubelet (the plane has none): every container of the pod waiting with
    `reason` (ErrImagePull, ImagePullBackOff, CrashLoopBackOff...), as the kubelet reports it."""
    found = core.read_namespaced_pod(pod, namespace)
    assert found.spec is not None
    statuses = [
        {
            "name": c.name, "ready": False, "restartCount": 0, "image": c.image, "imageID": "",
            "started": False, "state": {"waiting": {"reason": reason, "message": message}},
        }
        for c in found.spec.containers
    ]  # fmt: skip
    core.patch_namespaced_pod_status(
        pod, namespace, {"status": {"phase": "Pending", "containerStatuses": statuses}}
    )


def write_unschedulable_as_scheduler_would(
    core: client.CoreV1Api, namespace: str, pod: str, message: str
) -> None:
    """Stand-in for kube-scheduler (the plane runs none): the PodScheduled=False condition with
    reason Unschedulable it writes when no node fits."""
    condition = {
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z",
    }  # fmt: skip
    core.patch_namespaced_pod_status(pod, namespace, {"status": {"conditions": [condition]}})


def deny_in_namespace(plane: Any, namespace: str, resource: str, reason: str) -> str:
    """A ValidatingAdmissionPolicy (and binding) that refuses creating or updating `resource`
    (group ray.io) in `namespace` with `reason` (Invalid: HTTP 422; Forbidden: 403); returns
    its name. Waits until the apiserver enforces it."""
    name = f"deny-{resource}-{namespace}"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["ray.io"], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": [resource],
            }]},
            "validations": [{
                "expression": "false", "reason": reason,
                "message": f"{resource} are refused in this namespace by test policy {name}",
            }],
        },
    }  # fmt: skip
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            },
        },
    }
    plane.apply_yaml(yaml.safe_dump_all([policy, binding]))
    probe = yaml.safe_dump(
        {
            "apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": "probe", "namespace": namespace}, "spec": {"entrypoint": "x"},
        }
    )  # fmt: skip
    wait_for(
        f"policy {name} enforced",
        lambda: plane.kubectl(
            "create", "--dry-run=server", "-f", "-", input=probe, check=False
        ).returncode != 0,
    )  # fmt: skip
    return name


def pod_labels(api: client.ApiClient, namespace: str, job: str, attempt: int = 1) -> dict[str, str]:
    """The labels a pod of the job's RayJob gets from its template (KubeRay copies them): the
    job's name, its uid (what the operator matches on) and the OOM policy's attempt."""
    rljob: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, job
    )
    return {
        "rljob.dev/job": job,
        "rljob.dev/job-uid": rljob["metadata"]["uid"],
        "rljob.dev/attempt": str(attempt),
    }


# An RLJob that runs on CPU (no GPU on the plane).
CPU_SPEC: dict[str, Any] = {
    "rollout": {"engine": "torch"},
    "resources": {"gpusPerWorker": 0, "cpuRanksPerWorker": 2},
}


class Operator:
    """The operator process; restartable, logs to a file the failure messages can point at."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.kubeconfig, self.log = kubeconfig, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rljob_operator.main"], env=env, stdout=out, stderr=out
            )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
