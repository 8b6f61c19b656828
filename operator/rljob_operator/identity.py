"""Which RLJob a Kubernetes object belongs to: its uid, never its name alone (issue 28). Pure.

A job deleted and applied again under the same name is another object with another uid; the
children of the first (a RayJob held by KubeRay's finalizer, pods still terminating) keep
sending events under the same names and labels, and must reach nothing of the second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rljob.api import KIND

# On every child the operator renders and on the pod templates: the RLJob's uid (a RayCluster
# and its pods have KubeRay's objects as owners, so this label is how they name their job) and
# the OOM policy's attempt the pod runs (an OOMKilled entry is that attempt's by this number).
JOB_UID_LABEL = "rljob.dev/job-uid"
ATTEMPT_LABEL = "rljob.dev/attempt"


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def job_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the RLJob `obj` belongs to: its controller owner reference of kind RLJob
    (the operator's direct children), else its JOB_UID_LABEL (a RayCluster, a pod); None for
    an object that names no RLJob (made by hand, or by an operator before this label)."""
    meta = _meta(obj)
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("controller"):
            return str(ref.get("uid") or "") or None
    return (meta.get("labels") or {}).get(JOB_UID_LABEL) or None


def terminating(obj: Mapping[str, Any]) -> bool:
    """Deleted and held by a finalizer (KubeRay's on a RayJob): on its way out."""
    return bool(_meta(obj).get("deletionTimestamp"))


def belongs(obj: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether `obj` is the job `uid`'s and alive: the only objects the operator reads an
    outcome, a cause or an OOM from."""
    return obj is not None and job_uid(obj) == uid and not terminating(obj)


def own(obj: dict[str, Any] | None, uid: str) -> dict[str, Any] | None:
    """`obj` when it belongs to the job `uid` (see belongs), else None: as if it did not exist."""
    return obj if obj is not None and belongs(obj, uid) else None


def attempt_of(obj: Mapping[str, Any]) -> int | None:
    """The OOM policy's attempt a pod runs, from its ATTEMPT_LABEL."""
    value = (_meta(obj).get("labels") or {}).get(ATTEMPT_LABEL)
    return int(value) if value is not None and str(value).isdigit() else None


def earlier_incarnation(obj: Mapping[str, Any], name: str, uid: str) -> bool:
    """`obj` belongs to an RLJob of this very `name` with another uid: one deleted before this
    one was applied, whose children the garbage collector (or a finalizer) still holds."""
    refs = [r for r in _meta(obj).get("ownerReferences") or [] if r.get("kind") == KIND]
    return bool(refs) and all(r.get("name") == name and r.get("uid") != uid for r in refs)
