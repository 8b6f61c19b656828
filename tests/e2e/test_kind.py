"""The whole chain on a kind cluster: images built and loaded, KubeRay's chart and rljob's chart
installed, examples/tiny-local.yaml applied as it is, run to Succeeded, deleted without leftovers.

Needs Docker, kind, helm and kubectl, and network to KubeRay's Helm repository and to the Python
package index (the image builds). conftest.py skips it, with the reason, where Docker or kind is
missing. Environment: RLJOB_E2E_CLUSTER (reuse a kind cluster of that name and keep it),
RLJOB_E2E_KEEP=1 (keep the cluster created here), RLJOB_TORCH_INDEX_URL (a CPU-only torch wheel
index for the worker image), RLJOB_KUBERAY_HELM_REPO, RLJOB_HELM / RLJOB_KUBECTL (binaries).
Logs of every pod, the operators and the RLJob's Events are written to out/e2e on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api import RLJobSpec
from rljob.report import Stage

ROOT = Path(__file__).resolve().parents[2]
KIND_CONFIG = Path(__file__).parent / "kind-config.yaml"
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
LOGS = ROOT / "out" / "e2e"
KUBERAY_CHART_VERSION = "1.6.0"  # the KubeRay release the control-plane tests build (versions.env)
KUBERAY_HELM_REPO = os.environ.get(
    "RLJOB_KUBERAY_HELM_REPO", "https://ray-project.github.io/kuberay-helm/"
)
OPERATOR_IMAGE = "rljob/operator:e2e"
JOB_NAMESPACE = "rljob-e2e"
SUCCEEDED_TIMEOUT_SECONDS = 1500.0
GONE_TIMEOUT_SECONDS = 180.0


def run(*argv: str, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A command with its output captured; a failure raises with the command and its stderr."""
    print("+", " ".join(argv), flush=True)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-4000:]}"
            f"\n{result.stderr[-4000:]}"
        )
    return result


def tool(name: str) -> str:
    """A binary from RLJOB_<NAME>, PATH, or the control-plane cache (`hack/controlplane.sh env`)."""
    named = os.environ.get(f"RLJOB_{name.upper()}", "")
    found = (
        (named if Path(named).is_file() else None)
        or shutil.which(name)
        or shutil.which(name, path=os.environ.get("RLJOB_KUBE_BIN_DIR", ""))
    )
    if not found:
        raise AssertionError(f"{name} is not on PATH (or set RLJOB_{name.upper()})")
    return found


@dataclass
class Kind:
    """A kind cluster and the kubeconfig for it."""

    name: str
    kubeconfig: Path

    def kubectl(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        argv = [tool("kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        return run(*argv, check=check, timeout=timeout).stdout

    def helm(self, *args: str, timeout: float = 900) -> str:
        return run(tool("helm"), f"--kubeconfig={self.kubeconfig}", *args, timeout=timeout).stdout

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        out = self.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        return json.loads(out) if out.strip() else None


def worker_image() -> str:
    """The image the example's RayJob pods run: the example's own, or the API default."""
    spec = RLJobSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    return spec.resources.image


@pytest.fixture(scope="module")
def kind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kind]:
    reuse = os.environ.get("RLJOB_E2E_CLUSTER")
    name = reuse or f"rljob-e2e-{uuid.uuid4().hex[:6]}"
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    if not reuse:
        argv = ["kind", "create", "cluster", "--name", name, "--config", str(KIND_CONFIG)]
        if node_image := os.environ.get("RLJOB_KIND_NODE_IMAGE"):
            argv += ["--image", node_image]
        run(*argv, "--kubeconfig", str(kubeconfig), "--wait", "180s", timeout=600)
    else:
        kubeconfig.write_text(run("kind", "get", "kubeconfig", "--name", name).stdout)
    try:
        yield Kind(name, kubeconfig)
    finally:
        if not reuse and os.environ.get("RLJOB_E2E_KEEP") != "1":
            run("kind", "delete", "cluster", "--name", name, check=False, timeout=300)


@pytest.fixture(scope="module")
def installed(kind: Kind) -> Kind:
    """Images built and loaded, KubeRay's chart and rljob's chart installed and rolled out."""
    try:
        install(kind)
    except BaseException:
        print(f"e2e set-up failed; logs in {collect_logs(kind, example_name())}")
        raise
    return kind


def install(kind: Kind) -> None:
    build_args: list[str] = []
    if index := os.environ.get("RLJOB_TORCH_INDEX_URL"):
        build_args = ["--build-arg", f"TORCH_INDEX_URL={index}"]
    run("docker", "build", "-f", "operator/Dockerfile", "-t", OPERATOR_IMAGE, str(ROOT))
    run(
        "docker", "build", "-f", "worker_image/Dockerfile.cpu", *build_args,
        "-t", worker_image(), str(ROOT),
    )  # fmt: skip
    for image in (OPERATOR_IMAGE, worker_image()):
        run("kind", "load", "docker-image", image, "--name", kind.name, timeout=900)

    kind.helm("repo", "add", "kuberay", KUBERAY_HELM_REPO, "--force-update")
    kind.helm(
        "upgrade", "--install", "kuberay-operator", "kuberay/kuberay-operator",
        "--version", KUBERAY_CHART_VERSION, "--namespace", "kuberay-system",
        "--create-namespace", "--wait", "--timeout", "10m",
    )  # fmt: skip
    repository, tag = OPERATOR_IMAGE.split(":")
    kind.helm(
        "upgrade", "--install", "rljob", str(ROOT / "charts" / "rljob"),
        "--namespace", "rljob-system", "--create-namespace",
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", "image.pullPolicy=Never", "--wait", "--timeout", "5m",
    )  # fmt: skip
    kind.kubectl("-n", "rljob-system", "rollout", "status", "deploy/rljob", "--timeout=180s")
    kind.kubectl("create", "namespace", JOB_NAMESPACE, check=False)


def example_name() -> str:
    return str(yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"])


def collect_logs(kind: Kind, job: str) -> Path:
    """Everything a person needs to see why the run failed, under out/e2e/."""
    LOGS.mkdir(parents=True, exist_ok=True)
    dumps = {
        "rljob.yaml": ["get", "rljob", job, "-n", JOB_NAMESPACE, "-o", "yaml"],
        "describe-rljob.txt": ["describe", "rljob", job, "-n", JOB_NAMESPACE],
        "rayjobs.yaml": ["get", "rayjobs,rayclusters", "-n", JOB_NAMESPACE, "-o", "yaml"],
        "events.txt": ["get", "events", "-A", "--sort-by=.lastTimestamp"],
        "pods.txt": ["get", "pods", "-A", "-o", "wide"],
        "operator.log": ["logs", "-n", "rljob-system", "deploy/rljob", "--tail=-1"],
        "kuberay.log": ["logs", "-n", "kuberay-system", "deploy/kuberay-operator", "--tail=-1"],
    }
    for file, args in dumps.items():
        (LOGS / file).write_text(kind.kubectl(*args, check=False))
    pods = kind.kubectl("get", "pods", "-n", JOB_NAMESPACE, "-o", "name", check=False).split()
    for pod in pods:
        text = kind.kubectl(
            "logs", "-n", JOB_NAMESPACE, pod, "--all-containers", "--tail=-1", check=False
        )
        (LOGS / f"{pod.replace('/', '-')}.log").write_text(text)
    return LOGS


def wait_until_finished(kind: Kind, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + SUCCEEDED_TIMEOUT_SECONDS
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = (kind.get("rljob", name, JOB_NAMESPACE) or {}).get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            return status
        time.sleep(10)
    raise AssertionError(f"RLJob {name} not finished after {SUCCEEDED_TIMEOUT_SECONDS}s: {status}")


# What a fresh namespace holds before any job: these are not the job's leftovers.
NAMESPACE_DEFAULTS = {"configmap/kube-root-ca.crt", "serviceaccount/default"}


def objects_left(kind: Kind) -> list[str]:
    """Everything in the job's own namespace that a job could have made (it holds nothing else)."""
    found = kind.kubectl(
        "get", "rayjobs,rayclusters,pods,services,jobs,configmaps,serviceaccounts,roles,rolebindings",
        "-n", JOB_NAMESPACE, "-o", "name",
    )  # fmt: skip
    left = []
    for name in found.split():
        resource, _, obj = name.partition("/")  # e.g. rayjob.ray.io/tiny-local
        if f"{resource.split('.')[0]}/{obj}" not in NAMESPACE_DEFAULTS:
            left.append(name)
    return left


def test_tiny_example_runs_to_succeeded_with_memory_status_and_leaves_nothing_behind(
    installed: Kind,
) -> None:
    kind = installed
    name = example_name()
    try:
        kind.kubectl("apply", "-n", JOB_NAMESPACE, "-f", str(EXAMPLE))
        status = wait_until_finished(kind, name)
        assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
        assert status["iteration"] >= 2, status
        memory = status["memory"]
        assert memory["capacityBytes"] > 0 and memory["device"]
        stages = {s["name"] for s in memory["stages"]}
        assert {Stage.TRAIN.value, Stage.ROLLOUT.value} <= stages, stages
        assert all(s["peakBytes"] > 0 for s in memory["stages"]), memory["stages"]

        selector = f"involvedObject.kind=RLJob,involvedObject.name={name}"
        listed = kind.kubectl(
            "get", "events", "-n", JOB_NAMESPACE, "-o", "json", "--field-selector", selector
        )
        events = json.loads(listed)["items"]
        reasons = {e["reason"] for e in events}
        assert "RayJobSucceeded" in reasons, reasons
        assert not [e for e in events if e["type"] == "Warning"], events

        assert objects_left(kind), "the RLJob had no children to delete"
        kind.kubectl("delete", "rljob", name, "-n", JOB_NAMESPACE, "--wait=true")
        deadline = time.monotonic() + GONE_TIMEOUT_SECONDS
        while (left := objects_left(kind)) and time.monotonic() < deadline:
            time.sleep(5)
        assert not left, f"left behind after deleting the RLJob: {left}"
    except BaseException:
        print(f"e2e failed; logs in {collect_logs(kind, name)}")
        raise
