"""`helm install` of charts/rljob into the real test plane: the operator then runs as a process
with a token of the chart's ServiceAccount and the arguments of the chart's Deployment.

There is no kubelet here, so the Deployment never runs a pod. The process reconciles
examples/tiny-local.yaml into a RayJob, is refused what the chart does not grant, and
`helm uninstall` leaves none of the release's objects behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import CHART, CLUSTER_SCOPED, ROOT, documents
from rljob_helpers import wait_for
from support.plane import ControlPlane, free_port

from rljob_operator.rbac import OPERATOR_RULES
from rljob_operator.render import DRIVER_ENTRYPOINT, config_map_name

INSTANCE = "app.kubernetes.io/instance"


# --- helm install into the real plane ----------------------------------------------------------


@dataclass
class Installed:
    release: str
    namespace: str
    service_account: str
    args: list[str]
    manifest: list[dict[str, Any]]
    notes: str


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    health_url: str
    metrics_url: str

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def _install(plane: ControlPlane, release: str, namespace: str, *values: str) -> Installed:
    plane.create_namespace(namespace)
    output = plane.helm(
        "install", release, str(CHART), "--namespace", namespace,
        "--set", f"leaderElection.peeringName={release}", *values,
    ).stdout  # fmt: skip
    manifest = documents(plane.helm("get", "manifest", release, "-n", namespace).stdout)
    (deployment,) = [d for d in manifest if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    notes = output.split("NOTES:", 1)[-1]
    return Installed(
        release, namespace, pod["serviceAccountName"], pod["containers"][0]["args"], manifest, notes
    )


def _run_operator(plane: ControlPlane, installed: Installed, log: Path) -> OperatorProcess:
    """`rljob operator` (the image's ENTRYPOINT) with the chart's args, as the chart's account."""
    kubeconfig = plane.sa_kubeconfig(installed.namespace, installed.service_account)
    # The chart's fixed ports may be taken on a shared machine; same flags, free ports.
    health_port, metrics_port = free_port(), free_port()
    args = [
        re.sub(r":\d+/healthz$", f":{health_port}/healthz", a)
        if a.startswith("--liveness=")
        else (f"--metrics-port={metrics_port}" if a.startswith("--metrics-port=") else a)
        for a in installed.args
    ]
    rljob = Path(sys.executable).parent / "rljob"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(rljob), "operator", *args],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return OperatorProcess(
        proc,
        log,
        f"http://127.0.0.1:{health_port}/healthz",
        f"http://127.0.0.1:{metrics_port}/metrics",
    )


def _healthy(op: OperatorProcess) -> bool:
    assert op.proc.poll() is None, f"operator exited ({op.proc.returncode}):\n{op.log_text()}"
    try:
        with urllib.request.urlopen(op.health_url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _stop(op: OperatorProcess) -> None:
    if op.proc.poll() is None:
        os.killpg(op.proc.pid, signal.SIGTERM)
        try:
            op.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(op.proc.pid, signal.SIGKILL)
            op.proc.wait()


def _forbidden(plane: ControlPlane, kubeconfig: Path, *args: str) -> bool:
    result = plane.kubectl(*args, kubeconfig=kubeconfig, check=False)
    return result.returncode != 0 and "forbidden" in result.stderr.lower()


def _labelled(plane: ControlPlane, release: str) -> list[str]:
    kinds = (
        "deployments,serviceaccounts,services,roles,rolebindings,configmaps,kopfpeerings,"
        "clusterroles,clusterrolebindings,clusterkopfpeerings"
    )
    found = plane.kubectl("get", kinds, "-A", "-l", f"{INSTANCE}={release}", "-o", "name")
    return found.stdout.split()


def _uninstall_and_expect_nothing_left(plane: ControlPlane, installed: Installed) -> None:
    plane.helm("uninstall", installed.release, "-n", installed.namespace, "--wait", "--timeout=60s")
    assert wait_for(
        "helm uninstall to remove every object of the release",
        lambda: not _labelled(plane, installed.release) or None,
        30,
    )
    plane.delete_namespace(installed.namespace)


def _apply_tiny_example(plane: ControlPlane, namespace: str) -> dict[str, Any]:
    example = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    example["metadata"]["namespace"] = namespace
    plane.apply_yaml(yaml.safe_dump(example))
    return example


def _rayjob(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    result = plane.kubectl("get", "rayjob", name, "-n", namespace, "-o", "yaml", check=False)
    return yaml.safe_load(result.stdout) if result.returncode == 0 else None


@pytest.fixture
def kuberay_crds(plane: ControlPlane) -> None:
    plane.install_kuberay_crds()


@pytest.fixture
def release_name(plane: ControlPlane, namespace: str) -> Iterator[str]:
    """A release name unique to the test; a test that failed half-way is uninstalled here."""
    release = f"rljob-{namespace}"
    yield release
    plane.helm("uninstall", release, "-n", f"{namespace}-sys", "--ignore-not-found", check=False)
    plane.delete_namespace(f"{namespace}-sys")


def test_helm_install_runs_the_operator_with_only_the_charts_grants_and_uninstalls_clean(
    plane: ControlPlane, namespace: str, kuberay_crds: None, release_name: str, tmp_path: Path
) -> None:
    installed = _install(plane, release_name, f"{namespace}-sys")
    # NOTES.txt tells the user what comes next, with files that exist.
    assert "kubectl get crd rayjobs.ray.io" in installed.notes
    assert "kubectl apply -f examples/tiny-local.yaml" in installed.notes
    for example in re.findall(r"examples/[\w-]+\.yaml", installed.notes):
        assert (ROOT / example).is_file(), example
    kinds = {name.split("/")[0].split(".")[0] for name in _labelled(plane, release_name)}
    assert {
        "deployment", "serviceaccount", "service", "clusterrole", "clusterrolebinding",
        "clusterkopfpeering",
    } <= kinds, kinds  # fmt: skip
    # The chart's scope table is the apiserver's: cluster-scoped names as discovery lists them.
    cluster_scoped = set(
        plane.kubectl("api-resources", "--namespaced=false", "-o", "name").stdout.split()
    )
    for rule in OPERATOR_RULES:
        for group in rule.api_groups:
            for resource in rule.resources:
                base = resource.split("/")[0]
                served = base if not group else f"{base}.{group}"
                assert ((group, base) in CLUSTER_SCOPED) == (served in cluster_scoped), served

    op = _run_operator(plane, installed, tmp_path / "operator.log")
    try:
        wait_for("the operator's /healthz (the chart's probes)", lambda: _healthy(op), 60)
        example = _apply_tiny_example(plane, namespace)
        name = example["metadata"]["name"]
        rayjob = wait_for(
            "the RayJob rendered from examples/tiny-local.yaml",
            lambda: _rayjob(plane, namespace, name),
            60,
        )
        assert rayjob["spec"]["entrypoint"] == DRIVER_ENTRYPOINT
        plane.kubectl("get", "configmap", config_map_name(name), "-n", namespace)
        phase = wait_for(
            "status.phase written by the operator",
            lambda: (
                yaml.safe_load(
                    plane.kubectl("get", "rljob", name, "-n", namespace, "-o", "yaml").stdout
                ).get("status")
                or {}
            ).get("phase"),
            30,
        )
        assert phase in {"Pending", "Starting", "Running"}, phase
        # The metrics Service's target port serves the operator's Prometheus metrics.
        with urllib.request.urlopen(op.metrics_url, timeout=5) as response:
            assert "rljob_reconcile_duration_seconds" in response.read().decode()

        # What the chart does not grant, the apiserver refuses to the operator's account.
        sa = plane.sa_kubeconfig(installed.namespace, installed.service_account)
        plane.kubectl("create", "secret", "generic", "keep-me", "-n", namespace)
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"{namespace}-node"}}
        plane.apply_yaml(yaml.safe_dump(node))
        assert _forbidden(plane, sa, "get", "secret", "keep-me", "-n", namespace)
        assert _forbidden(plane, sa, "delete", "secret", "keep-me", "-n", namespace)
        assert _forbidden(plane, sa, "delete", "node", f"{namespace}-node")
        assert _forbidden(plane, sa, "delete", "rayjob", name, "-n", namespace)
        assert _forbidden(plane, sa, "create", "clusterrolebinding", "x", "--clusterrole=admin")
        plane.kubectl("get", "secret", "keep-me", "-n", namespace)
        plane.kubectl("get", "rayjob", name, "-n", namespace)
        plane.kubectl("delete", "node", f"{namespace}-node")
    finally:
        _stop(op)

    _uninstall_and_expect_nothing_left(plane, installed)


def _operator_peering_step(
    plane: ControlPlane, name: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    """What the operator's pod does first (ensure_peering), with the environment given."""
    code = (
        "import sys; from kubernetes import config; config.load_kube_config(); "
        "from rljob_operator.main import ensure_peering; ensure_peering(sys.argv[1], [])"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, name],
        env={**os.environ, "KUBECONFIG": str(plane.kubeconfig), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_an_operator_pod_that_starts_before_helm_waits_for_the_releases_peering(
    plane: ControlPlane, namespace: str, kuberay_crds: None, release_name: str
) -> None:
    # Helm creates custom resources after the Deployment, so the operator pod can start before
    # its ClusterKopfPeering exists. Started by the chart (RLJOB_HELM_RELEASE), it waits.
    plane.kubectl("apply", "-f", str(CHART / "crds" / "kopf-peering.yaml"))
    waiting = _operator_peering_step(plane, release_name, {"RLJOB_HELM_RELEASE": release_name})
    try:
        time.sleep(4)
        assert waiting.poll() is None, waiting.communicate()[0]
        absent = plane.kubectl("get", "clusterkopfpeering", release_name, check=False)
        assert absent.returncode != 0 and "NotFound" in absent.stderr
        installed = _install(plane, release_name, f"{namespace}-sys")
        assert waiting.wait(timeout=30) == 0, waiting.communicate()[0]
    finally:
        if waiting.poll() is None:
            waiting.kill()
    made = plane.kubectl_json("get", "clusterkopfpeering", release_name)
    assert made["metadata"]["labels"][INSTANCE] == release_name  # Helm's, not the operator's
    _uninstall_and_expect_nothing_left(plane, installed)

    # Installed by hand (no release), the operator creates what is missing; had the chart's
    # pod done that, `helm install` would have failed on the object it found.
    stray = f"{release_name}-x"
    by_hand = _operator_peering_step(plane, stray, {})
    assert by_hand.wait(timeout=60) == 0, by_hand.communicate()[0]
    try:
        refused = plane.helm(
            "install", stray, str(CHART), "--namespace", f"{namespace}-sys", "--create-namespace",
            "--set", f"leaderElection.peeringName={stray}", check=False,
        )  # fmt: skip
        assert refused.returncode != 0 and "exists" in refused.stderr, refused.stderr
    finally:
        plane.helm("uninstall", stray, "-n", f"{namespace}-sys", "--ignore-not-found", check=False)
        plane.kubectl("delete", "clusterkopfpeering", stray, "--ignore-not-found")


def test_namespaced_install_reconciles_only_its_namespace(
    plane: ControlPlane, namespace: str, kuberay_crds: None, release_name: str, tmp_path: Path
) -> None:
    other = plane.create_namespace(f"{namespace}-other")
    installed = _install(
        plane, release_name, f"{namespace}-sys", "--set", f"watchNamespaces={{{namespace}}}"
    )
    op = _run_operator(plane, installed, tmp_path / "operator.log")
    try:
        wait_for("the operator's /healthz", lambda: _healthy(op), 60)
        outside = _apply_tiny_example(plane, other)
        inside = _apply_tiny_example(plane, namespace)
        wait_for(
            "the RayJob in the watched namespace",
            lambda: _rayjob(plane, namespace, inside["metadata"]["name"]),
            60,
        )
        # The watched job is reconciled; after that, a job outside has had its chance too.
        time.sleep(3)
        assert _rayjob(plane, other, outside["metadata"]["name"]) is None
        sa = plane.sa_kubeconfig(installed.namespace, installed.service_account)
        assert _forbidden(plane, sa, "get", "configmaps", "-n", other)
        assert _forbidden(plane, sa, "get", "rljobs", "-A")
    finally:
        _stop(op)
        plane.delete_namespace(other)
    _uninstall_and_expect_nothing_left(plane, installed)
