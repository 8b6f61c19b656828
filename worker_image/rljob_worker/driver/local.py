"""The local driver: one process per rank on this machine (CPU on gloo, GPUs on NCCL).

Ranks rendezvous on loopback and stream every event to this process as it happens, so a rank
that fails or is stopped loses nothing it already measured; a failed run never hangs.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob.api import CheckpointFailure, ResumePoint, RLJobSpec, RLJobStatus
from rljob.report import IterationReport, OOMRecord, StageSample
from rljob_worker.checkpoint import ModelExported, SavedCheckpoint
from rljob_worker.driver import driver_status, iteration_reports
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

# After one rank failed, how long the others get to stop on their own before they are ended
# (they may be blocked in a collective that will never complete).
GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class _Exit:
    rank: int
    error: str | None


@dataclass
class LocalRun:
    """Everything the ranks reported, aggregated."""

    world_size: int
    device: str
    samples: list[StageSample] = field(default_factory=list)
    iterations: list[RankIteration] = field(default_factory=list)
    ooms: list[OOMRecord] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    checkpoint_failures: list[CheckpointFailure] = field(default_factory=list)
    # Checkpoints completed in an iteration whose report never came (it failed).
    checkpoints: list[SavedCheckpoint] = field(default_factory=list)
    exports: list[ModelExported] = field(default_factory=list)  # the same, for an export
    # <checkpoint.path>/metrics.jsonl, written as each iteration finishes on every rank.
    metrics_log: MetricsLog | None = None

    @property
    def ok(self) -> bool:
        return not self.ooms and not self.errors

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint's iteration this run continued from (None: it started at 0)."""
        return next((i.resumed_from for i in self.iterations if i.resumed_from is not None), None)

    @property
    def resume_point(self) -> ResumePoint | None:
        """The checkpoint (iteration, directory) this run continued from."""
        return next((i.resume_point for i in self.iterations if i.resume_point), None)

    @property
    def reports(self) -> list[IterationReport]:
        return iteration_reports(self.samples, self.iterations)

    def status(self, earlier_ooms: Sequence[OOMRecord] = ()) -> RLJobStatus:
        """The driver's status fields; `earlier_ooms` (earlier attempts' OOMs, when `rljob run`
        retries) stay in oomEvents and oomCounts, as the cluster's status keeps them."""
        return driver_status(
            self.reports, self.iterations, [*earlier_ooms, *self.ooms], self.world_size,
            self.checkpoint_failures, self.checkpoints, self.exports,
        )  # fmt: skip

    def add(self, event: RankEvent) -> bool:
        """Take one rank's event; True where it completed an iteration on every rank."""
        if isinstance(event, StageSample):
            self.samples.append(event)
        elif isinstance(event, RankIteration):
            self.iterations.append(event)
            done = sum(1 for i in self.iterations if i.iteration == event.iteration)
            if done < self.world_size:
                return False
            if self.metrics_log is not None:
                report = next(r for r in self.reports if r.iteration == event.iteration)
                self.metrics_log.record(report, self.resumed_from)
            return True
        elif isinstance(event, OOMRecord):
            self.ooms.append(event)
        elif isinstance(event, CheckpointFailure):
            self.checkpoint_failures.append(event)
        elif isinstance(event, SavedCheckpoint):
            self.checkpoints.append(event)
        elif isinstance(event, ModelExported):
            self.exports.append(event)
        return False


def _rank_main(launch: RankLaunch, config: RankConfig, events: Any) -> None:
    """Entry point of one rank's process."""
    quiet_environment()
    run_in_process_group(
        launch, config, events.put, report_exit=lambda error: events.put(_Exit(config.rank, error))
    )


def _end_ranks(
    processes: list[Any], exited: set[int], run: LocalRun, grace_seconds: float, why: str
) -> None:
    """SIGTERM every rank still running that has not said goodbye, wait `grace_seconds` for
    each, then SIGKILL what is left: no rank outlives the driver."""
    for rank, process in enumerate(processes):
        if rank not in exited and process.is_alive():
            log.warning("ending rank %d (pid %d): %s", rank, process.pid, why)
            run.errors.setdefault(rank, why)
            process.terminate()
    for rank, process in enumerate(processes):
        process.join(timeout=grace_seconds)
        if process.is_alive():
            log.warning("killing rank %d (pid %d): alive %.0f s after SIGTERM", rank,
                        process.pid, grace_seconds)  # fmt: skip
            process.kill()
            process.join(timeout=10)


def run_local(
    spec: RLJobSpec,
    ranks: int,
    device: str = "cpu",
    *,
    on_event: Callable[[RankEvent], None] | None = None,
    verify_weights: bool = False,
    inject_oom: OOMInjection | None = None,
    threads_per_rank: int = 1,
    collective_timeout_seconds: float = 600.0,
    grace_seconds: float = GRACE_SECONDS,
    job: str | None = None,
) -> LocalRun:
    """Run the job with `ranks` processes on this machine; `device` is 'cpu' or 'cuda'.

    On CUDA rank r uses cuda:r. Returns when every rank exited; `on_event` sees each event
    as it arrives (progress bars).
    """
    # Build a builtin model once, here, before any rank joins a process group: transformers'
    # save_pretrained writes only on process-group rank 0 once torch.distributed is initialised.
    from rljob_worker.model import resolve_model_path

    resolve_model_path(spec.model.path)
    context = mp.get_context("spawn")
    events = context.Queue()
    launch = RankLaunch(
        spec.model_dump_json(),
        f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
        threads_per_rank,
        collective_timeout_seconds,
    )
    configs = rank_configs(
        [f"cuda:{rank}" if device == "cuda" else "cpu" for rank in range(ranks)],
        [socket.gethostname()] * ranks,
        inject_oom=inject_oom,
        verify_weights=verify_weights,
        job=job,
    )
    processes = []
    for rank, config in enumerate(configs):
        process = context.Process(
            target=_rank_main,
            args=(launch, config, events),
            name=f"rljob-rank-{rank}",
        )
        process.start()
        processes.append(process)

    run = LocalRun(world_size=ranks, device=device, metrics_log=MetricsLog.of(spec))
    exited: set[int] = set()
    deadline: float | None = None
    try:
        while len(exited) < ranks:
            try:
                event = events.get(timeout=0.5)
            except queue.Empty:
                dead = [p for r, p in enumerate(processes) if r not in exited and not p.is_alive()]
                if dead and deadline is None:
                    # A rank died without saying goodbye (killed, segfault): the rest may hang.
                    for p in dead:
                        rank = processes.index(p)
                        run.errors[rank] = (
                            f"rank {rank} exited with code {p.exitcode} without a report"
                        )
                        exited.add(rank)
                    deadline = time.monotonic() + grace_seconds
                if deadline is not None and time.monotonic() > deadline:
                    break
                continue
            if isinstance(event, _Exit):
                exited.add(event.rank)
                if event.error is not None:
                    run.errors[event.rank] = event.error
                if (event.error is not None or run.ooms) and deadline is None:
                    deadline = time.monotonic() + grace_seconds
                continue
            run.add(event)
            if on_event is not None:
                on_event(event)
    except BaseException:
        # Interrupted (Ctrl-C) or an on_event that raised: no rank may outlive the driver (one
        # waiting in a collective would hold its GPU, and exit would wait on it).
        _end_ranks(processes, exited, run, grace_seconds, "ended by the driver: it stopped")
        raise
    _end_ranks(
        processes, exited, run, grace_seconds, "ended by the driver after another rank failed"
    )
    # Events a rank sent before it was ended are still in the queue: keep them.
    while True:
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            break
        if not isinstance(event, _Exit):
            run.add(event)
    return run
