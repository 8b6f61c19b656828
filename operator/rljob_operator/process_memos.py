"""What this operator process remembers between events: the per-job locks, and memos that only
skip work whose outcome is known (a restart empties them; every handler recomputes from the API).

Two memos: a RayJob state its RLJob's status was already computed from (MIRRORED), and a
job-config ConfigMap version already parsed (APPLIED); besides them the causes seen per job
(CAUSES) and the OOMKilled containers counted (KILLS).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from rljob.api import JOB_CONFIG_FILE, JobConfig, RLJobSpec
from rljob_operator import causes, identity, kube, oom, render


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _job_config_spec(config_map: Mapping[str, Any]) -> RLJobSpec | None:
    text = (config_map.get("data") or {}).get(JOB_CONFIG_FILE)
    if text is None:
        return None
    try:
        return JobConfig.from_yaml(text).spec
    except (ValidationError, yaml.YAMLError):
        return None  # someone edited it by hand; the next apply rewrites it


class AppliedSpecs:
    """The spec each job runs with (what its job-config ConfigMap holds), parsed once per
    version of that ConfigMap.

    The ConfigMap is read every time; only the parse is reused, for the very same content (a
    ConfigMap's uid and resourceVersion name its content exactly). Parsing that YAML was a tenth
    of the operator's CPU in bench/operator_load.py's profile, once per RayJob change.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[tuple[str, str], RLJobSpec | None]] = {}

    @staticmethod
    def _version(config_map: Mapping[str, Any]) -> tuple[str, str]:
        meta = config_map["metadata"]
        return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")

    def read(self, namespace: str, name: str, uid: str) -> RLJobSpec | None:
        """The spec the job `uid` runs with; None before its ConfigMap exists. A ConfigMap of
        this name that is not the job's (an earlier RLJob's of the same name, its garbage
        collection not done) holds another job's spec: taken for this one's, the new job would
        be applied with the old spec, and then refuse its own as an update of a live job."""
        found = identity.own(kube.get_config_map(namespace, render.config_map_name(name)), uid)
        if found is None:
            self.forget(namespace, name)
            return None
        held = self._held.get((namespace, name))
        if held is not None and held[0] == self._version(found):
            return held[1]
        spec = _job_config_spec(found)
        self._held[(namespace, name)] = (self._version(found), spec)
        return spec

    def remember(
        self, namespace: str, name: str, config_map: Mapping[str, Any], spec: RLJobSpec
    ) -> None:
        """The ConfigMap as an apply of render.config_map(spec) stored it."""
        self._held[(namespace, name)] = (self._version(config_map), spec)

    def forget(self, namespace: str, name: str) -> None:
        self._held.pop((namespace, name), None)


APPLIED = AppliedSpecs()


# Kills that finished before this moment may have been counted by an earlier operator process.
STARTED_AT = now()
KILLS = oom.KillCache()


class JobLocks:
    """One lock per RLJob name: the operator's status writes for a job (RayJob changes, pod
    kills, derived fields) run in kopf's worker threads, and each write states every
    operator-owned field, so they must not interleave within this process. Reentrant:
    reconcile() holds it from its first apply through its status write.

    A lock exists only while a handler holds or waits for it (counted), so no job leaves one
    behind, whichever of its events comes last, and two locks for one name never exist: a
    handler that comes while another holds the name's lock waits on that very lock.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[tuple[str, str], tuple[threading.RLock, int]] = {}

    @contextlib.contextmanager
    def hold(self, namespace: str, name: str) -> Iterator[None]:
        key = (namespace, name)
        with self._guard:
            lock, users = self._held.get(key, (threading.RLock(), 0))
            self._held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._held[key]
                if users == 1:
                    del self._held[key]
                else:
                    self._held[key] = (lock, users - 1)

    def __len__(self) -> int:
        with self._guard:
            return len(self._held)


LOCKS = JobLocks()


class MirroredRayJobs:
    """Per RLJob, the RayJob state (uid and status) its status was last computed from in this
    process, so a RayJob event that brings nothing new costs no read.

    The common case is the ADDED event of the RayJob reconcile() has just applied and mirrored:
    it cost two RLJob reads, a ConfigMap read and two spec validations per job, for no write.
    Read and kept under the job's lock with the write it describes, so it never runs ahead of
    status; empty after a restart, when kopf lists every RayJob again and each is mirrored afresh.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}

    @staticmethod
    def _state(rayjob: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        # status.compute reads the RayJob's name and status only; the uid tells a recreated one.
        return str(rayjob["metadata"].get("uid") or ""), dict(rayjob.get("status") or {})

    def holds(self, namespace: str, name: str, rayjob: Mapping[str, Any] | None) -> bool:
        seen = self._seen.get((namespace, name))
        return rayjob is not None and seen is not None and seen == self._state(rayjob)

    def remember(self, namespace: str, name: str, rayjob: Mapping[str, Any] | None) -> None:
        if rayjob is None:
            self.forget(namespace, name)
        else:
            self._seen[(namespace, name)] = copy.deepcopy(self._state(rayjob))

    def forget(self, namespace: str, name: str) -> None:
        self._seen.pop((namespace, name), None)


MIRRORED = MirroredRayJobs()
CAUSES = causes.CauseBook()


def forget_job(namespace: str, name: str, uid: str | None) -> None:
    """Drop what this process keeps of a job that is gone: the RayJob state and spec memos of
    its name (they hold content keys, so a job applied again under the name only re-reads),
    and the causes of the gone job's uid."""
    MIRRORED.forget(namespace, name)
    APPLIED.forget(namespace, name)
    if uid is not None:
        CAUSES.forget(namespace, name, uid)
