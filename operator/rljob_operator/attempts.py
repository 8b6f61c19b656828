"""The OOM policy's attempts as the operator tracks them (issue 19). Pure: the RLJob's status
(status.attempts, status.oomEvents) and the current attempt's RayJob in, the next status.attempts
and what to do out. rljob/oom_policy.py decides; this module observes and records.

State lives in the RLJob's status only (it survives operator restarts): the last entry of
status.attempts is the current attempt, and its RayJob is rayjob_name(job, N). A retry is
recorded by appending attempt N+1 to status.attempts before its RayJob exists; the handlers then
apply that attempt's children (server-side apply, a fixed name: never created twice). With
spec.oomPolicy.maxRetries 0 (and no attempts in status) nothing here writes anything.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rljob.api import Attempt, AttemptKnobs, RLJobSpec
from rljob.oom_policy import (
    Decision,
    Outcome,
    first_knobs,
    next_attempt,
    rayjob_name,
)
from rljob_operator.identity import JOB_UID_LABEL

RUNNING: Final = "Running"
SUCCEEDED: Final = "Succeeded"
FAILED: Final = "Failed"
# Results of an attempt that the policy decided on (retry or stop): never recomputed.
OOM_RESULTS = ("CUDAOutOfMemory", "OOMKilled")


@dataclass(frozen=True)
class Current:
    """The attempt the job is on: its number, RayJob and knobs (None: the spec's own)."""

    number: int
    ray_job: str
    knobs: AttemptKnobs | None = None


@dataclass(frozen=True)
class Step:
    """What one observation of the current attempt's RayJob means.

    attempts: status.attempts to write (None: the policy is off, write none); stop: (reason,
    message) of a final decision, for the Failed condition; retry: the new attempt, recorded in
    `attempts` but whose RayJob does not exist yet; decision: the policy's, when it ran.
    """

    attempts: list[dict[str, Any]] | None
    stop: tuple[str, str] | None = None
    retry: Current | None = None
    decision: Decision | None = None


def policy_on(spec: RLJobSpec, status: Mapping[str, Any]) -> bool:
    """Whether status.attempts is kept: the OOM policy is on, or the job checkpoints (each
    attempt records the checkpoint it resumed from), or attempts exist already."""
    return (
        spec.oom_policy.max_retries > 0
        or spec.checkpoint is not None
        or bool(status.get("attempts"))
    )


def with_resume(
    attempts: Sequence[Mapping[str, Any]], status: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """status.attempts with the driver's status.resumedFrom copied into the entry of the
    attempt whose driver resumed (its `attempt` stamp); a later resume of the same attempt
    (a RayJob run again after suspend/resume) replaces it. Other entries are left as they are."""
    out = [dict(a) for a in attempts]
    point = status.get("resumedFrom") or {}
    number = point.get("attempt")
    for entry_ in out:
        if number is not None and int(entry_["attempt"]) == int(number):
            entry_["resumedFrom"] = {"iteration": point["iteration"], "path": point["path"]}
    return out


def entry(
    job: str, number: int, knobs: AttemptKnobs, result: str = RUNNING, changed: str = ""
) -> dict[str, Any]:
    """A status.attempts entry (camelCase, as stored)."""
    attempt = Attempt.ran_with(
        number, knobs, ray_job=rayjob_name(job, number), changed=changed or None, result=result
    )
    return attempt.model_dump(by_alias=True, exclude_none=True, mode="json")


def _knobs(spec: RLJobSpec, last: Mapping[str, Any]) -> AttemptKnobs:
    return AttemptKnobs(
        mem_fraction_static=last["memFractionStatic"],  # a number, or "Auto"
        wake_up=last.get("wakeUp") or spec.rollout.wake_up,
        micro_batch_size=last.get("microBatchSize"),
        gradient_checkpointing=last.get("gradientCheckpointing"),
        margin=last.get("margin"),
        weight_sync_bucket_megabytes=last.get("weightSyncBucketMegabytes"),
    )


def current(job: str, spec: RLJobSpec | None, status: Mapping[str, Any]) -> Current:
    """The current attempt, from status.attempts (attempt 1, the RLJob's name, without any)."""
    attempts = list(status.get("attempts") or [])
    if not attempts or spec is None:
        return Current(1, rayjob_name(job, 1))
    last = attempts[-1]
    number = int(last["attempt"])
    knobs = _knobs(spec, last) if number > 1 else None
    return Current(number, str(last.get("rayJob") or rayjob_name(job, number)), knobs)


def current_ray_job(job: str, status: Mapping[str, Any]) -> str:
    """The current attempt's RayJob name, without parsing the spec."""
    attempts = list(status.get("attempts") or [])
    if not attempts:
        return rayjob_name(job, 1)
    last = attempts[-1]
    return str(last.get("rayJob") or rayjob_name(job, int(last["attempt"])))


# Ray job statuses that end a job without success, whatever KubeRay's deployment status says.
ENDED_BADLY = ("FAILED", "STOPPED")


def _may_retry(rayjob: Mapping[str, Any]) -> bool:
    """KubeRay may still run this failed Ray job again (its backoffLimit is not used up, and its
    deployment status is not final yet)."""
    rj = rayjob.get("status") or {}
    limit = int((rayjob.get("spec") or {}).get("backoffLimit") or 0)
    final = rj.get("jobDeploymentStatus") in ("Failed", "ValidationFailed", "Complete")
    return not final and int(rj.get("failed") or 0) < limit


def ended(rayjob: Mapping[str, Any]) -> str:
    """RUNNING (not ended, pending included), SUCCEEDED or FAILED: how a RayJob's status reads
    (status.py's phase and the OOM policy's attempt results both come from here)."""
    rj = rayjob.get("status") or {}
    job_status, deployment = rj.get("jobStatus", ""), rj.get("jobDeploymentStatus", "")
    # KubeRay 1.6 marks a job stopped through Ray (`ray job stop`) Complete too: not a success.
    if job_status == "SUCCEEDED" or (deployment == "Complete" and job_status not in ENDED_BADLY):
        return SUCCEEDED
    if deployment == "Retrying" or (job_status in ENDED_BADLY and _may_retry(rayjob)):
        # spec.backoffLimit: KubeRay runs the failed Ray job again on a new Ray cluster. Its
        # jobStatus says FAILED before its deployment status says Failed (that waits for the
        # submitter), then Retrying and New: the attempt goes on until Failed is final.
        return RUNNING
    if job_status in ENDED_BADLY or deployment in ("Failed", "ValidationFailed"):
        return FAILED
    return RUNNING


def finished(job: str, status: Mapping[str, Any]) -> bool:
    """Whether `status` records the current attempt's RayJob as ended, the RLJob Succeeded or
    Failed by it: that outcome stands. Neither the RayJob's deletion afterwards (by a user, or by
    KubeRay run with DELETE_RAYJOB_CR_AFTER_JOB_FINISHES) nor the operator's resume may turn it
    back into a pending job, or apply the RayJob again and so run the job a second time."""
    mirrored = status.get("rayJob") or {}
    if not mirrored or mirrored.get("name") != current_ray_job(job, status):
        return False
    return status.get("phase") in (SUCCEEDED, FAILED) and ended({"status": mirrored}) != RUNNING


def _seconds(text: str) -> datetime.datetime | None:
    """An RFC 3339 time cut to whole seconds (the apiserver's and the worker's precision)."""
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.replace(microsecond=0)


def outcome(
    rayjob: Mapping[str, Any],
    oom_events: Sequence[Mapping[str, Any]],
    number: int | None = None,
    plan: Mapping[str, Any] | None = None,
) -> Outcome:
    """How failed attempt `number` ended: its first OOM (CUDA from the driver, OOMKilled from
    the kubelet), else a plain failure.

    An OOM belongs to an attempt by its number (the driver stamps JobConfig.attempt on its
    entries, the operator the pod's attempt label on OOMKilled ones), whatever the clocks of
    the driver's node and the apiserver say. Only an entry without a number (written by an
    older driver or operator) is placed by time: strictly after the RayJob's creation, in whole
    seconds. `plan` (status.plan) gives the card and the failed stage's planned peak, where the
    driver stamped it with this attempt's number: with the OOM's requested and free bytes, the
    overshoot a retry under rollout Auto measures.
    """
    start = _seconds(str(rayjob.get("metadata", {}).get("creationTimestamp") or ""))
    found: list[tuple[datetime.datetime, int, Mapping[str, Any]]] = []
    for event in oom_events:
        kind = event.get("kind")
        when = _seconds(str(event.get("time") or ""))
        if kind not in OOM_RESULTS or when is None:
            continue
        stamped = event.get("attempt")
        if stamped is not None and number is not None:
            if int(stamped) != number:
                continue
        elif start is not None and when <= start:
            continue
        found.append((when, 0 if kind == "CUDAOutOfMemory" else 1, event))
    if not found:
        return Outcome(FAILED)
    _, _, first = min(found, key=lambda f: (f[0], f[1]))
    rank = first.get("rank")
    limit = first.get("limitBytes")
    planned: dict[str, Any] = {}
    if plan and number is not None and plan.get("attempt") == number:
        peaks = {s.get("name"): s.get("peakBytes") for s in plan.get("stages") or []}
        planned = {
            "capacity_bytes": plan.get("capacityBytes"),
            "planned_peak_bytes": peaks.get(first.get("stage")),
        }
    return Outcome(
        "CUDAOutOfMemory" if first["kind"] == "CUDAOutOfMemory" else "OOMKilled",
        stage=first.get("stage"),
        rank=int(rank) if rank is not None else None,
        pod=str(first.get("pod") or ""),
        limit_bytes=int(limit) if limit is not None else None,
        requested_bytes=first.get("requestedBytes"),
        free_bytes=first.get("freeBytes"),
        **planned,
    )


def advance(
    job: str,
    spec: RLJobSpec,
    status: Mapping[str, Any],
    rayjob: Mapping[str, Any] | None,
    fits: Callable[[AttemptKnobs], bool | None] = lambda _k: None,
    note: str = "",
) -> Step:
    """status.attempts after observing `rayjob` (the current attempt's, or None: not created).

    The current (last) entry's result follows its RayJob; when that RayJob failed with an OOM
    after it started, the policy (next_attempt) decides: a retry appends attempt N+1, a stop
    is returned for the Failed condition. Earlier entries are never touched, so the same
    observation always gives the same answer (level-triggered, restart-safe).
    """
    if not policy_on(spec, status):
        return Step(None)
    attempts = [dict(a) for a in status.get("attempts") or []]
    if not attempts:
        attempts = [entry(job, 1, first_knobs(spec))]
    last = attempts[-1]
    number = int(last["attempt"])
    name = str(last.get("rayJob") or rayjob_name(job, number))
    if rayjob is None or rayjob.get("metadata", {}).get("name") != name:
        return Step(attempts)
    created = rayjob.get("metadata", {}).get("creationTimestamp")
    if created:
        last["startedAt"] = str(created)
    result = ended(rayjob)
    for key in ("oomStage", "oomRank"):
        last.pop(key, None)
    last["message"] = ""
    if result != FAILED:
        last["result"] = result
        return Step(attempts)
    out = outcome(rayjob, list(status.get("oomEvents") or []), number, status.get("plan"))
    last["result"] = out.kind
    if out.kind == FAILED:
        return Step(attempts)
    if out.stage is not None:
        last["oomStage"] = str(out.stage)
    if out.rank is not None:
        last["oomRank"] = out.rank
    knobs = _knobs(spec, last)
    decision = next_attempt(spec, knobs, number, out, fits)
    last["message"] = (decision.message + (note if decision.retry else ""))[:1024]
    if decision.retry and decision.knobs is not None:
        changed = decision.changed(knobs, spec)
        attempts.append(entry(job, number + 1, decision.knobs, changed=changed))
        retry = Current(number + 1, rayjob_name(job, number + 1), decision.knobs)
        return Step(attempts, retry=retry, decision=decision)
    if decision.reason is None:
        return Step(attempts, decision=decision)
    return Step(attempts, stop=(decision.reason, decision.message), decision=decision)


def new_retries(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
) -> list[tuple[int, str]]:
    """(attempt number, the policy's message) for each retry `after` adds to `before`."""
    known = {int(a["attempt"]) for a in before}
    by_number = {int(a["attempt"]): a for a in after}
    return [
        (n, str((by_number.get(n - 1) or {}).get("message") or f"attempt {n}"))
        for n in sorted(by_number)
        if n > 1 and n not in known
    ]


def retry_unapplied(status: Mapping[str, Any]) -> bool:
    """From the body alone: a retry is recorded whose RayJob status does not mirror yet (its
    children not applied, or not seen yet)."""
    attempts = list(status.get("attempts") or [])
    if not attempts:
        return False
    last = attempts[-1]
    mirrored = (status.get("rayJob") or {}).get("name")
    return int(last.get("attempt") or 1) > 1 and mirrored != last.get("rayJob")


def late_oom_undecided(spec: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """From the body alone: the current attempt was recorded Failed without an OOM, and status
    now holds an OOM of that attempt (by its number, or for an unnumbered entry strictly after
    its startedAt: the rule outcome() decides by): the driver's write came after KubeRay's. Once
    decided, the attempt's result is the OOM's and this turns false; an earlier attempt's OOM
    never makes it true."""
    attempts = list(status.get("attempts") or [])
    if not attempts or int(((spec.get("oomPolicy") or {}).get("maxRetries")) or 0) <= 0:
        return False
    last = attempts[-1]
    if last.get("result") != FAILED:
        return False
    started = {"metadata": {"creationTimestamp": last.get("startedAt") or ""}}
    ooms = list(status.get("oomEvents") or [])
    if _seconds(str(last.get("startedAt") or "")) is None:
        ooms = [o for o in ooms if o.get("attempt") is not None]  # unnumbered: not placeable
    return outcome(started, ooms, int(last["attempt"])).kind != FAILED


def needs_attention(spec: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """From an RLJob event's body alone (no reads): whether the policy may have work to do."""
    return retry_unapplied(status) or late_oom_undecided(spec, status)


def mirrored_rayjob(job: str, status: Mapping[str, Any], uid: str) -> dict[str, Any] | None:
    """The current attempt's RayJob as status mirrors it, for deciding on a late OOM after the
    RayJob itself went (KubeRay deletes a finished one with DELETE_RAYJOB_CR_AFTER_JOB_FINISHES
    and ttlSecondsAfterFinished 0): its name, status and creation (the attempt's startedAt).
    None unless status records that attempt as finished and knows when it started."""
    attempts = list(status.get("attempts") or [])
    if not attempts or not finished(job, status) or not attempts[-1].get("startedAt"):
        return None
    mirrored = dict(status.get("rayJob") or {})
    return {
        "metadata": {
            "name": mirrored["name"],
            "creationTimestamp": attempts[-1]["startedAt"],
            # The RLJob whose status mirrors it (`uid`): the identity the operator matches on.
            "labels": {JOB_UID_LABEL: uid},
        },
        "status": {k: mirrored[k] for k in ("jobStatus", "jobDeploymentStatus") if k in mirrored},
    }
