"""RLJobStatus, the observed state, and its parts: phase and conditions, attempts with their
knobs, OOM entries, memory history, checkpoint and export news.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from rljob.api._base import API_VERSION, KIND, _Spec
from rljob.api.plan_status import PlanStatus
from rljob.api.rollout import MemFraction, WakeUpSetting
from rljob.api.spec import RLJobSpec
from rljob.report import MAX_METRICS, IterationMetrics, MemorySummary, OOMRecord, Stage


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


class AttemptKnobs(_Spec):
    """The memory knobs one attempt runs with (the OOM policy changes them between attempts;
    the spec keeps what the user wrote). The training knobs are None where the spec's stand."""

    mem_fraction_static: MemFraction
    wake_up: WakeUpSetting
    micro_batch_size: int | None = Field(default=None, ge=1)
    gradient_checkpointing: bool | None = None
    # Under Auto the knobs keep "Auto" (the driver resolves it on the real card) and carry the
    # margin explicitly: an OOM retry raises it by the overshoot it measured, so the next
    # attempt's choice is lower by what the last one lacked. None: spec.memoryPlan.margin.
    margin: float | None = Field(default=None, ge=0, lt=0.5)
    # Under weightSyncBucketMegabytes Auto an engine-stage OOM retries with the smallest bucket
    # Auto takes, fixed (a retry never holds a larger bucket). None: the spec's.
    weight_sync_bucket_megabytes: int | None = Field(default=None, ge=1, le=65536)

    def apply(self, spec: RLJobSpec) -> RLJobSpec:
        """`spec` as this attempt runs it: the user's, with these knobs in place."""
        update: dict[str, Any] = {
            "mem_fraction_static": self.mem_fraction_static,
            "wake_up": self.wake_up,
        }
        if self.weight_sync_bucket_megabytes is not None:
            update["weight_sync_bucket_megabytes"] = self.weight_sync_bucket_megabytes
        rollout = spec.rollout.model_copy(update=update)
        training: dict[str, Any] = {}
        if self.micro_batch_size is not None:
            training["micro_batch_size"] = self.micro_batch_size
        if self.gradient_checkpointing is not None:
            training["gradient_checkpointing"] = self.gradient_checkpointing
        memory_plan = spec.memory_plan
        if self.margin is not None:
            memory_plan = memory_plan.model_copy(update={"margin": self.margin})
        return spec.model_copy(
            update={
                "rollout": rollout,
                "training": spec.training.model_copy(update=training),
                "memory_plan": memory_plan,
            }
        )


def status_apply_body(
    namespace: str, name: str, status: dict[str, Any], uid: str | None = None
) -> dict[str, Any]:
    """The body of a server-side apply of RLJob `name`'s status (the operator's and the driver's
    writes). With `uid` it is a precondition: the apiserver refuses the write (409) unless the
    RLJob of that name is still that object, so status computed for a job never lands on one
    applied again under its name meanwhile."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "status": status}


class ResumePoint(_Spec):
    """The checkpoint a run continued from (docs/checkpoints.md): `status.resumedFrom` (driver,
    with its attempt) and `status.attempts[].resumedFrom` (operator, without)."""

    iteration: int = Field(ge=0, description="The checkpoint's iteration.")
    path: str = Field(description="The checkpoint's directory.")
    attempt: int | None = Field(
        default=None, ge=1, description="status.resumedFrom: the attempt whose driver resumed."
    )


class CheckpointFailure(_Spec):
    """`status.checkpointFailure` (driver): a save that failed; the job ends Failed with reason
    CheckpointFailed and this error (docs/checkpoints.md)."""

    iteration: int = Field(ge=0, description="The iteration whose checkpoint failed.")
    path: str = Field(description="The directory it was written to (it has no COMPLETE marker).")
    rank: int = Field(ge=0, description="The first rank (lowest number) that failed.")
    error: str = Field(
        max_length=1024, description="The OS error, e.g. [Errno 28] No space left on device."
    )
    attempt: int | None = Field(default=None, ge=1, description="The attempt it happened in.")

    def describe(self) -> str:
        """One line for the Failed condition, status.cause and the driver's log."""
        return (
            f"the checkpoint of iteration {self.iteration} in {self.path} failed on rank "
            f"{self.rank}: {self.error}"
        )


# The Ray driver's last line when the job fails (rljob_worker/driver/ray_main.py). KubeRay's
# message for a failed Ray job is Ray's, the job log's tail, which ends with this line: the
# operator's Failed condition takes the why from it (driver_failure).
_DRIVER_FAILED = re.compile(r"rljob driver: RLJob \S+ failed: (?P<why>.*\S)")


def driver_failed_line(job: str, why: str) -> str:
    """The line the driver ends a failed job's log with: `rljob driver: RLJob JOB failed: WHY`."""
    return f"rljob driver: RLJob {job} failed: {why}"


def driver_failure(log: str) -> str | None:
    """The why of the last driver_failed_line in `log` (a job log, KubeRay's message); None
    where it has none."""
    found = [m["why"] for m in _DRIVER_FAILED.finditer(log)]
    return found[-1] if found else None


# The Failed condition's reason (and the Warning Event's) when a checkpoint save failed.
REASON_CHECKPOINT_FAILED = "CheckpointFailed"


class Attempt(_Spec):
    """One `status.attempts` entry (operator-owned): a RayJob run with its knobs and outcome."""

    attempt: int = Field(ge=1)
    ray_job: str = Field(default="", description="The RayJob of this attempt.")
    mem_fraction_static: MemFraction
    wake_up: WakeUpSetting | None = None
    margin: float | None = Field(
        default=None,
        description="Auto: spec.memoryPlan.margin as this attempt ran it (an OOM retry raises "
        "it by the overshoot it measured).",
    )
    result: str = Field(
        default="", description="Running, Succeeded, Failed, CUDAOutOfMemory or OOMKilled."
    )
    micro_batch_size: int | None = Field(
        default=None, description="training.microBatchSize, where the OOM policy changed it."
    )
    gradient_checkpointing: bool | None = Field(
        default=None, description="training.gradientCheckpointing, where the policy changed it."
    )
    weight_sync_bucket_megabytes: int | None = Field(
        default=None,
        ge=1,
        description="rollout.weightSyncBucketMegabytes, where the policy fixed it in place of Auto.",
    )
    changed: str | None = Field(
        default=None,
        max_length=512,
        description="Which knob this attempt changed from the one before, and why.",
    )
    oom_stage: Stage | None = None
    oom_rank: int | None = None
    message: str = Field(default="", max_length=1024)
    started_at: str | None = Field(
        default=None,
        description="RFC 3339: when this attempt's RayJob was created.",
    )
    resumed_from: ResumePoint | None = Field(
        default=None,
        description="The checkpoint (iteration, path) this attempt last resumed from (absent: "
        "it started at iteration 0).",
    )

    @classmethod
    def ran_with(cls, number: int, knobs: AttemptKnobs, **fields: Any) -> Attempt:
        """Attempt `number` as it ran with `knobs` (the operator's entries, `rljob run`'s)."""
        return cls(
            attempt=number,
            mem_fraction_static=knobs.mem_fraction_static,
            wake_up=knobs.wake_up,
            micro_batch_size=knobs.micro_batch_size,
            gradient_checkpointing=knobs.gradient_checkpointing,
            margin=knobs.margin,
            weight_sync_bucket_megabytes=knobs.weight_sync_bucket_megabytes,
            **fields,
        )


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


def history_with(history: list[MemoryPoint], memory: MemorySummary | None) -> list[MemoryPoint]:
    """`history` with the latest iteration's memory (replacing a point of the same iteration),
    the last MAX_MEMORY_HISTORY iterations kept."""
    if memory is None:
        return history
    point = MemoryPoint(
        iteration=memory.iteration, peak_bytes={str(s.name): s.peak_bytes for s in memory.stages}
    )
    kept = [p for p in history if p.iteration != point.iteration]
    return sorted([*kept, point], key=lambda p: p.iteration)[-MAX_MEMORY_HISTORY:]


class CheckpointStatus(_Spec):
    """`status.checkpoint` (driver): the newest complete checkpoint."""

    iteration: int = Field(ge=0)
    path: str
    completed_at: str = Field(description="RFC 3339: when its COMPLETE marker was written.")
    bytes: int = Field(ge=0, description="Every rank's files together.")
    seconds: float = Field(
        ge=0,
        description="From the checkpoint stage's start until it was durable (its marker "
        "written): the slowest rank.",
    )
    blocked_seconds: float | None = Field(
        default=None,
        ge=0,
        description="How long the loop stood still for it: the checkpoint stage and any wait "
        "for its writer (slowest rank). Async: less than seconds; Sync: equal.",
    )


class ExportStatus(_Spec):
    """`status.export` (driver): the newest exported Hugging Face directory."""

    path: str
    iteration: int = Field(ge=0)


class RLJobStatus(_Spec):
    """Observed state. One writer per field: the operator owns phase, conditions, rayJob,
    attempts and OOMKilled entries; the job's driver owns iteration, memory, metrics and CUDA
    OOMs."""

    phase: Phase | None = None
    cause: str | None = Field(
        default=None,
        max_length=512,
        description="Why the job failed or is blocked, one short line (the Failed or PodsReady "
        "condition's reason and message); absent while nothing is wrong.",
    )
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
    metrics: list[IterationMetrics] = Field(
        default_factory=list,
        max_length=MAX_METRICS,
        description=f"Reward, loss, KL, entropy, lengths of the last {MAX_METRICS} iterations "
        "the current attempt finished (written by the driver; `kubectl rljob curve` draws it).",
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
    attempts: list[Attempt] = Field(
        default_factory=list,
        description="Every attempt (the OOM policy's retries), first to last (operator).",
    )
    plan: PlanStatus | None = Field(
        default=None, description="The memory plan the driver computed before iteration 1."
    )
    checkpoint: CheckpointStatus | None = Field(
        default=None, description="The newest complete checkpoint (driver)."
    )
    export: ExportStatus | None = Field(
        default=None, description="The newest export of the trained policy (driver)."
    )
    resumed_from: ResumePoint | None = Field(
        default=None, description="The checkpoint the current run continued from (driver)."
    )
    checkpoint_failure: CheckpointFailure | None = Field(
        default=None, description="A checkpoint save that failed and ended the job (driver)."
    )
    announced: dict[str, str] = Field(
        default_factory=dict,
        description="The checkpoint news the operator has posted Events for, by kind (written "
        "with the Events, so an operator restart does not post them again).",
        json_schema_extra={"x-kubernetes-map-type": "granular"},
    )
    # Derived by the operator from memory and oomCounts, so `kubectl get` can show them
    # (printer columns take one scalar path each).
    worst_stage_fraction: float | None = Field(
        default=None, ge=0, description="Highest peak fraction of any stage in status.memory."
    )
    oom_total: int | None = Field(default=None, ge=0, description="Sum of status.oomCounts.")
