"""What the chart tests share: rendering the chart with the real helm, its generated RBAC data file,
and the rules of operator/rljob_operator/rbac.py flattened for comparison.

`RLJOB_UPDATE_GOLDEN=1` rewrites the generated files (rules data, golden renders) from the sources.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from rljob_operator.rbac import OPERATOR_RULES, Rule

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rljob"
RULES_FILE = CHART / "files" / "operator-rules.yaml"
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("RLJOB_UPDATE_GOLDEN") == "1"

# Cluster-scoped resources rbac.py may name. A Role cannot grant these, so the namespaced chart
# puts them in its small ClusterRole; test_chart checks this table against the apiserver's own
# discovery, so a wrong entry fails there rather than in a user's cluster.
CLUSTER_SCOPED: frozenset[tuple[str, str]] = frozenset(
    {
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("", "namespaces"),
        ("", "nodes"),
        ("", "persistentvolumes"),
        ("kopf.dev", "clusterkopfpeerings"),
        ("rbac.authorization.k8s.io", "clusterroles"),
        ("rbac.authorization.k8s.io", "clusterrolebindings"),
        ("scheduling.k8s.io", "priorityclasses"),
        ("storage.k8s.io", "storageclasses"),
    }
)

HEADER = (
    "# Generated from operator/rljob_operator/rbac.py by tests/controlplane/chart_support.py\n"
    "# (RLJOB_UPDATE_GOLDEN=1 pytest tests/controlplane/test_chart.py). Do not edit by hand:\n"
    "# tests/controlplane/test_chart.py fails when this file and rbac.py differ.\n"
)

Grant = tuple[str, str, str, str]  # (apiGroup, resource, verb, resourceName or "")


def _is_cluster_scoped(group: str, resource: str) -> bool:
    return (group, resource.split("/")[0]) in CLUSTER_SCOPED


def _split(rule: Rule) -> dict[str, dict[str, Any]]:
    """The rule's resources by scope (a rule may mix them, e.g. kopf's two peering kinds)."""
    parts: dict[str, dict[str, Any]] = {}
    for scope in ("clusterScoped", "namespaced"):
        resources = [
            r
            for r in rule.resources
            if all(_is_cluster_scoped(g, r) == (scope == "clusterScoped") for g in rule.api_groups)
        ]
        if resources:
            entry: dict[str, Any] = {
                "why": rule.why,
                "apiGroups": list(rule.api_groups),
                "resources": resources,
                "verbs": list(rule.verbs),
            }
            if rule.resource_names:
                entry["resourceNames"] = list(rule.resource_names)
            parts[scope] = entry
    return parts


def rules_data() -> dict[str, list[dict[str, Any]]]:
    """rbac.py's OPERATOR_RULES as the chart reads them: {clusterScoped: [...], namespaced: [...]}."""
    data: dict[str, list[dict[str, Any]]] = {"clusterScoped": [], "namespaced": []}
    for rule in OPERATOR_RULES:
        for scope, entry in _split(rule).items():
            data[scope].append(entry)
    return data


def rules_file_text() -> str:
    return HEADER + yaml.safe_dump(rules_data(), sort_keys=False, width=100)


def grants(rules: list[dict[str, Any]]) -> set[Grant]:
    """PolicyRules flattened to single grants, so equal permissions compare equal."""
    return {
        (group, resource, verb, name)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
        for name in rule.get("resourceNames") or [""]
    }


def rbac_py_grants() -> set[Grant]:
    return grants([rule.to_k8s() for rule in OPERATOR_RULES])


def helm(helm_bin: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """helm without a cluster (lint, template); plane.helm runs the ones that need one."""
    result = subprocess.run(
        [str(helm_bin), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


def kube_version() -> str:
    """The plane's Kubernetes version: helm template's own default (v1.20) is below kubeVersion."""
    for line in (ROOT / "hack" / "versions.env").read_text().splitlines():
        if line.startswith("K8S_VERSION="):
            return line.split("=", 1)[1].strip()
    raise AssertionError("hack/versions.env has no K8S_VERSION")


def template(
    helm_bin: Path, *args: str, release: str = "rljob", namespace: str = "rljob-system"
) -> str:
    return helm(
        helm_bin, "template", release, str(CHART), "--namespace", namespace,
        "--kube-version", kube_version(), *args,
    ).stdout  # fmt: skip


def documents(rendered: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def by_kind(rendered: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents(rendered) if doc["kind"] == kind]
