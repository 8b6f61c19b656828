"""An RLJob's operator-owned status: computed from one observation (Observing: the spec, the
spec it runs with, its RayJob) and written once, with an Event per transition, kill and cause.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from rljob.api import AttemptKnobs, OOMEvent, RLJobSpec
from rljob.oom_policy import REASON_OOM_RETRY, capacity_note, plan_fits
from rljob_operator import attempts, causes, identity, kube, notices, oom, render, status
from rljob_operator.process_memos import CAUSES, LOCKS, MIRRORED, STARTED_AT, forget_job, now


def _validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """pydantic errors as (spec field path, message) pairs."""
    problems = []
    for err in exc.errors():
        path = ".".join(["spec", *(str(p) for p in err["loc"])])
        problems.append((path, err["msg"].removeprefix("Value error, ")))
    return problems


def parse_spec(body: kopf.Body | dict[str, Any]) -> tuple[RLJobSpec | None, list[tuple[str, str]]]:
    try:
        spec = RLJobSpec.model_validate(dict(body.get("spec") or {}))
    except ValidationError as exc:
        return None, _validation_problems(exc)
    return spec, render.deeper_problems(body["metadata"]["name"], spec)


# From the fresh RLJob: the operator's non-OOM status fields and the condition transitions, or
# None when this writer has nothing to say about that RLJob.
OperatorFields = Callable[[dict[str, Any]], tuple[dict[str, Any], list[status.Transition]] | None]


def carry(rljob: dict[str, Any]) -> tuple[dict[str, Any], list[status.Transition]]:
    return status.carried(dict(rljob.get("status") or {})), []


def _plan_veto(
    spec: RLJobSpec, capacity_bytes: int | None
) -> Callable[[AttemptKnobs], bool | None]:
    """The plan's veto on a retry's knobs, where the operator can plan (else None: no veto):
    on the card the ranks measured (status.memory.capacityBytes) where they reported it."""

    return lambda knobs: plan_fits(spec, knobs, capacity_bytes)


@dataclass(frozen=True)
class Observing:
    """The OperatorFields of one observation: the spec, the spec the job runs with, and the
    RayJob (None: it does not exist). With `spec` None and no problems the spec is parsed from
    the fresh RLJob, and an invalid one gives None (reconcile() owns the InvalidSpec status).

    The RayJob observed (`rayjob`, or `rayjob_name` for one deleted) must be the current
    attempt's (status.attempts, attempts.py) and the RLJob's own, by uid (`source_uid`, or the
    RayJob's owner): a RayJob of an earlier attempt, or of an earlier RLJob of this name,
    gives None. With
    the OOM policy on, the observation also advances status.attempts: a failed attempt with an
    OOM gets the policy's decision, and a retry is recorded with no RayJob yet (phase Pending);
    rljob_changed() then applies the new attempt's children."""

    spec: RLJobSpec | None
    applied: RLJobSpec | None
    rayjob: dict[str, Any] | None
    problems: list[tuple[str, str]] = field(default_factory=list)
    apply_failure: status.ApplyFailure | None = None
    reconciled: bool = False
    startup_expired: bool = False
    rayjob_name: str | None = None
    source_uid: str | None = None
    causes_cleared: bool = False  # the pods' and RayCluster's causes all cleared just now

    def __call__(
        self, rljob: dict[str, Any]
    ) -> tuple[dict[str, Any], list[status.Transition]] | None:
        spec, problems = self.spec, self.problems
        invalid_update: list[tuple[str, str]] = []
        if spec is None and not problems:
            spec, problems = parse_spec(rljob)
            if spec is None or problems:
                if self.applied is None:
                    return None  # reconcile() owns the InvalidSpec status of a job not applied
                # An invalid update of a job that runs (or ran) with `applied`: refused; the
                # job is observed as it runs, its status and attempts kept.
                invalid_update = problems or [("spec", "invalid")]
                spec, problems = self.applied, []
        current = dict(rljob.get("status") or {})
        meta = rljob["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        if self.source_uid is not None and self.source_uid != meta["uid"]:
            return None  # an earlier RLJob's RayJob (this name applied again): not this job's
        if self.rayjob is not None and identity.job_uid(self.rayjob) != meta["uid"]:
            return None
        about = self.rayjob["metadata"]["name"] if self.rayjob is not None else self.rayjob_name
        if about is not None and about != attempts.current_ray_job(meta["name"], current):
            return None  # an earlier attempt's RayJob: its outcome is recorded already
        if attempts.finished(meta["name"], current) and (
            self.rayjob is None or attempts.ended(self.rayjob) == attempts.RUNNING
        ):
            # The current attempt's RayJob ended, then went, or an event older than that end
            # (a watch behind a fresh read) shows it running: the outcome stands. An ended
            # RayJob does not run again; KubeRay's own retries (backoffLimit) do not end it.
            return None
        rayjob, step = self.rayjob, attempts.Step(None)
        if spec is not None and not problems:
            run_spec = status.applied_after_update(spec, self.applied)
            capacity = (current.get("memory") or {}).get("capacityBytes")
            step = attempts.advance(
                meta["name"], run_spec, current, rayjob,
                _plan_veto(run_spec, capacity), capacity_note(run_spec, capacity),
            )  # fmt: skip
            if step.retry is not None:
                rayjob = None  # the new attempt's RayJob is applied next (rljob_changed)
        observed = status.Observed(
            generation=int(rljob["metadata"].get("generation") or 0),
            spec=spec,
            applied_spec=self.applied,
            rayjob=rayjob,
            previous_conditions=list(current.get("conditions") or []),
            problems=problems,
            memory=current.get("memory"),
            oom_counts=dict(current.get("oomCounts") or {}),
            causes=[] if self.causes_cleared else CAUSES.current(namespace, name, uid),
            apply_failure=self.apply_failure,
            reconciled=self.reconciled,
            startup_expired=self.startup_expired,
            attempts=step.attempts,
            oom_stop=step.stop,
            checkpoint_failure=status.checkpoint_failure(
                current, int((step.attempts or [{"attempt": 1}])[-1]["attempt"])
            ),
            invalid_update=invalid_update,
        )
        return status.compute(observed, now())


def write_status(
    namespace: str,
    name: str,
    fields: OperatorFields,
    logger: logging.Logger | kopf.Logger,
    kills: Sequence[OOMEvent] = (),
    uid: str | None = None,
) -> str | None:
    """Read the RLJob, compute every operator-owned status field (with new kills merged in),
    apply them if anything changed, then post an Event per transition and per kill counted.

    With `uid` (the job an observed object belongs to) nothing is written unless the RLJob of
    this name is that job. Returns the uid of the RLJob found (None: there is none); when it is
    not `uid`, what this process keeps of the job `uid` is dropped (it is gone)."""
    with LOCKS.hold(namespace, name):
        rljob = kube.get_rljob(namespace, name)
        found = str(rljob["metadata"]["uid"]) if rljob is not None else None
        if rljob is None or (uid is not None and found != uid):
            forget_job(namespace, name, uid)
            return found  # deleted; the garbage collector takes its children
        computed_fields = fields(rljob)
        if computed_fields is None:
            return found
        operator_fields, transitions = computed_fields
        current = dict(rljob.get("status") or {})
        killed = oom.merge(oom.current_part(current), kills, started_at=STARTED_AT)
        computed = status.with_ooms(operator_fields, current, killed)
        # The driver's checkpoint news: the attempt's resumedFrom, and the Events not posted
        # yet, recorded in status.announced by this very write (posted once, restart or not).
        if computed.get("attempts"):
            computed["attempts"] = attempts.with_resume(computed["attempts"], current)
        news = notices.pending(current)
        if news or current.get("announced"):
            computed["announced"] = notices.announced_after(current, news)
        if status.differs(current, computed):
            kube.apply_status(namespace, name, computed, uid=found)
        if isinstance(fields, Observing):
            MIRRORED.remember(namespace, name, fields.rayjob)
        retries = attempts.new_retries(
            current.get("attempts") or [], computed.get("attempts") or []
        )
    body = kopf.Body(cast(kopf.RawBody, rljob))
    for number, message in retries:
        # One Warning per retry: the write that appended the attempt happens once.
        kopf.event(body, type="Warning", reason=REASON_OOM_RETRY, message=message)
        logger.warning(f"RLJob {namespace}/{name}: attempt {number}: {message}")
    for t in transitions:
        reason = t.reason if t.status == "True" or t.type == status.SPEC_APPLIED else t.type
        event_type = "Warning" if t.reason == status.REASON_UPDATE_REFUSED else t.event_type
        kopf.event(
            body, type=event_type, reason=reason, message=t.message or f"{t.type} {t.status}"
        )
        logger.info(f"{t.type}={t.status} ({t.reason}) {t.message}")
    for notice in news:
        kopf.event(body, type=notice.type, reason=notice.reason, message=notice.message)
        logger.info(f"RLJob {namespace}/{name}: {notice.reason}: {notice.message}")
    for kill in killed.counted:
        message = f"{kill.message}; kill {kill.count} of this container, {killed.total} in all"
        kopf.event(body, type="Warning", reason=oom.KIND, message=message)
        logger.warning(f"RLJob {namespace}/{name}: {message}")
    announce_causes(rljob, logger)
    return found


def announce_causes(rljob: dict[str, Any], logger: logging.Logger | kopf.Logger) -> None:
    """One Warning Event per distinct cause of the job (causes.py), its count the objects hit."""
    namespace, name = rljob["metadata"]["namespace"], rljob["metadata"]["name"]
    uid = str(rljob["metadata"]["uid"])
    for news in CAUSES.unannounced(namespace, name, uid):
        cause = news.cause
        try:
            count = kube.post_cause_event(
                rljob,
                causes.event_name(name, rljob["metadata"]["uid"], cause.key),
                cause.reason,
                cause.line,
                news.sources,
            )
        except (ApiException, HTTPError) as exc:
            logger.warning(f"RLJob {namespace}/{name}: Event for {cause.reason} not posted: {exc}")
            CAUSES.retract(namespace, name, uid, news)  # the job's next event tries again
            count = len(news.sources)
        if count is not None:  # None: an earlier process counted these already
            logger.warning(f"RLJob {namespace}/{name}: {causes.event_message(cause.line, count)}")
