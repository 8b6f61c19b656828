"""The kind cluster of the e2e layer as the tests see it: a kubeconfig, the Kubernetes client,
kubectl, RLJob manifests from examples/tiny-local.yaml, waits with deadlines, logs on failure.

`hack/kind.sh up` makes the cluster (hack/test.sh runs it before pytest and exports
RLJOB_E2E_KUBECONFIG); without that variable the fixture runs it itself.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
LOGS = ROOT / "out" / "e2e"
GROUP, VERSION, PLURAL = "rljob.dev", "v1alpha1", "rljobs"
OPERATOR_NAMESPACE = "rljob-system"

T = TypeVar("T")


def shell_env(*argv: str) -> dict[str, str]:
    """The `export K=V` lines a hack/ script prints, as a dict."""
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    found = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            found[key] = value
    return found


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 2.0) -> T:
    """probe() until it returns something not None/False; AssertionError naming `what` after
    `timeout` seconds, with the last value seen."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@dataclass
class Cluster:
    """The kind cluster: kubectl and the Kubernetes client on its kubeconfig."""

    kubeconfig: Path
    kubectl_bin: str
    worker_image: str
    api: client.ApiClient = field(init=False)

    def __post_init__(self) -> None:
        self.api = config.new_client_from_config(config_file=str(self.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        argv = [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}"
            )
        return result.stdout

    def rljob(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = cast(
                dict[str, Any],
                self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name),
            )
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return obj

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.rljob(namespace, name) or {}).get("status") or {}

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's pods as the API returns them (camelCase dicts)."""
        response: Any = self.core.list_namespaced_pod(namespace, _preload_content=False)
        return list(json.loads(response.data)["items"])

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind=RLJob,involvedObject.name={name}"
        response: Any = self.core.list_namespaced_event(
            namespace, field_selector=selector, _preload_content=False
        )
        return list(json.loads(response.data)["items"])

    def nodes(self) -> list[dict[str, Any]]:
        response: Any = self.core.list_node(_preload_content=False)
        return list(json.loads(response.data)["items"])

    def apply(self, manifest: dict[str, Any], namespace: str) -> None:
        subprocess.run(
            [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", "apply", "-n", namespace, "-f", "-"],
            input=yaml.safe_dump(manifest), text=True, check=True, capture_output=True,
        )  # fmt: skip

    def patch_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": spec}
        )

    def create_namespace(self, name: str) -> str:
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        return name

    def delete_namespace(self, name: str) -> None:
        self.core.delete_namespace(name)

    def collect_logs(self, namespace: str, label: str) -> Path:
        """Everything a person needs to see why a test failed, under out/e2e/<label>/."""
        folder = LOGS / label
        folder.mkdir(parents=True, exist_ok=True)
        dumps = {
            "rljobs.yaml": ["get", "rljobs", "-n", namespace, "-o", "yaml"],
            "rayjobs.yaml": ["get", "rayjobs,rayclusters", "-n", namespace, "-o", "yaml"],
            "events.txt": ["get", "events", "-A", "--sort-by=.lastTimestamp"],
            "pods.txt": ["get", "pods", "-A", "-o", "wide"],
            "pods.yaml": ["get", "pods", "-n", namespace, "-o", "yaml"],
            "operator.log": ["logs", "-n", OPERATOR_NAMESPACE, "deploy/rljob", "--tail=-1"],
            "kuberay.log": ["logs", "-n", "kuberay-system", "deploy/kuberay-operator", "--tail=-1"],
        }
        for file, args in dumps.items():
            (folder / file).write_text(self.kubectl(*args, check=False))
        for pod in self.pods(namespace):
            pod_name = pod["metadata"]["name"]
            text = self.kubectl(
                "logs", "-n", namespace, pod_name, "--all-containers", "--tail=-1", check=False
            )
            (folder / f"pod-{pod_name}.log").write_text(text)
        return folder


def tiny_job(name: str, image: str, **resources: Any) -> dict[str, Any]:
    """examples/tiny-local.yaml under another name, on the worker image built here, sized for
    one 2-CPU kind worker node (the example asks for 3 CPUs: a 2-CPU worker and a 1-CPU head).
    That node's 2 CPUs hold, as requests: the worker pod (1), KubeRay's submitter pod (500m,
    KubeRay's default), the two operators (100m each), the pod network daemon (10m), so the
    head gets 250m."""
    manifest: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    manifest["metadata"] = {"name": name}
    res = manifest["spec"]["resources"]
    res.update({"image": image, "cpu": "1", "headCpu": "250m"})
    res.update(resources)
    return manifest


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)[:6000]


def kind_cluster() -> Cluster:
    """The cluster hack/kind.sh made (made here when hack/test.sh has not)."""
    env = dict(os.environ)
    if not env.get("RLJOB_E2E_KUBECONFIG"):
        up = subprocess.run(["bash", "hack/kind.sh", "up"], cwd=ROOT, check=False)
        if up.returncode != 0:
            raise AssertionError("hack/kind.sh up failed (its output above names the step)")
        env.update(shell_env("bash", "hack/kind.sh", "env"))
    env.update({k: v for k, v in shell_env("bash", "hack/kind.sh", "env").items() if k not in env})
    kubeconfig = Path(env["RLJOB_E2E_KUBECONFIG"])
    assert kubeconfig.is_file(), f"no kubeconfig at {kubeconfig}: run hack/kind.sh up"
    return Cluster(kubeconfig, env["RLJOB_KUBECTL"], env["RLJOB_WORKER_IMAGE"])
