"""The OOM policy acted on by the operator (issue 19), against the real apiserver with the
operator as a process: a CUDA OOM in a stage makes it start a new attempt (RayJob NAME-aN, its
knobs in the job config), status.attempts lists every attempt, each retry is one Warning Event,
a third OOM under maxRetries 2 ends the job Failed/OOMRetriesExhausted, no RayJob is created twice
across an operator restart, and maxRetries 0 keeps the old behaviour.

Stand-ins, named: the job's driver is either the real local driver with the worker's OOM
injection (`run_driver_with_injected_oom`, test_telemetry's DRIVER) or `publish_oom_as_driver_would`
(the driver's status publisher, with the job's own token, writing a CUDA OOM record);
`write_rayjob_status_as_kuberay_would` plays KubeRay failing the RayJob after the driver exits;
`write_pod_status_as_kubelet_would` plays the kubelet's OOMKilled.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import test_operator
from kubernetes import client
from rljob_helpers import Operator, api_client, wait_for
from test_failures import reasons
from test_operator import (
    ROLE,
    create,
    get,
    ray_items,
    status_of,
    write_rayjob_status_as_kuberay_would,
)
from test_telemetry import DRIVER, job_pod, write_pod_status_as_kubelet_would

from rljob.api import JOB_CONFIG_FILE, JobConfig, RLJobSpec, RLJobStatus
from rljob.report import OOMRecord, Stage
from rljob_worker.publish import StatusPublisher

# The operator tests' fixtures (module scope: one operator process for this module).
admin = test_operator.admin
operator = test_operator.operator

# One rank on the CPU, the tiny builtin model (test_telemetry's job), with the OOM policy on.
CPU_SPEC: dict[str, Any] = {
    "model": {"path": "builtin:tiny-qwen2", "dtype": "bfloat16"},
    "algorithm": {"name": "grpo", "groupSize": 2, "iterations": 2},
    "data": {"trainBatchSize": 2, "maxResponseLength": 4},
    "rollout": {"engine": "torch", "weightSyncBucketMegabytes": 1, "memFractionStatic": 0.85},
    "training": {"microBatchSize": 2},
    "resources": {"gpusPerWorker": 0, "cpuRanksPerWorker": 1},
}


def with_policy(max_retries: int, wake_up: str = "staged") -> dict[str, Any]:
    rollout = {**CPU_SPEC["rollout"], "wakeUp": wake_up}
    return {**CPU_SPEC, "rollout": rollout, "oomPolicy": {"maxRetries": max_retries}}


def job_token(plane: Any, admin: client.ApiClient, namespace: str, name: str) -> Path:
    """A kubeconfig as the job's ServiceAccount (its pods' token), once its binding exists."""
    rbac = client.RbacAuthorizationV1Api(admin)
    wait_for(
        f"RoleBinding {name}-job",
        lambda: any(
            b.metadata and b.metadata.name == f"{name}-job"
            for b in rbac.list_namespaced_role_binding(namespace).items
        ),
    )
    return Path(plane.sa_kubeconfig(namespace, f"{name}-job"))


def run_driver_with_injected_oom(
    token: Path, namespace: str, name: str, spec: dict[str, Any], inject: str
) -> str:
    """The real local driver (as the head pod runs it) with the worker's OOM injection."""
    spec_json = RLJobSpec.model_validate_json(json.dumps(spec)).model_dump_json()
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(token), namespace, name, spec_json, inject],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "KUBECONFIG": "/nonexistent"},  # only the job's token is used
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout


def _after(rayjob: dict[str, Any], seconds: int = 1) -> str:
    """A time `seconds` after the RayJob was created (an attempt OOMs after it starts); waits
    for it to pass so no record lies in the future."""
    created = datetime.datetime.fromisoformat(
        rayjob["metadata"]["creationTimestamp"].replace("Z", "+00:00")
    )
    when = created + datetime.timedelta(seconds=seconds)
    while datetime.datetime.now(datetime.UTC) < when:
        time.sleep(0.1)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def publish_oom_as_driver_would(
    token: Path, namespace: str, name: str, rayjob: dict[str, Any], stage: Stage, rank: int = 0,
    skew_seconds: int = 0,
) -> None:  # fmt: skip
    """Stand-in for the driver of the attempt `rayjob` runs: its CUDA OOM record, through the
    driver's own publisher with the job's token, the RLJob's uid and the attempt's number from
    its job config (the pod template's labels carry the same), then its exit (the caller fails
    the RayJob). `skew_seconds`: the driver's node clock that far off the apiserver's."""
    when = datetime.datetime.fromisoformat(_after(rayjob).replace("Z", "+00:00"))
    oom = OOMRecord(
        time=(when + datetime.timedelta(seconds=skew_seconds)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        kind="CUDAOutOfMemory", stage=stage, iteration=1, rank=rank,
        requested_bytes=1 << 30, free_bytes=1 << 20, message="CUDA out of memory.",
    )  # fmt: skip
    labels = rayjob["metadata"]["labels"]
    publisher = StatusPublisher.from_env_or_kubeconfig(
        namespace, name, str(token),
        uid=labels["rljob.dev/job-uid"], attempt=int(labels["rljob.dev/attempt"]),
    )  # fmt: skip
    status = RLJobStatus(iteration=1, oom_events=[oom], oom_counts={"CUDAOutOfMemory": 1})  # type: ignore[list-item]
    publisher.publish(status, [oom])


def job_config(admin: client.ApiClient, namespace: str, name: str) -> JobConfig:
    found = client.CoreV1Api(admin).read_namespaced_config_map(f"{name}-job-config", namespace)
    assert found.data is not None
    return JobConfig.from_yaml(found.data[JOB_CONFIG_FILE])


def rayjob_names(admin: client.ApiClient, namespace: str) -> list[str]:
    return sorted(r["metadata"]["name"] for r in ray_items(admin, namespace, "rayjobs"))


def mirrored(admin: client.ApiClient, namespace: str, name: str, rayjob: str) -> bool:
    return (status_of(admin, namespace, name).get("rayJob") or {}).get("name") == rayjob


def fail_attempt(
    admin: client.ApiClient, token: Path, namespace: str, name: str, rayjob_name: str,
    stage: Stage = Stage.WAKE_KV_CACHE, skew_seconds: int = 0,
) -> None:  # fmt: skip
    """An OOM in `stage` of the attempt `rayjob_name`, then KubeRay's failure."""
    rayjob = wait_for(
        f"RayJob {rayjob_name}", lambda: get(admin, namespace, "rayjobs", rayjob_name)
    )
    publish_oom_as_driver_would(token, namespace, name, rayjob, stage, skew_seconds=skew_seconds)
    write_rayjob_status_as_kuberay_would(admin, namespace, rayjob_name, "FAILED", "Failed")


def test_an_injected_oom_in_wake_kv_cache_starts_attempt_two_with_the_fraction_lowered(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    spec = with_policy(2)
    create(admin, namespace, "kv", spec)
    token = job_token(plane, admin, namespace, "kv")
    first = wait_for("RayJob kv", lambda: get(admin, namespace, "rayjobs", "kv"))
    _after(first)
    out = run_driver_with_injected_oom(token, namespace, "kv", spec, "wake_kv_cache@iteration=1")
    assert "ooms: 1" in out, out
    write_rayjob_status_as_kuberay_would(admin, namespace, "kv", "FAILED", "Failed")
    second = wait_for("RayJob kv-a2", lambda: get(admin, namespace, "rayjobs", "kv-a2"))
    wait_for("status mirrors kv-a2", lambda: mirrored(admin, namespace, "kv", "kv-a2"))
    # The old RayJob is kept; the new one is owned by the RLJob like every child.
    assert rayjob_names(admin, namespace) == ["kv", "kv-a2"]
    assert get(admin, namespace, "rayjobs", "kv") is not None
    owner = second["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "RLJob" and owner["name"] == "kv"
    config = job_config(admin, namespace, "kv")
    assert config.attempt == 2 and config.knobs is not None
    assert (config.knobs.mem_fraction_static, config.knobs.wake_up) == (0.8, "staged")
    assert config.spec.rollout.mem_fraction_static == 0.85  # the user's spec is unchanged
    status = status_of(admin, namespace, "kv")
    assert status["phase"] in ("Pending", "Starting")
    one, two = status["attempts"]
    assert (one["attempt"], one["rayJob"], one["memFractionStatic"], one["wakeUp"]) == (
        1, "kv", 0.85, "staged",
    )  # fmt: skip
    assert (one["result"], one["oomStage"], one["oomRank"]) == (
        "CUDAOutOfMemory",
        "wake_kv_cache",
        0,
    )
    assert "attempt 2 runs with rollout.memFractionStatic 0.85 -> 0.8" in one["message"]
    assert (two["attempt"], two["rayJob"], two["memFractionStatic"], two["result"]) == (
        2, "kv-a2", 0.8, "Running",
    )  # fmt: skip
    wait_for("OOMRetry Warning", lambda: "OOMRetry" in reasons(admin, namespace, "kv"))
    time.sleep(1.0)  # any duplicate would have been posted by now
    assert reasons(admin, namespace, "kv").count("OOMRetry") == 1
    # The new attempt runs: the RLJob follows its RayJob, not the old one.
    write_rayjob_status_as_kuberay_would(admin, namespace, "kv-a2", "RUNNING", "Running")
    wait_for("phase Running", lambda: status_of(admin, namespace, "kv")["phase"] == "Running")


def test_single_goes_staged_then_lower_and_a_third_oom_exhausts_the_retries(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "three", with_policy(2, "single"))
    token = job_token(plane, admin, namespace, "three")
    fail_attempt(admin, token, namespace, "three", "three")
    wait_for("RayJob three-a2", lambda: get(admin, namespace, "rayjobs", "three-a2"))
    knobs = wait_for("a2's job config", lambda: job_config(admin, namespace, "three").knobs)
    assert (knobs.mem_fraction_static, knobs.wake_up) == (0.85, "staged")
    wait_for("status mirrors three-a2", lambda: mirrored(admin, namespace, "three", "three-a2"))
    fail_attempt(admin, token, namespace, "three", "three-a2")
    wait_for("RayJob three-a3", lambda: get(admin, namespace, "rayjobs", "three-a3"))
    wait_for("status mirrors three-a3", lambda: mirrored(admin, namespace, "three", "three-a3"))
    config = job_config(admin, namespace, "three")
    assert config.attempt == 3 and config.knobs is not None
    assert (config.knobs.mem_fraction_static, config.knobs.wake_up) == (0.8, "staged")
    fail_attempt(admin, token, namespace, "three", "three-a3")
    wait_for("phase Failed", lambda: status_of(admin, namespace, "three")["phase"] == "Failed")
    status = status_of(admin, namespace, "three")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "OOMRetriesExhausted"
    assert "attempt 3" in failed["message"] and "maxRetries=2" in failed["message"]
    assert [(a["attempt"], a["rayJob"], a["memFractionStatic"], a["wakeUp"], a["result"])
            for a in status["attempts"]] == [
        (1, "three", 0.85, "single", "CUDAOutOfMemory"),
        (2, "three-a2", 0.85, "staged", "CUDAOutOfMemory"),
        (3, "three-a3", 0.8, "staged", "CUDAOutOfMemory"),
    ]  # fmt: skip
    assert all(a["oomStage"] == "wake_kv_cache" for a in status["attempts"])
    wait_for(
        "OOMRetriesExhausted Warning",
        lambda: "OOMRetriesExhausted" in reasons(admin, namespace, "three"),
    )
    time.sleep(1.0)
    warnings = reasons(admin, namespace, "three")
    assert warnings.count("OOMRetry") == 2 and warnings.count("OOMRetriesExhausted") == 1
    assert rayjob_names(admin, namespace) == ["three", "three-a2", "three-a3"]


def test_a_retry_whose_rayjob_the_apiserver_turned_away_is_applied_once_it_can(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """Attempt 2's RayJob is refused by a quota (403, retried): status says ApplyRetrying, and
    once the quota is gone the operator applies it by itself (its startup check every 10 s),
    not only at the startup deadline."""
    core = client.CoreV1Api(admin)
    quota = client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="one-rayjob"),
        spec=client.V1ResourceQuotaSpec(hard={"count/rayjobs.ray.io": "1"}),
    )
    core.create_namespaced_resource_quota(namespace, quota)

    def counted() -> bool:
        held = core.read_namespaced_resource_quota("one-rayjob", namespace).status
        return bool(held is not None and held.hard)

    wait_for("quota counted", counted)
    create(admin, namespace, "stall", with_policy(1))
    token = job_token(plane, admin, namespace, "stall")
    fail_attempt(admin, token, namespace, "stall", "stall")

    def spec_applied() -> dict[str, Any]:
        conditions = status_of(admin, namespace, "stall").get("conditions") or []
        return next((c for c in conditions if c["type"] == "SpecApplied"), {})

    wait_for("ApplyRetrying", lambda: spec_applied().get("reason") == "ApplyRetrying", 60)
    assert "exceeded quota" in spec_applied()["message"]
    time.sleep(12)  # a startup check passes: still refused, still retrying
    assert rayjob_names(admin, namespace) == ["stall"]
    core.delete_namespaced_resource_quota("one-rayjob", namespace)
    wait_for("RayJob stall-a2", lambda: get(admin, namespace, "rayjobs", "stall-a2"), 60)
    wait_for("status mirrors stall-a2", lambda: mirrored(admin, namespace, "stall", "stall-a2"))
    assert spec_applied()["status"] == "True"


def failed_without_oom(
    plane: Any, admin: client.ApiClient, namespace: str, name: str
) -> tuple[Path, dict[str, Any], Callable[[], dict[str, Any]]]:
    """Attempt 1 of a job with maxRetries 1, failed by KubeRay before any OOM record (Failed):
    the job's token, its RayJob, and a reader of status.attempts[0]."""
    create(admin, namespace, name, with_policy(1))
    token = job_token(plane, admin, namespace, name)
    rayjob = wait_for(f"RayJob {name}", lambda: get(admin, namespace, "rayjobs", name))
    write_rayjob_status_as_kuberay_would(admin, namespace, name, "FAILED", "Failed")

    def first() -> dict[str, Any]:
        return dict((status_of(admin, namespace, name).get("attempts") or [{}])[0])

    wait_for("attempt 1 Failed", lambda: first().get("result") == "Failed")
    assert status_of(admin, namespace, name)["phase"] == "Failed"
    assert first()["startedAt"] == rayjob["metadata"]["creationTimestamp"]
    return token, rayjob, first


def test_a_late_oom_whose_step_failed_at_its_event_is_taken_by_the_operator_itself(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """KubeRay fails attempt 1 first (Failed, no OOM seen yet); the driver's OOM record comes
    later, and the operator's reads at that event fail (403: its RayJob `get` is revoked for
    the moment). Nothing about the job changes after that, yet once the operator can read
    again it decides by itself (its check every 10 s while the policy owes a step) and starts
    attempt 2. Before, such a job stayed Failed with its OOM undecided until some other
    change of the RLJob or an operator restart."""
    token, rayjob, first = failed_without_oom(plane, admin, namespace, "tardy")

    rbac = client.RbacAuthorizationV1Api(admin)
    role = rbac.read_cluster_role(ROLE)
    kept = copy.deepcopy(role.rules)
    for rule in role.rules or []:
        if "rayjobs" in (rule.resources or []):
            rule.verbs = [v for v in rule.verbs if v != "get"]
    rbac.replace_cluster_role(ROLE, role)
    as_operator = client.CustomObjectsApi(api_client(operator.kubeconfig))

    def refused() -> bool:
        try:
            as_operator.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "tardy")
        except client.ApiException as exc:
            return exc.status == 403
        return False

    try:
        wait_for("the operator's RayJob get refused", refused)
        seen = operator.log.stat().st_size
        publish_oom_as_driver_would(token, namespace, "tardy", rayjob, Stage.WAKE_KV_CACHE)
        wait_for(
            "the event's step failing",
            lambda: (
                f"{namespace}/tardy: OOM policy attempt not advanced yet"
                in operator.log.read_bytes()[seen:].decode(errors="replace")
            ),
        )
        # The events that write brings (the derived oomTotal, its own echo) settle while the
        # reads still fail: after this nothing about the job changes any more.
        time.sleep(5)
        assert first()["result"] == "Failed"
        assert get(admin, namespace, "rayjobs", "tardy-a2") is None
    finally:
        role = rbac.read_cluster_role(ROLE)
        role.rules = kept
        rbac.replace_cluster_role(ROLE, role)
    wait_for("RayJob tardy-a2", lambda: get(admin, namespace, "rayjobs", "tardy-a2"), 60)
    decided = first()
    assert (decided["result"], decided["oomStage"]) == ("CUDAOutOfMemory", "wake_kv_cache")
    assert "attempt 2 runs with" in decided["message"]


def test_a_late_oom_after_kuberay_deleted_the_failed_rayjob_is_decided_from_the_mirror(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """KubeRay fails attempt 1 and deletes its RayJob (DELETE_RAYJOB_CR_AFTER_JOB_FINISHES,
    the operator's ttlSecondsAfterFinished 0); then the driver's OOM record lands. The policy
    decides from status's mirror of the RayJob (name, status, startedAt): attempt 2 starts, and
    the failed attempt's RayJob is not applied (run) again. Before, nothing happened: the
    Failed job kept its OOM undecided."""
    token, rayjob, first = failed_without_oom(plane, admin, namespace, "gone")
    client.CustomObjectsApi(admin).delete_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", "gone"
    )
    wait_for("RayJob gone deleted", lambda: get(admin, namespace, "rayjobs", "gone") is None)
    publish_oom_as_driver_would(token, namespace, "gone", rayjob, Stage.WAKE_KV_CACHE)
    wait_for("RayJob gone-a2", lambda: get(admin, namespace, "rayjobs", "gone-a2"), 60)
    assert first()["result"] == "CUDAOutOfMemory"
    time.sleep(2)
    assert get(admin, namespace, "rayjobs", "gone") is None  # attempt 1 is not run again


def test_no_rayjob_is_created_twice_across_operator_restarts(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "restart", with_policy(2))
    token = job_token(plane, admin, namespace, "restart")
    first = wait_for("RayJob restart", lambda: get(admin, namespace, "rayjobs", "restart"))
    wait_for("attempt 1 in status", lambda: status_of(admin, namespace, "restart").get("attempts"))
    # The attempt fails while the operator is down: the resumed operator decides from status.
    operator.stop()
    publish_oom_as_driver_would(token, namespace, "restart", first, Stage.WAKE_KV_CACHE)
    write_rayjob_status_as_kuberay_would(admin, namespace, "restart", "FAILED", "Failed")
    operator.start()
    second = wait_for(
        "RayJob restart-a2", lambda: get(admin, namespace, "rayjobs", "restart-a2"), 60
    )
    wait_for(
        "status mirrors restart-a2", lambda: mirrored(admin, namespace, "restart", "restart-a2")
    )
    before = status_of(admin, namespace, "restart")
    assert [a["attempt"] for a in before["attempts"]] == [1, 2]
    # Restart again: every RayJob and RLJob is listed afresh; nothing is decided or made twice.
    offset = len(operator.log.read_text())
    operator.stop()
    operator.start()
    marker = f"reconciled RLJob {namespace}/restart"
    wait_for("operator resumed the RLJob", lambda: marker in operator.log.read_text()[offset:], 60)
    time.sleep(2.0)  # let it see both RayJobs again
    uids = {
        r["metadata"]["name"]: r["metadata"]["uid"] for r in ray_items(admin, namespace, "rayjobs")
    }
    assert uids == {"restart": first["metadata"]["uid"], "restart-a2": second["metadata"]["uid"]}
    after = status_of(admin, namespace, "restart")
    assert after["attempts"] == before["attempts"]
    assert job_config(admin, namespace, "restart").attempt == 2
    assert reasons(admin, namespace, "restart").count("OOMRetry") == 1


def test_max_retries_zero_keeps_todays_behaviour(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "once", with_policy(0))
    token = job_token(plane, admin, namespace, "once")
    fail_attempt(admin, token, namespace, "once", "once")
    wait_for("phase Failed", lambda: status_of(admin, namespace, "once").get("phase") == "Failed")
    failed = next(
        c for c in status_of(admin, namespace, "once")["conditions"] if c["type"] == "Failed"
    )
    assert failed["reason"] == "RayJobFailed"
    time.sleep(2.0)  # a retry would have been made by now
    assert rayjob_names(admin, namespace) == ["once"]
    status = status_of(admin, namespace, "once")
    assert "attempts" not in status and status["phase"] == "Failed"
    assert "OOMRetry" not in reasons(admin, namespace, "once")
    assert job_config(admin, namespace, "once").attempt == 1


def test_a_container_oomkilled_is_not_retried_and_names_the_limit(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create(admin, namespace, "host", with_policy(2))
    rayjob = wait_for("RayJob host", lambda: get(admin, namespace, "rayjobs", "host"))
    _after(rayjob)
    job_pod(admin, namespace, "host", "host-workers-0")  # limits memory 1Gi
    write_pod_status_as_kubelet_would(admin, namespace, "host-workers-0", restarts=0)
    wait_for("the kill in status", lambda: status_of(admin, namespace, "host").get("oomTotal"))
    write_rayjob_status_as_kuberay_would(admin, namespace, "host", "FAILED", "Failed")
    wait_for(
        "Failed OOMKilled",
        lambda: any(c["type"] == "Failed" and c["reason"] == "OOMKilled"
                    for c in status_of(admin, namespace, "host").get("conditions") or []),
    )  # fmt: skip
    status = status_of(admin, namespace, "host")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert str(1 << 30) in failed["message"] and "host-workers-0" in failed["message"]
    assert [a["result"] for a in status["attempts"]] == ["OOMKilled"]
    time.sleep(1.0)
    assert rayjob_names(admin, namespace) == ["host"]
    assert "OOMRetry" not in reasons(admin, namespace, "host")
