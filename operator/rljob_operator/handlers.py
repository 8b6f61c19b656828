"""kopf handlers: RLJob create/resume/update -> children by server-side apply (children.py);
RayJob, RayCluster and pod changes -> the RLJob's status and Events (status_writer.py).

Every handler is level-triggered: it recomputes from what exists, so running it twice (or
after a restart) creates nothing twice and loses nothing. What this process remembers between
events only skips work whose outcome is known (process_memos.py); a restart empties it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from rljob.api import GROUP, PLURAL, VERSION, RLJobSpec
from rljob.oom_policy import admit
from rljob_operator import (
    attempts,
    causes,
    identity,
    kube,
    metrics,
    notices,
    oom,
    render,
    status,
    storage,
)
from rljob_operator.children import apply_children
from rljob_operator.process_memos import APPLIED, CAUSES, KILLS, LOCKS, MIRRORED, forget_job
from rljob_operator.status_writer import Observing, carry, parse_spec, write_status

RAYJOB_LABELS = {render.JOB_LABEL: kopf.PRESENT}


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@metrics.timed("reconcile")
def reconcile(
    body: kopf.Body, name: str, namespace: str | None, uid: str, logger: kopf.Logger,
    retry: int = 0, **_: Any,
) -> None:  # fmt: skip
    """Apply the children for the spec (only suspend/ttl/startup timeout change on a live job),
    then status. A job that timed out starting keeps its RayJob suspended."""
    assert namespace is not None  # RLJobs are namespaced
    spec, problems = parse_spec(body)
    try:
        if spec is None or problems:
            text = "; ".join(f"{path}: {msg}" for path, msg in problems)
            if _refuse_invalid_update(namespace, name, uid, logger):
                logger.warning(f"RLJob {namespace}/{name}: update refused: {text}")
                return
            write_status(namespace, name, Observing(spec, None, None, problems), logger, uid=uid)
            raise kopf.PermanentError(f"RLJob {name}: {text}")
        run_spec = status.applied_after_update(spec, APPLIED.read(namespace, name, uid))
        if status.timed_out(body.get("status") or {}):
            run_spec = run_spec.model_copy(update={"suspend": True})
        owner = render.Owner(name=name, namespace=namespace, uid=uid)
        # Under the job's lock, so a RayJob event that arrives meanwhile (its own ADDED, while
        # the Role and RoleBinding are applied) waits for this status write: then it finds its
        # state mirrored and costs nothing, or, if KubeRay changed the RayJob since the apply
        # answered, it writes the newer state after this one instead of being overwritten by it.
        with LOCKS.hold(namespace, name):
            # A job the memory plan rejects (onMisfit Reject) gets no RayJob; status says why.
            start = admit(run_spec).start
            # The OOM policy's current attempt, from status as stored now (not as the event
            # saw it): its RayJob and job config are the ones to apply.
            stored_rljob = kube.get_rljob(namespace, name)
            if stored_rljob is None or stored_rljob["metadata"]["uid"] != uid:
                # Deleted (and maybe applied again) meanwhile: its children must not be made
                # again for a job that is gone, nor held against the one of the same name.
                logger.info(f"RLJob {namespace}/{name} (uid {uid}) is gone: nothing to apply")
                return
            held = stored_rljob.get("status") or {}
            attempt = attempts.current(name, run_spec, held)
            # A job whose current RayJob has ended is not applied again (it would run again if
            # that RayJob was deleted since); it is read, for a decision still to make on it.
            done = attempts.finished(name, held)
            stored = apply_children(
                owner, spec, run_spec, retry, logger, rayjob=start and not done, attempt=attempt
            )
            APPLIED.remember(namespace, name, stored["ConfigMap"], run_spec)
            if start and not done:
                warn_about_claims(stored_rljob, run_spec, logger)
            ended = (
                identity.own(kube.get_rayjob(namespace, attempt.ray_job), uid)
                if done
                else stored.get("RayJob")
            )
            observing = Observing(spec, run_spec, ended, reconciled=True)
            write_status(namespace, name, observing, logger, uid=uid)
        logger.info(f"reconciled RLJob {namespace}/{name}")
    except (ApiException, HTTPError) as exc:
        raise kube.as_kopf_error(exc, f"RLJob {namespace}/{name}") from exc


def _refuse_invalid_update(
    namespace: str, name: str, uid: str, logger: kopf.Logger | logging.Logger
) -> bool:
    """An invalid spec of a job whose children exist (it runs, or ran, with the spec in its
    ConfigMap): the update is refused and status observes the job as it runs (Observing), its
    attempts and RayJob kept; True. A job with no children yet: False (it fails InvalidSpec)."""
    applied = APPLIED.read(namespace, name, uid)
    if applied is None:
        return False
    with LOCKS.hold(namespace, name):
        rljob = kube.get_rljob(namespace, name)
        if rljob is None or rljob["metadata"]["uid"] != uid:
            return True  # gone meanwhile: nothing to write
        attempt = attempts.current(name, applied, rljob.get("status") or {})
        rayjob = identity.own(kube.get_rayjob(namespace, attempt.ray_job), uid)
        write_status(namespace, name, Observing(None, applied, rayjob), logger, uid=uid)
    return True


REASON_VOLUME_ACCESS = "VolumeAccessMode"


def warn_about_claims(
    rljob: Mapping[str, Any], spec: RLJobSpec, logger: kopf.Logger | logging.Logger
) -> None:
    """A Warning Event per mounted claim the job's pods cannot all mount (storage.py): once
    per job (by uid) and claim. Not a refusal: a ReadWriteOnce claim works where every pod lands
    on one node. A claim that cannot be read is left to the scheduler's own message."""
    meta = rljob["metadata"]
    namespace, job, uid = meta["namespace"], meta["name"], meta["uid"]
    try:
        problems = storage.claim_access_problems(
            spec, lambda claim: kube.claim_access_modes(namespace, claim)
        )
        for claim, message in problems:
            event = causes.event_name(job, uid, f"claim/{claim}")
            if kube.post_event_once(rljob, event, REASON_VOLUME_ACCESS, message):
                logger.warning(f"RLJob {namespace}/{job}: {message}")
    except (ApiException, HTTPError) as exc:  # e.g. an older chart's rules without the read
        logger.warning(f"RLJob {namespace}/{job}: claims' access modes not checked: {exc}")


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
    uid = identity.job_uid(body)
    if uid is None:
        return  # not made by this operator for a job it can name by uid
    rayjob: dict[str, Any] | None = dict(body)
    # On its way out (KubeRay's finalizer holds a deleted RayJob, still showing its last
    # status), or gone. Where that last status says the job ended, it is mirrored: if the write
    # of that end failed, this is the last chance to record it, and a job whose end is not
    # recorded would be applied again (run a second time) as a job not started.
    leaving = type == "DELETED" or identity.terminating(body)
    if leaving and attempts.ended(body) == attempts.RUNNING:
        if type != "DELETED":
            return  # nothing to mirror yet: its DELETED event comes next
        rayjob = None
    try:
        with LOCKS.hold(namespace, name):
            if MIRRORED.holds(namespace, name, rayjob):
                return  # the RLJob's status was computed from this very RayJob state
            # The spec is parsed from the RLJob _write reads (one read, under the same lock).
            # A RayJob of an earlier OOM-policy attempt, or of an earlier RLJob of this name,
            # is ignored there (Observing).
            applied = APPLIED.read(namespace, name, uid)
            observing = Observing(
                None, applied, rayjob, rayjob_name=body["metadata"]["name"], source_uid=uid
            )
            write_status(namespace, name, observing, logger, uid=uid)
    except (ApiException, HTTPError) as exc:
        logger.warning(f"RLJob {namespace}/{name}: status not updated: {exc}")


@kopf.on.event("ray.io", "v1", "rayclusters", labels=RAYJOB_LABELS)
@metrics.timed("raycluster_event")
def raycluster_changed(
    type: str, body: kopf.Body, name: str, namespace: str | None, labels: Mapping[str, str],
    logger: kopf.Logger, **_: Any,
) -> None:  # fmt: skip
    """KubeRay could not create a pod of the job (its ReplicaFailure condition): PodsReady."""
    assert namespace is not None
    found = [] if type == "DELETED" else causes.raycluster_causes(body)
    uid = identity.job_uid(body)
    if uid is not None:
        job = labels[render.JOB_LABEL]
        _observe_causes(namespace, job, uid, f"raycluster/{name}", found, logger)


def _observe_causes(
    namespace: str, job: str, uid: str, source: str, found: list[causes.Cause],
    logger: kopf.Logger | logging.Logger,
) -> None:  # fmt: skip
    """Record a source's causes for the job `uid`; when they changed, recompute the job's status
    (PodsReady) and post an Event for each cause not announced yet. Not retried: the source's
    next change or the RLJob's next status write repairs a lost one."""
    if not CAUSES.observe(namespace, job, uid, source, found):
        return
    try:
        with LOCKS.hold(namespace, job):
            rljob = kube.get_rljob(namespace, job)
            if rljob is None or rljob["metadata"]["uid"] != uid:
                forget_job(namespace, job, uid)  # the source's job is gone
                return
            ray_job = attempts.current_ray_job(job, rljob.get("status") or {})
            rayjob = identity.own(kube.get_rayjob(namespace, ray_job), uid)
            # A job whose last cause just cleared is dropped from the book (current() None, "heard
            # nothing: keep what status says"): say so, or PodsReady keeps the cleared cause.
            cleared = CAUSES.current(namespace, job, uid) is None
            observing = Observing(
                None, APPLIED.read(namespace, job, uid), rayjob, causes_cleared=cleared
            )
            write_status(namespace, job, observing, logger, uid=uid)
    except (ApiException, HTTPError) as exc:
        logger.warning(f"RLJob {namespace}/{job}: causes not recorded yet: {exc}")


# How often a job that is not running yet is checked against its startup deadline.
STARTUP_CHECK_SECONDS = 10.0


def _may_time_out(status: Mapping[str, Any], **_: Any) -> bool:
    return status.get("phase") in (None, "Pending", "Starting")


def _checked(spec: Mapping[str, Any], status: Mapping[str, Any], **_: Any) -> bool:
    """The timer's jobs: those not running yet (a recorded retry among them: Pending), and a
    Failed one whose late OOM the policy has not decided on (attempts.late_oom_undecided,
    bounded: false once the decision is recorded)."""
    return _may_time_out(status) or attempts.late_oom_undecided(spec, status)


@kopf.timer(GROUP, VERSION, PLURAL, interval=STARTUP_CHECK_SECONDS, when=_checked)
async def check_startup_and_oom_policy(
    body: kopf.Body, name: str, namespace: str | None, uid: str, logger: kopf.Logger, **_: Any
) -> None:
    """A job whose Ray job is not running by spec.startupTimeoutSeconds fails (StartupTimeout,
    with the last cause) and its RayJob is suspended: KubeRay deletes the pods
    (docs/status-and-events.md). Async, so the check of a job not due costs no thread; the work
    runs in one when due.

    Also the OOM policy's step that an RLJob event could not take (a 5xx, a quota, a read that
    failed): applying a recorded retry's children, or deciding on a failed attempt whose OOM
    record came after KubeRay's failure (the job is Failed then, so not timed out). kopf does
    not retry the event, and nothing else may change, so this check takes the step again."""
    assert namespace is not None
    current = dict(body.get("status") or {})
    if attempts.needs_attention(dict(body.get("spec") or {}), current):
        await asyncio.to_thread(_follow_attempt, namespace, name, logger)
    deadline = status.startup_deadline(body)  # None unless the job is not running yet
    if deadline is None or datetime.datetime.now(datetime.UTC) < deadline:
        return
    owner = render.Owner(name=name, namespace=namespace, uid=uid)
    await asyncio.to_thread(_time_out, owner, logger)


def _time_out(owner: render.Owner, logger: kopf.Logger) -> None:
    namespace, name = owner.namespace, owner.name
    try:
        with LOCKS.hold(namespace, name):
            applied = APPLIED.read(namespace, name, owner.uid)
            rljob = kube.get_rljob(namespace, name)
            if rljob is None or rljob["metadata"]["uid"] != owner.uid:
                return  # deleted (and maybe applied again) since the timer fired
            deadline = status.startup_deadline(rljob)
            if deadline is None or datetime.datetime.now(datetime.UTC) < deadline:
                return  # status moved on since the timer's body (running, suspended, retried)
            attempt = attempts.current(name, applied, rljob.get("status") or {})
            rayjob = identity.own(kube.get_rayjob(namespace, attempt.ray_job), owner.uid)
            if rayjob is not None and status.rayjob_started(rayjob):
                # It runs, or has ended, and status has not said so yet (that write failed,
                # or it started just now): mirror it; suspending would stop a running job.
                write_status(namespace, name, Observing(None, applied, rayjob), logger,
                             uid=owner.uid)  # fmt: skip
                return
            if rayjob is not None and applied is not None:
                # Suspend first: if this fails the job is still Starting and the timer retries.
                suspended = applied.model_copy(update={"suspend": True})
                rayjob = kube.apply(render.ray_job(owner, suspended, attempt.number))
            observing = Observing(None, applied, rayjob, startup_expired=True)
            write_status(namespace, name, observing, logger, uid=owner.uid)
    except (ApiException, HTTPError) as exc:
        raise kopf.TemporaryError(
            f"RLJob {namespace}/{name}: startup timeout: {exc}", delay=10
        ) from exc


@kopf.on.event(GROUP, VERSION, PLURAL)
@metrics.timed("rljob_event")
def rljob_changed(
    type: str, body: kopf.Body, name: str, namespace: str | None, logger: kopf.Logger, **_: Any
) -> None:
    """Every RLJob change: refresh its metrics; when the driver's memory or OOM counts moved,
    re-derive the printer-column fields (worstStageFraction, oomTotal); when the driver wrote
    checkpoint news (notices.py), post its Events and record the attempt's resumedFrom."""
    assert namespace is not None
    if type == "DELETED":
        metrics.JOBS.forget(namespace, name)
        forget_job(namespace, name, str((body.get("metadata") or {}).get("uid") or "") or None)
        return
    current = dict(body.get("status") or {})
    metrics.JOBS.observe(namespace, name, current)
    if attempts.needs_attention(
        dict(body.get("spec") or {}), current
    ) or status.checkpoint_failure_unmirrored(current):
        _follow_attempt(namespace, name, logger)
    wanted = status.derived(current.get("memory"), dict(current.get("oomCounts") or {}))
    held = {key: current[key] for key in status.DERIVED_FIELDS if key in current}
    if wanted == held and not notices.pending(current):
        return
    try:
        write_status(namespace, name, carry, logger)
    except (ApiException, HTTPError) as exc:
        # Not retried by kopf: the next change of this RLJob repairs it.
        logger.warning(f"RLJob {namespace}/{name}: derived status not updated: {exc}")


def _follow_attempt(namespace: str, name: str, logger: kopf.Logger | logging.Logger) -> None:
    """The OOM policy's work an RLJob change may bring (attempts.needs_attention): apply the
    children of a retry recorded in status.attempts whose RayJob does not exist yet, or decide
    on a failed attempt whose OOM record arrived after KubeRay's failure; likewise a checkpoint
    failure recorded after it (status.checkpoint_failure_unmirrored) makes Failed say so. Everything is read
    again under the job's lock, so a stale event does nothing; a failure here is logged, and
    the timer (check_startup_and_oom_policy, every STARTUP_CHECK_SECONDS while the job is
    Pending or its late OOM is undecided), the next change of the RLJob or the operator's
    resume tries again."""
    try:
        with LOCKS.hold(namespace, name):
            rljob = kube.get_rljob(namespace, name)
            if rljob is None or identity.terminating(rljob):
                return  # a job being deleted starts no attempt (kopf's finalizer may hold it)
            uid = str(rljob["metadata"]["uid"])
            applied = APPLIED.read(namespace, name, uid)
            said, problems = parse_spec(rljob)
            if problems:
                said = None
            # An invalid update (said None) of a job with children is refused: the job goes on
            # as it runs. Observing is given no spec then: it parses the RLJob's again and says
            # the update is refused.
            spec = said if said is not None else applied
            if spec is None:
                return
            run_spec = status.applied_after_update(spec, applied)
            current = dict(rljob.get("status") or {})
            attempt = attempts.current(name, run_spec, current)
            rayjob = identity.own(kube.get_rayjob(namespace, attempt.ray_job), uid)
            if rayjob is None and attempts.finished(name, current):
                # The attempt ended and its RayJob went: a late OOM is decided from what status
                # mirrors of it; the attempt is never applied (run) again.
                rayjob = attempts.mirrored_rayjob(name, current, uid)
                if rayjob is None:
                    return
            if rayjob is None and attempt.number > 1:
                if status.timed_out(current):
                    run_spec = run_spec.model_copy(update={"suspend": True})
                owner = render.Owner(name=name, namespace=namespace, uid=uid)
                stored = apply_children(owner, spec, run_spec, 0, logger, attempt=attempt)
                APPLIED.remember(namespace, name, stored["ConfigMap"], run_spec)
                logger.info(f"RLJob {namespace}/{name}: attempt {attempt.number} started")
                observing = Observing(said, run_spec, stored.get("RayJob"), reconciled=True)
            else:
                observing = Observing(said, applied, rayjob)
            write_status(namespace, name, observing, logger, uid=uid)
    except (ApiException, HTTPError, kopf.TemporaryError, kopf.PermanentError) as exc:
        logger.warning(f"RLJob {namespace}/{name}: OOM policy attempt not advanced yet: {exc}")


@kopf.on.event("", "v1", "pods", labels=RAYJOB_LABELS)
@metrics.timed("pod_event")
def pod_changed(
    type: str, body: kopf.Body, name: str, namespace: str | None, labels: Mapping[str, str],
    logger: kopf.Logger, **_: Any,
) -> None:  # fmt: skip
    """Why a job's pod is not running (PodsReady, causes.py), and its containers OOMKilled (or
    the pod evicted for memory): into the RLJob's
    status.oomEvents and a Warning Event. A write lost here is repaired by the pod's next
    change or the operator's next start (kopf lists every pod again, and kills are deduped)."""
    assert namespace is not None
    job = labels[render.JOB_LABEL]
    uid = identity.job_uid(body)
    deleted = type == "DELETED"
    if uid is None:
        if deleted:
            KILLS.forget(namespace, name)
        return  # a pod that names no job by uid (an older operator's): never matched by name
    found = [] if deleted else causes.pod_causes(body)
    _observe_causes(namespace, job, uid, f"pod/{name}", found, logger)
    # A deleted pod's last status still counts: a kill whose write failed on its last change,
    # with no change since (a forced deletion), is recorded now; then the pod is forgotten.
    kills = KILLS.fresh(namespace, oom.pod_kills(body))
    if deleted:
        KILLS.forget(namespace, name)
    if not kills:
        return
    try:
        seen = write_status(namespace, job, carry, logger, kills, uid=uid)
    except (ApiException, HTTPError) as exc:
        logger.warning(f"RLJob {namespace}/{job}: OOMKilled not recorded yet: {exc}")
        return
    if seen == uid and not deleted:
        KILLS.record(namespace, kills)
