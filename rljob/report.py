"""The memory report the worker sends back: canonical stage names, per-rank samples, OOM records.

Shared by the worker (which produces it), the drivers (which aggregate it) and the operator
(which publishes it); it imports neither torch nor kopf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel


class Stage(StrEnum):
    """The stages of one colocated iteration, in staged-awake order (docs/design.md).

    These names are the ones in code, logs, status, metrics and plots.
    """

    TRAIN = "train"
    # Only on iterations where spec.checkpoint is due: the training state is still on the
    # device, so nothing moves just to be saved (docs/checkpoints.md).
    CHECKPOINT = "checkpoint"
    OFFLOAD_OPTIMIZER = "offload_optimizer"
    WAKE_WEIGHTS = "wake_weights"
    OFFLOAD_TRAIN = "offload_train"
    WAKE_KV_CACHE = "wake_kv_cache"
    ROLLOUT = "rollout"
    SLEEP = "sleep"


STAGE_ORDER: tuple[Stage, ...] = tuple(Stage)

# One colour per stage, in STAGE_ORDER, for every plot (rljob run's timeline, kubectl rljob plot).
STAGE_COLOURS = (
    "#4c72b0",
    "#8c8c8c",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
)


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


MemoryKind = Literal["cuda", "host"]


class StageSample(_Model):
    """One rank's memory and time for one stage of one iteration.

    On CUDA the byte counts come from torch.cuda memory stats (peak reset at the stage's start)
    and `torch.cuda.mem_get_info`; on CPU they come from the process RSS and the host's
    memory, and `kind` says "host" so nobody mistakes them for GPU figures.
    """

    iteration: int = Field(ge=0)
    rank: int = Field(ge=0)
    stage: Stage
    kind: MemoryKind
    device: str = Field(description="Device name, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu'.")
    start_seconds: float = Field(description="Wall-clock start, seconds since the epoch.")
    seconds: float = Field(ge=0)
    peak_allocated_bytes: int = Field(ge=0)
    peak_reserved_bytes: int = Field(ge=0)
    allocated_bytes: int = Field(ge=0, description="Allocated at the stage's end.")
    reserved_bytes: int = Field(ge=0, description="Reserved at the stage's end.")
    device_used_bytes: int = Field(
        ge=0, description="Device total minus free at the stage's end (all processes)."
    )
    device_peak_used_bytes: int = Field(
        ge=0,
        description="Highest device-wide use seen during the stage (allocator peak plus memory "
        "held outside the allocator, e.g. torch_memory_saver regions).",
    )
    device_total_bytes: int = Field(ge=0)
    node: str = ""


def bytes_text(n: int) -> str:
    """A byte count for a person: GiB from 1 GiB, MiB from 1 MiB, KiB from 1 KiB, else bytes
    (so a small figure never reads "0.0 MiB")."""
    for unit, size, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


OOMKind = Literal["CUDAOutOfMemory", "OOMKilled"]


class OOMRecord(_Model):
    """An out-of-memory event, as the worker (CUDA) or the operator (container) saw it."""

    time: str = Field(description="RFC 3339 time.")
    kind: OOMKind
    stage: Stage | None = None
    iteration: int | None = None
    rank: int | None = None
    pod: str = ""
    container: str = ""
    node: str = ""
    requested_bytes: int | None = None
    free_bytes: int | None = None
    limit_bytes: int | None = None
    message: str = ""
    attempt: int | None = Field(
        default=None,
        ge=1,
        description="The OOM policy's attempt it happened in (the driver's JobConfig.attempt, "
        "or the pod's attempt label): the policy matches OOMs to attempts by this number.",
    )

    def request_text(self, size: Callable[[int], str] = str, unit: str = " bytes") -> str:
        """ "requested N bytes with M free", leaving out what the OOM's message did not say (an
        sglang process's OOM names neither). `size` writes a count and `unit` follows the first
        one (kubectl rljob: GiB/MiB, which name their unit)."""
        parts = (
            [f"requested {size(self.requested_bytes)}{unit}"]
            if self.requested_bytes is not None
            else []
        )
        if self.free_bytes is not None:
            free = size(self.free_bytes)
            parts.append(f"with {free} free" if parts else f"{free}{unit} free")
        return " ".join(parts) or "no size given"


class MultiTurnFigures(_Model):
    """One iteration's multi-turn rollout, all ranks (docs/multi-turn.md): model turns per
    conversation, tool calls, those that failed (an error text to the model) or timed out,
    conversations cut off at the trajectory budget or maxTurns (trained, loss-masked), and
    those in which a tool answered with the problem's answer (the tool was called correctly);
    with spec.rollout.multiTurn.partialRollout, the trained conversations that began in an
    earlier rollout (resumed) and those left under way for the next one (paused)."""

    turns_mean: float = Field(ge=0)
    tool_calls: int = Field(ge=0)
    tool_errors: int = Field(ge=0)
    tool_timeouts: int = Field(ge=0)
    cut_off: int = Field(ge=0)
    # Conversations in which a tool's result was the problem's answer (a correct tool call).
    answer_from_tool: int = Field(default=0, ge=0)
    # Prompt tokens the engines found cached / prompt tokens sent, where they report it (sglang).
    prefix_cache_hit_rate: float | None = None
    # Partial rollout: trained conversations that ran in more than one rollout, and those the
    # rollout left paused (mid-turn or between turns) for the next one.
    resumed: int = Field(default=0, ge=0)
    paused: int = Field(default=0, ge=0)


class ValidationFigures(_Model):
    """One iteration's validation (spec.data.validation), all ranks: the held-out prompts
    answered, their mean reward, the share with the full score, the answers' mean length and the
    share cut at maxResponseLength, the reward calls that failed (scored 0), and the seconds it
    took inside the rollout stage (the slowest rank)."""

    prompts: int = Field(ge=0)
    reward_mean: float | None = None
    correct_share: float | None = None
    response_length_mean: float | None = None
    truncated_share: float | None = None
    reward_errors: int = Field(default=0, ge=0)
    seconds: float = Field(ge=0)


class LearningFigures(_Model):
    """One iteration's learning figures, combined over ranks: what reports.json and
    status.metrics both carry.

    Per-token figures (loss, KL, entropy, clip fraction, mismatch) are means over every
    response token of every rank and every optimizer step; the training figures are those of
    the update that preceded this iteration's rollout (none at iteration 0).
    """

    @field_validator("*", mode="before")
    @classmethod
    def _finite_or_none(cls, value: Any) -> Any:
        """A figure that is inf or NaN (a loss over a step whose gradient overflowed) is None:
        status is JSON, which has neither, and the apiserver refuses every later write whose
        metrics still hold one (they keep 100 iterations)."""
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value

    iteration: int = Field(ge=0)
    reward_mean: float | None = None
    kl_mean: float | None = None
    reward_std: float | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    correct_share: float | None = None
    response_length_mean: float | None = None
    response_length_max: int | None = None
    truncated_share: float | None = None
    policy_loss: float | None = None
    entropy_mean: float | None = None
    clip_fraction: float | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    # Optimizer steps skipped for a gradient norm that was inf or NaN (the weights unchanged
    # by them); absent in a healthy run.
    skipped_steps: int | None = Field(default=None, ge=1)
    # Mean |log p_engine - log p_trainer| over the response tokens, before the update.
    logprob_mismatch_mean: float | None = None
    # Reward calls that failed and were scored 0, all ranks (spec.reward.onError Zero).
    reward_errors: int = Field(default=0, ge=0)
    # spec.rollout.mode multiTurn only (None otherwise): its conversations' figures.
    multi_turn: MultiTurnFigures | None = None
    # spec.data.validation's iterations only (None otherwise): the held-out prompts' figures.
    validation: ValidationFigures | None = None


class IterationReport(LearningFigures):
    """Everything the ranks reported for one iteration, combined over ranks (reports.json)."""

    optimizer_steps: int | None = None
    samples: list[StageSample] = Field(default_factory=list)


class StageMemory(_Model):
    """The worst rank's figures for one stage: what `status.memory.stages` lists."""

    name: Stage
    peak_bytes: int = Field(ge=0)
    peak_fraction: float = Field(ge=0)
    seconds: float = Field(ge=0)
    rank: int = Field(ge=0)


class LoadSample(_Model):
    """One rank's start-up: policy and reference built on meta and loaded shard by shard
    (train.Trainer), measured as a stage is (memory.MemoryMeter.load)."""

    rank: int = Field(ge=0)
    kind: MemoryKind
    device: str
    seconds: float = Field(ge=0)
    peak_allocated_bytes: int = Field(ge=0, description="torch's allocator peak (host: RSS).")
    device_peak_used_bytes: int = Field(ge=0, description="Highest device-wide use seen.")
    device_total_bytes: int = Field(ge=0)
    host_peak_bytes: int = Field(ge=0, description="The rank process's highest RSS seen.")
    node: str = ""


class LoadMemory(_Model):
    """`status.memory.load`: the start-up's worst rank (device-wide peak), measured once."""

    peak_bytes: int = Field(ge=0)
    peak_fraction: float = Field(ge=0)
    peak_allocated_bytes: int = Field(ge=0, description="That rank's torch allocator peak.")
    host_peak_bytes: int = Field(ge=0, description="The highest rank process RSS (any rank).")
    seconds: float = Field(ge=0, description="The slowest rank's.")
    rank: int = Field(ge=0)


def summarize_load(samples: list[LoadSample]) -> LoadMemory | None:
    """The worst rank's start-up (by device-wide peak); None before any rank loaded."""
    if not samples:
        return None
    worst = max(samples, key=lambda s: s.device_peak_used_bytes)
    capacity = min(s.device_total_bytes for s in samples)
    return LoadMemory(
        peak_bytes=worst.device_peak_used_bytes,
        peak_fraction=round(worst.device_peak_used_bytes / capacity, 4) if capacity else 0.0,
        peak_allocated_bytes=worst.peak_allocated_bytes,
        host_peak_bytes=max(s.host_peak_bytes for s in samples),
        seconds=round(max(s.seconds for s in samples), 4),
        rank=worst.rank,
    )


class MemorySummary(_Model):
    """`status.memory`: the latest iteration, worst rank per stage, with device and capacity."""

    iteration: int = Field(ge=0)
    kind: MemoryKind
    device: str
    capacity_bytes: int = Field(ge=0)
    stages: list[StageMemory]
    load: LoadMemory | None = Field(
        default=None, description="The start-up (models built and loaded), before iteration 0."
    )

    @property
    def worst_fraction(self) -> float:
        return max((s.peak_fraction for s in self.stages), default=0.0)


# status.metrics keeps this many iterations. Each entry is at most ~450 bytes of JSON (18
# numbers, floats rounded to METRIC_DIGITS significant digits), so the list stays under ~45 KB,
# next to memoryHistory's ~25 KB: far below etcd's 1.5 MiB object limit.
MAX_METRICS = 100
METRIC_DIGITS = 5


def _rounded(value: float | None) -> float | None:
    """`value` to METRIC_DIGITS significant digits: what a curve needs, and a bounded width."""
    return None if value is None else float(f"{value:.{METRIC_DIGITS}g}")


class IterationMetrics(LearningFigures):
    """One iteration of `status.metrics`: the learning figures of an IterationReport (no
    memory samples; status.memory and memoryHistory hold those), rounded for a bounded size."""

    seconds: float | None = Field(
        default=None, ge=0, description="The iteration's stages, worst rank each, summed."
    )

    @classmethod
    def of(cls, report: IterationReport) -> IterationMetrics:
        numbers = report.model_dump(include=set(LearningFigures.model_fields))
        summary = summarize(report)
        seconds = sum(s.seconds for s in summary.stages) if summary else None
        rounded = {k: _rounded(v) if isinstance(v, float) else v for k, v in numbers.items()}
        return cls.model_validate({**rounded, "seconds": _rounded(seconds)})


def metrics_with(
    metrics: list[IterationMetrics], reports: list[IterationReport]
) -> list[IterationMetrics]:
    """`metrics` with `reports`' iterations added (a report replaces an entry of its iteration),
    in iteration order, the last MAX_METRICS kept."""
    fresh = {r.iteration: IterationMetrics.of(r) for r in reports}
    kept = [m for m in metrics if m.iteration not in fresh]
    return sorted([*kept, *fresh.values()], key=lambda m: m.iteration)[-MAX_METRICS:]


def summarize(report: IterationReport) -> MemorySummary | None:
    """Reduce all ranks' samples of an iteration to the worst rank per stage, in stage order.

    The peak counted is the device-wide peak use, since that is what an OOM is measured
    against; capacity is the smallest device total seen (ranks on one kind of GPU agree).
    """
    if not report.samples:
        return None
    worst: dict[Stage, StageSample] = {}
    for sample in report.samples:
        held = worst.get(sample.stage)
        if held is None or sample.device_peak_used_bytes > held.device_peak_used_bytes:
            worst[sample.stage] = sample
    capacity = min(s.device_total_bytes for s in report.samples)
    first = report.samples[0]
    stages = [
        StageMemory(
            name=stage,
            peak_bytes=worst[stage].device_peak_used_bytes,
            peak_fraction=round(worst[stage].device_peak_used_bytes / capacity, 4)
            if capacity
            else 0.0,
            seconds=round(worst[stage].seconds, 4),
            rank=worst[stage].rank,
        )
        for stage in STAGE_ORDER
        if stage in worst
    ]
    return MemorySummary(
        iteration=report.iteration,
        kind=first.kind,
        device=first.device,
        capacity_bytes=capacity,
        stages=stages,
    )
