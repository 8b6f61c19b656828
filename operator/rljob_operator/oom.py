"""Container OOM kills: a job's pod in, OOMKilled entries out; and the bounded, aggregated
OOMKilled part of RLJob status (last N entries, one per container, plus a total count). Pure.

A kill is recognised by the container's termination number (its restartCount once it restarts
after that kill), so the same kill seen twice (state.terminated, then lastState.terminated
after the restart; or again after an operator restart) is counted once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes.utils import parse_quantity

from rljob.api import OOMEvent
from rljob_operator.identity import attempt_of

KIND: Literal["OOMKilled"] = "OOMKilled"
# status.oomEvents keeps this many OOMKilled entries (one per container, latest kills first to
# go); status.oomCounts.OOMKilled counts every kill and each kill is a Warning Event.
MAX_KILLED_ENTRIES = 10


def _limit_bytes(pod: Mapping[str, Any], container: str) -> int | None:
    for spec in (pod.get("spec") or {}).get("containers") or []:
        if spec.get("name") == container:
            limit = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
            return int(parse_quantity(limit)) if limit is not None else None
    return None


def _memory_eviction(status: Mapping[str, Any]) -> bool:
    # The kubelet's eviction manager: reason Evicted, message "The node was low on resource:
    # memory. ..." (disk or PID pressure evictions are not OOMs).
    return status.get("reason") == "Evicted" and "memory" in str(status.get("message") or "")


def _eviction_time(status: Mapping[str, Any], statuses: list[Mapping[str, Any]]) -> str:
    """When the pod was evicted: the latest of the kubelet's DisruptionTarget condition and its
    containers' (`statuses`) ends; its start only where neither shows (merge() orders and bounds
    entries by time, and takes an early one for a kill an earlier operator counted)."""
    times = [
        c.get("lastTransitionTime")
        for c in status.get("conditions") or []
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
    ]
    for cs in statuses:
        times.append(((cs.get("state") or {}).get("terminated") or {}).get("finishedAt"))
    found = [str(t) for t in times if t]
    return max(found) if found else str(status.get("startTime") or "")


def pod_kills(pod: Mapping[str, Any]) -> list[OOMEvent]:
    """Every OOM kill the pod's status shows: containers terminated with reason OOMKilled (now
    or as their last state) and the pod evicted for memory. One entry per container, count 1."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name, node = str(meta.get("name") or ""), str((pod.get("spec") or {}).get("nodeName") or "")
    attempt = attempt_of(pod)
    kills: list[OOMEvent] = []
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for cs in statuses:
        restarts = int(cs.get("restartCount") or 0)
        # Not restarted yet: this termination becomes restart number restarts+1.
        candidates = [
            ((cs.get("state") or {}).get("terminated"), restarts + 1),
            ((cs.get("lastState") or {}).get("terminated"), restarts),
        ]
        for terminated, termination in candidates:
            if terminated and terminated.get("reason") == KIND:
                container = str(cs.get("name") or "")
                limit = _limit_bytes(pod, container)
                kills.append(
                    OOMEvent(
                        id=f"killed/{name}/{container}",
                        time=str(terminated.get("finishedAt") or terminated.get("startedAt") or ""),
                        kind=KIND,
                        pod=name,
                        container=container,
                        node=node,
                        limit_bytes=limit,
                        count=1,
                        restart_count=termination,
                        attempt=attempt,
                        message=f"container {container} of pod {name} was OOMKilled"
                        + (f" (memory limit {limit} bytes)" if limit is not None else "")
                        + f", exit code {terminated.get('exitCode', '?')}",
                    )
                )
                break  # the current state is the newer of the two
    if _memory_eviction(status):
        kills.append(
            OOMEvent(
                id=f"killed/{name}/-",
                time=_eviction_time(status, statuses),
                kind=KIND,
                pod=name,
                node=node,
                count=1,
                restart_count=1,
                attempt=attempt,
                message=str(status.get("message") or "evicted for memory")[:1000],
            )
        )
    return kills


@dataclass(frozen=True)
class KilledPart:
    """The operator's OOMKilled part of status, after merging newly observed kills."""

    entries: list[OOMEvent]
    total: int
    counted: list[OOMEvent]  # kills counted now (each gets a Warning Event)

    def to_status(self) -> dict[str, Any]:
        part: dict[str, Any] = {
            "oomEvents": [
                e.model_dump(by_alias=True, exclude_none=True, mode="json") for e in self.entries
            ]
        }
        if self.total:
            part["oomCounts"] = {KIND: self.total}
        return part


def current_part(status: Mapping[str, Any]) -> KilledPart:
    """The OOMKilled part as status holds it now (the driver's CUDA entries are not ours)."""
    entries = [
        OOMEvent.model_validate(e) for e in status.get("oomEvents") or [] if e.get("kind") == KIND
    ]
    total = int((status.get("oomCounts") or {}).get(KIND) or 0)
    return KilledPart(entries=entries, total=total, counted=[])


def merge(
    part: KilledPart,
    kills: Iterable[OOMEvent],
    keep: int = MAX_KILLED_ENTRIES,
    started_at: str = "",
) -> KilledPart:
    """Add the kills not yet counted: repeated kills of a container aggregate into its entry;
    the entries stay the `keep` with the latest kills; the total counts every kill once.

    A container that dropped out of the entries cannot be compared by restart count any more.
    For a kill that finished before this operator started (`started_at`, RFC 3339), one older
    than the oldest entry of a full list was counted by an earlier operator before it dropped
    out. Later kills are never skipped by time: pods are handled concurrently, so kills are not
    merged in time order (KillCache keeps this process from counting one twice).
    """
    by_id = {e.id: e for e in part.entries}
    oldest = min((e.time for e in part.entries), default="") if len(part.entries) >= keep else ""
    total, counted = part.total, []
    for kill in kills:
        held = by_id.get(kill.id)
        if held is not None:
            if (kill.restart_count or 0) <= (held.restart_count or 0):
                continue
            by_id[kill.id] = kill.model_copy(update={"count": (held.count or 1) + 1})
        else:
            if oldest and kill.time < started_at and kill.time < oldest:
                continue
            by_id[kill.id] = kill.model_copy(update={"count": 1})
        total += 1
        counted.append(by_id[kill.id])
    entries = sorted(by_id.values(), key=lambda e: (e.time, e.id))[-keep:]
    return KilledPart(entries=entries, total=total, counted=counted)


class KillCache:
    """The kills this operator process has counted, per (namespace, pod id): the latest restart
    count of each. A pod's status shows its last kill on every later change (readiness, another
    container), and its entry may have left the bounded status list, so this is what keeps a
    live operator from counting it again. Bounded by the live pods (forget on deletion)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], int] = {}

    def fresh(self, namespace: str, kills: Iterable[OOMEvent]) -> list[OOMEvent]:
        with self._lock:
            return [
                k for k in kills if (k.restart_count or 0) > self._seen.get((namespace, k.id), -1)
            ]

    def record(self, namespace: str, kills: Iterable[OOMEvent]) -> None:
        with self._lock:
            for k in kills:
                key = (namespace, k.id)
                self._seen[key] = max(self._seen.get(key, -1), k.restart_count or 0)

    def forget(self, namespace: str, pod: str) -> None:
        with self._lock:
            for key in [k for k in self._seen if k[0] == namespace and k[1].split("/")[1] == pod]:
                del self._seen[key]
