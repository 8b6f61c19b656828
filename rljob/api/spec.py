"""RLJobSpec, the whole spec: its sections, and the rules across them (CEL at admission, checked
by the model as well).
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from rljob.api._base import CrossFieldRule, _cel_rules, _check_rules, _Spec
from rljob.api.algorithm import AlgorithmSpec
from rljob.api.checkpoint import CheckpointSpec, ExportSpec
from rljob.api.data import ChatTemplateMode, DataSpec
from rljob.api.memory import MemoryPlanSpec, OffloadMode, OOMPolicySpec
from rljob.api.model import ModelSpec
from rljob.api.resources import ResourcesSpec
from rljob.api.reward import RewardSpec
from rljob.api.rollout import AUTO, EngineName, RolloutMode, RolloutSpec
from rljob.api.training import TrainingSpec
from rljob.api.volumes import (
    JOB_CONFIG_VOLUME,
    MOUNTS_NAME_VOLUMES_RULE,
    OPERATOR_ENV,
    SHM_VOLUME,
    SUPPORTED_VOLUME_SOURCES,
    EnvFromSource,
    EnvVars,
    VolumeMounts,
    Volumes,
)

# The ranks of one worker and of the job, in CEL (ResourcesSpec.ranks_per_worker, world_size).
_RANKS_PER_WORKER_CEL = (
    "(self.resources.gpusPerWorker > 0 ? self.resources.gpusPerWorker "
    ": self.resources.cpuRanksPerWorker)"
)
_WORLD_SIZE_CEL = f"(self.resources.workers * {_RANKS_PER_WORKER_CEL})"

TP_DIVIDES_RANKS_RULE = CrossFieldRule(
    cel=f"{_RANKS_PER_WORKER_CEL} % self.rollout.tensorParallelSize == 0",
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

# Every rank rolls out and trains on the same number of prompts (rljob_worker.loop
# prompts_per_rank, which the worker would otherwise refuse at its start, GPUs held).
BATCH_DIVIDES_RANKS_RULE = CrossFieldRule(
    cel=f"self.data.trainBatchSize % {_WORLD_SIZE_CEL} == 0",
    message="data.trainBatchSize must be a multiple of the job's ranks (resources.workers x "
    "resources.gpusPerWorker, or x cpuRanksPerWorker when that is 0): every rank rolls out and "
    "trains on the same number of prompts",
    field_path=".data.trainBatchSize",
    check=lambda s: s.data.train_batch_size % s.world_size == 0,
)
# Each mini-batch needs a response of its own (rljob_worker.policy_update): the worker would
# refuse it only in iteration 1's train stage, after loading the model and a whole rollout.
MINI_BATCHES_FIT_RULE = CrossFieldRule(
    cel=f"self.algorithm.ppoMiniBatches <= self.data.trainBatchSize / {_WORLD_SIZE_CEL} "
    "* self.algorithm.groupSize",
    message="algorithm.ppoMiniBatches must not exceed the responses each rank trains on per "
    "iteration (data.trainBatchSize / ranks x algorithm.groupSize): lower it, or raise "
    "data.trainBatchSize or algorithm.groupSize",
    field_path=".algorithm.ppoMiniBatches",
    check=lambda s: (
        s.algorithm.ppo_mini_batches
        <= s.data.train_batch_size // s.world_size * s.algorithm.group_size
    ),
)

# mode multiTurn renders the conversation's turns with the model's chat template, the tools'
# schemas in it (rljob_worker.agentic.chat): a first prompt outside it (chatTemplate None) would
# have no assistant header and no tools before the template's own tool turns.
MULTI_TURN_NEEDS_TEMPLATE_RULE = CrossFieldRule(
    cel="self.rollout.mode != 'multiTurn' || self.data.chatTemplate != 'None'",
    message="data.chatTemplate None cannot go with rollout.mode multiTurn: its turns, and the "
    "tools' schemas, are in the model's chat template (leave chatTemplate Auto)",
    field_path=".data.chatTemplate",
    check=lambda s: (
        s.rollout.mode != RolloutMode.MULTI_TURN or s.data.chat_template != ChatTemplateMode.NONE
    ),
)


def _as_directory(path: str) -> str:
    return path if path.endswith("/") else path + "/"


# An export replaces its directory whole (built aside, renamed into place, the old one deleted),
# and withCheckpoints writes iteration-NNNNNNNN/ under it: at checkpoint.path or above it, that
# deletes or overwrites the checkpoints, with no error. A subdirectory of checkpoint.path is fine.
EXPORT_SPARES_CHECKPOINTS_RULE = CrossFieldRule(
    cel="!has(self.checkpoint) || !has(self.export) || !(self.checkpoint.path + '/')"
    ".startsWith(self.export.path.endsWith('/') ? self.export.path : self.export.path + '/')",
    message="export.path must not be checkpoint.path or a directory above it: an export "
    "replaces its directory whole, which would delete the checkpoints; export elsewhere (a "
    "subdirectory of checkpoint.path is fine)",
    field_path=".export.path",
    check=lambda s: (
        s.checkpoint is None
        or s.export is None
        or not (s.checkpoint.path + "/").startswith(_as_directory(s.export.path))
    ),
)


def _min_fraction_problem(s: RLJobSpec) -> str | None:
    """Checked by the models only: CEL cannot read memFractionStatic (an untyped field)."""
    fraction = s.rollout.mem_fraction_static
    if s.oom_policy.max_retries == 0 or fraction == AUTO or s.oom_policy.min_fraction <= fraction:
        return None
    return (
        "spec.oomPolicy.minFraction: oomPolicy.minFraction must not exceed "
        "rollout.memFractionStatic (retries only lower the fraction)"
    )


SPEC_RULES: tuple[CrossFieldRule, ...] = (
    TP_DIVIDES_RANKS_RULE,
    SGLANG_NEEDS_GPU_RULE,
    MOUNTS_NAME_VOLUMES_RULE,
    BATCH_DIVIDES_RANKS_RULE,
    MINI_BATCHES_FIT_RULE,
    EXPORT_SPARES_CHECKPOINTS_RULE,
    MULTI_TURN_NEEDS_TEMPLATE_RULE,
)


DEFAULT_STARTUP_TIMEOUT_SECONDS = 900


class RLJobSpec(_Spec):
    """A colocated RL job: FSDP training and a rollout engine on the same GPUs."""

    model_config = ConfigDict(json_schema_extra=_cel_rules(*SPEC_RULES))

    model: ModelSpec = Field(default_factory=ModelSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    volumes: Volumes = Field(
        default=[],
        description="Volumes of the Ray pods (head and workers). Supported sources: "
        + ", ".join(SUPPORTED_VOLUME_SOURCES)
        + f". Not {JOB_CONFIG_VOLUME} or {SHM_VOLUME} (the operator's own).",
    )
    volume_mounts: VolumeMounts = Field(
        default=[],
        description="Mounts of spec.volumes in the Ray containers (head and workers).",
    )
    env: EnvVars = Field(
        default=[],
        description="Environment of the Ray containers (head and workers): value, or valueFrom "
        "a secretKeyRef or configMapKeyRef (HF_TOKEN from a Secret). Not the names the "
        "operator sets: " + ", ".join(OPERATOR_ENV) + ".",
    )
    env_from: list[EnvFromSource] = Field(
        default=[],
        max_length=32,
        description="Secrets or ConfigMaps whose every key becomes an env var of the Ray "
        "containers (spec.env and the operator's own variables win on a name).",
    )
    suspend: bool = Field(
        default=False, description="true deletes the RayJob's pods and keeps the RLJob."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the Ray cluster (its pods) this long after the job finishes; the "
        "RayJob and the RLJob with its status stay. Unset means 0: as soon as it finishes.",
    )

    startup_timeout_seconds: int = Field(
        default=DEFAULT_STARTUP_TIMEOUT_SECONDS,
        ge=1,
        le=7 * 24 * 3600,
        description="A job whose Ray job is not running this long after it was created (or "
        "resumed) fails with reason StartupTimeout and the last cause seen; the operator then "
        "suspends its RayJob, so KubeRay deletes its pods (docs/status-and-events.md).",
    )
    backoff_limit: int = Field(
        default=0,
        ge=0,
        le=100,
        description="How many times KubeRay runs a failed Ray job again on a new Ray cluster "
        "(the RayJob's backoffLimit): a lost pod, a crashed rank. With spec.checkpoint "
        "(resume Auto) each run continues from the newest complete checkpoint "
        "(docs/checkpoints.md). OOMs are the OOM policy's (spec.oomPolicy), not this.",
    )
    memory_plan: MemoryPlanSpec = Field(
        default_factory=MemoryPlanSpec,
        description="Admission by the per-stage memory plan (docs/memory-plan.md).",
    )
    offload: OffloadMode = Field(
        default=OffloadMode.AUTO,
        description="Auto: offload optimizer state and training params only when, and only as "
        "much as, the memory plan says the engine needs (within training.offloadOptimizer and "
        "training.offloadParams). Always: offload as those two flags say.",
    )
    oom_policy: OOMPolicySpec = Field(
        default_factory=OOMPolicySpec,
        description="Bounded retries after a CUDA OOM (a container OOMKilled is not retried).",
    )
    checkpoint: CheckpointSpec | None = Field(
        default=None,
        description="Periodic checkpoints and resume from the newest (docs/checkpoints.md).",
    )
    export: ExportSpec | None = Field(
        default=None,
        description="The trained policy as a Hugging Face directory (docs/checkpoints.md).",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> RLJobSpec:
        _check_rules(self, SPEC_RULES, "spec")
        problem = _min_fraction_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the colocated loop: one per GPU; on CPU, cpuRanksPerWorker per worker."""
        return self.resources.workers * self.resources.ranks_per_worker
