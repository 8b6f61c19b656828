"""Admission of RLJobs by the real kube-apiserver: every example applies; invalid specs are
rejected by the generated schema and CEL rules with a message that names the field; fields
that are immutable after creation stay so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rljob_helpers import (
    ROOT,
    admin_kubeconfig,
    api_client,
    install_rljob_crds,
    rljob,
)
from support.malformed import MALFORMED, Malformed

from rljob.api import GROUP, PLURAL, VERSION, RLJobSpec

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def custom(plane: Any) -> client.CustomObjectsApi:
    install_rljob_crds(plane)
    return client.CustomObjectsApi(api_client(admin_kubeconfig(plane)))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_applies_with_kubectl(plane: Any, namespace: str, path: Path) -> None:
    install_rljob_crds(plane)
    plane.kubectl("apply", "-n", namespace, "-f", str(path))
    out = plane.kubectl("get", "rlj", path.stem, "-n", namespace, "-o", "name")
    assert f"rljob.{GROUP}/{path.stem}" in str(getattr(out, "stdout", out))


INVALID: list[tuple[str, dict[str, Any], str]] = [
    (
        "grpo-group-of-one",
        {"algorithm": {"name": "grpo", "groupSize": 1}},
        "spec.algorithm.groupSize",
    ),
    ("mfs-one", {"rollout": {"memFractionStatic": 1.0}}, "spec.rollout.memFractionStatic"),
    ("mfs-zero", {"rollout": {"memFractionStatic": 0}}, "spec.rollout.memFractionStatic"),
    ("mfs-negative", {"rollout": {"memFractionStatic": -0.5}}, "spec.rollout.memFractionStatic"),
    ("engine-unknown", {"rollout": {"engine": "vllm"}}, "spec.rollout.engine"),
    ("wakeup-unknown", {"rollout": {"wakeUp": "partial"}}, "spec.rollout.wakeUp"),
    (
        "tp-not-dividing-gpus",
        {"rollout": {"tensorParallelSize": 3}, "resources": {"gpusPerWorker": 8}},
        "spec.rollout.tensorParallelSize",
    ),
    (
        "tp-not-dividing-cpu-ranks",
        {
            "rollout": {"engine": "torch", "tensorParallelSize": 2},
            "resources": {"gpusPerWorker": 0, "cpuRanksPerWorker": 3},
        },
        "spec.rollout.tensorParallelSize",
    ),
    ("sglang-on-cpu", {"resources": {"gpusPerWorker": 0}}, "spec.resources.gpusPerWorker"),
    ("zero-workers", {"resources": {"workers": 0}}, "spec.resources.workers"),
    ("too-many-gpus", {"resources": {"gpusPerWorker": 17}}, "spec.resources.gpusPerWorker"),
    ("memory-not-quantity", {"resources": {"memory": "lots"}}, "spec.resources.memory"),
    ("cpu-not-quantity", {"resources": {"cpu": "eight"}}, "spec.resources.cpu"),
    ("shm-not-quantity", {"resources": {"sharedMemory": "1 GB"}}, "spec.resources.sharedMemory"),
    ("lr-zero", {"algorithm": {"learningRate": 0}}, "spec.algorithm.learningRate"),
    ("clip-one", {"algorithm": {"clipRatio": 1}}, "spec.algorithm.clipRatio"),
    ("zero-iterations", {"algorithm": {"iterations": 0}}, "spec.algorithm.iterations"),
    ("algorithm-unknown", {"algorithm": {"name": "dpo"}}, "spec.algorithm.name"),
    ("dtype-unknown", {"model": {"dtype": "int8"}}, "spec.model.dtype"),
    ("model-path-empty", {"model": {"path": ""}}, "spec.model.path"),
    (
        "toleration-exists-with-value",
        {"resources": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
        "spec.resources.tolerations[0].value",
    ),
    (
        "pull-policy-unknown",
        {"resources": {"imagePullPolicy": "Sometimes"}},
        "spec.resources.imagePullPolicy",
    ),
    ("ttl-negative", {"ttlSecondsAfterFinished": -1}, "spec.ttlSecondsAfterFinished"),
    ("batch-zero", {"data": {"trainBatchSize": 0}}, "spec.data.trainBatchSize"),
    ("top-p-zero", {"rollout": {"sampling": {"topP": 0}}}, "spec.rollout.sampling.topP"),
    (
        "bucket-zero",
        {"rollout": {"weightSyncBucketMegabytes": 0}},
        "spec.rollout.weightSyncBucketMegabytes",
    ),
]


@pytest.mark.parametrize(("name", "spec", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_rljob_is_rejected_naming_the_field(
    custom: client.CustomObjectsApi, namespace: str, name: str, spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiException) as info:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rljob(name, spec))
    assert info.value.status == 422
    assert field in str(info.value.body), info.value.body


def test_at_least_twenty_invalid_cases() -> None:
    assert len(INVALID) >= 20


@pytest.mark.parametrize("case", MALFORMED, ids=lambda c: c.id)
def test_kubectl_apply_refuses_the_malformed_rljob_naming_the_field(
    plane: Any, custom: client.CustomObjectsApi, namespace: str, case: Malformed
) -> None:
    """Issue 17's "Seen" cases and more: each was (or would be) accepted and then never run."""
    manifest = yaml.safe_dump(rljob(case.job_name, case.spec))
    result = plane.kubectl("apply", "-n", namespace, "-f", "-", input=manifest, check=False)
    assert result.returncode != 0, f"{case.id} was accepted:\n{manifest}"
    assert "is invalid" in result.stderr, result.stderr
    assert case.field in result.stderr, result.stderr
    gone = plane.kubectl("get", "rlj", case.job_name, "-n", namespace, check=False)
    assert gone.returncode != 0  # nothing was stored


def test_a_valid_neighbour_of_each_malformed_kind_applies(plane: Any, namespace: str) -> None:
    """The rules do not overreach: real quantities, images, names and paths are admitted."""
    spec = {
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        "data": {"source": "/data/prompts.jsonl", "answerKey": "reward_model.ground_truth"},
        "reward": {"function": "/data/rewards/gsm8k.py:compute_score", "timeoutSeconds": 0.5},
        "startupTimeoutSeconds": 60,
        "resources": {
            "cpu": "500m", "memory": "1.5Gi", "sharedMemory": "1536Mi", "headCpu": "1.0",
            "headMemory": "+2Gi", "image": "localhost:5000/rljob/worker:dev@sha256:" + "a" * 64,
            "priorityClassName": "high-priority.gpu", "nodeSelector": {"nvidia.com/gpu.product": "H100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }  # fmt: skip
    name = "a" * 47
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(rljob(name, spec)))
    stored = plane.kubectl_json("get", "rlj", name, "-n", namespace)
    assert stored["spec"]["resources"]["memory"] == "1.5Gi"
    assert stored["spec"]["startupTimeoutSeconds"] == 60
    assert stored["spec"]["reward"]["function"] == "/data/rewards/gsm8k.py:compute_score"


def test_rollout_auto_is_admitted_and_stored_as_written(
    custom: client.CustomObjectsApi, namespace: str
) -> None:
    """Issue 35: memFractionStatic takes a number or Auto (a schema-less scalar checked by CEL),
    wakeUp takes Auto; a number still works, with an OOM policy's minFraction beside Auto."""
    auto = {
        "rollout": {
            "memFractionStatic": "Auto",
            "wakeUp": "Auto",
            "weightSyncBucketMegabytes": "Auto",
        },
        "memoryPlan": {"margin": 0.05},
        "oomPolicy": {"maxRetries": 2, "minFraction": 0.9},
    }
    stored: dict[str, Any] = custom.create_namespaced_custom_object(  # type: ignore[assignment]
        GROUP, VERSION, namespace, PLURAL, rljob("auto", auto)
    )
    assert stored["spec"]["rollout"]["memFractionStatic"] == "Auto"
    assert stored["spec"]["rollout"]["wakeUp"] == "Auto"
    assert stored["spec"]["rollout"]["weightSyncBucketMegabytes"] == "Auto"
    assert stored["spec"]["memoryPlan"]["margin"] == 0.05
    number = {"rollout": {"memFractionStatic": 0.91, "weightSyncBucketMegabytes": 2048}}
    stored = custom.create_namespaced_custom_object(  # type: ignore[assignment]
        GROUP, VERSION, namespace, PLURAL, rljob("num", number)
    )
    assert stored["spec"]["rollout"]["memFractionStatic"] == 0.91
    assert stored["spec"]["rollout"]["weightSyncBucketMegabytes"] == 2048
    assert stored["spec"]["memoryPlan"]["margin"] == 0.015


def test_defaults_fill_the_stored_spec(custom: client.CustomObjectsApi, namespace: str) -> None:
    stored: dict[str, Any] = custom.create_namespaced_custom_object(  # type: ignore[assignment]
        GROUP, VERSION, namespace, PLURAL, rljob("d")
    )
    assert stored["spec"]["rollout"]["memFractionStatic"] == 0.85
    assert stored["spec"]["rollout"]["wakeUp"] == "staged"
    assert stored["spec"]["rollout"]["weightSyncBucketMegabytes"] == 512
    assert stored["spec"]["resources"]["workers"] == 1


def test_fs_group_defaults_to_the_images_group_and_none_applies_as_none(
    plane: Any, custom: client.CustomObjectsApi, namespace: str
) -> None:
    """fsGroup is 1000 unless set; `fsGroup: None` through kubectl apply (the opt-out for a
    cluster that sets its own, as OpenShift's restricted SCC does) reaches the operator as no
    fsGroup. A null would not: kubectl drops it and the apiserver fills the default in again
    (seen here, so the opt-out is a word); a string other than None, a negative or fractional
    group is refused."""
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(rljob("fsg-d")))
    plane.kubectl(
        "apply", "-n", namespace, "-f", "-",
        input=yaml.safe_dump(rljob("fsg-none", {"resources": {"fsGroup": "None"}})),
    )  # fmt: skip
    plane.kubectl(
        "apply", "-n", namespace, "-f", "-",
        input=yaml.safe_dump(rljob("fsg-null", {"resources": {"fsGroup": None}})),
    )  # fmt: skip
    default = plane.kubectl_json("get", "rlj", "fsg-d", "-n", namespace)["spec"]
    none = plane.kubectl_json("get", "rlj", "fsg-none", "-n", namespace)["spec"]
    null = plane.kubectl_json("get", "rlj", "fsg-null", "-n", namespace)["spec"]
    assert default["resources"]["fsGroup"] == 1000
    assert none["resources"]["fsGroup"] == "None"
    assert null["resources"]["fsGroup"] == 1000  # why the opt-out is not null
    assert RLJobSpec.model_validate(default).resources.fs_group == 1000
    assert RLJobSpec.model_validate(none).resources.fs_group == "None"
    for bad in ("none", -1, 1.5, True):
        result = plane.kubectl(
            "apply", "-n", namespace, "-f", "-", check=False,
            input=yaml.safe_dump(rljob("fsg-bad", {"resources": {"fsGroup": bad}})),
        )  # fmt: skip
        assert result.returncode != 0 and "spec.resources.fsGroup" in result.stderr, (
            bad,
            result.stderr,
        )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": {"path": "other/model"}}, "spec.model"),
        ({"rollout": {"engine": "torch"}}, "spec.rollout.engine"),
        ({"resources": {"workers": 2}}, "spec.resources.workers"),
        ({"resources": {"gpusPerWorker": 2}}, "spec.resources.gpusPerWorker"),
    ],
)
def test_immutable_field_cannot_change_after_creation(
    custom: client.CustomObjectsApi, namespace: str, change: dict[str, Any], field: str
) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rljob("imm"))
    with pytest.raises(ApiException) as info:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "imm", {"spec": change},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
    assert info.value.status == 422
    assert field in str(info.value.body) and "immutable" in str(info.value.body)


def test_suspend_and_ttl_stay_mutable(custom: client.CustomObjectsApi, namespace: str) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rljob("mut"))
    patched: dict[str, Any] = custom.patch_namespaced_custom_object(  # type: ignore[assignment]
        GROUP, VERSION, namespace, PLURAL, "mut",
        {"spec": {"suspend": True, "ttlSecondsAfterFinished": 60}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    assert patched["spec"]["suspend"] is True
    assert patched["spec"]["ttlSecondsAfterFinished"] == 60
