"""The job's side of RLJob status: the driver-owned fields (iteration, reward/KL, memory, memory
history, metrics, CUDA OOM entries and count, checkpoint news) server-side applied under field
manager `rljob-job`, and Events.

Runs with the per-job ServiceAccount (get/patch on its own RLJob and its status, create Events):
in-cluster config in the Ray head pod, a kubeconfig elsewhere. Hook: `StatusPublisher.publish`
after each iteration (Ray driver), or `PublishingListener` as the local driver's `on_event`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from rljob.api import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    CheckpointFailure,
    MemoryPoint,
    OOMEvent,
    PlanStatus,
    ResumePoint,
    RLJobStatus,
    history_with,
    status_apply_body,
)
from rljob.report import OOMRecord
from rljob_worker.driver import CONTINUED_FIELDS, continued

FIELD_MANAGER = "rljob-job"
APPLY = "application/apply-patch+yaml"
CUDA_OOM = "CUDAOutOfMemory"
# At most one IterationCompleted Event per this many seconds (a long job would otherwise flood
# the namespace's Events); the first iteration always gets one.
ITERATION_EVENT_SECONDS = 60.0

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _dump(model: Any) -> Any:
    return model.model_dump(by_alias=True, mode="json") if model is not None else None


_Stamped = TypeVar("_Stamped", ResumePoint, CheckpointFailure)


def _stamped(record: _Stamped | None, attempt: int | None) -> _Stamped | None:
    if record is None or record.attempt is not None or attempt is None:
        return record
    return record.model_copy(update={"attempt": attempt})


def driver_fields(
    status: RLJobStatus,
    history: list[MemoryPoint],
    held: Sequence[OOMEvent] = (),
    held_count: int = 0,
    attempt: int | None = None,
) -> dict[str, Any]:
    """The status fields the driver owns, camelCase, for server-side apply. Only CUDA OOMs:
    OOMKilled entries and count are the operator's (each writer owns its entries by `id`).

    `held` and `held_count` are the CUDA OOM entries and count an earlier driver of this job
    wrote (an earlier attempt, a resumed job): they stay, with this driver's after them. Under
    server-side apply the field manager is the same, so what one apply leaves out is deleted.
    This driver's own entries carry `attempt` (its JobConfig's): the OOM policy matches an OOM to
    its attempt by that number, not by comparing this node's clock with the apiserver's."""
    from rljob_worker.driver import newest_ooms

    own = [
        OOMEvent.model_validate(o).model_copy(update={"attempt": o.attempt or attempt})
        for o in status.oom_events
        if o.kind == CUDA_OOM
    ]
    ids = {o.id for o in own}
    cuda = newest_ooms([*(o for o in held if o.kind == CUDA_OOM and o.id not in ids), *own])
    fields: dict[str, Any] = {
        "iteration": status.iteration,
        "rewardMean": status.reward_mean,
        "klMean": status.kl_mean,
        "memory": status.memory.model_dump(by_alias=True, mode="json") if status.memory else None,
        "memoryHistory": [p.model_dump(by_alias=True, mode="json") for p in history] or None,
        "metrics": [
            m.model_dump(by_alias=True, exclude_none=True, mode="json") for m in status.metrics
        ]
        or None,
        "oomEvents": [o.model_dump(by_alias=True, exclude_none=True, mode="json") for o in cuda],
        "checkpoint": _dump(status.checkpoint),
        "export": _dump(status.export),
        # Stamped with this driver's attempt: the operator copies a resume into that attempt's
        # status.attempts entry, and a failure is this attempt's.
        "resumedFrom": _dump(_stamped(status.resumed_from, attempt)),
        "checkpointFailure": _dump(_stamped(status.checkpoint_failure, attempt)),
    }
    count = held_count + int(status.oom_counts.get(CUDA_OOM, 0))
    if count:
        fields["oomCounts"] = {CUDA_OOM: count}
    return {key: value for key, value in fields.items() if value is not None}


def oom_message(oom: OOMRecord) -> str:
    """The Warning Event's text: where it happened and what was asked for."""
    return (
        f"CUDA out of memory in stage {oom.stage} (rank {oom.rank}, iteration {oom.iteration}"
        + (f", node {oom.node}" if oom.node else "")
        + f"): {oom.request_text()}. {oom.message}"
    )[:1024]


def iteration_message(status: RLJobStatus) -> str:
    text = f"iteration {status.iteration} completed"
    if status.reward_mean is not None:
        text += f", reward {status.reward_mean:.4g}"
    memory = status.memory
    if memory is not None and memory.stages:
        worst = max(memory.stages, key=lambda s: s.peak_fraction)
        text += (
            f"; worst stage {worst.name} at {worst.peak_fraction:.3f} of "
            f"{memory.capacity_bytes} bytes ({memory.device}, rank {worst.rank})"
        )
    return text


class RateLimit:
    """True at most once per `seconds` (the first call always)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.last: float | None = None

    def __call__(self) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.seconds:
            return False
        self.last = now
        return True


class JobGone(RuntimeError):
    """The RLJob of this name is not the one this driver runs for (deleted, maybe applied again)."""


class StatusPublisher:
    """Writes one RLJob's driver-owned status and posts its Events."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        *,
        iteration_event_seconds: float = ITERATION_EVENT_SECONDS,
        uid: str | None = None,
        attempt: int | None = None,
    ) -> None:
        self.api, self.namespace, self.name = api, namespace, name
        # The RLJob this driver runs for (JobConfig.uid): its writes are refused by the
        # apiserver once that object is gone, even if another RLJob of the name exists.
        self.job_uid, self.attempt = uid, attempt
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.iteration_events = RateLimit(iteration_event_seconds)
        self._uid: str | None = None
        self._history: list[MemoryPoint] | None = None
        self._held_ooms: list[OOMEvent] = []
        self._held_oom_count = 0
        self._earlier = RLJobStatus()  # CONTINUED_FIELDS as status held them at _load
        self._unposted: list[OOMRecord] = []  # CUDA OOMs whose Warning Event is not posted yet
        self._announced: int | None = None
        # status.plan: rank 0's memory plan (rljob/plan/), set once it arrives.
        self.plan: PlanStatus | None = None

    @classmethod
    def from_env_or_kubeconfig(
        cls, namespace: str, name: str, kubeconfig: str | None = None, **kwargs: Any
    ) -> StatusPublisher:
        """In-cluster config (the pod's ServiceAccount token) if present, else a kubeconfig
        ($KUBECONFIG or ~/.kube/config when `kubeconfig` is None)."""
        if kubeconfig is None:
            try:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                return cls(client.ApiClient(configuration), namespace, name, **kwargs)
            except config.ConfigException:
                pass
        return cls(config.new_client_from_config(config_file=kubeconfig), namespace, name, **kwargs)

    def _load(self) -> None:
        """The RLJob's uid (Events point at it), and the memory history, CUDA OOMs, checkpoint,
        export and metrics written before (by an earlier attempt's driver, or an earlier run of
        this attempt): this driver goes on with them."""
        rljob: Any = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name
        )
        self._uid = str(rljob["metadata"]["uid"])
        if self.job_uid is not None and self._uid != self.job_uid:
            raise JobGone(
                f"RLJob {self.namespace}/{self.name} is now another object (uid {self._uid}, this "
                f"driver's is {self.job_uid}): it was deleted and applied again; not writing"
            )
        status = rljob.get("status") or {}
        self._history = [MemoryPoint.model_validate(p) for p in status.get("memoryHistory") or []]
        self._held_ooms = [
            OOMEvent.model_validate(o)
            for o in status.get("oomEvents") or []
            if o.get("kind") == CUDA_OOM
        ]
        self._held_oom_count = int((status.get("oomCounts") or {}).get(CUDA_OOM, 0))
        self._earlier = RLJobStatus.model_validate(
            {key: status[key] for key in CONTINUED_FIELDS if status.get(key)}
        )

    def next_attempt(self) -> None:
        """A new attempt of `rljob run --publish` (locally it is the operator too): its driver
        starts from what status holds now (the earlier attempts' OOMs, history, checkpoint and
        metrics), as a new RayJob's driver does in the cluster. Without this the second
        attempt's apply, under the same field manager, would drop the first one's OOM entries
        and count."""
        self._history = None
        self._announced = None
        self.plan = None  # the new attempt's rank 0 sends its own (else attempt 1's stays)

    def publish(self, status: RLJobStatus, new_ooms: Sequence[OOMRecord] = ()) -> None:
        """Apply the driver-owned fields of `status`; a Warning Event per new CUDA OOM, and a
        rate-limited Normal IterationCompleted when the iteration moved. Raises ApiException
        (e.g. 403 for an RLJob this account may not write)."""
        if self._history is None:
            self._load()
        assert self._history is not None
        self._history = history_with(self._history, status.memory)
        fields = driver_fields(
            continued(status, self._earlier),
            self._history,
            self._held_ooms,
            self._held_oom_count,
            self.attempt,
        )
        if self.plan is not None:
            stamped = self.plan.model_copy(update={"attempt": self.attempt})
            fields["plan"] = stamped.model_dump(by_alias=True, mode="json")
        body = status_apply_body(self.namespace, self.name, fields, self.job_uid)
        # A new OOM's Warning Event waits for a status write that succeeds (the entry first);
        # one whose write failed is posted with the next write, not dropped with the failure.
        self._unposted += [o for o in new_ooms if o.kind == CUDA_OOM]
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.name, body,
            field_manager=FIELD_MANAGER, force=True, _content_type=APPLY,
        )  # fmt: skip
        posting, self._unposted = self._unposted, []
        for oom in posting:
            self.event("Warning", CUDA_OOM, oom_message(oom))
        if status.iteration is not None and status.iteration != self._announced:
            self._announced = status.iteration
            if self.iteration_events():
                self.event("Normal", "IterationCompleted", iteration_message(status))

    def event(self, event_type: str, reason: str, message: str) -> None:
        """Post a core/v1 Event on the RLJob (what `kubectl describe rljob` lists)."""
        now = _now()
        body: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": self.name,
                "namespace": self.namespace,
                "uid": self._uid,
            },
            "type": event_type,
            "reason": reason,
            "message": message,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": FIELD_MANAGER, "host": socket.gethostname()},
            "reportingComponent": f"{GROUP}/job",
            "reportingInstance": socket.gethostname(),
        }
        self.core.create_namespaced_event(self.namespace, body)


class PublishingListener:
    """The local driver's `on_event`: aggregates rank events as the driver does (a LocalRun's,
    so the two never count differently) and publishes when every rank finished an iteration,
    and at once on a CUDA OOM. A failed write is logged and retried with the next one (each
    write is the whole driver-owned state), so the apiserver being slow never stops training."""

    def __init__(
        self,
        publisher: StatusPublisher,
        world_size: int,
        then: Callable[[Any], None] | None = None,
    ) -> None:
        from rljob_worker.driver.local import LocalRun

        self.publisher, self.then = publisher, then
        # What the ranks sent: memory samples, iterations, OOMs, checkpoint parts (one sent
        # alone, completed in the iteration of a newer one, counts too), exports, failures.
        self.run = LocalRun(world_size, device="")
        self.failures: list[Exception] = []

    def status(self) -> RLJobStatus:
        return self.run.status()

    def __call__(self, event: Any) -> None:
        from rljob_worker.loop import RankIteration

        if self.then is not None:
            self.then(event)
        if isinstance(event, RankIteration) and event.plan is not None:
            self.publisher.plan = event.plan  # rank 0's plan, before iteration 1: status.plan
        completed = self.run.add(event)
        # A checkpoint failure is published with the final flush, a checkpoint part or an
        # export with the iteration's report.
        if isinstance(event, OOMRecord):
            self.flush([event])
        elif completed:
            self.flush()

    def flush(self, new_ooms: Sequence[OOMRecord] = ()) -> None:
        """Publish what has been gathered so far (also at the end, so the last samples of a
        failed iteration are written)."""
        try:
            self.publisher.publish(self.status(), new_ooms)
        except (ApiException, HTTPError, JobGone) as exc:
            self.failures.append(exc)
            log.warning(
                f"RLJob {self.publisher.namespace}/{self.publisher.name}: status not written: {exc}"
            )
