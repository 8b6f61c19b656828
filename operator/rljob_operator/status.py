"""Status computation: what the operator observes (RLJob, applied spec, RayJob) in, the
operator-owned status fields out. Pure; computed each time from observations, never accumulated.

The operator owns phase, observedGeneration, conditions, rayJob, attempts (the OOM policy's,
advanced by attempts.py) and the derived printer-column fields; the job's driver owns
iteration, memory and CUDA OOMs (docs/design.md, "Boundaries").
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rljob.api import (
    DEFAULT_STARTUP_TIMEOUT_SECONDS,
    REASON_CHECKPOINT_FAILED,
    CheckpointFailure,
    Phase,
    RLJobSpec,
    driver_failure,
)
from rljob.oom_policy import (
    MEMORY_PLAN_FITS,
    REASON_HOST_OOM,
    REASON_PLAN_MISFIT,
    REASON_RETRIES_EXHAUSTED,
    admit,
)
from rljob_operator import attempts
from rljob_operator.causes import Cause
from rljob_operator.oom import KIND as KILLED
from rljob_operator.oom import KilledPart

# Condition types (metav1.Condition.type).
CREATED = "Created"
RUNNING = "Running"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
SUSPENDED = "Suspended"
SPEC_APPLIED = "SpecApplied"
PODS_READY = "PodsReady"
CONDITION_TYPES = (
    CREATED, PODS_READY, RUNNING, SUCCEEDED, FAILED, SUSPENDED, SPEC_APPLIED, MEMORY_PLAN_FITS,
)  # fmt: skip

# Reasons (CamelCase, as metav1.Condition requires).
REASON_RAYJOB_CREATED = "RayJobCreated"
REASON_RAYJOB_MISSING = "RayJobNotCreated"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_JOB_PENDING = "RayJobPending"
REASON_JOB_RUNNING = "RayJobRunning"
REASON_JOB_SUCCEEDED = "RayJobSucceeded"
REASON_JOB_FAILED = "RayJobFailed"
REASON_JOB_STOPPED = "RayJobStopped"
REASON_SUSPENDED = "SuspendedByUser"
REASON_NOT_SUSPENDED = "NotSuspended"
REASON_APPLIED = "Applied"
REASON_UPDATE_REFUSED = "UpdateRefused"
REASON_NOT_FINISHED = "NotFinished"
REASON_STARTUP_TIMEOUT = "StartupTimeout"
REASON_APPLY_RETRYING = "ApplyRetrying"
REASON_PODS_RUNNING = "PodsRunning"
REASON_PODS_PENDING = "PodsPending"
# A child the apiserver refused for good: "<Kind>Refused" (RayJobRefused, ConfigMapRefused...).
REFUSED_SUFFIX = "Refused"

# Spec fields an update may change on a live job; any other change is refused.
MUTABLE_SPEC_FIELDS = ("suspend", "ttlSecondsAfterFinished", "startupTimeoutSeconds")
# status.cause (a printer column) is cut to this many characters.
MAX_CAUSE = 120


@dataclass(frozen=True)
class ApplyFailure:
    """Applying one child failed: refused for good (a 4xx that retrying will not change) or
    retried (5xx, conflict, throttling, forbidden, unreachable) after `retry_in_seconds`."""

    kind: str
    name: str
    message: str  # the apiserver's own, with its HTTP status
    retry_in_seconds: float | None = None  # None: refused for good
    refused_by: str = "the apiserver"  # or the operator (a RayJob name another job holds)

    @property
    def refused(self) -> bool:
        return self.retry_in_seconds is None

    @property
    def reason(self) -> str:
        return f"{self.kind}{REFUSED_SUFFIX}" if self.refused else REASON_APPLY_RETRYING

    @property
    def text(self) -> str:
        what = f"{self.kind} {self.name}"
        if self.refused:
            return f"{self.refused_by} refused {what}: {self.message}"
        return f"applying {what} failed: {self.message}; retrying in {self.retry_in_seconds:.0f}s"


@dataclass(frozen=True)
class Observed:
    """Everything status is computed from."""

    generation: int
    spec: RLJobSpec | None  # None: the spec failed validation (see problems)
    applied_spec: RLJobSpec | None  # the spec in the job-config ConfigMap, if it exists
    rayjob: dict[str, Any] | None  # the RayJob as read from the API, if it exists
    previous_conditions: list[dict[str, Any]] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (field path, message)
    memory: dict[str, Any] | None = None  # status.memory, written by the driver
    oom_counts: dict[str, int] = field(default_factory=dict)  # status.oomCounts
    # Why the pods are not running, as the pods and RayCluster show it now; None: not known to
    # this process yet (the PodsReady condition status holds is kept).
    causes: list[Cause] | None = None
    apply_failure: ApplyFailure | None = None  # applying a child failed in this reconcile
    reconciled: bool = False  # this reconcile applied every child
    startup_expired: bool = False  # the startup deadline passed (the timer says so)
    # status.attempts as the OOM policy has it (attempts.advance); None: the policy is off.
    attempts: list[dict[str, Any]] | None = None
    # The policy's final decision on a failed attempt: (reason, message) for Failed.
    oom_stop: tuple[str, str] | None = None
    # The driver's status.checkpointFailure of the current attempt: Failed says CheckpointFailed.
    checkpoint_failure: CheckpointFailure | None = None
    # An update of a job that has its children already (a live or finished job) whose spec
    # fails validation: refused (SpecApplied UpdateRefused, these problems), and the job is
    # observed with the spec it runs with (`spec` is that one then), not failed.
    invalid_update: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Transition:
    """A condition that changed, for an Event."""

    type: str
    status: str
    reason: str
    message: str

    @property
    def event_type(self) -> str:
        failed = self.type == FAILED and self.status == "True"
        return "Warning" if failed or self.reason in WARNING_REASONS else "Normal"


WARNING_REASONS = (REASON_UPDATE_REFUSED, REASON_APPLY_RETRYING, REASON_PLAN_MISFIT)
# Failed reasons of the OOM policy: news even when Failed was already True (a RayJobFailed seen
# before the driver's OOM record arrived).
POLICY_REASONS = (REASON_RETRIES_EXHAUSTED, REASON_HOST_OOM)


def refused_fields(spec: RLJobSpec, applied: RLJobSpec | None) -> list[str]:
    """Spec paths that differ from what the job runs with and cannot be applied to it."""
    if applied is None:
        return []
    new = spec.model_dump(by_alias=True, mode="json")
    old = applied.model_dump(by_alias=True, mode="json")
    return sorted(
        f"spec.{path}"
        for path in _diff(new, old, "")
        if path.split(".")[0] not in MUTABLE_SPEC_FIELDS
    )


def _diff(new: Any, old: Any, prefix: str) -> list[str]:
    if isinstance(new, dict) and isinstance(old, dict):
        paths: list[str] = []
        for key in sorted(set(new) | set(old)):
            sub = f"{prefix}.{key}" if prefix else key
            paths += _diff(new.get(key), old.get(key), sub)
        return paths
    return [] if new == old else [prefix]


def applied_after_update(spec: RLJobSpec, applied: RLJobSpec | None) -> RLJobSpec:
    """The spec to run after an update: the running spec with only the mutable fields taken."""
    if applied is None:
        return spec
    return applied.model_copy(
        update={
            "suspend": spec.suspend,
            "ttl_seconds_after_finished": spec.ttl_seconds_after_finished,
            "startup_timeout_seconds": spec.startup_timeout_seconds,
        }
    )


def _phase_and_reasons(obs: Observed) -> tuple[Phase, dict[str, tuple[bool, str, str]]]:
    """Phase plus, per condition type, (status, reason, message)."""
    if obs.problems or obs.spec is None:
        text = "; ".join(f"{path}: {msg}" for path, msg in obs.problems) or "invalid spec"
        return Phase.FAILED, {
            CREATED: (False, REASON_INVALID_SPEC, text),
            FAILED: (True, REASON_INVALID_SPEC, text),
        }
    conditions: dict[str, tuple[bool, str, str]] = {}
    refused = refused_fields(obs.spec, obs.applied_spec)
    if obs.invalid_update:
        text = "; ".join(f"{path}: {msg}" for path, msg in obs.invalid_update)
        conditions[SPEC_APPLIED] = (
            False, REASON_UPDATE_REFUSED, f"the update is invalid, the job runs as before: {text}"
        )  # fmt: skip
    elif refused:
        conditions[SPEC_APPLIED] = (
            False, REASON_UPDATE_REFUSED, "cannot change a live job: " + ", ".join(refused)
        )  # fmt: skip
    else:
        conditions[SPEC_APPLIED] = (True, REASON_APPLIED, "the RayJob reflects the spec")
    if obs.rayjob is None:
        what = "RayJob not created yet"
        if obs.attempts and len(obs.attempts) > 1:
            last = obs.attempts[-1]
            what = f"RayJob {last.get('rayJob')} of attempt {last.get('attempt')} not created yet"
        conditions[CREATED] = (False, REASON_RAYJOB_MISSING, what)
        return Phase.PENDING, conditions
    name = obs.rayjob.get("metadata", {}).get("name", "")
    conditions[CREATED] = (True, REASON_RAYJOB_CREATED, f"RayJob {name} created")
    rj = obs.rayjob.get("status") or {}
    job_status = rj.get("jobStatus", "")
    deployment = rj.get("jobDeploymentStatus", "")
    detail = rj.get("message") or rj.get("reason") or ""
    suspended = deployment in ("Suspended", "Suspending") or (
        obs.spec.suspend and deployment in ("", "New")
    )
    conditions[SUSPENDED] = (
        (True, REASON_SUSPENDED, f"RayJob {deployment or 'suspend requested'}")
        if suspended
        else (False, REASON_NOT_SUSPENDED, "")
    )
    outcome = attempts.ended(obs.rayjob)
    if outcome == attempts.SUCCEEDED:
        phase = Phase.SUCCEEDED
        conditions[SUCCEEDED] = (True, REASON_JOB_SUCCEEDED, detail or "the job succeeded")
        conditions[RUNNING] = (False, REASON_JOB_SUCCEEDED, "")
        conditions[FAILED] = (False, REASON_JOB_SUCCEEDED, "")
        return phase, conditions
    if outcome == attempts.FAILED:
        reason = REASON_JOB_STOPPED if job_status == "STOPPED" else REASON_JOB_FAILED
        # KubeRay's message is Ray's job log tail; the driver's last line there says why.
        message = (
            driver_failure(detail)
            or detail
            or f"jobStatus {job_status or '-'}, jobDeploymentStatus {deployment}"
        )
        if obs.checkpoint_failure is not None:
            reason, message = REASON_CHECKPOINT_FAILED, obs.checkpoint_failure.describe()
        conditions[FAILED] = (True, reason, message)
        conditions[RUNNING] = (False, reason, "")
        conditions[SUCCEEDED] = (False, reason, "")
        return Phase.FAILED, conditions
    conditions[SUCCEEDED] = (False, REASON_NOT_FINISHED, "")
    conditions[FAILED] = (False, REASON_NOT_FINISHED, "")
    if suspended:
        conditions[RUNNING] = (False, REASON_SUSPENDED, "")
        return Phase.SUSPENDED, conditions
    if job_status == "RUNNING":
        conditions[RUNNING] = (True, REASON_JOB_RUNNING, "the Ray job is running")
        return Phase.RUNNING, conditions
    conditions[RUNNING] = (False, REASON_JOB_PENDING, f"jobDeploymentStatus {deployment or '-'}")
    return (Phase.STARTING if deployment else Phase.PENDING), conditions


Conditions = dict[str, tuple[bool, str, str]]


def _pods_ready(obs: Observed, phase: Phase) -> tuple[bool, str, str] | None:
    """PodsReady: True once the Ray job runs; else the causes the pods and RayCluster show."""
    if phase in (Phase.RUNNING, Phase.SUCCEEDED):
        return True, REASON_PODS_RUNNING, "the Ray job's pods are running"
    if obs.causes is None:
        held = {c["type"]: c for c in obs.previous_conditions}.get(PODS_READY)
        if held is None:
            return None
        return held.get("status") == "True", str(held["reason"]), str(held.get("message") or "")
    if obs.causes:
        lines = [c.line for c in obs.causes[:3]]
        if len(obs.causes) > 3:
            lines.append(f"and {len(obs.causes) - 3} more")
        return False, obs.causes[0].reason, "; ".join(lines)
    if obs.rayjob is None:
        return None
    return False, REASON_PODS_PENDING, "no pod reports a problem; the Ray cluster is starting"


def _standing_failure(obs: Observed) -> tuple[str, str] | None:
    """(reason, message) of a failure the operator decided and that stands: a child refused now
    or earlier in this generation (a reconcile that applies every child clears it), or a
    startup timeout (for good: the RayJob was suspended)."""
    if obs.apply_failure is not None and obs.apply_failure.refused:
        return obs.apply_failure.reason, obs.apply_failure.text
    held = {c["type"]: c for c in obs.previous_conditions}.get(FAILED)
    if held is None or held.get("status") != "True":
        return None
    reason = str(held.get("reason") or "")
    refused_here = (
        reason.endswith(REFUSED_SUFFIX)
        and held.get("observedGeneration") == obs.generation
        and obs.apply_failure is None
        and not obs.reconciled
    )
    if reason == REASON_STARTUP_TIMEOUT or refused_here:
        return reason, str(held.get("message") or "")
    return None


def _startup_timeout_seconds(obs: Observed) -> int:
    return obs.spec.startup_timeout_seconds if obs.spec else DEFAULT_STARTUP_TIMEOUT_SECONDS


def _startup_timeout_text(obs: Observed, pods: tuple[bool, str, str] | None) -> str:
    timeout = _startup_timeout_seconds(obs)
    if pods is not None and not pods[0] and pods[1] != REASON_PODS_PENDING:
        last = pods[2]
    elif obs.apply_failure is not None:
        last = obs.apply_failure.text
    elif obs.rayjob is None:
        last = "the RayJob was never created"
    else:
        deployment = (obs.rayjob.get("status") or {}).get("jobDeploymentStatus") or "-"
        last = f"none reported (RayJob jobDeploymentStatus {deployment})"
    return f"the Ray job was not running {timeout}s after the job started; last cause: {last}"


def _with_failures(obs: Observed, phase: Phase, conditions: Conditions) -> Phase:
    """Overlay what the operator itself decided (apply failures, startup timeout) on the phase
    and conditions computed from the RayJob; returns the phase."""
    failure = obs.apply_failure
    if failure is not None:
        conditions[SPEC_APPLIED] = (False, failure.reason, failure.text)
        if obs.rayjob is None:
            conditions[CREATED] = (False, failure.reason, failure.text)
    standing = _standing_failure(obs)
    if standing is None and obs.startup_expired and phase in (Phase.PENDING, Phase.STARTING):
        standing = REASON_STARTUP_TIMEOUT, _startup_timeout_text(obs, conditions.get(PODS_READY))
    if standing is None and obs.oom_stop is not None and phase is Phase.FAILED:
        standing = obs.oom_stop
    if standing is None:
        return phase
    reason, message = standing
    conditions[FAILED] = (True, reason, message)
    conditions[RUNNING] = (False, reason, "")
    conditions[SUCCEEDED] = (False, reason, "")
    suspended = conditions.get(SUSPENDED)
    if reason == REASON_STARTUP_TIMEOUT and suspended is not None and suspended[0]:
        # The operator suspended the RayJob (the clean-up policy), not the job's user.
        conditions[SUSPENDED] = (
            True,
            REASON_STARTUP_TIMEOUT,
            f"{suspended[2]} by the operator: the Ray job did not start within "
            f"{_startup_timeout_seconds(obs)}s",
        )
    return Phase.FAILED


def _cause(conditions: Conditions) -> str | None:
    """status.cause, one short line for `kubectl get`: why the job failed or is blocked. A
    message's line breaks and runs of blanks become one space (a printer column of several
    lines breaks `kubectl get`'s table), then it is cut to MAX_CAUSE."""
    failed = conditions.get(FAILED)
    pods = conditions.get(PODS_READY)
    applied = conditions.get(SPEC_APPLIED)
    if failed and failed[0]:
        text = f"{failed[1]}: {failed[2]}"
    elif pods and not pods[0] and pods[1] != REASON_PODS_PENDING:
        text = f"{pods[1]}: {pods[2]}"
    elif applied and not applied[0]:
        text = f"{applied[1]}: {applied[2]}"
    else:
        return None
    text = " ".join(text.split())
    return text if len(text) <= MAX_CAUSE else text[: MAX_CAUSE - 3].rstrip() + "..."


def _with_plan(spec: RLJobSpec, phase: Phase, conditions: Conditions) -> Phase:
    """MemoryPlanFits where the operator can plan (rljob/oom_policy.admit); a misfit with
    onMisfit Reject is Failed (reconcile() then creates no RayJob)."""
    admission = admit(spec)
    if admission.status == "Unknown":
        return phase
    conditions[MEMORY_PLAN_FITS] = (admission.status == "True", admission.reason, admission.message)
    if admission.start:
        return phase
    conditions[FAILED] = (True, REASON_PLAN_MISFIT, admission.message)
    return Phase.FAILED


def compute(obs: Observed, now: str) -> tuple[dict[str, Any], list[Transition]]:
    """The operator's status fields (camelCase) and the condition transitions since last time.

    lastTransitionTime moves only when a condition's status changes, as metav1.Condition says.
    """
    phase, wanted = _phase_and_reasons(obs)
    if not obs.problems and obs.spec is not None:
        pods = _pods_ready(obs, phase)
        if pods is not None:
            wanted[PODS_READY] = pods
        phase = _with_failures(obs, phase, wanted)
        phase = _with_plan(obs.spec, phase, wanted)
    previous = {c["type"]: c for c in obs.previous_conditions}
    conditions: list[dict[str, Any]] = []
    transitions: list[Transition] = []
    for ctype in CONDITION_TYPES:
        if ctype not in wanted:
            continue
        ok, reason, message = wanted[ctype]
        flag = "True" if ok else "False"
        before = previous.get(ctype)
        changed = before is None or before.get("status") != flag
        # The OOM policy's verdict on a job already Failed (RayJobFailed first) is news too.
        renamed = (
            ctype == FAILED and ok and reason in POLICY_REASONS
            and before is not None and before.get("reason") != reason
        )  # fmt: skip
        # A condition appearing as False (e.g. Failed=False at creation) is no news; an Event
        # goes out when one becomes True or flips.
        # PodsReady has no transition Event: each cause has its own aggregated one (causes.py),
        # and the pods running is the Running condition's Event.
        # MemoryPlanFits=False is news at creation too: the Warning Event of onMisfit Warn.
        news = ok or before is not None or ctype == MEMORY_PLAN_FITS
        if ((changed and news) or renamed) and ctype != PODS_READY:
            transitions.append(Transition(ctype, flag, reason, message))
        since = now if before is None or changed else str(before["lastTransitionTime"])
        conditions.append(
            {
                "type": ctype,
                "status": flag,
                "reason": reason,
                "message": message,
                "lastTransitionTime": since,
                "observedGeneration": obs.generation,
            }
        )
    status: dict[str, Any] = {
        "phase": phase.value,
        "observedGeneration": obs.generation,
        "conditions": conditions,
    }
    cause = _cause(wanted)
    if cause is not None:
        status["cause"] = cause
    if obs.rayjob is not None:
        rj = obs.rayjob.get("status") or {}
        status["rayJob"] = {
            "name": obs.rayjob["metadata"]["name"],
            "jobStatus": rj.get("jobStatus", ""),
            "jobDeploymentStatus": rj.get("jobDeploymentStatus", ""),
        }
    if obs.attempts:
        status["attempts"] = obs.attempts
    status.update(derived(obs.memory, obs.oom_counts))
    return status, transitions


# The operator's own status fields besides the OOM part (what a write that observes no RayJob
# change carries over unchanged: under server-side apply a field left out is a field given up).
CARRIED_FIELDS = (
    "phase", "observedGeneration", "conditions", "rayJob", "attempts", "cause", "announced",
)  # fmt: skip


def checkpoint_failure(current: Mapping[str, Any], attempt: int) -> CheckpointFailure | None:
    """The driver's status.checkpointFailure if it is attempt `attempt`'s (an earlier attempt's
    failure says nothing about this one)."""
    found = current.get("checkpointFailure")
    if not found:
        return None
    failure = CheckpointFailure.model_validate(found)
    return failure if failure.attempt in (None, attempt) else None


def checkpoint_failure_unmirrored(current: Mapping[str, Any]) -> bool:
    """Whether the job is Failed for KubeRay's reason while its current attempt's driver has
    recorded a checkpoint failure: the driver's write can land after KubeRay's failure was
    mirrored, and Failed must then say CheckpointFailed (the RayJob is observed again)."""
    if current.get("phase") != Phase.FAILED:
        return False
    attempt = int((list(current.get("attempts") or []) or [{"attempt": 1}])[-1]["attempt"])
    if checkpoint_failure(current, attempt) is None:
        return False
    held = {c.get("type"): c for c in current.get("conditions") or []}.get(FAILED) or {}
    return held.get("reason") in (REASON_JOB_FAILED, REASON_JOB_STOPPED)  # compute()'s others


def carried(current: dict[str, Any]) -> dict[str, Any]:
    """The operator-owned fields of `current` status, as they are."""
    return {key: current[key] for key in CARRIED_FIELDS if key in current}


def derived(memory: dict[str, Any] | None, oom_counts: dict[str, int]) -> dict[str, Any]:
    """The printer-column fields: worst stage fraction of the latest memory, sum of OOM counts."""
    out: dict[str, Any] = {}
    stages = (memory or {}).get("stages") or []
    if stages:
        out["worstStageFraction"] = max(float(s.get("peakFraction", 0.0)) for s in stages)
    if any(oom_counts.values()):
        out["oomTotal"] = sum(int(v) for v in oom_counts.values())
    return out


def with_ooms(
    operator_status: dict[str, Any], current: dict[str, Any], killed: KilledPart
) -> dict[str, Any]:
    """The whole operator-owned status: its fields plus the OOMKilled part, and the derived
    fields recomputed from the driver's memory and every writer's OOM counts."""
    counts = {**dict(current.get("oomCounts") or {}), KILLED: killed.total}
    out = {key: v for key, v in operator_status.items() if key not in DERIVED_FIELDS}
    return {**out, **killed.to_status(), **derived(current.get("memory"), counts)}


DERIVED_FIELDS = ("worstStageFraction", "oomTotal")


def _operator_view(current: dict[str, Any]) -> dict[str, Any]:
    """`current` status as the operator owns it: only OOMKilled entries and count."""
    view = dict(current)
    view["oomEvents"] = [e for e in current.get("oomEvents") or [] if e.get("kind") == KILLED]
    killed = (current.get("oomCounts") or {}).get(KILLED)
    view["oomCounts"] = {KILLED: killed} if killed else None
    return view


def differs(current: dict[str, Any], computed: dict[str, Any]) -> bool:
    """Whether writing `computed` would change `current` (so unchanged status costs no write).
    A derived field the computation no longer produces counts as a change (it must go)."""
    view = _operator_view(current)
    if any(key in current and key not in computed for key in DERIVED_FIELDS):
        return True
    return any(view.get(key) != value for key, value in computed.items())


def _time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def startup_deadline(rljob: Mapping[str, Any]) -> datetime.datetime | None:
    """When the job fails for not having started, or None while no deadline runs (it runs,
    finished, failed, or is suspended). The clock starts when the RLJob is created, again
    when it is resumed (its Suspended condition turning False), again with each OOM retry, and
    again when a job that ran stops running (its Running condition turning False: KubeRay's
    retry)."""
    current = rljob.get("status") or {}
    if current.get("phase") not in (None, Phase.PENDING.value, Phase.STARTING.value):
        return None
    since = _time(str(rljob["metadata"]["creationTimestamp"]))
    retried = len(current.get("attempts") or []) > 1
    for c in current.get("conditions") or []:
        if c.get("type") == SUSPENDED and c.get("status") == "False":
            since = max(since, _time(str(c["lastTransitionTime"])))
        # An OOM retry starts the clock again: Created turned False when the retry was
        # recorded and True when its RayJob was made.
        if retried and c.get("type") == CREATED:
            since = max(since, _time(str(c["lastTransitionTime"])))
        # A job that ran and stopped running (KubeRay runs it again after a failure,
        # spec.backoffLimit) starts the clock again when it stopped.
        if c.get("type") == RUNNING and c.get("status") == "False":
            since = max(since, _time(str(c["lastTransitionTime"])))
    spec = rljob.get("spec") or {}
    timeout = int(spec.get("startupTimeoutSeconds") or DEFAULT_STARTUP_TIMEOUT_SECONDS)
    return since + datetime.timedelta(seconds=timeout)


def rayjob_started(rayjob: Mapping[str, Any]) -> bool:
    """Whether the RayJob's Ray job runs or has ended: a job past that has started, whatever its
    RLJob's status says yet (the startup deadline no longer applies to it)."""
    job_status = (rayjob.get("status") or {}).get("jobStatus", "")
    return job_status == "RUNNING" or attempts.ended(rayjob) != attempts.RUNNING


def timed_out(current: Mapping[str, Any]) -> bool:
    """Whether status says the job failed for not starting (its RayJob stays suspended)."""
    return any(
        c.get("type") == FAILED and c.get("status") == "True"
        and c.get("reason") == REASON_STARTUP_TIMEOUT
        for c in current.get("conditions") or []
    )  # fmt: skip
