"""Unit tests of the driver's status publishing core: which fields the job writes (only its
own), the bounded memory history, the OOM Event text and the IterationCompleted rate limit."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rljob.api import (
    MAX_MEMORY_HISTORY,
    CheckpointFailure,
    CheckpointStatus,
    ExportStatus,
    MemoryPoint,
    OOMEvent,
    ResumePoint,
    RLJobStatus,
    history_with,
)
from rljob.report import IterationMetrics, MemorySummary, OOMRecord, Stage, StageMemory
from rljob_worker.publish import (
    RateLimit,
    driver_fields,
    iteration_message,
    oom_message,
)


def memory(iteration: int, train_bytes: int = 100) -> MemorySummary:
    return MemorySummary(
        iteration=iteration,
        kind="cuda",
        device="NVIDIA H100 80GB HBM3",
        capacity_bytes=1000,
        stages=[
            StageMemory(name=Stage.TRAIN, peak_bytes=train_bytes, peak_fraction=train_bytes / 1000,
                        seconds=1.0, rank=1),
            StageMemory(name=Stage.ROLLOUT, peak_bytes=900, peak_fraction=0.9, seconds=2.0, rank=0),
        ],
    )  # fmt: skip


CUDA = OOMRecord(
    time="2026-05-09T10:00:00Z", kind="CUDAOutOfMemory", stage=Stage.WAKE_KV_CACHE, iteration=1,
    rank=3, node="gpu-7", requested_bytes=2 << 30, free_bytes=1 << 20, message="CUDA out of memory.",
)  # fmt: skip


def test_driver_writes_only_its_own_fields_and_only_cuda_ooms() -> None:
    killed = {"time": "2026-05-09T09:00:00Z", "kind": "OOMKilled", "pod": "p", "container": "c"}
    status = RLJobStatus.model_validate(
        {
            "phase": "Running",
            "conditions": [],
            "iteration": 2,
            "rewardMean": 0.5,
            "memory": memory(2).model_dump(by_alias=True),
            "oomEvents": [CUDA.model_dump(by_alias=True), killed],
            "oomCounts": {"CUDAOutOfMemory": 1, "OOMKilled": 7},
        }
    )
    fields = driver_fields(status, history_with([], status.memory))
    assert set(fields) == {
        "iteration", "rewardMean", "memory", "memoryHistory", "oomEvents", "oomCounts",
    }  # fmt: skip
    assert fields["oomCounts"] == {"CUDAOutOfMemory": 1}
    [entry] = fields["oomEvents"]
    assert entry["kind"] == "CUDAOutOfMemory" and entry["stage"] == "wake_kv_cache"
    assert entry["id"] == "cuda/rank3/it1/wake_kv_cache/2026-05-09T10:00:00Z"
    assert fields["memoryHistory"] == [
        {"iteration": 2, "peakBytes": {"train": 100, "rollout": 900}}
    ]


def test_an_earlier_drivers_cuda_ooms_stay_before_this_ones() -> None:
    """Attempt 2's driver (or a resumed job's) starts with no OOMs of its own; what the earlier
    driver wrote stays in its apply, or server-side apply would delete it (same manager)."""
    held = [OOMEvent.model_validate(CUDA.model_copy(update={"time": "2026-05-09T09:00:00Z"}))]
    assert driver_fields(RLJobStatus(), [], held, 4) == {
        "oomEvents": [held[0].model_dump(by_alias=True, exclude_none=True, mode="json")],
        "oomCounts": {"CUDAOutOfMemory": 4},
    }
    own = RLJobStatus.model_validate(
        {"oomEvents": [CUDA.model_dump(by_alias=True)], "oomCounts": {"CUDAOutOfMemory": 1}}
    )
    fields = driver_fields(own, [], held, 4)
    assert [e["time"] for e in fields["oomEvents"]] == ["2026-05-09T09:00:00Z", CUDA.time]
    assert fields["oomCounts"] == {"CUDAOutOfMemory": 5}
    # the same entry held and reported again (a driver that loaded what it wrote) is one entry
    again = driver_fields(own, [], [OOMEvent.model_validate(CUDA)], 1)
    assert len(again["oomEvents"]) == 1


def test_before_any_iteration_nothing_is_claimed() -> None:
    assert driver_fields(RLJobStatus(), []) == {"oomEvents": []}


def test_history_keeps_one_point_per_iteration_and_the_last_hundred() -> None:
    history: list[MemoryPoint] = []
    for iteration in range(MAX_MEMORY_HISTORY + 20):
        history = history_with(history, memory(iteration))
    history = history_with(history, memory(MAX_MEMORY_HISTORY + 19, train_bytes=555))
    assert len(history) == MAX_MEMORY_HISTORY
    assert [p.iteration for p in history] == list(range(20, MAX_MEMORY_HISTORY + 20))
    assert history[-1].peak_bytes["train"] == 555


def test_oom_event_names_stage_rank_and_bytes() -> None:
    text = oom_message(CUDA)
    for part in ("stage wake_kv_cache", "rank 3", "iteration 1", "node gpu-7", str(2 << 30)):
        assert part in text


@pytest.mark.parametrize(
    ("requested", "free", "expected"),
    [
        (2 << 30, 1 << 20, f"requested {2 << 30} bytes with {1 << 20} free."),
        (None, 1 << 20, f"): {1 << 20} bytes free."),  # an sglang child's OOM names no size
        (None, None, "): no size given."),
    ],
)
def test_oom_event_says_only_the_sizes_the_oom_gave(
    requested: int | None, free: int | None, expected: str
) -> None:
    text = oom_message(CUDA.model_copy(update={"requested_bytes": requested, "free_bytes": free}))
    assert expected in text and "None" not in text


def test_iteration_event_names_the_worst_stage_with_capacity_and_device() -> None:
    text = iteration_message(RLJobStatus(iteration=4, reward_mean=0.25, memory=memory(4)))
    assert "iteration 4" in text and "worst stage rollout at 0.900 of 1000 bytes" in text
    assert "NVIDIA H100 80GB HBM3" in text


def test_iteration_events_are_rate_limited() -> None:
    now = [0.0]
    limit = RateLimit(60.0, clock=lambda: now[0])
    fired = []
    for second in range(0, 200, 10):
        now[0] = float(second)
        fired.append(limit())
    assert [s for s, f in zip(range(0, 200, 10), fired, strict=True) if f] == [0, 60, 120, 180]


class _AppliedStatus:
    """Stand-in for the apiserver's status subresource under one field manager's server-side
    apply (the driver's): each apply replaces the fields that manager applied before."""

    def __init__(self) -> None:
        self.status: dict[str, object] = {}
        self.owned: set[str] = set()

    def get_namespaced_custom_object(self, *_: object) -> dict[str, object]:
        return {"metadata": {"uid": "uid-1"}, "status": copy.deepcopy(self.status)}

    def patch_namespaced_custom_object_status(self, *args: object, **_: object) -> None:
        fields = dict(args[5]["status"])  # type: ignore[index]
        for gone in self.owned - set(fields):
            self.status.pop(gone, None)
        self.status.update(copy.deepcopy(fields))
        self.owned = set(fields)


def test_rljob_run_publish_keeps_the_first_attempts_oom_in_the_second() -> None:
    """`rljob run --publish` runs every attempt through one publisher: the second attempt starts
    from what status holds (next_attempt), so its apply keeps attempt 1's OOM entry and count."""
    from kubernetes import client

    from rljob_worker.publish import StatusPublisher

    publisher = StatusPublisher(client.ApiClient(), "ns", "job")
    applied = _AppliedStatus()
    publisher.custom = applied  # type: ignore[assignment]
    publisher.event = lambda *_args, **_kw: None  # type: ignore[method-assign]
    first = RLJobStatus(iteration=0, oom_events=[CUDA], oom_counts={"CUDAOutOfMemory": 1})  # type: ignore[list-item]
    publisher.publish(first, [CUDA])
    assert applied.status["oomCounts"] == {"CUDAOutOfMemory": 1}
    publisher.next_attempt()  # without it: oomEvents [], no oomCounts
    publisher.publish(RLJobStatus(iteration=1), [])
    assert applied.status["oomCounts"] == {"CUDAOutOfMemory": 1}
    assert [e["stage"] for e in applied.status["oomEvents"]] == ["wake_kv_cache"]  # type: ignore[attr-defined]


class _Recorder:
    """Stands in for StatusPublisher at the listener's boundary: keeps what it was given."""

    plan = None

    def __init__(self) -> None:
        self.published: list[RLJobStatus] = []

    def publish(self, status: RLJobStatus, new_ooms: object) -> None:
        self.published.append(status)


def test_the_listener_counts_checkpoint_parts_sent_alone() -> None:
    """A rank sends a checkpoint part alone when it completed in the iteration of a newer one
    (loop.run_rank): the in-cluster listener keeps it for status.checkpoint, as LocalRun does,
    and never takes it for a memory sample (which broke its status on kind)."""
    from typing import Any, cast

    from rljob_worker.checkpoint import SavedCheckpoint
    from rljob_worker.publish import PublishingListener

    recorder = _Recorder()
    listener = PublishingListener(cast(Any, recorder), world_size=2)
    for rank in range(2):
        listener(SavedCheckpoint(1, "/ckpt/iteration-00000001", 100 + rank, 2.0 + rank,
                                 "2026-11-26T22:00:00Z" if rank == 0 else None))  # fmt: skip
    assert listener.run.samples == []
    listener.flush()
    (status,) = recorder.published
    assert status.checkpoint is not None
    assert (status.checkpoint.iteration, status.checkpoint.bytes) == (1, 201)
    assert status.checkpoint.seconds == 3.0


def test_the_listener_reports_an_export_sent_alone() -> None:
    """Rank 0 sends an export alone when its iteration failed after export.withCheckpoints
    wrote it (loop._send_unreported): status.export names it, and no memory sample is made."""
    from typing import Any, cast

    from rljob_worker.checkpoint import ModelExported
    from rljob_worker.publish import PublishingListener

    recorder = _Recorder()
    listener = PublishingListener(cast(Any, recorder), world_size=2)
    listener(ModelExported(3, "/export/iteration-00000003"))
    assert listener.run.samples == []
    listener.flush()
    (status,) = recorder.published
    assert status.export is not None
    assert (status.export.iteration, status.export.path) == (3, "/export/iteration-00000003")


def _metrics(*iterations: int, reward: float = 0.0) -> list[IterationMetrics]:
    return [IterationMetrics(iteration=i, reward_mean=reward + i) for i in iterations]


@pytest.mark.parametrize(
    ("earlier", "own", "resumed_at", "expected"),
    [
        # A run resumed at 3 redoes 3 on: its values stand from there, none twice.
        ((0, 1, 2, 3, 4), (3,), 3, [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0)]),
        # Resumed, with no iteration finished by every rank yet: the resume point cuts.
        ((0, 1, 2, 3, 4), (), 3, [(0, 0.0), (1, 1.0), (2, 2.0)]),
        # Nothing of its own yet and no resume known: the earlier curve stays whole.
        ((0, 1, 2), (), None, [(0, 0.0), (1, 1.0), (2, 2.0)]),
        # A run that started again at 0 (no checkpoint) replaces the earlier curve.
        ((0, 1, 2, 3), (0, 1), None, [(0, 10.0), (1, 11.0)]),
    ],
)
def test_continued_keeps_the_earlier_metrics_before_this_runs_first_iteration(
    earlier: tuple[int, ...],
    own: tuple[int, ...],
    resumed_at: int | None,
    expected: list[tuple[int, float]],
) -> None:
    from rljob_worker.driver import continued

    resumed = None if resumed_at is None else ResumePoint(iteration=resumed_at, path="/c")
    status = RLJobStatus(metrics=_metrics(*own, reward=10.0), resumed_from=resumed)
    merged = continued(status, RLJobStatus(metrics=_metrics(*earlier)))
    assert [(m.iteration, m.reward_mean) for m in merged.metrics] == expected


def _checkpoint(iteration: int) -> CheckpointStatus:
    return CheckpointStatus(iteration=iteration, path=f"/c/iteration-{iteration:08d}",
                            completed_at="2026-05-09T10:00:00Z", bytes=10, seconds=1.0)  # fmt: skip


def test_a_rerun_of_the_attempt_keeps_the_checkpoint_export_and_earlier_metrics() -> None:
    """KubeRay runs the job again after a lost pod (same attempt, a new driver process): its
    first apply, under the same field manager, must not delete status.checkpoint, .export or
    the metrics of the iterations before its resume point; an earlier run's failed save and
    resume are its own and go."""
    from kubernetes import client

    from rljob_worker.publish import StatusPublisher

    applied = _AppliedStatus()

    def driver() -> StatusPublisher:
        publisher = StatusPublisher(client.ApiClient(), "ns", "job", attempt=1)
        publisher.custom = applied  # type: ignore[assignment]
        publisher.event = lambda *_args, **_kw: None  # type: ignore[method-assign]
        return publisher

    failure = CheckpointFailure(iteration=5, path="/c/iteration-00000005", rank=0, error="ENOSPC")
    driver().publish(
        RLJobStatus(
            iteration=4, memory=memory(4), metrics=_metrics(0, 1, 2, 3, 4),
            checkpoint=_checkpoint(3), export=ExportStatus(path="/e/iteration-00000003", iteration=3),
            resumed_from=ResumePoint(iteration=1, path="/c/iteration-00000001"),
            checkpoint_failure=failure,
        )
    )  # fmt: skip
    rerun = driver()
    resumed = ResumePoint(iteration=3, path="/c/iteration-00000003")
    rerun.publish(
        RLJobStatus(
            iteration=3, memory=memory(3), metrics=_metrics(3, reward=10.0), resumed_from=resumed
        )
    )
    status: Any = applied.status
    assert status["checkpoint"]["iteration"] == 3
    assert status["export"] == {"path": "/e/iteration-00000003", "iteration": 3}
    # Iteration 4 of the lost run is redone: the earlier value goes, the new one comes later.
    assert [(m["iteration"], m["rewardMean"]) for m in status["metrics"]] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0),
    ]  # fmt: skip
    assert status["resumedFrom"] == {**resumed.model_dump(), "attempt": 1}
    assert "checkpointFailure" not in status
    # Its own save replaces the one it carried.
    rerun.publish(RLJobStatus(iteration=4, metrics=_metrics(3, 4, reward=10.0),
                              checkpoint=_checkpoint(4), resumed_from=resumed))  # fmt: skip
    assert status["checkpoint"]["iteration"] == 4
    assert [m["rewardMean"] for m in status["metrics"]] == [0.0, 1.0, 2.0, 13.0, 14.0]


class _Apiserver:
    """The two calls StatusPublisher makes of the custom-objects API; the first `failing`
    status applies answer 503 (an apiserver blip)."""

    def __init__(self, failing: int = 0) -> None:
        self.failing, self.applied = failing, []  # type: ignore[var-annotated]

    def get_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
        return {"metadata": {"uid": "u"}, "status": {}}

    def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        if self.failing:
            self.failing -= 1
            raise ApiException(status=503)
        self.applied.append(args[5]["status"])


def _publisher(apiserver: _Apiserver, events: list[str]) -> Any:
    from kubernetes import client

    from rljob_worker.publish import StatusPublisher

    publisher = StatusPublisher(client.ApiClient(), "ns", "job", attempt=1)
    publisher.custom = apiserver  # type: ignore[assignment]
    publisher.event = lambda kind, reason, message: events.append(reason)  # type: ignore[method-assign, assignment]
    return publisher


def test_a_cuda_oom_event_waits_out_a_failed_status_write() -> None:
    # The Warning Event follows the status write that holds the entry; a write that failed
    # dropped the Event for good (the next flush has no new OOM).
    from rljob_worker.publish import PublishingListener

    events: list[str] = []
    listener = PublishingListener(_publisher(_Apiserver(failing=1), events), world_size=2)
    listener(OOMRecord(time="2026-01-01T00:00:00Z", kind="CUDAOutOfMemory",
                       stage=Stage.WAKE_KV_CACHE, iteration=1, rank=0, message="oom"))  # fmt: skip
    assert events == []  # its write failed
    listener.flush()
    assert events == ["CUDAOutOfMemory"]
    listener.flush()
    assert events == ["CUDAOutOfMemory"]  # once


def test_a_figure_that_is_not_finite_is_left_out_of_status() -> None:
    # JSON has no NaN: one such figure made every later write invalid while metrics kept it.
    import json

    from kubernetes import client

    entry = IterationMetrics(iteration=1, policy_loss=float("nan"), entropy_mean=float("inf"))
    assert (entry.policy_loss, entry.entropy_mean) == (None, None)
    body = driver_fields(RLJobStatus(iteration=1, metrics=[entry]), [])
    json.dumps(client.ApiClient().sanitize_for_serialization(body), allow_nan=False)


def test_a_new_attempt_publishes_no_plan_of_the_one_before() -> None:
    from rljob.api import PlanStatus, WakeUp

    apiserver, events = _Apiserver(), []  # type: ignore[var-annotated]
    publisher = _publisher(apiserver, events)
    publisher.plan = PlanStatus(capacity_bytes=1, wake_up=WakeUp.STAGED, mem_fraction_static=0.9,
                                fits=True, offload_optimizer=True, offload_params=True,
                                stages=[])  # fmt: skip
    publisher.publish(RLJobStatus(iteration=0))
    assert apiserver.applied[-1]["plan"]["attempt"] == 1
    publisher.next_attempt()
    publisher.attempt = 2  # as rljob run sets it; attempt 2 fails before its rank 0 plans
    publisher.publish(RLJobStatus())
    assert "plan" not in apiserver.applied[-1]
