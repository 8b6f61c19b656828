"""The Ray driver: one colocated worker actor per rank in a placement group, events streamed back.

It runs inside a RayJob (or against a local Ray cluster in tests): every rank's events reach the
driver as they happen, and a rank that dies or raises ends the job within seconds, named.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from rljob.api import AUTO, REASON_CHECKPOINT_FAILED, RLJobSpec, RLJobStatus, WakeUp
from rljob.report import IterationReport, OOMRecord
from rljob_worker.driver.failure import (
    FailureKind,
    RankFailure,
    failure_reason,
    headline,
    plain,
)
from rljob_worker.driver.local import GRACE_SECONDS, LocalRun
from rljob_worker.driver.metrics_log import MetricsLog
from rljob_worker.driver.rank_process import (
    RankLaunch,
    free_port,
    quiet_environment,
    rank_configs,
    run_in_process_group,
)
from rljob_worker.loop import RankConfig, RankEvent, RankIteration
from rljob_worker.memory import OOMInjection

log = logging.getLogger(__name__)

# How long the placement group may wait for its bundles (KubeRay may still be starting the
# worker pods when the driver begins).
PLACEMENT_TIMEOUT_SECONDS = 600.0
# How long the driver blocks on the event queue per turn: also its reaction time to a failure.
POLL_SECONDS = 0.1

IterationCallback = Callable[[IterationReport, RLJobStatus], None]


def rank_actor_name(job: str, rank: int) -> str:
    """The Ray actor name of a rank (`ray list actors` shows it; tests find ranks by it)."""
    return f"{job}-rank-{rank}"


class RankWorker:
    """One rank's colocated worker, as a Ray actor: where it runs, then `run` for the whole job."""

    def __init__(self) -> None:
        quiet_environment()

    def where(self) -> tuple[str, str]:
        """(node IP, host name): the IP for the rendezvous, the host name (the pod) for people."""
        return ray.util.get_node_ip_address(), socket.gethostname()

    def free_port(self) -> int:
        return free_port("")

    def run(self, launch: RankLaunch, config: RankConfig, events: Queue) -> None:
        """Join the process group and run every iteration; each event is put on `events` before
        the rank moves on, so what it measured survives its death. Ray sets
        CUDA_VISIBLE_DEVICES to this actor's GPU, so its device is always cuda:0."""
        run_in_process_group(launch, config, events.put, build_model=True)


@dataclass
class RayRun(LocalRun):
    """Everything the ranks reported, aggregated, plus who failed where (run.reason says it)."""

    wake_up: WakeUp = WakeUp.STAGED
    last_iteration: int = 0
    checkpoint_every: int = 0  # spec.checkpoint.everyIterations (0: none): where a death was
    nodes: dict[int, str] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    setup_error: str | None = None
    # The ranks' event queue was lost (its actor gone): what they reported since is too, so
    # the run cannot count as done whatever the ranks returned.
    events_lost: str | None = None

    def fail(self, rank: int, how: FailureKind, error: str) -> None:
        error = plain(error)
        self.failures.append(RankFailure(rank, self.nodes.get(rank, "?"), how, error, time.time()))
        self.errors.setdefault(rank, error)

    @property
    def ok(self) -> bool:
        return (
            super().ok and not self.failures and self.setup_error is None and not self.events_lost
        )

    @property
    def reason(self) -> str | None:
        """Why the job failed, naming rank, node and stage (failure.failure_reason)."""
        if self.setup_error is not None:
            return self.setup_error
        if self.checkpoint_failures:  # every rank raised it together: the save is the cause
            return f"{REASON_CHECKPOINT_FAILED}: {self.checkpoint_failures[0].describe()}"
        if self.events_lost is not None and not (self.ooms or self.failures):
            return f"the ranks' event queue was lost (on the driver's node): {self.events_lost}"
        return failure_reason(
            self.ooms, self.failures, self.samples, self.wake_up, self.last_iteration, self.nodes,
            self.checkpoint_every,
        )  # fmt: skip


def _bundles(spec: RLJobSpec) -> list[dict[str, float]]:
    """One bundle per rank: a GPU and a CPU on GPU workers, a CPU otherwise."""
    bundle = {"GPU": 1.0, "CPU": 1.0} if spec.resources.gpus_per_worker > 0 else {"CPU": 1.0}
    return [dict(bundle) for _ in range(spec.world_size)]


def _ranked_bundles(group: PlacementGroup) -> list[int]:
    """Bundle indices in rank order: the bundles of one node get consecutive ranks, so a node's
    ranks can form its tensor-parallel group."""
    table = ray.util.placement_group_table(group)
    nodes: dict[int, str] = {int(k): str(v) for k, v in table["bundles_to_node_id"].items()}
    first_seen: dict[str, int] = {}
    for index in sorted(nodes):
        first_seen.setdefault(nodes[index], index)
    return sorted(nodes, key=lambda i: (first_seen[nodes[i]], i))


def _drain(events: Queue, wait_seconds: float, run: RayRun) -> list[Any]:
    """Every event waiting now; blocks up to `wait_seconds` for the first. A queue whose actor
    is gone gives nothing (the ranks' puts then fail, and each rank's ending names it), rather
    than an exception that would end the driver with no outcome recorded."""
    try:
        items = [events.get(block=True, timeout=wait_seconds)]
        waiting = events.qsize()
        if waiting:
            items += events.get_nowait_batch(waiting)
    except Empty:
        return []
    except RayError as error:
        if run.events_lost is None:
            log.error("the ranks' event queue is gone: %s", headline(str(error)))
            run.events_lost = headline(plain(str(error)))
        time.sleep(wait_seconds)  # as a poll that found nothing
        return []
    return items


class _NotStarted(RuntimeError):
    """The ranks could not be placed or started; no rank ran a stage."""


def _start_actors(
    spec: RLJobSpec, job: str, group: PlacementGroup, actors: list[Any], timeout_seconds: float
) -> tuple[list[tuple[str, str]], str]:
    """Place the bundles and start one actor per rank (appended to `actors`, which the caller
    holds: an actor whose handle is dropped is collected). Returns each rank's (IP, host) and
    the rendezvous address (rank 0's node, a free port there)."""
    try:
        ray.get(group.ready(), timeout=timeout_seconds)
    except GetTimeoutError:
        raise _NotStarted(
            f"placement group of {spec.world_size} bundles {_bundles(spec)[0]} not placed "
            f"within {timeout_seconds:.0f}s; the cluster has {ray.cluster_resources()}"
        ) from None
    gpu = spec.resources.gpus_per_worker > 0
    worker_class = ray.remote(RankWorker)
    for rank, bundle in enumerate(_ranked_bundles(group)):
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle
        )
        actors.append(
            worker_class.options(
                name=rank_actor_name(job, rank),
                num_cpus=1,
                num_gpus=1 if gpu else 0,
                max_restarts=0,
                scheduling_strategy=strategy,
            ).remote()
        )
    try:
        located = ray.get([a.where.remote() for a in actors], timeout=timeout_seconds)
        port = ray.get(actors[0].free_port.remote(), timeout=timeout_seconds)
    except (RayActorError, RayTaskError, GetTimeoutError) as error:
        raise _NotStarted(f"rank actors did not start: {plain(str(error))}") from None
    return located, f"tcp://{located[0][0]}:{port}"


def run_ray(
    spec: RLJobSpec,
    *,
    job: str = "rljob",
    job_uid: str | None = None,
    on_event: Callable[[RankEvent], None] | None = None,
    on_iteration: IterationCallback | None = None,
    verify_weights: bool = False,
    inject_oom: OOMInjection | None = None,
    threads_per_rank: int = 1,
    collective_timeout_seconds: float = 600.0,
    grace_seconds: float = GRACE_SECONDS,
    placement_timeout_seconds: float = PLACEMENT_TIMEOUT_SECONDS,
) -> RayRun:
    """Run the job on the connected Ray cluster (ray.init first): spec.world_size ranks.

    `on_event` sees each rank event as it arrives (the same hook as run_local's, so a
    publish.PublishingListener fits); `on_iteration(report, status)` runs once every rank
    finished an iteration (where the status publisher writes the RLJob status). Returns when
    every rank ended; after a failure the others get `grace_seconds` before they are killed.
    """
    world = spec.world_size
    gpu = spec.resources.gpus_per_worker > 0
    run = RayRun(
        world_size=world,
        device="cuda" if gpu else "cpu",
        # wakeUp Auto: staged until rank 0's plan says what it chose (take() below).
        wake_up=WakeUp.STAGED if spec.rollout.wake_up == AUTO else WakeUp(spec.rollout.wake_up),
        last_iteration=spec.algorithm.iterations,
        checkpoint_every=spec.checkpoint.every_iterations if spec.checkpoint is not None else 0,
        metrics_log=MetricsLog.of(spec),
    )
    group = placement_group(_bundles(spec), strategy="PACK", name=f"{job}-ranks")
    # The queue's actor takes no CPU (every CPU of the cluster may be in the ranks' bundles)
    # and lives on the driver's node: anywhere else (Ray places a 0-CPU actor on any node) it
    # would go with a lost worker pod, and the events of every rank with it.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    events = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
    actors: list[Any] = []
    try:
        try:
            located, init_method = _start_actors(
                spec, job, group, actors, placement_timeout_seconds
            )
        except _NotStarted as error:
            run.setup_error = str(error)
            return run
        for rank, (ip, host) in enumerate(located):
            run.nodes[rank] = f"{host} ({ip})"
        log.info(
            "%s: %d ranks on %s, rendezvous %s",
            job,
            world,
            sorted(set(run.nodes.values())),
            init_method,
        )
        configs = rank_configs(
            ["cuda:0" if gpu else "cpu"] * world,
            [host for _ip, host in located],
            inject_oom=inject_oom,
            verify_weights=verify_weights,
            job=job_uid,
        )
        launch = RankLaunch(
            spec.model_dump_json(), init_method, threads_per_rank, collective_timeout_seconds
        )
        pending = {}
        for rank, (actor, config) in enumerate(zip(actors, configs, strict=True)):
            ref = actor.run.remote(launch, config, events)
            pending[ref] = rank
        _watch(run, events, pending, actors, on_event, on_iteration, grace_seconds)
        return run
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        events.shutdown(force=True)
        remove_placement_group(group)


def _watch(
    run: RayRun,
    events: Queue,
    pending: dict[Any, int],
    actors: list[Any],
    on_event: Callable[[RankEvent], None] | None,
    on_iteration: IterationCallback | None,
    grace_seconds: float,
) -> None:
    """Take events and rank endings as they come until every rank ended or the grace after a
    failure ran out; then end the rest and keep what they sent before."""
    done: dict[int, int] = {}
    deadline: float | None = None

    def take(event: RankEvent) -> None:
        run.add(event)
        if on_event is not None:
            on_event(event)
        if isinstance(event, RankIteration):
            if event.plan is not None:  # the mode the ranks run (Auto's choice)
                run.wake_up = event.plan.wake_up
            done[event.iteration] = done.get(event.iteration, 0) + 1
            if done[event.iteration] == run.world_size and on_iteration is not None:
                reports = run.reports
                report = next(r for r in reports if r.iteration == event.iteration)
                on_iteration(report, run.status())

    while pending:
        for event in _drain(events, POLL_SECONDS, run):
            take(event)
            if isinstance(event, OOMRecord) and deadline is None:
                deadline = time.monotonic() + grace_seconds
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                ray.get(ref)
                continue
            except RayTaskError as error:
                run.fail(rank, "raised", str(error))
            except RayError as error:  # the actor died: killed, its node or worker lost, OOM
                run.fail(rank, "died", str(error))
            log.error(
                "rank %d (node %s) ended the job: %s",
                rank,
                run.nodes.get(rank),
                headline(run.errors[rank]),
            )
            if deadline is None:
                deadline = time.monotonic() + grace_seconds
        if deadline is not None and pending and time.monotonic() > deadline:
            break
    for rank in sorted(pending.values()):
        log.warning("ending rank %d: another rank failed", rank)
        run.fail(rank, "ended", "ended by the driver after another rank failed")
        ray.kill(actors[rank], no_restart=True)
    # What the ranks put before they ended is still in the queue: keep it.
    try:
        waiting = events.qsize()
        while waiting:
            for event in events.get_nowait_batch(waiting):
                take(event)
            waiting = events.qsize()
    except RayError as error:  # the queue's actor is gone: what it held is too
        log.error("the ranks' last events are lost with their queue: %s", headline(str(error)))
        run.events_lost = run.events_lost or headline(plain(str(error)))
