"""kopf handlers: RLJob create/resume/update -> children by server-side apply; RayJob changes
-> the RLJob's status and Events. Thin shell: read, call render/status, write.

Every handler is level-triggered: it recomputes from what exists, so running it twice (or
after a restart) creates nothing twice and loses nothing. Two memos in this process only skip
work whose outcome is known: a RayJob state its RLJob's status was already computed from
(MIRRORED), and a job-config ConfigMap version already parsed (APPLIED); a restart empties both.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import kopf
import yaml
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from rljob.api import (
    GROUP,
    JOB_CONFIG_FILE,
    PLURAL,
    VERSION,
    AttemptKnobs,
    JobConfig,
    OOMEvent,
    RLJobSpec,
)
from rljob.oom_policy import REASON_OOM_RETRY, admit, capacity_note, plan_fits
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
)

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

    def read(self, namespace: str, name: str) -> RLJobSpec | None:
        found = kube.get_config_map(namespace, render.config_map_name(name))
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
STARTED_AT = _now()
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

# From the fresh RLJob: the operator's non-OOM status fields and the condition transitions, or
# None when this writer has nothing to say about that RLJob.
OperatorFields = Callable[[dict[str, Any]], tuple[dict[str, Any], list[status.Transition]] | None]


def _carry(rljob: dict[str, Any]) -> tuple[dict[str, Any], list[status.Transition]]:
    return status.carried(dict(rljob.get("status") or {})), []


def _fits(spec: RLJobSpec, capacity_bytes: int | None) -> Callable[[AttemptKnobs], bool | None]:
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
        if spec is None and not problems:
            spec, problems = _parse(rljob)
            if spec is None or problems:
                return None
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
        if self.rayjob is None and attempts.finished(meta["name"], current):
            return None  # the current attempt's RayJob ended, then went: the outcome stands
        rayjob, step = self.rayjob, attempts.Step(None)
        if spec is not None and not problems:
            run_spec = status.applied_after_update(spec, self.applied)
            capacity = (current.get("memory") or {}).get("capacityBytes")
            step = attempts.advance(
                meta["name"], run_spec, current, rayjob,
                _fits(run_spec, capacity), capacity_note(run_spec, capacity),
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
        )
        return status.compute(observed, _now())


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


def _write(
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
            _forget(namespace, name, uid)
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
    _announce_causes(rljob, logger)
    return found


def _forget(namespace: str, name: str, uid: str | None) -> None:
    """Drop what this process keeps of a job that is gone: the RayJob state and spec memos of
    its name (they hold content keys, so a job applied again under the name only re-reads),
    and the causes of the gone job's uid."""
    MIRRORED.forget(namespace, name)
    APPLIED.forget(namespace, name)
    if uid is not None:
        CAUSES.forget(namespace, name, uid)


def _announce_causes(rljob: dict[str, Any], logger: logging.Logger | kopf.Logger) -> None:
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


# Applied after the RayJob: its pods reference the ServiceAccount (admission refuses a pod whose
# account is missing) and the ConfigMap (a volume) when KubeRay creates them, but only the driver
# uses the Role and RoleBinding, once Ray runs, seconds later (and its status publisher retries a
# refused write). So the RayJob exists two requests sooner after an RLJob is created.
AFTER_RAYJOB = ("Role", "RoleBinding")


def _apply_order(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """render.children() reordered for applying: the RayJob as soon as its pods' references exist."""
    return sorted(children, key=lambda child: child["kind"] in AFTER_RAYJOB)  # stable


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
    spec, problems = _parse(body)
    try:
        if spec is None or problems:
            _write(namespace, name, Observing(spec, None, None, problems), logger, uid=uid)
            text = "; ".join(f"{path}: {msg}" for path, msg in problems)
            raise kopf.PermanentError(f"RLJob {name}: {text}")
        run_spec = status.applied_after_update(spec, APPLIED.read(namespace, name))
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
            stored = _apply_children(
                owner, spec, run_spec, retry, logger, rayjob=start and not done, attempt=attempt
            )
            APPLIED.remember(namespace, name, stored["ConfigMap"], run_spec)
            ended = (
                identity.own(kube.get_rayjob(namespace, attempt.ray_job), uid)
                if done
                else stored.get("RayJob")
            )
            observing = Observing(spec, run_spec, ended, reconciled=True)
            _write(namespace, name, observing, logger, uid=uid)
        logger.info(f"reconciled RLJob {namespace}/{name}")
    except (ApiException, HTTPError) as exc:
        raise kube.as_kopf_error(exc, f"RLJob {namespace}/{name}") from exc


def _apply_children(
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
            _failed(
                owner, spec, run_spec, stored, kube.apply_failure(child, exc, retry), logger, exc
            )
        if taken is not None:
            _failed(owner, spec, run_spec, stored, taken, logger)
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


def _failed(
    owner: render.Owner, spec: RLJobSpec, run_spec: RLJobSpec, stored: dict[str, dict[str, Any]],
    failure: status.ApplyFailure, logger: kopf.Logger | logging.Logger,
    cause: BaseException | None = None,
) -> NoReturn:  # fmt: skip
    """Status says why a child was not applied; then kopf's error: permanent when refused for
    good, else a retry after the failure's backoff."""
    where = f"RLJob {owner.namespace}/{owner.name}"
    try:
        observing = Observing(spec, run_spec, stored.get("RayJob"), apply_failure=failure)
        _write(owner.namespace, owner.name, observing, logger, uid=owner.uid)
    except (ApiException, HTTPError) as status_exc:
        logger.warning(f"{where}: status not updated: {status_exc}")
    if failure.refused:
        raise kopf.PermanentError(f"{where}: {failure.text}") from cause
    delay = failure.retry_in_seconds
    raise kopf.TemporaryError(f"{where}: {failure.text}", delay=delay) from cause


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
    if uid is None or (type != "DELETED" and identity.terminating(body)):
        # Not made by this operator for a job it can name by uid, or on its way out (KubeRay's
        # finalizer holds a deleted RayJob, still showing its last status): nothing to mirror.
        # Its DELETED event comes next.
        return
    rayjob = None if type == "DELETED" else dict(body)
    try:
        with LOCKS.hold(namespace, name):
            if MIRRORED.holds(namespace, name, rayjob):
                return  # the RLJob's status was computed from this very RayJob state
            # The spec is parsed from the RLJob _write reads (one read, under the same lock).
            # A RayJob of an earlier OOM-policy attempt, or of an earlier RLJob of this name,
            # is ignored there (Observing).
            applied = APPLIED.read(namespace, name)
            observing = Observing(
                None, applied, rayjob, rayjob_name=body["metadata"]["name"], source_uid=uid
            )
            _write(namespace, name, observing, logger, uid=uid)
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
                _forget(namespace, job, uid)  # the source's job is gone
                return
            ray_job = attempts.current_ray_job(job, rljob.get("status") or {})
            rayjob = identity.own(kube.get_rayjob(namespace, ray_job), uid)
            # A job whose last cause just cleared is dropped from the book (current() None, "heard
            # nothing: keep what status says"): say so, or PodsReady keeps the cleared cause.
            cleared = CAUSES.current(namespace, job, uid) is None
            observing = Observing(
                None, APPLIED.read(namespace, job), rayjob, causes_cleared=cleared
            )
            _write(namespace, job, observing, logger, uid=uid)
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
async def startup_deadline(
    body: kopf.Body, name: str, namespace: str | None, uid: str, logger: kopf.Logger, **_: Any
) -> None:
    """A job whose Ray job is not running by spec.startupTimeoutSeconds fails (StartupTimeout,
    with the last cause) and its RayJob is suspended: KubeRay deletes the pods (README policy).
    Async, so the check of a job not due costs no thread; the work runs in one when due.

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
            applied = APPLIED.read(namespace, name)
            rljob = kube.get_rljob(namespace, name)
            if rljob is None or rljob["metadata"]["uid"] != owner.uid:
                return  # deleted (and maybe applied again) since the timer fired
            attempt = attempts.current(name, applied, rljob.get("status") or {})
            rayjob = identity.own(kube.get_rayjob(namespace, attempt.ray_job), owner.uid)
            if rayjob is not None and applied is not None:
                # Suspend first: if this fails the job is still Starting and the timer retries.
                suspended = applied.model_copy(update={"suspend": True})
                rayjob = kube.apply(render.ray_job(owner, suspended, attempt.number))
            observing = Observing(None, applied, rayjob, startup_expired=True)
            _write(namespace, name, observing, logger, uid=owner.uid)
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
        _forget(namespace, name, str((body.get("metadata") or {}).get("uid") or "") or None)
        return
    current = dict(body.get("status") or {})
    metrics.JOBS.observe(namespace, name, current)
    if attempts.needs_attention(dict(body.get("spec") or {}), current):
        _follow_attempt(namespace, name, logger)
    wanted = status.derived(current.get("memory"), dict(current.get("oomCounts") or {}))
    held = {key: current[key] for key in status.DERIVED_FIELDS if key in current}
    if wanted == held and not notices.pending(current):
        return
    try:
        _write(namespace, name, _carry, logger)
    except (ApiException, HTTPError) as exc:
        # Not retried by kopf: the next change of this RLJob repairs it.
        logger.warning(f"RLJob {namespace}/{name}: derived status not updated: {exc}")


def _follow_attempt(namespace: str, name: str, logger: kopf.Logger | logging.Logger) -> None:
    """The OOM policy's work an RLJob change may bring (attempts.needs_attention): apply the
    children of a retry recorded in status.attempts whose RayJob does not exist yet, or decide
    on a failed attempt whose OOM record arrived after KubeRay's failure. Everything is read
    again under the job's lock, so a stale event does nothing; a failure here is logged, and
    the timer (startup_deadline, every STARTUP_CHECK_SECONDS while the job is Pending or its
    late OOM is undecided), the next change of the RLJob or the operator's resume tries again."""
    try:
        with LOCKS.hold(namespace, name):
            rljob = kube.get_rljob(namespace, name)
            if rljob is None:
                return
            spec, problems = _parse(rljob)
            if spec is None or problems:
                return
            applied = APPLIED.read(namespace, name)
            run_spec = status.applied_after_update(spec, applied)
            current = dict(rljob.get("status") or {})
            attempt = attempts.current(name, run_spec, current)
            uid = str(rljob["metadata"]["uid"])
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
                stored = _apply_children(owner, spec, run_spec, 0, logger, attempt=attempt)
                APPLIED.remember(namespace, name, stored["ConfigMap"], run_spec)
                logger.info(f"RLJob {namespace}/{name}: attempt {attempt.number} started")
                observing = Observing(spec, run_spec, stored.get("RayJob"), reconciled=True)
            else:
                observing = Observing(spec, applied, rayjob)
            _write(namespace, name, observing, logger, uid=uid)
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
    if type == "DELETED":
        KILLS.forget(namespace, name)
    if uid is None:
        return  # a pod that names no job by uid (an older operator's): never matched by name
    found = [] if type == "DELETED" else causes.pod_causes(body)
    _observe_causes(namespace, job, uid, f"pod/{name}", found, logger)
    if type == "DELETED":
        return
    kills = KILLS.fresh(namespace, oom.pod_kills(body))
    if not kills:
        return
    try:
        seen = _write(namespace, job, _carry, logger, kills, uid=uid)
    except (ApiException, HTTPError) as exc:
        logger.warning(f"RLJob {namespace}/{job}: OOMKilled not recorded yet: {exc}")
        return
    if seen == uid:
        KILLS.record(namespace, kills)
