"""Applying an RLJob's children (render.children) by server-side apply, in the order their
references need, refusing a name another job holds, and saying in status why one was refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NoReturn

import kopf
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from rljob.api import RLJobSpec
from rljob_operator import attempts, identity, kube, render, status
from rljob_operator.status_writer import Observing, write_status

# Applied after the RayJob: its pods reference the ServiceAccount (admission refuses a pod whose
# account is missing) and the ConfigMap (a volume) when KubeRay creates them, but only the driver
# uses the Role and RoleBinding, once Ray runs, seconds later (and its status publisher retries a
# refused write). So the RayJob exists two requests sooner after an RLJob is created.
AFTER_RAYJOB = ("Role", "RoleBinding")


def _apply_order(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """render.children() reordered for applying: the RayJob as soon as its pods' references exist."""
    return sorted(children, key=lambda child: child["kind"] in AFTER_RAYJOB)  # stable


def apply_children(
    owner: render.Owner, spec: RLJobSpec, run_spec: RLJobSpec, retry: int,
    logger: kopf.Logger | logging.Logger, rayjob: bool = True,
    attempt: attempts.Current | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Server-side apply every child of the current attempt (1 when not given); the stored
    objects by kind. A child the apiserver refuses makes the RLJob Failed (PermanentError: kopf
    stops); a transient failure is in status as a retry, and kopf retries with a doubling
    delay."""
    stored: dict[str, dict[str, Any]] = {}
    number, knobs = (attempt.number, attempt.knobs) if attempt is not None else (1, None)
    for child in _apply_order(render.children(owner, run_spec, number, knobs)):
        if child["kind"] == "RayJob" and not rayjob:
            continue
        try:
            taken = _held_by_another(child, owner)
            if taken is None:
                stored[child["kind"]] = kube.apply(child)
        except (ApiException, HTTPError) as exc:
            refused_child(
                owner, spec, run_spec, stored, kube.apply_failure(child, exc, retry), logger, exc
            )
        if taken is not None:
            refused_child(owner, spec, run_spec, stored, taken, logger)
    return stored


# How soon a job waiting for an earlier RLJob's child of the same name to go looks again: the
# garbage collector deletes most children within a second; a RayJob waits for KubeRay's
# finalizer (its cluster torn down), seconds more. A fixed short delay, not kopf's doubling
# backoff, so the new job starts within this of the old child being gone.
EARLIER_CHILD_RETRY_SECONDS = 2.0


def _held_by_another(child: Mapping[str, Any], owner: render.Owner) -> status.ApplyFailure | None:
    """Why `child` must not be applied: an object of its kind and name exists that is not this
    RLJob's (by uid), e.g. RLJob `exp`'s attempt 2 (`exp-a2`) and an RLJob named `exp-a2`.
    Server-side apply with force would take it over (an object with no owner, or one an earlier
    RLJob of this name owned, whose garbage collection or finalizer has not finished), and the
    apiserver refuses one another RLJob controls with a message that names neither job ("Only
    one reference can have Controller set to true"). An earlier RLJob's child of this very name,
    or this job's own child being deleted, is waited for (status says so) and never adopted;
    anything else is refused for good, saying whose it is."""
    kind, name = str(child["kind"]), str(child["metadata"]["name"])
    existing = kube.get_child(kind, owner.namespace, name)
    if existing is None or identity.belongs(existing, owner.uid):
        return None
    if identity.earlier_incarnation(existing, owner.name, owner.uid) or (
        identity.job_uid(existing) == owner.uid
    ):
        gone = identity.job_uid(existing)
        whose = "this RLJob" if gone == owner.uid else f"an earlier RLJob of this name (uid {gone})"
        message = f"waiting for it to be deleted: it belongs to {whose}, which is being deleted"
        return status.ApplyFailure(
            kind, name, message, retry_in_seconds=EARLIER_CHILD_RETRY_SECONDS
        )
    refs = existing.get("metadata", {}).get("ownerReferences") or []
    holder = ", ".join(f"{ref.get('kind')} {ref.get('name')}" for ref in refs) or "no owner"
    message = (
        f"a {kind} of that name exists and belongs to {holder}, not to RLJob {owner.name}; "
        "rename one of the two jobs (an OOM retry's attempt N runs as RayJob NAME-aN)"
    )
    return status.ApplyFailure(kind, name, message, refused_by="the operator")


def refused_child(
    owner: render.Owner, spec: RLJobSpec, run_spec: RLJobSpec, stored: dict[str, dict[str, Any]],
    failure: status.ApplyFailure, logger: kopf.Logger | logging.Logger,
    cause: BaseException | None = None,
) -> NoReturn:  # fmt: skip
    """Status says why a child was not applied; then kopf's error: permanent when refused for
    good, else a retry after the failure's backoff."""
    where = f"RLJob {owner.namespace}/{owner.name}"
    try:
        observing = Observing(spec, run_spec, stored.get("RayJob"), apply_failure=failure)
        write_status(owner.namespace, owner.name, observing, logger, uid=owner.uid)
    except (ApiException, HTTPError) as status_exc:
        logger.warning(f"{where}: status not updated: {status_exc}")
    if failure.refused:
        raise kopf.PermanentError(f"{where}: {failure.text}") from cause
    delay = failure.retry_in_seconds
    raise kopf.TemporaryError(f"{where}: {failure.text}", delay=delay) from cause
