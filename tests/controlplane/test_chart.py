"""The Helm chart charts/rljob without a cluster: lint, golden renders, schema refusals, RBAC equal
to rbac.py, and the single sources (rules file, CRD copies) kept identical.

The real `helm install` into the test plane is in test_chart_install.py.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import (
    CHART,
    CLUSTER_SCOPED,
    GOLDEN,
    ROOT,
    RULES_FILE,
    UPDATE,
    by_kind,
    grants,
    helm,
    kube_version,
    rbac_py_grants,
    rules_file_text,
    template,
)
from support.plane import Binaries

NAMESPACED_VALUES = GOLDEN / "values-namespaced.yaml"
RENDERS = {"default": [], "namespaced": ["--values", str(NAMESPACED_VALUES)]}


@pytest.fixture(scope="module")
def helm_bin() -> Path:
    return Binaries.locate().helm


# --- single sources ------------------------------------------------------------------------


def test_chart_rules_file_is_generated_from_rbac_py() -> None:
    if UPDATE:
        RULES_FILE.write_text(rules_file_text())
    assert RULES_FILE.read_text() == rules_file_text(), (
        f"{RULES_FILE.relative_to(ROOT)} differs from operator/rljob_operator/rbac.py; "
        "regenerate it: RLJOB_UPDATE_GOLDEN=1 pytest tests/controlplane/test_chart.py"
    )


def test_chart_crds_are_the_repository_crds_byte_for_byte() -> None:
    repo = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert repo, "crds/ is empty"
    assert sorted(chart) == sorted(repo)
    stale = [name for name in repo if chart[name] != repo[name]]
    assert not stale, f"charts/rljob/crds/ is stale for {stale}: `make crd` copies crds/ there"


def test_chart_app_version_is_the_project_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # image.tag defaults to appVersion: the operator image built from this tree.
    assert chart["appVersion"] == project["version"]


# --- lint, golden renders, schema ----------------------------------------------------------


@pytest.mark.parametrize("values", list(RENDERS), ids=list(RENDERS))
def test_helm_lint_is_clean(helm_bin: Path, values: str) -> None:
    result = helm(helm_bin, "lint", "--strict", str(CHART), *RENDERS[values])
    assert "0 chart(s) failed" in result.stdout, result.stdout


@pytest.mark.parametrize("values", list(RENDERS), ids=list(RENDERS))
def test_helm_template_matches_the_golden_render(helm_bin: Path, values: str) -> None:
    rendered = template(helm_bin, *RENDERS[values])
    golden = GOLDEN / f"chart-{values}.yaml"
    if UPDATE:
        golden.write_text(rendered)
    assert golden.is_file(), f"{golden} missing: RLJOB_UPDATE_GOLDEN=1 writes it"
    assert rendered == golden.read_text(), (
        f"`helm template` differs from {golden.name}; review the diff and regenerate with "
        "RLJOB_UPDATE_GOLDEN=1 pytest tests/controlplane/test_chart.py"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "replicas=0"], r"at '/replicas': minimum: got 0, want 1"),
        (["--set", "image.pullPolicy=Sometimes"], r"at '/image/pullPolicy': value must be one of"),
        (["--set", "watchNamespaces={Team_A}"], r"at '/watchNamespaces/0'.*does not match pattern"),
        (["--set", "watchNamespace=team-a"], r"additional properties 'watchNamespace' not allowed"),
        (["--set", "podSecurityContext.runAsNonRoot=false"], r"at '/podSecurityContext/runAsNon"),
        (["--set", "securityContext.allowPrivilegeEscalation=true"], r"allowPrivilegeEscalation"),
        (
            ["--set", "metrics.port=70000"],
            r"at '/metrics/port': maximum: got 70,?000, want 65,?535",
        ),
        (["--set", "extraArgs={standalone}"], r"at '/extraArgs/0'.*does not match pattern '\^--'"),
        (
            ["--set", "leaderElection.enabled=false", "--set", "replicas=2"],
            r"replicas=2 needs leaderElection.enabled=true",
        ),
    ],
    ids=[
        "replicas-0",
        "pull-policy",
        "namespace-name",
        "misspelt-key",
        "root",
        "privilege-escalation",
        "port",
        "extra-arg",
        "standalone-replicas",
    ],
)
def test_wrong_values_are_refused_with_a_message_naming_the_value(
    helm_bin: Path, args: list[str], message: str
) -> None:
    result = helm(
        helm_bin, "template", "rljob", str(CHART), "--kube-version", kube_version(), *args,
        check=False,
    )  # fmt: skip
    assert result.returncode != 0, f"helm accepted {args}"
    assert re.search(message, result.stderr), result.stderr


# --- what the renders say --------------------------------------------------------------------


def _operator_container(rendered: str) -> dict[str, Any]:
    (deployment,) = by_kind(rendered, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_default_render_grants_exactly_rbac_py_cluster_wide(helm_bin: Path) -> None:
    rendered = template(helm_bin)
    (role,) = by_kind(rendered, "ClusterRole")
    assert grants(role["rules"]) == rbac_py_grants()
    assert not by_kind(rendered, "Role")
    (binding,) = by_kind(rendered, "ClusterRoleBinding")
    (account,) = by_kind(rendered, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "rljob-system"}
    ]


def test_namespaced_render_puts_rbac_py_in_a_role_per_namespace(helm_bin: Path) -> None:
    rendered = template(helm_bin, *RENDERS["namespaced"])
    watched = yaml.safe_load(NAMESPACED_VALUES.read_text())["watchNamespaces"]
    (cluster_role,) = by_kind(rendered, "ClusterRole")
    roles = by_kind(rendered, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
    assert sorted(b["metadata"]["namespace"] for b in by_kind(rendered, "RoleBinding")) == sorted(
        watched
    )
    cluster_grants = grants(cluster_role["rules"])
    # The ClusterRole keeps only what a Role cannot grant; everything else is per namespace.
    assert {(g, r.split("/")[0]) for g, r, _, _ in cluster_grants} <= CLUSTER_SCOPED
    for role in roles:
        assert grants(role["rules"]) | cluster_grants == rbac_py_grants()
    args = _operator_container(rendered)["args"]
    assert [a for a in args if a.startswith("--namespace=")] == [
        f"--namespace={n}" for n in watched
    ]
    assert sorted(p["metadata"]["namespace"] for p in by_kind(rendered, "KopfPeering")) == sorted(
        watched
    )


def test_operator_pod_is_restricted_and_probed_on_kopfs_liveness_endpoint(helm_bin: Path) -> None:
    rendered = template(helm_bin)
    (deployment,) = by_kind(rendered, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _operator_container(rendered)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"] and container["resources"]["requests"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--liveness=http://0.0.0.0:{ports['health']}/healthz" in container["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert f"--metrics-port={ports['metrics']}" in container["args"]
    (service,) = by_kind(rendered, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert not by_kind(rendered, "ServiceMonitor")
    monitored = template(helm_bin, "--set", "metrics.serviceMonitor.enabled=true")
    (monitor,) = by_kind(monitored, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_standalone_render_drops_peering_and_never_runs_two_operators(helm_bin: Path) -> None:
    rendered = template(helm_bin, "--set", "leaderElection.enabled=false")
    assert "--standalone" in _operator_container(rendered)["args"]
    assert not by_kind(rendered, "ClusterKopfPeering")
    (deployment,) = by_kind(rendered, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
