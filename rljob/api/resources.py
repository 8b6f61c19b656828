"""spec.resources: where and how big the Ray pods are (GPUs, ranks, image, CPU, memory,
scheduling).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from rljob.api._base import (
    CrossFieldRule,
    DNSSubdomain,
    ImageReference,
    LabelKey,
    LabelValue,
    PositiveQuantity,
    _cel_rules,
    _check_rules,
    _quantity,
    _Spec,
    immutable,
)
from rljob.api.rollout import _number_or_auto, _only_numbers_or_auto


class Toleration(_Spec):
    """A Kubernetes toleration for the worker pods."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value)",
                    "message": "a toleration with operator Exists must not set value",
                    "fieldPath": ".value",
                }
            ]
        }
    )

    # Bounded lengths keep the apiserver's CEL cost estimate of this list's rule small.
    key: LabelKey | None = Field(default=None, description="Taint key; empty matches all keys.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default)."
    )
    value: LabelValue | None = Field(default=None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists must not set value")
        return self


# The worker image's user and group (worker_image/Dockerfile*: uid 1000, gid 1000): the default
# fsGroup, so a claim's files are that group's.
WORKER_GROUP = 1000
# fsGroup: None sets none. A word, not null: the apiserver fills a null back in with the default
# (kubectl apply drops it; tests/controlplane/test_rljob_admission.py saw 1000 stored).
NO_FS_GROUP: Literal["None"] = "None"
_MAX_GID = 2147483647


def _gid_or_none(value: int | str) -> int | str:
    if value != NO_FS_GROUP and not (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_GID
    ):
        raise ValueError(f"fsGroup must be None or an integer in [0, {_MAX_GID}]")
    return value


# An integer group id, or None: untyped as rollout.memFractionStatic is (a number or Auto).
FsGroup = Annotated[
    int | Literal["None"],
    Field(json_schema_extra=_number_or_auto(
        {"minimum": 0, "maximum": _MAX_GID, "multipleOf": 1}, word=NO_FS_GROUP
    )),
    _only_numbers_or_auto("fsGroup", f"an integer in [0, {_MAX_GID}]", word=NO_FS_GROUP),
    AfterValidator(_gid_or_none),
]  # fmt: skip

SHM_WITHIN_MEMORY_RULE = CrossFieldRule(
    cel="!isQuantity(self.sharedMemory) || !isQuantity(self.memory) || "
    "quantity(self.sharedMemory).compareTo(quantity(self.memory)) <= 0",
    message="sharedMemory is memory-backed (/dev/shm counts against the pod's memory limit), "
    "so it may not exceed memory",
    field_path=".sharedMemory",
    check=lambda r: _quantity(r.shared_memory) <= _quantity(r.memory),
)
RESOURCES_RULES: tuple[CrossFieldRule, ...] = (SHM_WITHIN_MEMORY_RULE,)


class ResourcesSpec(_Spec):
    """Where and how big the Ray pods are."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*RESOURCES_RULES))

    workers: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Worker pods (one per node). Immutable after creation.",
        json_schema_extra=immutable("spec.resources.workers"),
    )
    gpus_per_worker: int = Field(
        default=1,
        ge=0,
        le=16,
        description="nvidia.com/gpu per worker pod, one rank per GPU; 0 runs on CPU (kind, "
        "laptops) with cpuRanksPerWorker ranks. Immutable after creation.",
        json_schema_extra=immutable("spec.resources.gpusPerWorker"),
    )
    cpu_ranks_per_worker: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks (processes on gloo) per worker pod when gpusPerWorker is 0; ignored "
        "on GPU. Immutable after creation.",
        json_schema_extra=immutable("spec.resources.cpuRanksPerWorker"),
    )
    image: ImageReference = Field(
        default="ghcr.io/rljob/worker:0.1.0",
        description="Worker image for the Ray head and workers: [registry[:port]/]path[:tag]"
        "[@digest].",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the worker image."
    )
    cpu: PositiveQuantity = Field(default="8", description="CPU request and limit per worker pod.")
    memory: PositiveQuantity = Field(
        default="64Gi", description="Memory request and limit per worker pod."
    )
    shared_memory: PositiveQuantity = Field(
        default="16Gi",
        description="Size of the /dev/shm volume (NCCL, Ray object store); memory-backed, so it "
        "counts against the pod's memory and may not exceed it.",
    )
    head_cpu: PositiveQuantity = Field(default="2", description="CPU of the Ray head pod.")
    head_memory: PositiveQuantity = Field(default="8Gi", description="Memory of the Ray head pod.")
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        max_length=64,
        description="Node labels the worker pods must match.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations of the worker pods."
    )
    fs_group: FsGroup = Field(
        default=WORKER_GROUP,
        description="The pods' fsGroup: the kubelet gives the files of a volume that supports it "
        "(a block-storage claim, emptyDir) to this group, group-writable, so a claim formatted "
        "root-owned (EBS, Persistent Disk) takes the checkpoints and the export. 1000: the "
        "worker image's user and group. Changed only where the volume's root does not match "
        "(fsGroupChangePolicy OnRootMismatch: a large dataset is not walked at every start). "
        "None: no fsGroup (OpenShift's restricted SCC sets the namespace's own).",
    )
    priority_class_name: DNSSubdomain | None = Field(
        default=None,
        description="PriorityClass of the head and worker pods (it must exist: the apiserver "
        "refuses pods that name a missing one, and the RLJob then fails to start).",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> ResourcesSpec:
        _check_rules(self, RESOURCES_RULES, "spec.resources")
        return self

    @property
    def ranks_per_worker(self) -> int:
        """One rank per GPU; on CPU, cpu_ranks_per_worker processes."""
        return self.gpus_per_worker if self.gpus_per_worker > 0 else self.cpu_ranks_per_worker
