"""kopf handlers: RLJob create/resume/update -> children by server-side apply; RayJob changes
-> the RLJob's status and Events. Thin shell: read, call render/status, write.

Every handler is level-triggered: it recomputes from what exists, so running it twice (or
after a restart) creates nothing twice and loses nothing.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from rljob.api import GROUP, JOB_CONFIG_FILE, PLURAL, VERSION, JobConfig, RLJobSpec
from rljob_operator import kube, render, status

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


def _publish(
    body: kopf.Body,
    spec: RLJobSpec | None,
    applied: RLJobSpec | None,
    rayjob: dict[str, Any] | None,
    problems: list[tuple[str, str]],
    logger: logging.Logger | kopf.Logger,
) -> None:
    """Compute status from observations; write it (only if it changed) and an Event per change."""
    meta, current = body["metadata"], dict(body.get("status") or {})
    observed = status.Observed(
        generation=int(meta.get("generation") or 0),
        spec=spec,
        applied_spec=applied,
        rayjob=rayjob,
        previous_conditions=list(current.get("conditions") or []),
        problems=problems,
        memory=current.get("memory"),
        oom_counts=dict(current.get("oomCounts") or {}),
    )
    computed, transitions = status.compute(observed, _now())
    if status.differs(current, computed):
        kube.apply_status(meta["namespace"], meta["name"], computed)
    for t in transitions:
        reason = t.reason if t.status == "True" or t.type == status.SPEC_APPLIED else t.type
        event_type = "Warning" if t.reason == status.REASON_UPDATE_REFUSED else t.event_type
        kopf.event(
            body, type=event_type, reason=reason, message=t.message or f"{t.type} {t.status}"
        )
        logger.info(f"{t.type}={t.status} ({t.reason}) {t.message}")


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(
    body: kopf.Body, name: str, namespace: str | None, uid: str, logger: kopf.Logger, **_: Any
) -> None:
    """Apply the children for the spec (only suspend/ttl change on a live job), then status."""
    assert namespace is not None  # RLJobs are namespaced
    spec, problems = _parse(body)
    try:
        if spec is None or problems:
            _publish(body, spec, None, None, problems, logger)
            text = "; ".join(f"{path}: {msg}" for path, msg in problems)
            raise kopf.PermanentError(f"RLJob {name}: {text}")
        applied = _applied_spec(namespace, name)
        run_spec = status.applied_after_update(spec, applied)
        owner = render.Owner(name=name, namespace=namespace, uid=uid)
        rayjob: dict[str, Any] = {}
        for child in render.children(owner, run_spec):
            rayjob = kube.apply(child)  # the RayJob is last
        _publish(body, spec, run_spec, rayjob, [], logger)
        logger.info(f"reconciled RLJob {namespace}/{name}")
    except (ApiException, HTTPError) as exc:
        raise kube.as_kopf_error(exc, f"RLJob {namespace}/{name}") from exc


@kopf.on.event("ray.io", "v1", "rayjobs", labels=RAYJOB_LABELS)
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
        _publish(
            kopf.Body(cast(kopf.RawBody, rljob)),
            spec,
            _applied_spec(namespace, name),
            rayjob,
            [],
            logger,
        )
    except (ApiException, HTTPError) as exc:
        logger.warning(f"RLJob {namespace}/{name}: status not updated: {exc}")
