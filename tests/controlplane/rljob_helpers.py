"""Helpers shared by the RLJob control-plane tests: API clients on the test plane, CRD install,
and waiting with a deadline (never an unbounded sleep loop)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from support.processes import wait_for  # noqa: F401  (re-exported for the tests)

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
