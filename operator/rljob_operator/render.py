"""Pure builders: an RLJob's spec in, the manifests of its children out (no API calls).

Children: the job-config ConfigMap, the KubeRay RayJob, and the job's own ServiceAccount, Role
and RoleBinding. Every child carries a controller owner reference to the RLJob, so the
garbage collector deletes them with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob.api import (
    API_VERSION,
    JOB_CONFIG_DIR,
    JOB_CONFIG_FILE,
    JOB_CONFIG_VOLUME,
    KIND,
    NO_FS_GROUP,
    RAY_MEMORY_MONITOR_ENV,
    SGL_TP_IMBALANCE_ENV,
    SGLANG_TP_IMBALANCE_ENV,
    SHM_DIR,
    SHM_VOLUME,
    AttemptKnobs,
    JobConfig,
    RLJobSpec,
    _quantity,
    name_problems,
)
from rljob.oom_policy import rayjob_name
from rljob_operator.identity import ATTEMPT_LABEL, JOB_UID_LABEL
from rljob_operator.rbac import job_rules
from rljob_operator.storage import storage_problems

# The Ray driver the RayJob runs (built in worker_image/rljob_worker/driver/ray_main.py).
DRIVER_MODULE = "rljob_worker.driver.ray_main"
DRIVER_ENTRYPOINT = f"python -m {DRIVER_MODULE} --config {JOB_CONFIG_DIR}/{JOB_CONFIG_FILE}"
RAY_VERSION = "2.60.0"
RAY_API_VERSION = "ray.io/v1"
JOB_LABEL = "rljob.dev/job"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rljob-operator"}
WORKER_GROUP = "workers"


@dataclass(frozen=True)
class Owner:
    """The RLJob that owns the children (what kopf.adopt would read from the body)."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def config_map_name(job: str) -> str:
    return f"{job}-job-config"


def job_account_name(job: str) -> str:
    """Name of the per-job ServiceAccount, Role and RoleBinding."""
    return f"{job}-job"


def _labels(owner: Owner) -> dict[str, str]:
    """The job's name (for people and selectors) and its uid (what the operator matches on)."""
    return {JOB_LABEL: owner.name, JOB_UID_LABEL: owner.uid}


def _metadata(name: str, owner: Owner, attempt: int | None = None) -> dict[str, Any]:
    labels = {**_labels(owner), **MANAGED_BY}
    if attempt is not None:
        labels[ATTEMPT_LABEL] = str(attempt)
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner.reference()],
    }


def config_map(
    owner: Owner, spec: RLJobSpec, attempt: int = 1, knobs: AttemptKnobs | None = None
) -> dict[str, Any]:
    """The worker's job config: the validated spec and whose status to write; from the OOM
    policy's second attempt on, the attempt's number and memory knobs (the spec unchanged)."""
    config = JobConfig(name=owner.name, namespace=owner.namespace, uid=owner.uid, spec=spec)
    if attempt != 1 or knobs is not None:
        config = config.model_copy(update={"attempt": attempt, "knobs": knobs})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(config_map_name(owner.name), owner),
        "data": {JOB_CONFIG_FILE: config.to_yaml()},
    }


def _wire(models: list[Any]) -> list[dict[str, Any]]:
    """The user's Kubernetes objects (spec.volumes, env...) as the pod spec takes them."""
    return [m.model_dump(by_alias=True, exclude_none=True, mode="json") for m in models]


def _volumes(owner: Owner, spec: RLJobSpec, shm: str) -> list[dict[str, Any]]:
    """The operator's volumes, then the user's spec.volumes (admission refuses a user's volume
    named like one of the operator's). `shm`: the /dev/shm volume's size."""
    return [
        {"name": JOB_CONFIG_VOLUME, "configMap": {"name": config_map_name(owner.name)}},
        # NCCL and Ray's object store use /dev/shm; the container default (64 MiB) is too small.
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        *_wire(spec.volumes),
    ]


def head_shared_memory(spec: RLJobSpec) -> str:
    """The head's /dev/shm: spec.resources.sharedMemory (sized for the workers' NCCL and object
    store), but no more than the head's memory: a memory-backed volume counts against its
    pod's limit, and the defaults (16Gi over an 8Gi head) would let the head's object store
    fill past the limit and be OOMKilled rather than spill."""
    res = spec.resources
    return min(res.shared_memory, res.head_memory, key=_quantity)


_MOUNTS: list[dict[str, Any]] = [
    {"name": JOB_CONFIG_VOLUME, "mountPath": JOB_CONFIG_DIR, "readOnly": True},
    {"name": SHM_VOLUME, "mountPath": SHM_DIR},
]


def _pod_template(
    owner: Owner, spec: RLJobSpec, container: dict[str, Any], attempt: int, shm: str
) -> dict[str, Any]:
    res = spec.resources
    pod: dict[str, Any] = {
        "serviceAccountName": job_account_name(owner.name),
        "containers": [container],
        "volumes": _volumes(owner, spec, shm),
    }
    if res.node_selector:
        pod["nodeSelector"] = dict(res.node_selector)
    if res.tolerations:
        pod["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in res.tolerations
        ]
    if res.priority_class_name:
        pod["priorityClassName"] = res.priority_class_name
    if res.fs_group != NO_FS_GROUP:
        pod["securityContext"] = {
            "fsGroup": res.fs_group,
            "fsGroupChangePolicy": "OnRootMismatch",
        }
    labels = {**_labels(owner), ATTEMPT_LABEL: str(attempt)}
    return {"metadata": {"labels": labels}, "spec": pod}


def _container(
    name: str, spec: RLJobSpec, limits: dict[str, Any], env: list[dict[str, str]]
) -> dict[str, Any]:
    """A Ray container: the operator's mounts and env first, then the user's (spec.volumeMounts,
    spec.env, spec.envFrom); admission refuses a user's name or path that clashes with ours."""
    container: dict[str, Any] = {
        "name": name,
        "image": spec.resources.image,
        "imagePullPolicy": spec.resources.image_pull_policy,
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "volumeMounts": [*(dict(m) for m in _MOUNTS), *_wire(spec.volume_mounts)],
    }
    # Kubernetes expands $(NAME) in a value from the entries before it, so the user's come last.
    full_env: list[dict[str, Any]] = [*env, *_wire(spec.env)]
    if full_env:
        container["env"] = full_env
    if spec.env_from:
        container["envFrom"] = _wire(spec.env_from)
    # KubeRay runs a Ray container's own args before its generated `ray start` ("ARGS && ulimit
    # -n 65536; ray start ... --block"): the OOM guard, in the background.
    container["args"] = [OOM_GUARD_ARGS]
    return container


# worker_image/rljob_worker/oom_guard.py: a kernel OOM kill inside a Ray container (the kernel
# picks a Ray worker first, so `ray start` lived on and the container never exited) ends the
# container, so the kubelet reports OOMKilled and the operator with it. Seen on kind: a rank
# killed by the kernel, the job failed as "actor died unexpectedly", no OOMKilled anywhere.
OOM_GUARD_ARGS = "{ python -m rljob_worker.oom_guard & }"


# Ray's memory monitor kills a task when its node nears the container's memory limit (95%), and
# the job then fails with Ray's OutOfMemoryError while the container lives on: the kubelet never
# reports it. Off in rljob's pods, so the pod's memory limit is the one boundary and a host OOM
# is always the kernel's OOMKilled, which the operator reports with the pod and its limit (the
# e2e OOMKilled test lost that race to the monitor once in six kind runs).
def ray_env() -> list[dict[str, str]]:
    """The environment of every Ray container (head and workers)."""
    return [{"name": RAY_MEMORY_MONITOR_ENV, "value": "0"}]


def worker_env(spec: RLJobSpec) -> list[dict[str, str]]:
    env = ray_env()
    if spec.rollout.tensor_parallel_size > 1:
        # SGLang refuses to start TP>1 when ranks see unequal free memory, which is always the
        # case while FSDP shares the GPUs (verl and slime set the same switch).
        env.append({"name": SGL_TP_IMBALANCE_ENV, "value": "True"})
        # sglang 0.5.23 (the pinned release) reads this name instead; the adapter sets it too.
        env.append({"name": SGLANG_TP_IMBALANCE_ENV, "value": "false"})
    return env


def ray_job(owner: Owner, spec: RLJobSpec, attempt: int = 1) -> dict[str, Any]:
    """The KubeRay RayJob: a head (runs the driver, no ranks) and one worker group (the ranks).
    Attempt N >= 2 of the OOM policy is RayJob NAME-aN (rljob.oom_policy.rayjob_name)."""
    res = spec.resources
    worker_limits: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    worker_start: dict[str, str] = {}
    if res.gpus_per_worker > 0:
        worker_limits["nvidia.com/gpu"] = res.gpus_per_worker
    else:
        # On CPU one Ray actor per rank: advertise exactly cpuRanksPerWorker CPUs to Ray.
        worker_start["num-cpus"] = str(res.cpu_ranks_per_worker)
    head_limits = {"cpu": res.head_cpu, "memory": res.head_memory}
    head = _container("ray-head", spec, head_limits, env=ray_env())
    head["ports"] = [
        {"containerPort": 6379, "name": "gcs-server"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
    ]
    worker = _container("ray-worker", spec, worker_limits, env=worker_env(spec))
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": _metadata(rayjob_name(owner.name, attempt), owner, attempt),
        "spec": {
            "entrypoint": DRIVER_ENTRYPOINT,
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished or 0,
            "suspend": spec.suspend,
            "backoffLimit": spec.backoff_limit,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": {
                    # num-cpus 0: no rank is ever placed on the head; it only runs the driver.
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                    "template": _pod_template(owner, spec, head, attempt, head_shared_memory(spec)),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": WORKER_GROUP,
                        "replicas": res.workers,
                        "minReplicas": res.workers,
                        "maxReplicas": res.workers,
                        "rayStartParams": worker_start,
                        "template": _pod_template(
                            owner, spec, worker, attempt, spec.resources.shared_memory
                        ),
                    }
                ],
            },
        },
    }


def service_account(owner: Owner) -> dict[str, Any]:
    """The job's own identity: its pods write only their RLJob's status with it."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(job_account_name(owner.name), owner),
    }


def job_role(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(job_account_name(owner.name), owner),
        "rules": job_rules(owner.name),
    }


def job_role_binding(owner: Owner) -> dict[str, Any]:
    name = job_account_name(owner.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(name, owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


def children(
    owner: Owner, spec: RLJobSpec, attempt: int = 1, knobs: AttemptKnobs | None = None
) -> list[dict[str, Any]]:
    """All children of one attempt: identity and config before the RayJob that uses them (the
    operator applies the Role and RoleBinding after the RayJob: see handlers.AFTER_RAYJOB).
    Every attempt shares the ServiceAccount, Role, RoleBinding and job-config ConfigMap (which
    names the current attempt and its knobs); each has its own RayJob."""
    return [
        service_account(owner),
        job_role(owner),
        job_role_binding(owner),
        config_map(owner, spec, attempt, knobs),
        ray_job(owner, spec, attempt),
    ]


def deeper_problems(name: str, spec: RLJobSpec) -> list[tuple[str, str]]:
    """Problems the models cannot see in the spec alone, or may not refuse (they also check
    `rljob run`'s manifests): (field path, message). Empty when the job can run. The name
    rules are also CEL at the CRD's root; checked again here for RLJobs admitted under an older
    CRD. On a cluster the checkpoints and the export must be on a writable volume (storage.py)."""
    return name_problems(name) + storage_problems(spec)
