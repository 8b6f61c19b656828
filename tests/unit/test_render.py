"""Unit tests of the pure builders: every example renders to its golden children, and the
shape rules (GPU limits, TP env, /dev/shm, owner references, job identity) hold.

Regenerate the golden files after an intended change with
`RLJOB_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_render.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api import JobConfig, RLJobSpec, parse_manifest
from rljob_operator.render import (
    DRIVER_ENTRYPOINT,
    Owner,
    children,
    config_map,
    deeper_problems,
    ray_job,
)

ROOT = Path(__file__).parents[2]
GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
UID = "00000000-0000-0000-0000-000000000001"


def _load(path: Path) -> tuple[Owner, RLJobSpec]:
    name, spec = parse_manifest(yaml.safe_load(path.read_text()))
    return Owner(name=name, namespace="team-a", uid=UID), spec


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_renders_to_golden_children(path: Path) -> None:
    owner, spec = _load(path)
    rendered = yaml.safe_dump_all(children(owner, spec), sort_keys=False, width=100)
    golden = GOLDEN / f"{path.stem}.children.yaml"
    if os.environ.get("RLJOB_UPDATE_GOLDEN") == "1":
        golden.write_text(rendered)
    assert golden.read_text() == rendered, f"regenerate {golden.name} if the change is intended"


def _worker(rayjob: dict[str, Any]) -> dict[str, Any]:
    return rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def _spec(**sections: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(sections)


OWNER = Owner(name="j", namespace="ns", uid=UID)


@pytest.mark.parametrize(
    ("resources", "gpu_limit"),
    [({"workers": 2, "gpusPerWorker": 8}, 8), ({"workers": 1, "gpusPerWorker": 1}, 1)],
)
def test_worker_group_is_sized_from_resources(resources: dict[str, Any], gpu_limit: int) -> None:
    spec = _spec(resources=resources, data={"trainBatchSize": 16})  # a multiple of the ranks
    group = _worker(ray_job(OWNER, spec))
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == resources["workers"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == gpu_limit


def test_cpu_job_has_no_gpu_limit_and_advertises_one_cpu_per_rank() -> None:
    spec = _spec(
        rollout={"engine": "torch"},
        resources={"gpusPerWorker": 0, "cpuRanksPerWorker": 3},
        data={"trainBatchSize": 6},
    )
    group = _worker(ray_job(OWNER, spec))
    assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert group["rayStartParams"]["num-cpus"] == "3"


@pytest.mark.parametrize(("tp", "has_env"), [(1, False), (2, True), (8, True)])
def test_tp_memory_imbalance_check_disabled_only_when_tp_above_one(tp: int, has_env: bool) -> None:
    spec = _spec(rollout={"tensorParallelSize": tp}, resources={"gpusPerWorker": 8})
    env = _worker(ray_job(OWNER, spec))["template"]["spec"]["containers"][0].get("env", [])
    expected = {"name": "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK", "value": "True"}
    assert (expected in env) is has_env


def test_shm_is_memory_backed_and_sized_from_spec() -> None:
    pod = _worker(ray_job(OWNER, _spec(resources={"sharedMemory": "3Gi"})))["template"]["spec"]
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/dev/shm", "/etc/rljob"} <= mounts


def test_rayjob_runs_the_driver_in_k8s_job_mode_and_shuts_down() -> None:
    rayjob = ray_job(OWNER, _spec(suspend=True, ttlSecondsAfterFinished=30))
    assert rayjob["spec"]["entrypoint"] == DRIVER_ENTRYPOINT
    assert rayjob["spec"]["submissionMode"] == "K8sJobMode"
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    assert rayjob["spec"]["ttlSecondsAfterFinished"] == 30
    assert rayjob["spec"]["suspend"] is True


def test_scheduling_fields_reach_head_and_workers() -> None:
    spec = _spec(
        resources={
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "high",
        }
    )
    cluster = ray_job(OWNER, spec)["spec"]["rayClusterSpec"]
    for pod in (
        cluster["headGroupSpec"]["template"]["spec"],
        _worker({"spec": {"rayClusterSpec": cluster}})["template"]["spec"],
    ):
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["priorityClassName"] == "high"
        assert pod["serviceAccountName"] == "j-job"


@pytest.mark.parametrize(
    ("resources", "context"),
    [
        ({}, {"fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"}),
        ({"fsGroup": 2000}, {"fsGroup": 2000, "fsGroupChangePolicy": "OnRootMismatch"}),
        ({"fsGroup": "None"}, None),
    ],
)
def test_fs_group_reaches_head_and_workers_or_none_where_null(
    resources: dict[str, Any], context: dict[str, Any] | None
) -> None:
    cluster = ray_job(OWNER, _spec(resources=resources))["spec"]["rayClusterSpec"]
    for pod in (
        cluster["headGroupSpec"]["template"]["spec"],
        _worker({"spec": {"rayClusterSpec": cluster}})["template"]["spec"],
    ):
        assert pod.get("securityContext") == context


def test_every_child_is_controlled_by_the_rljob() -> None:
    for child in children(OWNER, _spec()):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "RLJob",
            "j",
            UID,
            True,
        )
        assert child["metadata"]["namespace"] == "ns"


def test_config_map_holds_the_spec_the_worker_reads_back() -> None:
    spec = _spec(rollout={"memFractionStatic": 0.93})
    text = config_map(OWNER, spec)["data"]["job.yaml"]
    config = JobConfig.from_yaml(text)
    assert (config.name, config.namespace, config.spec) == ("j", "ns", spec)


def test_job_role_grants_status_of_its_own_rljob_only() -> None:
    role = children(OWNER, _spec())[1]
    rules = [r for r in role["rules"] if r["apiGroups"] == ["rljob.dev"]]
    assert {tuple(r["resources"]): r["verbs"] for r in rules} == {
        ("rljobs",): ["get"],
        ("rljobs/status",): ["get", "patch"],
    }
    assert all(r["resourceNames"] == ["j"] for r in rules)


@pytest.mark.parametrize(("name", "problem"), [("a" * 47, None), ("a" * 48, "metadata.name")])
def test_names_longer_than_kuberay_allows_are_a_deeper_problem(
    name: str, problem: str | None
) -> None:
    found = [field for field, _ in deeper_problems(name, _spec())]
    assert found == ([problem] if problem else [])


def test_rays_memory_monitor_is_off_in_every_ray_container() -> None:
    """A host OOM must end as the kernel's OOMKilled (reported with the pod's limit), not as
    Ray's own task kill at 95% of the limit, which leaves the container running."""
    cluster = children(OWNER, _spec())[-1]["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in pods:
        (container,) = group["template"]["spec"]["containers"]
        assert {"name": "RAY_memory_monitor_refresh_ms", "value": "0"} in container["env"]
