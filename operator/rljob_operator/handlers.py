"""kopf handlers: RLJob create/resume/update -> children by server-side apply; RayJob changes
-> the RLJob's status and Events. Thin shell: read, call render/status, write.

Every handler is level-triggered: it recomputes from what exists, so running it twice (or
after a restart) creates nothing twice and loses nothing.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from rljob.api import GROUP, JOB_CONFIG_FILE, PLURAL, VERSION, JobConfig, OOMEvent, RLJobSpec
from rljob_operator import kube, metrics, oom, render, status

RAYJOB_LABELS = {render.JOB_LABEL: kopf.PRESENT}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """pydantic errors as (spec field path, message) pairs."""
    problems = []
    for err in exc.errors():
        path = ".".join(["spec", *(str(p) for p in err["loc"])])
        problems.append((path, err["msg"].removeprefix("Value error, ")))
    return problems


def _parse(body: kopf.Body | dict[str, Any]) -> tuple[RLJobSpec | None, list[tuple[str, str]]]:
    try:
        spec = RLJobSpec.model_validate(dict(body.get("spec") or {}))
    except ValidationError as exc:
        return None, _validation_problems(exc)
    return spec, render.deeper_problems(body["metadata"]["name"], spec)


def _applied_spec(namespace: str, name: str) -> RLJobSpec | None:
    """The spec the job runs with: what the job-config ConfigMap holds."""
    data = kube.get_config_map_data(namespace, render.config_map_name(name))
    if not data or JOB_CONFIG_FILE not in data:
        return None
    try:
        return JobConfig.from_yaml(data[JOB_CONFIG_FILE]).spec
    except ValidationError:
        return None  # someone edited it by hand; the next apply rewrites it


# Kills that finished before this moment may have been counted by an earlier operator process.
STARTED_AT = _now()
KILLS = oom.KillCache()


def _job_lock(namespace: str, name: str) -> threading.Lock:
    """One lock per RLJob: the operator's status writes for a job (RayJob changes, pod kills,
    derived fields) run in kopf's worker threads, and each write states every operator-owned
    field, so they must not interleave within this process."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault((namespace, name), threading.Lock())


_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()

# From the fresh RLJob: the operator's non-OOM status fields and the condition transitions.
OperatorFields = Callable[[dict[str, Any]], tuple[dict[str, Any], list[status.Transition]]]


def _carry(rljob: dict[str, Any]) -> tuple[dict[str, Any], list[status.Transition]]:
    return status.carried(dict(rljob.get("status") or {})), []


def _observing(
    spec: RLJobSpec | None,
    applied: RLJobSpec | None,
    rayjob: dict[str, Any] | None,
    problems: list[tuple[str, str]],
) -> OperatorFields:
    def fields(rljob: dict[str, Any]) -> tuple[dict[str, Any], list[status.Transition]]:
        current = dict(rljob.get("status") or {})
        observed = status.Observed(
            generation=int(rljob["metadata"].get("generation") or 0),
            spec=spec,
            applied_spec=applied,
            rayjob=rayjob,
            previous_conditions=list(current.get("conditions") or []),
            problems=problems,
            memory=current.get("memory"),
            oom_counts=dict(current.get("oomCounts") or {}),
        )
        return status.compute(observed, _now())

    return fields


def _write(
    namespace: str,
    name: str,
    fields: OperatorFields,
    logger: logging.Logger | kopf.Logger,
    kills: Sequence[OOMEvent] = (),
) -> None:
    """Read the RLJob, compute every operator-owned status field (with new kills merged in),
    apply them if anything changed, then post an Event per transition and per kill counted."""
    with _job_lock(namespace, name):
        rljob = kube.get_rljob(namespace, name)
        if rljob is None:
            return  # deleted; the garbage collector takes its children
        current = dict(rljob.get("status") or {})
        operator_fields, transitions = fields(rljob)
        killed = oom.merge(oom.current_part(current), kills, started_at=STARTED_AT)
        computed = status.with_ooms(operator_fields, current, killed)
        if status.differs(current, computed):
            kube.apply_status(namespace, name, computed)
    body = kopf.Body(cast(kopf.RawBody, rljob))
    for t in transitions:
        reason = t.reason if t.status == "True" or t.type == status.SPEC_APPLIED else t.type
        event_type = "Warning" if t.reason == status.REASON_UPDATE_REFUSED else t.event_type
        kopf.event(
            body, type=event_type, reason=reason, message=t.message or f"{t.type} {t.status}"
        )
        logger.info(f"{t.type}={t.status} ({t.reason}) {t.message}")
    for kill in killed.counted:
        message = f"{kill.message}; kill {kill.count} of this container, {killed.total} in all"
        kopf.event(body, type="Warning", reason=oom.KIND, message=message)
        logger.warning(f"RLJob {namespace}/{name}: {message}")


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@metrics.timed("reconcile")
def reconcile(
    body: kopf.Body, name: str, namespace: str | None, uid: str, logger: kopf.Logger, **_: Any
) -> None:
    """Apply the children for the spec (only suspend/ttl change on a live job), then status."""
    assert namespace is not None  # RLJobs are namespaced
    spec, problems = _parse(body)
    try:
        if spec is None or problems:
            _write(namespace, name, _observing(spec, None, None, problems), logger)
            text = "; ".join(f"{path}: {msg}" for path, msg in problems)
            raise kopf.PermanentError(f"RLJob {name}: {text}")
        applied = _applied_spec(namespace, name)
        run_spec = status.applied_after_update(spec, applied)
        owner = render.Owner(name=name, namespace=namespace, uid=uid)
        rayjob: dict[str, Any] = {}
        for child in render.children(owner, run_spec):
            rayjob = kube.apply(child)  # the RayJob is last
        _write(namespace, name, _observing(spec, run_spec, rayjob, []), logger)
        logger.info(f"reconciled RLJob {namespace}/{name}")
    except (ApiException, HTTPError) as exc:
        raise kube.as_kopf_error(exc, f"RLJob {namespace}/{name}") from exc


@kopf.on.event("ray.io", "v1", "rayjobs", labels=RAYJOB_LABELS)
@metrics.timed("rayjob_event")
def rayjob_changed(
    type: str, body: kopf.Body, namespace: str | None, labels: Mapping[str, str],
    logger: kopf.Logger, **_: Any,
) -> None:  # fmt: skip
    """Mirror a RayJob change into its RLJob's status. Events are not retried by kopf, so a
    failure here is logged and the next RayJob event or the RLJob's resume repairs it."""
    name = labels[render.JOB_LABEL]
    assert namespace is not None  # RayJobs are namespaced
    try:
        rljob = kube.get_rljob(namespace, name)
        if rljob is None:
            return  # deleted; the garbage collector takes the RayJob too
        spec, problems = _parse(rljob)
        if spec is None or problems:
            return  # reconcile() owns the InvalidSpec status
        rayjob = None if type == "DELETED" else dict(body)
        fields = _observing(spec, _applied_spec(namespace, name), rayjob, [])
        _write(namespace, name, fields, logger)
    except (ApiException, HTTPError) as exc:
        logger.warning(f"RLJob {namespace}/{name}: status not updated: {exc}")


@kopf.on.event(GROUP, VERSION, PLURAL)
@metrics.timed("rljob_event")
def rljob_changed(
    type: str, body: kopf.Body, name: str, namespace: str | None, logger: kopf.Logger, **_: Any
) -> None:
    """Every RLJob change: refresh its metrics; when the driver's memory or OOM counts moved,
    re-derive the printer-column fields (worstStageFraction, oomTotal)."""
    assert namespace is not None
    if type == "DELETED":
        metrics.JOBS.forget(namespace, name)
        return
    current = dict(body.get("status") or {})
    metrics.JOBS.observe(namespace, name, current)
    wanted = status.derived(current.get("memory"), dict(current.get("oomCounts") or {}))
    held = {key: current[key] for key in status.DERIVED_FIELDS if key in current}
    if wanted == held:
        return
    try:
        _write(namespace, name, _carry, logger)
    except (ApiException, HTTPError) as exc:
        # Not retried by kopf: the next change of this RLJob repairs it.
        logger.warning(f"RLJob {namespace}/{name}: derived status not updated: {exc}")


@kopf.on.event("", "v1", "pods", labels=RAYJOB_LABELS)
@metrics.timed("pod_event")
def pod_changed(
    type: str, body: kopf.Body, name: str, namespace: str | None, labels: Mapping[str, str],
    logger: kopf.Logger, **_: Any,
) -> None:  # fmt: skip
    """A job pod's container OOMKilled (or the pod evicted for memory): into the RLJob's
    status.oomEvents and a Warning Event. A write lost here is repaired by the pod's next
    change or the operator's next start (kopf lists every pod again, and kills are deduped)."""
    assert namespace is not None
    if type == "DELETED":
        KILLS.forget(namespace, name)
        return
    kills = KILLS.fresh(namespace, oom.pod_kills(body))
    if not kills:
        return
    job = labels[render.JOB_LABEL]
    try:
        _write(namespace, job, _carry, logger, kills)
    except (ApiException, HTTPError) as exc:
        logger.warning(f"RLJob {namespace}/{job}: OOMKilled not recorded yet: {exc}")
        return
    KILLS.record(namespace, kills)
