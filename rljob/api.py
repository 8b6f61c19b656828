"""The RLJob API: pydantic models that are the single source of truth for the CRD schema.

The CRD in crds/ is generated from these models (`rljob crd`); the worker reads the same spec
(through the job-config ConfigMap), so nothing here may import kopf or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from rljob.report import MemorySummary, OOMRecord

GROUP = "rljob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]

# Kubernetes quantity syntax (the apiserver's own regex for resource.Quantity strings).
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several fields, written once and enforced twice: as CEL by the apiserver
    (x-kubernetes-validations, at admission) and as Python by the models (`rljob run`, and the
    operator's deeper check). `field_path` is relative to the model the rule sits on."""

    cel: str
    message: str
    field_path: str
    check: Callable[[Any], bool]

    def to_k8s(self) -> dict[str, str]:
        return {
            "rule": self.cel,
            "message": self.message,
            "fieldPath": self.field_path,
            "reason": "FieldValueInvalid",
        }


def immutable(what: str) -> dict[str, Any]:
    """json_schema_extra for a field that cannot change after creation (a CEL transition rule)."""
    return {
        "x-kubernetes-validations": [
            {"rule": "self == oldSelf", "message": f"{what} is immutable after creation"}
        ]
    }


def _cel_rules(*rules: CrossFieldRule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.to_k8s() for r in rules]}


def _check_rules(model: BaseModel, rules: tuple[CrossFieldRule, ...], where: str) -> None:
    broken = [r for r in rules if not r.check(model)]
    if broken:
        raise ValueError("; ".join(f"{where}{r.field_path}: {r.message}" for r in broken))


class _Spec(BaseModel):
    """Base for spec sections: camelCase on the wire, snake_case in Python, unknown keys refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=False
    )


class ModelSpec(_Spec):
    """The policy model to train and serve. Immutable after creation."""

    model_config = ConfigDict(json_schema_extra=immutable("spec.model"))

    path: str = Field(
        default="builtin:tiny-qwen2",
        min_length=1,
        max_length=4096,
        description="Model to load with transformers' from_pretrained: a local directory, a "
        "mounted volume path, or a Hugging Face id (verl: actor_rollout_ref.model.path). "
        "'builtin:tiny-qwen2' builds a tiny randomly initialised Qwen2 model and tokenizer "
        "locally (no download), for CPU runs and tests.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="Parameter dtype of the rollout engine and of FSDP's compute.",
    )


class AlgorithmName(StrEnum):
    GRPO = "grpo"
    PPO = "ppo"


GRPO_GROUP_RULE = CrossFieldRule(
    cel="self.name != 'grpo' || self.groupSize >= 2",
    message="grpo needs groupSize >= 2 (its advantage is relative to the group)",
    field_path=".groupSize",
    check=lambda a: a.name != AlgorithmName.GRPO or a.group_size >= 2,
)


class AlgorithmSpec(_Spec):
    """The RL algorithm (verl: algorithm.* and actor_rollout_ref.actor.*)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(GRPO_GROUP_RULE))

    name: AlgorithmName = Field(
        default=AlgorithmName.GRPO,
        description="grpo: group-relative advantages (reward minus the group's mean, over its "
        "std). ppo: PPO-style clipped loss with batch-normalised advantages (no critic).",
    )
    group_size: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Responses sampled per prompt (verl: actor_rollout_ref.rollout.n). "
        "GRPO needs at least 2.",
    )
    learning_rate: float = Field(
        default=1e-6, gt=0, le=1, description="AdamW learning rate (verl: actor.optim.lr)."
    )
    kl_coef: float = Field(
        default=0.001,
        ge=0,
        description="Coefficient of the KL term to the reference policy (verl: "
        "actor.kl_loss_coef). 0 disables the reference model.",
    )
    clip_ratio: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip range epsilon (verl: actor.clip_ratio)."
    )
    iterations: int = Field(
        default=2,
        ge=1,
        description="Training iterations, each train -> sync -> rollout "
        "(verl: trainer.total_training_steps).",
    )
    seed: int = Field(default=0, ge=0, description="Seed for sampling and initialisation.")

    @model_validator(mode="after")
    def _cross_field(self) -> AlgorithmSpec:
        _check_rules(self, (GRPO_GROUP_RULE,), "spec.algorithm")
        return self


class DataSpec(_Spec):
    """Where prompts come from."""

    source: str = Field(
        default="builtin:arithmetic",
        min_length=1,
        description="'builtin:arithmetic' generates addition prompts with an exact-match reward "
        "(no download); otherwise a path to a JSONL file of {prompt, answer} rows.",
    )
    train_batch_size: int = Field(
        default=8,
        ge=1,
        description="Prompts per iteration across all ranks (verl: data.train_batch_size).",
    )
    max_prompt_length: int = Field(
        default=64, ge=1, description="Tokens; longer prompts are truncated from the left."
    )
    max_response_length: int = Field(
        default=16, ge=1, description="New tokens generated per response."
    )


class EngineName(StrEnum):
    SGLANG = "sglang"
    TORCH = "torch"


class WakeUp(StrEnum):
    STAGED = "staged"
    SINGLE = "single"


class SamplingSpec(_Spec):
    """Sampling parameters of the rollout."""

    temperature: float = Field(default=1.0, ge=0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="-1 disables top-k.")


# Engines whose weights and KV cache can be released and resumed separately (by tag); staged
# wake-up needs that. A new engine joins this list only once its adapter implements tags.
ENGINES_WITH_TAGGED_RELEASE: tuple[EngineName, ...] = (EngineName.SGLANG, EngineName.TORCH)

STAGED_NEEDS_TAGS_RULE = CrossFieldRule(
    cel="self.wakeUp != 'staged' || self.engine in ["
    + ", ".join(f"'{e.value}'" for e in ENGINES_WITH_TAGGED_RELEASE)
    + "]",
    message="wakeUp staged needs an engine with tagged release ("
    + ", ".join(e.value for e in ENGINES_WITH_TAGGED_RELEASE)
    + "); use wakeUp single",
    field_path=".wakeUp",
    check=lambda r: r.wake_up != WakeUp.STAGED or r.engine in ENGINES_WITH_TAGGED_RELEASE,
)


class RolloutSpec(_Spec):
    """The rollout engine that shares the GPUs with training (verl: actor_rollout_ref.rollout)."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(STAGED_NEEDS_TAGS_RULE))

    engine: EngineName = Field(
        default=EngineName.SGLANG,
        description="sglang: the production engine. torch: the reference engine on "
        "transformers (CPU runs, tests and measurement; not a production engine). "
        "Immutable after creation.",
        json_schema_extra=immutable("spec.rollout.engine"),
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs per engine (verl: rollout.tensor_model_parallel_size); must divide "
        "the ranks of one worker (gpusPerWorker, or cpuRanksPerWorker on CPU). Immutable.",
        json_schema_extra=immutable("spec.rollout.tensorParallelSize"),
    )
    mem_fraction_static: float = Field(
        default=0.85,
        gt=0,
        lt=1,
        description="Fraction of device memory for the engine's weights plus KV cache "
        "(sglang's mem_fraction_static; verl: rollout.gpu_memory_utilization). Staged "
        "wake-up makes 0.9-0.95 reachable.",
    )
    wake_up: WakeUp = Field(
        default=WakeUp.STAGED,
        description="staged: resume weights, update them, free training params, then resume "
        "the KV cache. single: resume weights and KV cache together (baseline).",
    )
    weight_sync_bucket_megabytes: int = Field(
        default=512,
        ge=1,
        le=65536,
        description="Size of one weight-update bucket in MiB "
        "(verl: rollout.update_weights_bucket_megabytes).",
    )
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec, description="Sampling parameters of the rollout."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> RolloutSpec:
        _check_rules(self, (STAGED_NEEDS_TAGS_RULE,), "spec.rollout")
        return self


class TrainingSpec(_Spec):
    """FSDP training of the policy (verl: actor_rollout_ref.actor)."""

    strategy: Literal["fsdp2"] = Field(
        default="fsdp2", description="torch.distributed.fsdp.fully_shard over all ranks."
    )
    micro_batch_size: int = Field(
        default=2,
        ge=1,
        description="Sequences per forward/backward per rank "
        "(verl: actor.ppo_micro_batch_size_per_gpu).",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward."
    )
    offload_optimizer: bool = Field(
        default=True,
        description="Move optimizer state to pinned CPU memory during rollout "
        "(verl: actor.fsdp_config.optimizer_offload).",
    )
    offload_params: bool = Field(
        default=True,
        description="Move training parameters to CPU during rollout "
        "(verl: actor.fsdp_config.param_offload). Staged wake-up frees them before the "
        "KV cache is resumed.",
    )


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
    key: str | None = Field(
        default=None, max_length=253, description="Taint key; empty matches all keys."
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default)."
    )
    value: str | None = Field(
        default=None, max_length=63, description="Taint value (operator Equal)."
    )
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


class ResourcesSpec(_Spec):
    """Where and how big the Ray pods are."""

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
    image: str = Field(
        default="ghcr.io/rljob/worker:0.1.0",
        min_length=1,
        description="Worker image for the Ray head and workers.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the worker image."
    )
    cpu: str = Field(
        default="8", pattern=QUANTITY_PATTERN, description="CPU request and limit per worker pod."
    )
    memory: str = Field(
        default="64Gi",
        pattern=QUANTITY_PATTERN,
        description="Memory request and limit per worker pod.",
    )
    shared_memory: str = Field(
        default="16Gi",
        pattern=QUANTITY_PATTERN,
        description="Size of the /dev/shm volume (NCCL, Ray object store); memory-backed, so it "
        "counts against the pod's memory.",
    )
    head_cpu: str = Field(
        default="2", pattern=QUANTITY_PATTERN, description="CPU of the Ray head pod."
    )
    head_memory: str = Field(
        default="8Gi", pattern=QUANTITY_PATTERN, description="Memory of the Ray head pod."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the worker pods must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations of the worker pods."
    )
    priority_class_name: str | None = Field(
        default=None, description="PriorityClass of the head and worker pods."
    )

    @property
    def ranks_per_worker(self) -> int:
        """One rank per GPU; on CPU, cpu_ranks_per_worker processes."""
        return self.gpus_per_worker if self.gpus_per_worker > 0 else self.cpu_ranks_per_worker


TP_DIVIDES_RANKS_RULE = CrossFieldRule(
    cel="(self.resources.gpusPerWorker > 0 ? self.resources.gpusPerWorker "
    ": self.resources.cpuRanksPerWorker) % self.rollout.tensorParallelSize == 0",
    message="rollout.tensorParallelSize must divide the ranks of one worker "
    "(resources.gpusPerWorker, or resources.cpuRanksPerWorker when that is 0)",
    field_path=".rollout.tensorParallelSize",
    check=lambda s: s.resources.ranks_per_worker % s.rollout.tensor_parallel_size == 0,
)
SGLANG_NEEDS_GPU_RULE = CrossFieldRule(
    cel="self.rollout.engine != 'sglang' || self.resources.gpusPerWorker >= 1",
    message="rollout.engine sglang needs resources.gpusPerWorker >= 1 (use engine torch on CPU)",
    field_path=".resources.gpusPerWorker",
    check=lambda s: s.rollout.engine != EngineName.SGLANG or s.resources.gpus_per_worker >= 1,
)
SPEC_RULES: tuple[CrossFieldRule, ...] = (TP_DIVIDES_RANKS_RULE, SGLANG_NEEDS_GPU_RULE)


class RLJobSpec(_Spec):
    """A colocated RL job: FSDP training and a rollout engine on the same GPUs."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*SPEC_RULES))

    model: ModelSpec = Field(default_factory=ModelSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    suspend: bool = Field(
        default=False, description="true deletes the RayJob's pods and keeps the RLJob."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the Ray cluster (its pods) this long after the job finishes; the "
        "RayJob and the RLJob with its status stay. Unset means 0: as soon as it finishes.",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> RLJobSpec:
        _check_rules(self, SPEC_RULES, "spec")
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the colocated loop: one per GPU; on CPU, cpuRanksPerWorker per worker."""
        return self.resources.workers * self.resources.ranks_per_worker


class Phase(StrEnum):
    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(_Spec):
    """metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class RayJobRef(_Spec):
    name: str
    job_status: str = ""
    job_deployment_status: str = ""


class Attempt(_Spec):
    attempt: int = Field(ge=1)
    mem_fraction_static: float
    result: str = ""


def oom_event_id(record: OOMRecord) -> str:
    """A stable key for one OOM entry (status.oomEvents is a map list keyed by it).

    CUDA OOMs are one per (rank, iteration, stage, time). OOMKilled entries aggregate every
    kill of one container, so their key is the pod and container.
    """
    if record.kind == "OOMKilled":
        return f"killed/{record.pod}/{record.container or '-'}"
    return (
        f"cuda/rank{record.rank if record.rank is not None else '-'}"
        f"/it{record.iteration if record.iteration is not None else '-'}"
        f"/{record.stage or '-'}/{record.time}"
    )


class OOMEvent(OOMRecord):
    """One `status.oomEvents` entry: an OOMRecord plus its key and, for OOMKilled, the kills
    aggregated into it. Each writer (operator: OOMKilled; driver: CUDAOutOfMemory) owns its
    own entries under server-side apply, because the list is a map keyed by `id`."""

    id: str = Field(
        min_length=1,
        max_length=512,
        description="Stable key of the entry (set from the record when not given).",
    )
    count: int | None = Field(
        default=None, ge=1, description="OOMKilled: kills of this container aggregated here."
    )
    restart_count: int | None = Field(
        default=None,
        ge=0,
        description="OOMKilled: the container's restartCount at the latest kill counted (so a "
        "kill seen again after an operator restart is not counted twice).",
    )

    @model_validator(mode="before")
    @classmethod
    def _with_id(cls, data: Any) -> Any:
        # Drivers hand over plain OOMRecords; they become entries with a content-derived key.
        if isinstance(data, OOMRecord) and not isinstance(data, OOMEvent):
            data = data.model_dump()
        if isinstance(data, dict) and not data.get("id"):
            record = OOMRecord.model_validate(
                {
                    k: v
                    for k, v in data.items()
                    if k not in ("id", "count", "restartCount", "restart_count")
                }
            )
            data = {**data, "id": oom_event_id(record)}
        return data


class MemoryPoint(_Spec):
    """One iteration of `status.memoryHistory`: per stage the worst rank's peak bytes."""

    iteration: int = Field(ge=0)
    peak_bytes: dict[str, int] = Field(
        default_factory=dict, description="Stage name -> the worst rank's peak bytes."
    )


# status.memoryHistory keeps this many iterations (the plot's window; bounded so status stays
# far below etcd's object size limit).
MAX_MEMORY_HISTORY = 100


class RLJobStatus(_Spec):
    """Observed state. One writer per field: the operator owns phase, conditions, rayJob,
    attempts and OOMKilled entries; the job's driver owns iteration, memory and CUDA OOMs."""

    phase: Phase | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        description="metav1.Condition entries, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    ray_job: RayJobRef | None = None
    iteration: int | None = None
    reward_mean: float | None = None
    kl_mean: float | None = None
    memory: MemorySummary | None = None
    memory_history: list[MemoryPoint] = Field(
        default_factory=list,
        max_length=MAX_MEMORY_HISTORY,
        description=f"Per-stage peak bytes of the last {MAX_MEMORY_HISTORY} iterations "
        "(written by the driver; `kubectl rljob plot` draws it).",
    )
    oom_events: list[OOMEvent] = Field(
        default_factory=list,
        description="The latest OOMs of each kind (the operator keeps the OOMKilled entries, "
        "the driver the CUDAOutOfMemory ones); every OOM is also an Event.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    oom_counts: dict[str, int] = Field(
        default_factory=dict,
        description="All OOMs ever seen, by kind (oomEvents keeps the last N). Each key has "
        "its own writer: OOMKilled the operator, CUDAOutOfMemory the driver.",
        json_schema_extra={"x-kubernetes-map-type": "granular"},
    )
    attempts: list[Attempt] = Field(default_factory=list)
    # Derived by the operator from memory and oomCounts, so `kubectl get` can show them
    # (printer columns take one scalar path each).
    worst_stage_fraction: float | None = Field(
        default=None, ge=0, description="Highest peak fraction of any stage in status.memory."
    )
    oom_total: int | None = Field(default=None, ge=0, description="Sum of status.oomCounts.")


JOB_CONFIG_DIR = "/etc/rljob"
JOB_CONFIG_FILE = "job.yaml"


class JobConfig(_Spec):
    """What the worker is given (the ConfigMap mounted at /etc/rljob/job.yaml): the validated
    spec plus the RLJob's identity, so the driver knows whose status to write."""

    name: str = Field(min_length=1, description="The RLJob's name.")
    namespace: str = Field(min_length=1, description="The RLJob's namespace.")
    spec: RLJobSpec

    def to_yaml(self) -> str:
        return yaml.dump(
            self.model_dump(by_alias=True, mode="json"), Dumper=_SafeDumper, sort_keys=False
        )

    @classmethod
    def from_yaml(cls, text: str) -> JobConfig:
        return cls.model_validate(yaml.load(text, Loader=_SafeLoader))


# libyaml's safe dumper and loader where PyYAML was built with it (its wheels are): the same
# text as the pure-Python ones for these documents (the golden ConfigMaps), 5-9x faster; the
# operator renders and parses a job config on every reconcile.
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_manifest(doc: dict[str, Any]) -> tuple[str, RLJobSpec]:
    """Validate an RLJob manifest (as `kubectl apply` would take it); return (name, spec)."""
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise ValueError(
            f"expected apiVersion {API_VERSION} and kind {KIND}, got "
            f"{doc.get('apiVersion')!r} / {doc.get('kind')!r}"
        )
    name = str((doc.get("metadata") or {}).get("name") or "")
    if not name:
        raise ValueError("metadata.name is required")
    return name, RLJobSpec.model_validate(doc.get("spec") or {})
