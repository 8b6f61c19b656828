"""The user's volumes, mounts and env (issue 30) render into both Ray pod templates after the
operator's own, and the names the models refuse are exactly the ones the builders use."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from rljob.api import OPERATOR_ENV, OPERATOR_MOUNT_PATHS, OPERATOR_VOLUMES, RLJobSpec
from rljob_operator.render import Owner, children, ray_job
from rljob_operator.storage import claim_access_problems

OWNER = Owner(name="j", namespace="ns", uid="00000000-0000-0000-0000-000000000001")
CPU = {"rollout": {"engine": "torch"}, "resources": {"gpusPerWorker": 0}}


def _pods(spec: RLJobSpec) -> list[dict[str, Any]]:
    """The head's and the worker group's pod specs."""
    cluster = ray_job(OWNER, spec)["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        group["template"]["spec"] for group in cluster["workerGroupSpecs"]
    ]


# One volume of each supported source, as a user writes it (and as the pod must receive it).
VOLUMES: dict[str, dict[str, Any]] = {
    "persistentVolumeClaim": {
        "name": "data",
        "persistentVolumeClaim": {"claimName": "rl-data", "readOnly": True},
    },
    "configMap": {
        "name": "rewards",
        "configMap": {
            "name": "rewards",
            "items": [{"key": "reward.py", "path": "gsm8k/reward.py", "mode": 0o444}],
            "defaultMode": 0o644,
            "optional": False,
        },
    },
    "secret": {"name": "keys", "secret": {"secretName": "s3-keys", "defaultMode": 0o400}},
    "emptyDir": {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    "hostPath": {"name": "cache", "hostPath": {"path": "/var/cache/hf", "type": "Directory"}},
}


@pytest.mark.parametrize("kind", list(VOLUMES))
def test_each_supported_volume_kind_renders_into_head_and_workers(kind: str) -> None:
    volume = VOLUMES[kind]
    mount = {"name": volume["name"], "mountPath": "/mnt/x", "subPath": "a/b", "readOnly": True}
    spec = RLJobSpec.model_validate({**CPU, "volumes": [volume], "volumeMounts": [mount]})
    for pod in _pods(spec):
        names = [v["name"] for v in pod["volumes"]]
        assert names == [*OPERATOR_VOLUMES, volume["name"]]
        assert pod["volumes"][-1] == volume  # as written: nothing added, nothing lost
        (container,) = pod["containers"]
        assert [m["mountPath"] for m in container["volumeMounts"]] == [
            *OPERATOR_MOUNT_PATHS,
            "/mnt/x",
        ]
        assert container["volumeMounts"][-1] == mount


def test_hf_token_comes_from_a_secret_and_its_value_is_nowhere_in_the_children() -> None:
    env = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "TOKEN_CHECK", "value": "$(HF_TOKEN)"},
    ]
    env_from = [{"secretRef": {"name": "s3"}, "prefix": "S3_"}, {"configMapRef": {"name": "c"}}]
    spec = RLJobSpec.model_validate({**CPU, "env": env, "envFrom": env_from})
    for pod in _pods(spec):
        (container,) = pod["containers"]
        names = [e["name"] for e in container["env"]]
        # The operator's first: Kubernetes expands $(NAME) only from entries before it.
        assert names[: -len(env)] == [n for n in names if n in OPERATOR_ENV]
        assert container["env"][-len(env) :] == env
        assert container["envFrom"] == env_from
        assert "value" not in container["env"][-2]
    # Neither the RayJob nor the job config ConfigMap can carry a secret's value: there is none.
    assert "hf_" not in yaml.safe_dump_all(children(OWNER, spec))


def test_a_job_without_volumes_or_env_renders_only_the_operators() -> None:
    (pod, *_) = _pods(RLJobSpec.model_validate(CPU))
    (container,) = pod["containers"]
    assert [v["name"] for v in pod["volumes"]] == list(OPERATOR_VOLUMES)
    assert "envFrom" not in container


def test_the_refused_names_are_the_ones_the_operator_uses() -> None:
    """OPERATOR_* (what admission refuses) and the builders cannot drift apart: with tensor
    parallelism on, every env name, volume and mount path the operator sets is in them."""
    spec = RLJobSpec.model_validate(
        {"rollout": {"tensorParallelSize": 2}, "resources": {"gpusPerWorker": 2}}
    )
    for pod in _pods(spec):
        (container,) = pod["containers"]
        assert {v["name"] for v in pod["volumes"]} == set(OPERATOR_VOLUMES)
        assert {m["mountPath"] for m in container["volumeMounts"]} == set(OPERATOR_MOUNT_PATHS)
        assert {e["name"] for e in container["env"]} <= set(OPERATOR_ENV)
    worker = _pods(spec)[1]["containers"][0]
    assert {e["name"] for e in worker["env"]} == set(OPERATOR_ENV)


@pytest.mark.parametrize(
    ("spec", "ours", "theirs"),
    [
        ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "dshm", "/dev/shm"),
        ({"volumes": [{"name": "job-config", "emptyDir": {}}]}, "job-config", "/etc/rljob"),
        (
            {
                "volumes": [{"name": "d", "emptyDir": {}}],
                "volumeMounts": [{"name": "d", "mountPath": "/etc/rljob/extra"}],
            },
            "/etc/rljob",
            "job-config",
        ),
        (
            {"env": [{"name": "RAY_memory_monitor_refresh_ms", "value": "1"}]},
            "RAY_memory_monitor_refresh_ms",
            "set by the operator",
        ),
    ],
)
def test_a_clash_is_refused_naming_both_sides(spec: dict[str, Any], ours: str, theirs: str) -> None:
    with pytest.raises(ValidationError) as info:
        RLJobSpec.model_validate(spec)
    assert ours in str(info.value) and theirs in str(info.value)


def test_unsupported_volume_kinds_are_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="nfs"):
        RLJobSpec.model_validate(
            {"volumes": [{"name": "d", "nfs": {"server": "nfs.local", "path": "/x"}}]}
        )


def test_a_mount_of_the_operators_volume_is_refused() -> None:
    # job-config is not a volume of spec.volumes, and its name says whose it is.
    with pytest.raises(ValidationError, match="operator's own volume"):
        RLJobSpec.model_validate({"volumeMounts": [{"name": "job-config", "mountPath": "/cfg"}]})


def test_checkpoints_and_the_export_must_be_on_a_writable_volume() -> None:
    """On a cluster a path on no volume is the container's own filesystem: a re-run starts over
    and the export goes with the pod while the job says Succeeded. The operator refuses such a
    spec (InvalidSpec, nothing created); `rljob run`'s manifests have no volumes and pass."""
    from rljob_operator.render import deeper_problems

    def problems(checkpoint: str, export: str, **storage: Any) -> dict[str, str]:
        spec = RLJobSpec.model_validate(
            {"checkpoint": {"path": checkpoint}, "export": {"path": export}, **storage}
        )
        return dict(deeper_problems("job", spec))

    volumes = {
        "volumes": [
            {"name": "ckpt", "persistentVolumeClaim": {"claimName": "runs"}},
            {"name": "models", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}},
            {"name": "cfg", "configMap": {"name": "settings"}},
            {"name": "scratch", "emptyDir": {}},
        ],
        "volumeMounts": [
            {"name": "ckpt", "mountPath": "/data"},
            {"name": "models", "mountPath": "/data/models"},
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "scratch", "mountPath": "/scratch", "readOnly": False},
        ],
    }
    assert problems("/data/run/ckpt", "/scratch/export", **volumes) == {}
    assert problems("/data", "/data/out/", **volumes) == {}  # the mount point itself, a slash
    found = problems("/data/models/ckpt", "/etc/cfg/out", **volumes)
    assert "volumeMount models at /data/models is read-only" in found["spec.checkpoint.path"]
    assert "volume cfg at /etc/cfg is a configMap" in found["spec.export.path"]
    found = problems("/datasets/ckpt", "out/export", **volumes)  # /datasets is not under /data
    assert set(found) == {"spec.checkpoint.path", "spec.export.path"}
    assert "is on no volume" in found["spec.checkpoint.path"]
    assert "is on no volume" in problems("/data/ckpt", "/exports/final")["spec.export.path"]


@pytest.mark.parametrize(
    ("resources", "head", "workers"),
    [
        ({}, "8Gi", "16Gi"),  # the defaults: 16Gi of /dev/shm would pass the 8Gi head's limit
        ({"sharedMemory": "2Gi"}, "2Gi", "2Gi"),
        ({"sharedMemory": "12Gi", "headMemory": "9500Mi"}, "9500Mi", "12Gi"),
    ],
)
def test_the_heads_shared_memory_stays_within_the_heads_memory(
    resources: dict[str, str], head: str, workers: str
) -> None:
    spec = RLJobSpec.model_validate(
        {"rollout": {"engine": "torch"}, "resources": {"gpusPerWorker": 0, **resources}}
    )
    sizes = [
        next(v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "dshm")
        for pod in _pods(spec)
    ]
    assert sizes == [head, workers]


CLAIMS = {"once": ["ReadWriteOnce"], "pod": ["ReadWriteOncePod"], "many": ["ReadWriteMany"],
          "both": ["ReadWriteOnce", "ReadOnlyMany"]}  # fmt: skip


@pytest.mark.parametrize(
    ("claim", "workers", "expected"),
    [
        ("once", 1, "persistentVolumeClaim once (volume v) is ReadWriteOnce: it attaches to one "
                    "node, and the job's 2 pods"),
        ("once", 2, "is ReadWriteOnce: it attaches to one node, and the job's 3 pods"),
        ("pod", 1, "persistentVolumeClaim pod (volume v) is ReadWriteOncePod: one pod may mount "
                   "it, and the job's 2 pods"),
        ("many", 4, None),
        ("both", 2, None),  # ReadOnlyMany: pods of several nodes may mount it
        ("missing", 2, None),  # not made yet: the scheduler says so itself
    ],
)  # fmt: skip
def test_a_claim_the_jobs_pods_cannot_all_mount_is_named(
    claim: str, workers: int, expected: str | None
) -> None:
    spec = RLJobSpec.model_validate({
        **CPU, "resources": {"gpusPerWorker": 0, "workers": workers},
        "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}],
        "volumeMounts": [{"name": "v", "mountPath": "/v"}],
    })  # fmt: skip
    problems = claim_access_problems(spec, CLAIMS.get)
    if expected is None:
        assert problems == []
    else:
        ((name, message),) = problems
        assert name == claim and expected in message, message


def test_a_claim_no_container_mounts_is_not_checked() -> None:
    spec = RLJobSpec.model_validate({
        **CPU, "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "once"}}],
    })  # fmt: skip
    asked: list[str] = []

    def modes(claim: str) -> list[str] | None:
        asked.append(claim)
        return CLAIMS.get(claim)

    assert claim_access_problems(spec, modes) == []
    assert asked == []
