"""Per-stage memory and OOMs end to end on the real apiserver (RBAC on): a real local driver
writing its RLJob's status with the per-job ServiceAccount's token, the operator (a real process
with --metrics-port) turning OOMKilled pods into status and Events, metrics, and the kubectl view.

Stand-ins, named: `write_pod_status_as_kubelet_would` plays the kubelet (no kubelet runs here; the
test creates the job's pods itself, labelled as KubeRay labels them, and writes their
containerStatuses); `write_rayjob_status_as_kuberay_would` plays KubeRay's status writes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families
from rljob_helpers import (
    admin_kubeconfig,
    api_client,
    grant_operator_rbac,
    install_rljob_crds,
    pod_labels,
    rljob,
    wait_for,
)

from rljob import kubectl_plugin
from rljob.api import GROUP, PLURAL, VERSION, RLJobStatus, WakeUp
from rljob.report import STAGE_ORDER, MemorySummary, OOMRecord, Stage, StageMemory
from rljob_operator.oom import MAX_KILLED_ENTRIES
from rljob_worker.publish import StatusPublisher
from rljob_worker.stages import stage_order

SA_NAMESPACE, SA_NAME = "rljob-telemetry", "rljob-operator"
ROLE = "rljob-operator-telemetry"
ITERATIONS = 2
# One rank on the CPU, the tiny builtin model: the real colocated loop, as small as it goes.
CPU_SPEC: dict[str, Any] = {
    "model": {"path": "builtin:tiny-qwen2", "dtype": "bfloat16"},
    "algorithm": {"name": "grpo", "groupSize": 2, "iterations": ITERATIONS},
    "data": {"trainBatchSize": 2, "maxResponseLength": 4},
    "rollout": {"engine": "torch", "weightSyncBucketMegabytes": 1},
    "training": {"microBatchSize": 2},
    "resources": {"gpusPerWorker": 0, "cpuRanksPerWorker": 1},
}
# The local driver with the publishing hook, as `rljob run --publish NS/NAME` will run it.
DRIVER = """
import sys
from rljob.api import RLJobSpec
from rljob_worker.driver.local import run_local
from rljob_worker.memory import OOMInjection
from rljob_worker.publish import PublishingListener, StatusPublisher

kubeconfig, namespace, name, spec_json, inject = sys.argv[1:6]
spec = RLJobSpec.model_validate_json(spec_json)
publisher = StatusPublisher.from_env_or_kubeconfig(namespace, name, kubeconfig)
listener = PublishingListener(publisher, spec.world_size)
run = run_local(spec, spec.world_size, "cpu", on_event=listener,
                inject_oom=OOMInjection.from_env(inject) if inject else None, grace_seconds=5)
listener.flush()
print("failures:", listener.failures, "ooms:", len(run.ooms), "errors:", list(run.errors))
sys.exit(1 if listener.failures else 0)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Operator:
    """`python -m rljob_operator.main --standalone --metrics-port P` as its own account."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.kubeconfig, self.log, self.port = kubeconfig, log, _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        argv = [sys.executable, "-m", "rljob_operator.main", "--standalone"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*argv, "--metrics-port", str(self.port)], env=env, stdout=out, stderr=out
            )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@pytest.fixture(scope="module")
def admin(plane: Any) -> client.ApiClient:
    install_rljob_crds(plane)
    plane.install_kuberay_crds()
    return api_client(admin_kubeconfig(plane))


@pytest.fixture(scope="module")
def operator(plane: Any, admin: client.ApiClient, tmp_path_factory: Any) -> Iterator[Operator]:
    proc = Operator(
        grant_operator_rbac(plane, SA_NAMESPACE, SA_NAME, ROLE),
        tmp_path_factory.mktemp("op") / "operator.log",
    )
    proc.start()
    yield proc
    proc.stop()
    plane.kubectl("delete", "clusterrolebinding", ROLE, "clusterrole", ROLE, "--ignore-not-found")


def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def status_of(admin: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    found: Any = custom(admin).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return dict(found.get("status") or {})


def events_for(admin: client.ApiClient, namespace: str, name: str) -> list[client.CoreV1Event]:
    return list(
        client.CoreV1Api(admin)
        .list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=RLJob"
        )
        .items
    )


def create_job(
    admin: client.ApiClient, plane: Any, namespace: str, name: str,
    spec: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Create the RLJob; once the operator made its account and binding, a kubeconfig that
    authenticates as the job's ServiceAccount (the token its pods get)."""
    custom(admin).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, rljob(name, spec or CPU_SPEC)
    )
    rbac = client.RbacAuthorizationV1Api(admin)

    def bound() -> bool:
        try:
            rbac.read_namespaced_role_binding(f"{name}-job", namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    wait_for(f"RoleBinding {name}-job", bound)
    wait_for("phase set", lambda: status_of(admin, namespace, name).get("phase"))
    return Path(plane.sa_kubeconfig(namespace, f"{name}-job"))


def run_driver(kubeconfig: Path, namespace: str, name: str, inject: str = "") -> str:
    spec = json.dumps(rljob(name, CPU_SPEC)["spec"])
    from rljob.api import RLJobSpec

    spec_json = RLJobSpec.model_validate_json(spec).model_dump_json()
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(kubeconfig), namespace, name, spec_json, inject],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KUBECONFIG": "/nonexistent"},  # only the job's token is used
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout


def job_pod(admin: client.ApiClient, namespace: str, job: str, name: str) -> None:
    """A pod of the job as KubeRay makes it (its template labels carry rljob.dev/job)."""
    manifest: Any = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {**pod_labels(admin, namespace, job), "ray.io/group": "w"},
        },
        "spec": {
            "containers": [
                {
                    "name": "ray-worker",
                    "image": "rljob/worker:test",
                    "resources": {"limits": {"memory": "1Gi", "cpu": "1"}},
                }
            ]
        },
    }
    client.CoreV1Api(admin).create_namespaced_pod(namespace, manifest)


def write_pod_status_as_kubelet_would(
    admin: client.ApiClient, namespace: str, pod: str, restarts: int
) -> None:
    """Stand-in for the kubelet: the container was OOMKilled (exit 137); with restarts > 0 the
    kubelet restarted it, so the kill is lastState and the container runs again."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    killed = {"reason": "OOMKilled", "exitCode": 137, "startedAt": now, "finishedAt": now}
    container: dict[str, Any] = {
        "name": "ray-worker",
        "image": "rljob/worker:test",
        "imageID": "",
        "ready": restarts > 0,
        "restartCount": restarts,
    }
    if restarts == 0:
        container["state"] = {"terminated": killed}
    else:
        container["state"] = {"running": {"startedAt": now}}
        container["lastState"] = {"terminated": killed}
    client.CoreV1Api(admin).patch_namespaced_pod_status(
        pod, namespace, {"status": {"phase": "Running", "containerStatuses": [container]}}
    )


def write_rayjob_status_as_kuberay_would(
    admin: client.ApiClient, namespace: str, name: str, job_status: str, deployment: str
) -> None:
    custom(admin).patch_namespaced_custom_object_status(
        "ray.io", "v1", namespace, "rayjobs", name,
        {"status": {"jobStatus": job_status, "jobDeploymentStatus": deployment}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


def killed_count(admin: client.ApiClient, namespace: str, name: str) -> int:
    return int((status_of(admin, namespace, name).get("oomCounts") or {}).get("OOMKilled") or 0)


def _at_least(admin: client.ApiClient, namespace: str, name: str, kills: int) -> Any:
    return lambda: killed_count(admin, namespace, name) >= kills


def synthetic_status(iteration: int, ooms: list[OOMRecord]) -> RLJobStatus:
    """What a driver reports after `iteration` (figures made up; the write path is real)."""
    stages = [
        StageMemory(name=s, peak_bytes=(i + 1) * 1000 + iteration, peak_fraction=(i + 1) / 10,
                    seconds=0.1, rank=i % 2)
        for i, s in enumerate(STAGE_ORDER)
    ]  # fmt: skip
    memory = MemorySummary(
        iteration=iteration, kind="cuda", device="test", capacity_bytes=10_000, stages=stages
    )
    return RLJobStatus(
        iteration=iteration,
        memory=memory,
        oom_events=ooms[-10:],  # type: ignore[arg-type]
        oom_counts={"CUDAOutOfMemory": len(ooms)} if ooms else {},
    )


def cuda_oom(iteration: int) -> OOMRecord:
    return OOMRecord(
        time=f"2026-05-09T10:00:{iteration % 60:02d}Z", kind="CUDAOutOfMemory",
        stage=STAGE_ORDER[iteration % 7], iteration=iteration, rank=0, requested_bytes=1 << 30,
        free_bytes=1 << 20, message="CUDA out of memory.",
    )  # fmt: skip


def test_driver_with_the_job_account_writes_its_status_and_is_refused_on_another_job(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    token = create_job(admin, plane, namespace, "drv")
    create_job(admin, plane, namespace, "other")
    run_driver(token, namespace, "drv")
    status = status_of(admin, namespace, "drv")
    assert status["iteration"] == ITERATIONS
    # Staged's stages; the checkpoint stage runs only for a job with spec.checkpoint (not this).
    assert [s["name"] for s in status["memory"]["stages"]] == [
        s.value for s in stage_order(WakeUp.STAGED)
    ]
    assert status["memory"]["kind"] == "host" and status["memory"]["capacityBytes"] > 0
    assert [p["iteration"] for p in status["memoryHistory"]] == list(range(ITERATIONS + 1))
    # The learning figures per iteration, through the CRD's schema (an unknown field is pruned).
    assert [m["iteration"] for m in status["metrics"]] == list(range(ITERATIONS + 1))
    assert all("rewardMean" in m for m in status["metrics"])
    assert "policyLoss" in status["metrics"][-1] and "policyLoss" not in status["metrics"][0]
    assert status["phase"]  # the operator's fields survived the driver's writes
    worst = max(s["peakFraction"] for s in status["memory"]["stages"])
    assert wait_for(
        "worstStageFraction derived by the operator",
        lambda: status_of(admin, namespace, "drv").get("worstStageFraction") == worst,
    )
    assert "IterationCompleted" in {e.reason for e in events_for(admin, namespace, "drv")}
    # Printer columns.
    table = plane.kubectl("get", "rljobs", "drv", "-n", namespace).stdout
    assert "WORST-STAGE" in table and "OOMS" in table and str(worst) in table
    # The same token may not write another RLJob's status.
    other = StatusPublisher.from_env_or_kubeconfig(namespace, "other", str(token))
    with pytest.raises(ApiException) as refused:
        other.publish(RLJobStatus.model_validate({"iteration": 9}))
    assert refused.value.status == 403
    assert "iteration" not in status_of(admin, namespace, "other")
    # The kubectl view reads the same status.
    kubeconfig = ["--kubeconfig", str(admin_kubeconfig(plane))]
    assert kubectl_plugin.main([*kubeconfig, "describe", "drv", "-n", namespace]) == 0
    out = tmp_path / "memory.png"
    assert kubectl_plugin.main([*kubeconfig, "plot", "drv", "-n", namespace, "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    curve = tmp_path / "curve.png"
    assert (
        kubectl_plugin.main([*kubeconfig, "curve", "drv", "-n", namespace, "-o", str(curve)]) == 0
    )
    assert curve.read_bytes()[:4] == b"\x89PNG"


# Every stage this job runs (staged, no spec.checkpoint: tests/worker/test_checkpoint_resume.py
# has the checkpoint stage's OOM retry).
@pytest.mark.parametrize("stage", stage_order(WakeUp.STAGED))
def test_oom_injected_in_a_stage_is_in_status_and_an_event(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str, stage: Stage
) -> None:
    name = f"oom-{stage.value.replace('_', '-')}"
    token = create_job(admin, plane, namespace, name)
    run_driver(token, namespace, name, inject=f"{stage.value}@iteration=1")
    status = status_of(admin, namespace, name)
    [entry] = status["oomEvents"]
    assert (entry["kind"], entry["stage"], entry["rank"], entry["iteration"]) == (
        "CUDAOutOfMemory", stage.value, 0, 1,
    )  # fmt: skip
    assert entry["requestedBytes"] > 0 and status["oomCounts"] == {"CUDAOutOfMemory": 1}
    warnings = [e for e in events_for(admin, namespace, name) if e.reason == "CUDAOutOfMemory"]
    assert len(warnings) == 1 and warnings[0].type == "Warning"
    assert f"stage {stage.value}" in str(warnings[0].message) and "rank 0" in str(
        warnings[0].message
    )
    assert wait_for("oomTotal", lambda: status_of(admin, namespace, name).get("oomTotal") == 1)


def test_oomkilled_pod_appears_in_status_and_events_within_5s(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create_job(admin, plane, namespace, "kill")
    job_pod(admin, namespace, "kill", "kill-workers-0")
    start = time.monotonic()
    write_pod_status_as_kubelet_would(admin, namespace, "kill-workers-0", restarts=0)
    wait_for("OOMKilled in status", lambda: killed_count(admin, namespace, "kill") == 1, 5)
    wait_for(
        "OOMKilled Event",
        lambda: "OOMKilled" in {e.reason for e in events_for(admin, namespace, "kill")},
        max(0.1, 5 - (time.monotonic() - start)),
    )
    [entry] = status_of(admin, namespace, "kill")["oomEvents"]
    assert (entry["pod"], entry["container"], entry["limitBytes"]) == (
        "kill-workers-0", "ray-worker", 2**30,
    )  # fmt: skip
    # The kubelet restarts it: the same kill, now as lastState, is not counted again.
    write_pod_status_as_kubelet_would(admin, namespace, "kill-workers-0", restarts=1)
    time.sleep(1.5)
    assert killed_count(admin, namespace, "kill") == 1


def test_a_thousand_kills_keep_status_bounded_and_the_count_right(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    create_job(admin, plane, namespace, "many")
    pods = [f"many-workers-{i:03d}" for i in range(200)]
    for pod in pods:
        job_pod(admin, namespace, "many", pod)
    for round_ in range(5):  # every pod's container killed 5 times: 1,000 kills
        for pod in pods:
            write_pod_status_as_kubelet_would(admin, namespace, pod, restarts=round_ + 1)
        target = len(pods) * (round_ + 1)
        wait_for(f"{target} kills", _at_least(admin, namespace, "many", target), 150)
    time.sleep(1.0)
    status = status_of(admin, namespace, "many")
    assert status["oomCounts"]["OOMKilled"] == 1000 and status["oomTotal"] == 1000
    entries = status["oomEvents"]
    # The last N containers killed, each at its 5th kill (their earlier kills, made while other
    # containers held the list, are in the total and in Events).
    assert len(entries) == MAX_KILLED_ENTRIES and all(e["restartCount"] == 5 for e in entries)
    assert len(json.dumps(status)) < 16_000


def test_operator_restart_loses_no_memory_or_oom_field(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    token = create_job(admin, plane, namespace, "keep")
    publisher = StatusPublisher.from_env_or_kubeconfig(namespace, "keep", str(token))
    ooms = [cuda_oom(0), cuda_oom(1)]
    for iteration in range(3):
        publisher.publish(synthetic_status(iteration, ooms), [])
    job_pod(admin, namespace, "keep", "keep-workers-0")
    write_pod_status_as_kubelet_would(admin, namespace, "keep-workers-0", restarts=1)
    wait_for(
        "kill and derived fields", lambda: status_of(admin, namespace, "keep").get("oomTotal") == 3
    )
    fields = ("iteration", "memory", "memoryHistory", "oomEvents", "oomCounts",
              "worstStageFraction", "oomTotal", "phase")  # fmt: skip
    before = {k: status_of(admin, namespace, "keep")[k] for k in fields}
    offset = len(operator.log.read_text())
    operator.stop()
    operator.start()
    marker = f"reconciled RLJob {namespace}/keep"
    wait_for("operator resumed", lambda: marker in operator.log.read_text()[offset:], 60)
    time.sleep(2.0)  # let the resumed operator see the pod again (its kill must not recount)
    after = status_of(admin, namespace, "keep")
    assert {k: after.get(k) for k in fields} == before


def test_a_new_driver_keeps_the_cuda_ooms_an_earlier_one_wrote(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """An OOM retry's attempt 2 (or a resumed job) runs a new driver under the same field
    manager: its first apply, with no OOMs of its own yet, must not delete attempt 1's."""
    token = create_job(admin, plane, namespace, "again")
    first = StatusPublisher.from_env_or_kubeconfig(namespace, "again", str(token))
    first.publish(synthetic_status(0, [cuda_oom(0), cuda_oom(1)]), [])
    wait_for("two CUDA OOMs", lambda: status_of(admin, namespace, "again").get("oomTotal") == 2)
    second = StatusPublisher.from_env_or_kubeconfig(namespace, "again", str(token))
    second.publish(synthetic_status(0, []), [])
    second.publish(synthetic_status(1, [cuda_oom(5)]), [])
    status = status_of(admin, namespace, "again")
    assert status["oomCounts"] == {"CUDAOutOfMemory": 3}
    assert [e["iteration"] for e in status["oomEvents"]] == [0, 1, 5]
    assert wait_for("oomTotal 3", lambda: status_of(admin, namespace, "again").get("oomTotal") == 3)


def test_operator_and_job_writes_interleaved_100_times_lose_nothing(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    token = create_job(admin, plane, namespace, "mix")
    publisher = StatusPublisher.from_env_or_kubeconfig(namespace, "mix", str(token))
    pods = [f"mix-workers-{i:03d}" for i in range(100)]
    for pod in pods:
        job_pod(admin, namespace, "mix", pod)
    ooms: list[OOMRecord] = []
    phases = [("RUNNING", "Running", "Running"), ("PENDING", "Initializing", "Starting")]

    def job_side() -> None:
        for i in range(100):
            if i % 10 == 0:
                ooms.append(cuda_oom(i))
            publisher.publish(synthetic_status(i, ooms), [])

    writer = threading.Thread(target=job_side)
    writer.start()
    for i, pod in enumerate(pods):  # the operator's inputs: kills and RayJob transitions
        write_pod_status_as_kubelet_would(admin, namespace, pod, restarts=0)
        job_status, deployment, _ = phases[i % 2]
        write_rayjob_status_as_kuberay_would(admin, namespace, "mix", job_status, deployment)
    writer.join()
    wait_for("100 kills", lambda: killed_count(admin, namespace, "mix") == 100, 60)
    wait_for(
        "phase Starting", lambda: status_of(admin, namespace, "mix").get("phase") == "Starting"
    )
    status = status_of(admin, namespace, "mix")
    assert status["iteration"] == 99 and status["memory"]["iteration"] == 99
    assert len(status["memoryHistory"]) == 100
    assert status["oomCounts"] == {"CUDAOutOfMemory": 10, "OOMKilled": 100}
    kinds = [e["kind"] for e in status["oomEvents"]]
    assert kinds.count("CUDAOutOfMemory") == 10 and kinds.count("OOMKilled") == MAX_KILLED_ENTRIES
    assert {c["type"] for c in status["conditions"]} >= {"Created", "Running"}
    assert wait_for(
        "oomTotal 110", lambda: status_of(admin, namespace, "mix").get("oomTotal") == 110
    )


def test_scraped_metrics_match_status(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    token = create_job(admin, plane, namespace, "scrape")
    publisher = StatusPublisher.from_env_or_kubeconfig(namespace, "scrape", str(token))
    publisher.publish(synthetic_status(4, [cuda_oom(3)]), [cuda_oom(3)])
    job_pod(admin, namespace, "scrape", "scrape-workers-0")
    write_pod_status_as_kubelet_would(admin, namespace, "scrape-workers-0", restarts=0)
    wait_for("oomTotal 2", lambda: status_of(admin, namespace, "scrape").get("oomTotal") == 2)
    status = status_of(admin, namespace, "scrape")
    job = (("job", "scrape"), ("namespace", namespace))

    def matches() -> bool:
        got = operator.scrape()
        stages_ok = all(
            got.get(("rljob_stage_peak_fraction", tuple(sorted((*job, ("stage", s["name"]))))))
            == s["peakFraction"]
            for s in status["memory"]["stages"]
        )
        kinds_ok = all(
            got.get(("rljob_ooms", tuple(sorted((*job, ("kind", k)))))) == v
            for k, v in status["oomCounts"].items()
        )
        return (
            stages_ok
            and kinds_ok
            and got.get(("rljob_iteration", job)) == status["iteration"]
            and got.get(("rljob_jobs", (("phase", status["phase"]),)), 0) >= 1
            and got.get(("rljob_reconcile_duration_seconds_count", (("handler", "reconcile"),)), 0)
            >= 1
        )

    assert wait_for("metrics equal to status", matches, 15)
    got = operator.scrape()
    peak = {s["name"]: s["peakBytes"] for s in status["memory"]["stages"]}
    for stage, value in peak.items():
        key = tuple(sorted((*job, ("stage", stage), ("kind", "cuda"), ("device", "test"))))
        assert got[("rljob_stage_peak_bytes", key)] == value
    recent = tuple(sorted((*job, ("kind", "CUDAOutOfMemory"), ("stage", cuda_oom(3).stage or ""))))
    assert got[("rljob_recent_ooms", recent)] == 1


def _reasons(admin: client.ApiClient, namespace: str, name: str) -> dict[str, int]:
    """How many Events of each reason the RLJob has (an Event posted twice counts 2, or has
    count 2 where the apiserver aggregated it)."""
    counts: dict[str, int] = {}
    for event in events_for(admin, namespace, name):
        reason = str(event.reason)
        counts[reason] = counts.get(reason, 0) + (event.count or 1)
    return counts


# The operator refuses checkpoints on no volume (storage.py): the news tests' /data is one.
DATA_VOLUME: dict[str, Any] = {
    "volumes": [{"name": "data", "emptyDir": {}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
}


def test_checkpoint_news_is_one_event_each_also_after_an_operator_restart(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """The driver's status.checkpoint, .resumedFrom, .export and .checkpointFailure become
    Events (once each, not again after a restart), the attempt's resumedFrom, and Failed with
    reason CheckpointFailed. The driver's writes are the real StatusPublisher's with the job's
    token; KubeRay's FAILED is the stand-in write_rayjob_status_as_kuberay_would."""
    from rljob.api import CheckpointFailure, CheckpointStatus, ExportStatus, ResumePoint

    root = "/data/ckpt"
    spec = {**CPU_SPEC, "checkpoint": {"path": root}, **DATA_VOLUME}
    token = create_job(admin, plane, namespace, "news", spec)
    publisher = StatusPublisher.from_env_or_kubeconfig(namespace, "news", str(token), attempt=1)

    def checkpoint(iteration: int) -> CheckpointStatus:
        return CheckpointStatus(
            iteration=iteration, path=f"{root}/iteration-{iteration:08d}",
            completed_at="2026-11-26T05:00:00Z", bytes=1600000, seconds=0.05,
        )  # fmt: skip

    resumed = ResumePoint(iteration=1, path=f"{root}/iteration-00000001")
    publisher.publish(RLJobStatus(iteration=2, resumed_from=resumed, checkpoint=checkpoint(2)))
    wait_for(
        "CheckpointWritten and ResumedFromCheckpoint",
        lambda: (
            _reasons(admin, namespace, "news").get("CheckpointWritten") == 1
            and _reasons(admin, namespace, "news").get("ResumedFromCheckpoint") == 1
        ),
    )
    export = ExportStatus(path="/data/export", iteration=3)
    publisher.publish(
        RLJobStatus(iteration=3, resumed_from=resumed, checkpoint=checkpoint(3), export=export)
    )
    wait_for("the second CheckpointWritten and ExportWritten", lambda: (
        _reasons(admin, namespace, "news").get("CheckpointWritten") == 2
        and _reasons(admin, namespace, "news").get("ExportWritten") == 1
    ))  # fmt: skip
    attempts = wait_for(
        "attempt 1's resumedFrom",
        lambda: [a for a in status_of(admin, namespace, "news").get("attempts") or []
                 if a.get("resumedFrom")],
    )  # fmt: skip
    assert attempts[0]["attempt"] == 1
    assert attempts[0]["resumedFrom"] == {"iteration": 1, "path": f"{root}/iteration-00000001"}
    messages = {e.message for e in events_for(admin, namespace, "news")}
    assert f"checkpoint of iteration 3 complete in {root}/iteration-00000003 (1.5 MiB, 0.05 s)" in (
        messages
    )

    failure = CheckpointFailure(
        iteration=4, path=f"{root}/iteration-00000004", rank=1,
        error=f"[Errno 28] No space left on device: '{root}/iteration-00000004/state/__1_0.distcp'",
    )  # fmt: skip
    publisher.publish(
        RLJobStatus(
            iteration=3, resumed_from=resumed, checkpoint=checkpoint(3), export=export,
            checkpoint_failure=failure,
        )
    )  # fmt: skip
    write_rayjob_status_as_kuberay_would(admin, namespace, "news", "FAILED", "Failed")

    def failed() -> dict[str, Any] | None:
        for c in status_of(admin, namespace, "news").get("conditions") or []:
            if c["type"] == "Failed" and c["status"] == "True":
                return dict(c)
        return None

    condition = wait_for("Failed", failed)
    assert condition["reason"] == "CheckpointFailed", condition
    assert "iteration 4" in condition["message"] and "[Errno 28]" in condition["message"]
    assert status_of(admin, namespace, "news")["phase"] == "Failed"
    warnings = [e for e in events_for(admin, namespace, "news") if e.reason == "CheckpointFailed"]
    assert warnings and all(e.type == "Warning" for e in warnings)
    assert any("[Errno 28]" in (e.message or "") for e in warnings)

    before = _reasons(admin, namespace, "news")
    offset = len(operator.log.read_text())
    operator.stop()
    operator.start()
    marker = f"reconciled RLJob {namespace}/news"
    wait_for("operator resumed", lambda: marker in operator.log.read_text()[offset:], 60)
    time.sleep(3.0)  # the resumed operator has listed the RLJob and its RayJob again
    assert _reasons(admin, namespace, "news") == before
    assert before["CheckpointWritten"] == 2 and before["ResumedFromCheckpoint"] == 1


def test_a_checkpoint_failure_written_after_kuberays_failure_still_names_the_failure(
    plane: Any, operator: Operator, admin: client.ApiClient, namespace: str
) -> None:
    """The other order: KubeRay's FAILED is mirrored first (Failed, RayJobFailed), then the
    driver's status.checkpointFailure lands. Failed then says CheckpointFailed too, without
    waiting for another RayJob change."""
    from rljob.api import CheckpointFailure

    root = "/data/ckpt"
    spec = {**CPU_SPEC, "checkpoint": {"path": root}, **DATA_VOLUME}
    token = create_job(admin, plane, namespace, "late", spec)
    write_rayjob_status_as_kuberay_would(admin, namespace, "late", "FAILED", "Failed")

    def failed() -> dict[str, Any] | None:
        for c in status_of(admin, namespace, "late").get("conditions") or []:
            if c["type"] == "Failed" and c["status"] == "True":
                return dict(c)
        return None

    assert wait_for("Failed", failed)["reason"] == "RayJobFailed"
    publisher = StatusPublisher.from_env_or_kubeconfig(namespace, "late", str(token), attempt=1)
    failure = CheckpointFailure(
        iteration=2, path=f"{root}/iteration-00000002", rank=0,
        error=f"[Errno 28] No space left on device: '{root}/iteration-00000002'",
    )  # fmt: skip
    publisher.publish(RLJobStatus(iteration=1, checkpoint_failure=failure))
    condition = wait_for(
        "Failed with reason CheckpointFailed",
        lambda: (c := failed()) is not None and c["reason"] == "CheckpointFailed" and c,
    )
    assert "iteration 2" in condition["message"] and "[Errno 28]" in condition["message"]
    assert status_of(admin, namespace, "late")["phase"] == "Failed"
    warnings = [e for e in events_for(admin, namespace, "late") if e.reason == "CheckpointFailed"]
    assert warnings and all(e.type == "Warning" for e in warnings)
