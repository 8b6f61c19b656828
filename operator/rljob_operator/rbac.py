"""The RBAC rules the operator and each job's pods need: the one list tests and the chart share.

`OPERATOR_RULES` is what the operator's ServiceAccount is bound to (a ClusterRole); `job_role`
is the per-RLJob least-privilege Role bound to the RayJob's pods (issue 9, item 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rljob.api import GROUP, PLURAL


@dataclass(frozen=True)
class Rule:
    """One rbac.authorization.k8s.io/v1 PolicyRule, with a reason a reviewer can check."""

    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str
    resource_names: tuple[str, ...] = field(default=())

    def to_k8s(self) -> dict[str, Any]:
        rule: dict[str, Any] = {
            "apiGroups": list(self.api_groups),
            "resources": list(self.resources),
            "verbs": list(self.verbs),
        }
        if self.resource_names:
            rule["resourceNames"] = list(self.resource_names)
        return rule


# No `delete` anywhere: children go by owner references (the garbage collector deletes them),
# and no `escalate`/`bind`: the per-job Role grants only verbs the operator itself holds.
OPERATOR_RULES: tuple[Rule, ...] = (
    Rule(
        (GROUP,),
        (PLURAL,),
        ("get", "list", "watch", "patch"),
        "watch RLJobs; kopf's progress annotations and its startup timer's finalizer",
    ),
    Rule((GROUP,), (f"{PLURAL}/status",), ("get", "patch"), "write phase, conditions, rayJob"),
    Rule(
        ("ray.io",),
        ("rayjobs",),
        ("get", "list", "watch", "create", "patch"),
        "server-side apply the RayJob; mirror its status",
    ),
    Rule(("ray.io",), ("rayclusters",), ("get", "list", "watch"), "report the cluster's state"),
    Rule(
        ("",),
        ("configmaps",),
        ("get", "list", "watch", "create", "patch"),
        "server-side apply the worker's job config",
    ),
    Rule(("",), ("pods",), ("get", "list", "watch"), "see OOMKilled containers of the job"),
    Rule(
        ("",),
        ("persistentvolumeclaims",),
        ("get",),
        "read a mounted claim's access modes (ReadWriteOnce on pods of several nodes)",
    ),
    Rule(
        ("",),
        ("events",),
        ("get", "create", "patch"),
        "Events on RLJobs (kopf posts core/v1); a cause's Event is read to count on",
    ),
    Rule(("events.k8s.io",), ("events",), ("create", "patch"), "Events through events/v1"),
    Rule(("",), ("serviceaccounts",), ("get", "create", "patch"), "per-job ServiceAccount"),
    Rule(
        ("rbac.authorization.k8s.io",),
        ("roles", "rolebindings"),
        ("get", "create", "patch"),
        "per-job Role and RoleBinding",
    ),
    # kopf's framework: it watches CRDs and namespaces to (re)discover what it serves.
    Rule(
        ("apiextensions.k8s.io",),
        ("customresourcedefinitions",),
        ("list", "watch"),
        "kopf discovers served resources",
    ),
    Rule(("",), ("namespaces",), ("list", "watch"), "kopf follows namespace patterns"),
    # kopf peering: keep-alives so only one replica acts (see main.py).
    Rule(
        ("kopf.dev",),
        ("clusterkopfpeerings", "kopfpeerings"),
        ("get", "list", "watch", "create", "patch"),
        "peering between operator replicas; main.py creates the peering object if missing",
    ),
)


def operator_rules() -> list[dict[str, Any]]:
    """The PolicyRules of the operator's ClusterRole, in Kubernetes shape."""
    return [rule.to_k8s() for rule in OPERATOR_RULES]


def operator_cluster_role(name: str = "rljob-operator") -> dict[str, Any]:
    """The operator's ClusterRole manifest (the chart renders the same rules)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": operator_rules(),
    }


def job_rules(rljob_name: str) -> list[dict[str, Any]]:
    """The per-RLJob Role's rules: read that one RLJob, patch its status only, post Events.

    `resourceNames` pins both rules to the job's own object, so a job's pods cannot write
    another job's status (the apiserver refuses it); `patch` is on the status subresource
    alone, so they cannot change their own spec either (seen on kind: with `patch` on
    `rljobs` too, the driver's token could patch its own RLJob's spec).
    """
    return [
        Rule(
            (GROUP,),
            (PLURAL,),
            ("get",),
            "the driver reads its own RLJob (uid for Events)",
            (rljob_name,),
        ).to_k8s(),
        Rule(
            (GROUP,),
            (f"{PLURAL}/status",),
            ("get", "patch"),
            "the driver writes iteration, memory, CUDA OOMs",
            (rljob_name,),
        ).to_k8s(),
        Rule(("",), ("events",), ("create",), "Events from the driver").to_k8s(),
        Rule(("events.k8s.io",), ("events",), ("create",), "Events from the driver").to_k8s(),
    ]
