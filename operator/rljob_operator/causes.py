"""Why a job's pods are not running: what the scheduler, the kubelet and KubeRay report, read from
the job's pods and its RayCluster, as one-line causes. Pure, plus the per-job book of live causes.

A cause is keyed for Events by its reason and the container (or RayCluster condition) it hit,
so four workers failing to pull one image are one cause, one Event (its count the pods hit).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Pod-level reasons (kubelet's and the scheduler's own words where they have one).
UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL_BACK_OFF = "ImagePullBackOff"
CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
CONTAINER_FAILED = "ContainerFailed"
POD_FAILED = "PodFailed"
# The kubelet alternates ErrImagePull and ImagePullBackOff for one failing pull: one cause.
_SAME_AS = {"ErrImagePull": IMAGE_PULL_BACK_OFF}
# Waiting reasons that will not clear by themselves.
WAITING_FAILURES = (
    "ErrImagePull",
    IMAGE_PULL_BACK_OFF,
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    CRASH_LOOP_BACK_OFF,
)
# KubeRay's RayCluster condition when it cannot create (or delete) a pod.
REPLICA_FAILURE = "ReplicaFailure"
# The most telling first: a pod that cannot exist, then one that cannot start, then one that
# has not been placed (which may still clear when capacity frees up).
_ORDER = (
    "FailedCreateHeadPod",
    "FailedCreateWorkerPod",
    "InvalidImageName",
    "ErrImageNeverPull",
    IMAGE_PULL_BACK_OFF,
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    CRASH_LOOP_BACK_OFF,
    CONTAINER_FAILED,
    POD_FAILED,
    UNSCHEDULABLE,
)
MAX_MESSAGE = 300


def _one_line(text: Any) -> str:
    line = " ".join(str(text or "").split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


@dataclass(frozen=True, order=True)
class Cause:
    """One reason a job's pods are not running, on one object (`pod/NAME`, `raycluster/NAME`)."""

    reason: str
    source: str
    message: str
    container: str = ""

    @property
    def key(self) -> str:
        """What makes two causes one for Events: the reason and the container (or condition)."""
        return f"{self.reason}/{self.container}"

    @property
    def line(self) -> str:
        where = f"{self.source}" + (f" container {self.container}" if self.container else "")
        return f"{self.reason} on {where}: {self.message}"

    @property
    def rank(self) -> int:
        return _ORDER.index(self.reason) if self.reason in _ORDER else len(_ORDER)


def pod_causes(pod: Mapping[str, Any]) -> list[Cause]:
    """The pod's blocking causes: not schedulable, a container that cannot start or keeps
    crashing, a container that exited non-zero, or the pod failed. OOMKilled is oom.py's."""
    name = str((pod.get("metadata") or {}).get("name") or "")
    source = f"pod/{name}"
    status = pod.get("status") or {}
    found: list[Cause] = []
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == UNSCHEDULABLE
        ):
            found.append(Cause(UNSCHEDULABLE, source, _one_line(condition.get("message"))))
    for cs in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        container = str(cs.get("name") or "")
        waiting = (cs.get("state") or {}).get("waiting") or {}
        terminated = (cs.get("state") or {}).get("terminated") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        reason = str(waiting.get("reason") or "")
        if reason in WAITING_FAILURES:
            message = _one_line(waiting.get("message") or reason)
            if reason == CRASH_LOOP_BACK_OFF and last:
                message = _one_line(
                    f"restarted {cs.get('restartCount', 0)} times; last exit code "
                    f"{last.get('exitCode', '?')} ({last.get('reason') or 'Error'})"
                    + (f": {last['message']}" if last.get("message") else "")
                )
            found.append(Cause(_SAME_AS.get(reason, reason), source, message, container))
        elif _failed(terminated):
            message = f"exited with code {terminated.get('exitCode')} ({terminated.get('reason')})"
            if terminated.get("message"):
                message += f": {terminated['message']}"
            found.append(Cause(CONTAINER_FAILED, source, _one_line(message), container))
    if status.get("phase") == "Failed" and not found:
        found.append(
            Cause(str(status.get("reason") or POD_FAILED), source, _one_line(status.get("message")))
        )
    return found


def _failed(terminated: Mapping[str, Any]) -> bool:
    return (
        bool(terminated)
        and terminated.get("exitCode", 0) != 0
        and (terminated.get("reason") != "OOMKilled")
    )


def raycluster_causes(raycluster: Mapping[str, Any]) -> list[Cause]:
    """KubeRay's ReplicaFailure condition (a head or worker pod it could not create: refused by
    the apiserver's admission, e.g. a missing PriorityClass or an invalid pod)."""
    name = str((raycluster.get("metadata") or {}).get("name") or "")
    return [
        Cause(
            str(c.get("reason") or REPLICA_FAILURE),
            f"raycluster/{name}",
            _one_line(c.get("message")),
        )
        for c in (raycluster.get("status") or {}).get("conditions") or []
        if c.get("type") == REPLICA_FAILURE and c.get("status") == "True"
    ]


def ordered(causes: list[Cause]) -> list[Cause]:
    return sorted(causes, key=lambda c: (c.rank, c.source, c.container, c.reason))


def event_name(job: str, uid: str, key: str) -> str:
    """A stable Event name per job and cause key, so a cause is one Event whose count grows.
    The RLJob's uid is in it: a job deleted and applied again under the same name (its image
    fixed, say) gets Events of its own, not updates to the old object's, which `kubectl
    describe` (matching the uid) would not show."""
    digest = hashlib.sha256(f"{uid}/{key}".encode()).hexdigest()[:12]
    return f"{job}.cause.{digest}"


# The Event of a cause lists, in this annotation, the sources its count has counted (the newest
# SOURCES_KEPT of them), so an operator that restarts, or a new leader, counts on from the Event
# instead of from zero: kopf lists every pod again at start, and the pods already counted are not
# counted twice. Within one process each source is announced once (CauseBook); across a restart,
# a source older than the SOURCES_KEPT newest that is still failing is counted again (a job with
# over 128 failing pods of one cause).
SOURCES_ANNOTATION = "rljob.dev/counted-sources"
SOURCES_KEPT = 128


@dataclass(frozen=True)
class Announcement:
    """An Event to post or update: the cause (its first source) and the sources that hit it
    since this process last announced it (each source is announced once per process; the
    Event's annotation says which an earlier process counted)."""

    cause: Cause
    sources: tuple[str, ...]


def counted(
    previous: list[str] | None, previous_count: int, sources: tuple[str, ...]
) -> tuple[int, list[str]] | None:
    """An Event's count and counted sources after `sources` hit its cause; None when it has
    counted every one of them already (nothing to write). `previous` is None for no Event yet."""
    if previous is None:
        return len(sources), list(sources)[-SOURCES_KEPT:]
    fresh = [s for s in sources if s not in previous]
    if not fresh:
        return None
    return previous_count + len(fresh), (previous + fresh)[-SOURCES_KEPT:]


def event_message(line: str, count: int) -> str:
    return line + (f" ({count} objects)" if count > 1 else "")


class CauseBook:
    """Per job (namespace, name and uid: a job applied again under its name is another job),
    the live causes of each source object, as its latest event showed them; and which (cause
    key, source) pairs were already announced by an Event in this process (the Event itself
    keeps which it counted across processes: SOURCES_ANNOTATION).

    Level-triggered: each pod or RayCluster event replaces its source's causes, and kopf lists
    every pod and RayCluster again when the operator starts, so a restart rebuilds the book.
    `current` is None for a job this process has heard nothing about (keep what status says).
    A job whose sources all cleared is dropped whole, announcements included (its Events'
    annotations keep a later announcement from counting a source twice), so the book holds the
    jobs with live causes only.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple[str, str, str], dict[str, list[Cause]]] = {}
        self._announced: dict[tuple[str, str, str], dict[str, list[str]]] = {}

    def observe(self, namespace: str, job: str, uid: str, source: str, causes: list[Cause]) -> bool:
        """Record a source's causes now; True when they changed."""
        key = (namespace, job, uid)
        with self._lock:
            sources = self._live.get(key, {})
            before = sources.get(source, [])
            if causes:
                sources[source] = list(causes)
                self._live[key] = sources
            else:
                sources.pop(source, None)
                if not sources:
                    self._live.pop(key, None)
                    self._announced.pop(key, None)
            return before != causes

    def current(self, namespace: str, job: str, uid: str) -> list[Cause] | None:
        with self._lock:
            sources = self._live.get((namespace, job, uid))
            if sources is None:
                return None
            return ordered([c for causes in sources.values() for c in causes])

    def unannounced(self, namespace: str, job: str, uid: str) -> list[Announcement]:
        """Causes with a source not yet counted in their Event; marks them counted."""
        key = (namespace, job, uid)
        with self._lock:
            if key not in self._live:
                return []
            announced = self._announced.setdefault(key, {})
            fresh: dict[str, list[str]] = {}
            live = ordered([c for causes in self._live[key].values() for c in causes])
            for cause in live:
                sources = announced.setdefault(cause.key, [])
                if cause.source not in sources:
                    sources.append(cause.source)
                    fresh.setdefault(cause.key, []).append(cause.source)
            return [
                Announcement(next(c for c in live if c.key == key), tuple(new))
                for key, new in fresh.items()
            ]

    def retract(self, namespace: str, job: str, uid: str, news: Announcement) -> None:
        """An Announcement whose Event was not written: its sources count as unannounced
        again, so the job's next event tries again."""
        with self._lock:
            by_key = self._announced.get((namespace, job, uid), {})
            sources = by_key.get(news.cause.key, [])
            sources[:] = [s for s in sources if s not in news.sources]

    def forget(self, namespace: str, job: str, uid: str) -> None:
        with self._lock:
            self._live.pop((namespace, job, uid), None)
            self._announced.pop((namespace, job, uid), None)

    def __len__(self) -> int:
        """Jobs held (live causes or announcements): what a deleted job must not leave."""
        with self._lock:
            return len(self._live.keys() | self._announced.keys())
