"""Unit tests of the RBAC rule list the operator, its tests and the Helm chart share."""

from __future__ import annotations

from rljob_operator.main import peering_priority
from rljob_operator.rbac import OPERATOR_RULES, job_rules, operator_cluster_role


def _verbs(group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in OPERATOR_RULES
        if group in rule.api_groups and resource in rule.resources
        for verb in rule.verbs
    }


def test_operator_never_deletes_children_the_garbage_collector_does() -> None:
    assert all("delete" not in rule.verbs and "*" not in rule.verbs for rule in OPERATOR_RULES)


def test_operator_can_apply_every_child_it_renders() -> None:
    for group, resource in [
        ("ray.io", "rayjobs"),
        ("", "configmaps"),
        ("", "serviceaccounts"),
        ("rbac.authorization.k8s.io", "roles"),
        ("rbac.authorization.k8s.io", "rolebindings"),
    ]:
        assert {"get", "create", "patch"} <= _verbs(group, resource), resource


def test_operator_holds_every_verb_it_grants_to_a_job_so_no_escalate_is_needed() -> None:
    for rule in job_rules("j"):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= _verbs(group, resource), (group, resource)


def test_job_rules_pin_status_to_one_rljob() -> None:
    (status_rule,) = [r for r in job_rules("mine") if "rljobs/status" in r["resources"]]
    assert status_rule["resourceNames"] == ["mine"]
    assert set(status_rule["verbs"]) == {"get", "patch"}


def test_job_may_patch_only_the_status_of_its_own_rljob_never_the_spec() -> None:
    granted = {
        (resource, verb, tuple(rule.get("resourceNames", ())))
        for rule in job_rules("mine")
        if "rljob.dev" in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert ("rljobs", "patch", ("mine",)) not in granted
    assert {("rljobs", "get", ("mine",)), ("rljobs/status", "patch", ("mine",))} <= granted


def test_cluster_role_manifest_carries_the_rules() -> None:
    role = operator_cluster_role("x")
    assert role["kind"] == "ClusterRole" and role["metadata"]["name"] == "x"
    assert len(role["rules"]) == len(OPERATOR_RULES)


def test_older_replica_gets_the_higher_peering_priority() -> None:
    # kopf pauses the lower priority; the replica that started first must keep acting.
    older = [peering_priority(1000.0) for _ in range(50)]
    newer = [peering_priority(1000.001) for _ in range(50)]
    assert min(older) > max(newer)
