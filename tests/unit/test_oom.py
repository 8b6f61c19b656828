"""Unit tests of the operator's pure OOM core: a pod's status in, OOMKilled entries out; kills
merged into a bounded status part that aggregates repeats and counts each kill once."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.api import OOMEvent
from rljob_operator.oom import (
    MAX_KILLED_ENTRIES,
    KillCache,
    KilledPart,
    current_part,
    merge,
    pod_kills,
)
from rljob_operator.status import differs, with_ooms


def pod(
    *, state: dict[str, Any] | None = None, last: dict[str, Any] | None = None,
    restarts: int = 0, name: str = "job-workers-abc", status: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    container: dict[str, Any] = {"name": "ray-worker", "restartCount": restarts, "state": {}}
    if state is not None:
        container["state"] = {"terminated": state}
    if last is not None:
        container["lastState"] = {"terminated": last}
    return {
        "metadata": {"name": name, "labels": {"rljob.dev/job": "job"}},
        "spec": {
            "nodeName": "node-1",
            "containers": [{"name": "ray-worker", "resources": {"limits": {"memory": "64Gi"}}}],
        },
        "status": {"containerStatuses": [container], **(status or {})},
    }


KILLED = {"reason": "OOMKilled", "exitCode": 137, "finishedAt": "2026-05-09T10:00:00Z"}


@pytest.mark.parametrize(
    ("shape", "termination"),
    [
        (pod(state=KILLED, restarts=0), 1),  # killed, not restarted yet
        (pod(last=KILLED, restarts=1), 1),  # the same kill after the kubelet restarted it
        (pod(last=KILLED, restarts=4), 4),
    ],
)
def test_oomkilled_container_becomes_one_entry_with_limit_node_and_time(
    shape: dict[str, Any], termination: int
) -> None:
    [kill] = pod_kills(shape)
    assert (kill.kind, kill.pod, kill.container, kill.node) == (
        "OOMKilled", "job-workers-abc", "ray-worker", "node-1",
    )  # fmt: skip
    assert kill.limit_bytes == 64 * 2**30
    assert kill.time == "2026-05-09T10:00:00Z"
    assert kill.restart_count == termination
    assert kill.id == "killed/job-workers-abc/ray-worker"


@pytest.mark.parametrize(
    "shape",
    [
        pod(),
        pod(state={"reason": "Error", "exitCode": 1}),
        pod(last={"reason": "Completed", "exitCode": 0}, restarts=1),
        pod(status={"phase": "Failed", "reason": "Evicted", "message": "low on ephemeral-storage"}),
    ],
)
def test_pods_without_an_oom_give_no_entry(shape: dict[str, Any]) -> None:
    assert pod_kills(shape) == []


def test_memory_eviction_is_an_oomkilled_entry() -> None:
    evicted = pod(
        status={
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
            "startTime": "2026-05-09T09:00:00Z",
        }
    )
    [kill] = pod_kills(evicted)
    assert kill.kind == "OOMKilled" and "memory" in kill.message


def test_a_memory_eviction_is_dated_when_it_happened_and_counted_after_a_restart() -> None:
    """An eviction's time is the eviction's (the kubelet's DisruptionTarget condition, the
    containers' end), not the pod's start: dated at its start, a pod evicted hours after it
    started sorted as the oldest entry and, with the entries full and the pod started before
    the operator, was taken for a kill an earlier operator had counted and never counted."""
    evicted = pod(
        state={"reason": "ContainerStatusUnknown", "exitCode": 137,
               "finishedAt": "2026-05-09T11:00:05Z"},
        status={
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
            "startTime": "2026-05-09T09:00:00Z",
            "conditions": [{"type": "DisruptionTarget", "status": "True",
                            "reason": "TerminationByKubelet",
                            "lastTransitionTime": "2026-05-09T11:00:00Z"}],
        },
    )  # fmt: skip
    [kill] = pod_kills(evicted)
    assert kill.time == "2026-05-09T11:00:05Z"
    full = KilledPart([], 0, [])
    for i in range(MAX_KILLED_ENTRIES):
        at = {**KILLED, "finishedAt": f"2026-05-09T10:{i:02d}:00Z"}
        full = merge(full, pod_kills(pod(state=at, name=f"p{i:02d}")))
    # The operator restarted at 10:30, after the pod started, before it was evicted.
    after = merge(full, [kill], started_at="2026-05-09T10:30:00Z")
    assert after.total == MAX_KILLED_ENTRIES + 1 and after.counted == [kill]


def test_the_same_kill_seen_twice_counts_once() -> None:
    before = pod(state=KILLED, restarts=0)
    after = pod(last=KILLED, restarts=1)
    part = merge(KilledPart([], 0, []), pod_kills(before))
    again = merge(part, pod_kills(after))
    assert part.total == 1 and again.total == 1 and again.counted == []


def test_repeated_kills_of_a_container_aggregate_into_one_entry() -> None:
    part = KilledPart([], 0, [])
    for restarts in range(1, 6):
        part = merge(part, pod_kills(pod(last=KILLED, restarts=restarts)))
    assert part.total == 5
    [entry] = part.entries
    assert entry.count == 5 and entry.restart_count == 5


def test_many_kills_keep_the_entries_bounded_and_the_count_exact() -> None:
    part = KilledPart([], 0, [])
    for i in range(1000):
        kill = {**KILLED, "finishedAt": f"2026-05-09T10:{i // 60:02d}:{i % 60:02d}Z"}
        part = merge(part, pod_kills(pod(state=kill, name=f"p{i:04d}")))
    assert part.total == 1000
    assert len(part.entries) == MAX_KILLED_ENTRIES
    assert [e.pod for e in part.entries] == [f"p{i:04d}" for i in range(990, 1000)]
    # A restarted operator sees an old pod again: older than every entry kept and than the
    # operator's start, it was counted before it left the list.
    old = pod_kills(pod(state={**KILLED, "finishedAt": "2026-05-09T10:00:05Z"}, name="p0005"))
    assert merge(part, old, started_at="2026-05-09T12:00:00Z").total == 1000


def test_kills_merged_out_of_time_order_are_all_counted() -> None:
    # Pods are handled concurrently: a kill can arrive after later ones filled the list.
    part = KilledPart([], 0, [])
    for i in reversed(range(30)):
        kill = {**KILLED, "finishedAt": f"2026-05-09T10:00:{i:02d}Z"}
        part = merge(part, pod_kills(pod(state=kill, name=f"p{i:02d}")), started_at="2026-05-09")
    assert part.total == 30 and len(part.entries) == MAX_KILLED_ENTRIES


def test_kill_cache_passes_each_kill_of_a_container_once() -> None:
    cache = KillCache()
    first = pod_kills(pod(state=KILLED, restarts=0))
    assert cache.fresh("ns", first) == first
    cache.record("ns", first)
    assert cache.fresh("ns", pod_kills(pod(last=KILLED, restarts=1))) == []  # same kill
    assert cache.fresh("other", first) == first
    second = pod_kills(pod(last=KILLED, restarts=2))
    assert cache.fresh("ns", second) == second
    cache.forget("ns", "job-workers-abc")
    assert cache.fresh("ns", first) == first


def test_status_part_round_trips_and_leaves_cuda_entries_to_the_driver() -> None:
    part = merge(KilledPart([], 0, []), pod_kills(pod(state=KILLED)))
    cuda = OOMEvent.model_validate(
        {"time": "2026-05-09T10:00:01Z", "kind": "CUDAOutOfMemory", "stage": "rollout", "rank": 1}
    )
    current = {
        "oomEvents": [*part.to_status()["oomEvents"], cuda.model_dump(by_alias=True, mode="json")],
        "oomCounts": {"OOMKilled": 1, "CUDAOutOfMemory": 3},
        "memory": {"stages": [{"name": "train", "peakFraction": 0.4}]},
    }
    assert current_part(current).entries == part.entries
    computed = with_ooms({"phase": "Running"}, current, current_part(current))
    assert computed["oomCounts"] == {"OOMKilled": 1}
    assert [e["kind"] for e in computed["oomEvents"]] == ["OOMKilled"]
    assert computed["oomTotal"] == 4 and computed["worstStageFraction"] == 0.4
    assert not differs({**current, **computed, "oomEvents": current["oomEvents"],
                        "oomCounts": current["oomCounts"]}, computed)  # fmt: skip
    assert cuda.id == "cuda/rank1/it-/rollout/2026-05-09T10:00:01Z"
