"""The operator's Prometheus metrics: RLJobs by phase, per job and stage the peak memory, OOMs by
kind (and by stage for the entries status keeps), reconcile durations and errors.

Job metrics mirror the RLJobs' status as last seen (a custom collector over a snapshot table), so
a scrape always matches status and a deleted job's series vanish with it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

from prometheus_client import Counter, Histogram
from prometheus_client.core import REGISTRY, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from rljob.api import Phase

P = ParamSpec("P")
R = TypeVar("R")

RECONCILE_SECONDS = Histogram(
    "rljob_reconcile_duration_seconds",
    "Time spent in one operator handler call.",
    ["handler"],
)
RECONCILE_ERRORS = Counter(
    "rljob_reconcile_errors",
    "Operator handler calls that raised (kopf retries temporary errors).",
    ["handler"],
)


def timed(handler: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a handler: its duration into rljob_reconcile_duration_seconds, a raise into
    rljob_reconcile_errors_total (then re-raised for kopf to retry or stop)."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except BaseException:
                RECONCILE_ERRORS.labels(handler).inc()
                raise
            finally:
                RECONCILE_SECONDS.labels(handler).observe(time.perf_counter() - start)

        return run

    return wrap


def job_families(statuses: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[Metric]:
    """The job metric families for a table of (namespace, name) -> status. Pure."""
    jobs = GaugeMetricFamily("rljob_jobs", "RLJobs by status.phase.", labels=["phase"])
    iteration = GaugeMetricFamily(
        "rljob_iteration", "status.iteration of each RLJob.", labels=["namespace", "job"]
    )
    peak_bytes = GaugeMetricFamily(
        "rljob_stage_peak_bytes",
        "Worst rank's peak memory per stage in the latest iteration (status.memory).",
        labels=["namespace", "job", "stage", "kind", "device"],
    )
    fraction = GaugeMetricFamily(
        "rljob_stage_peak_fraction",
        "Worst rank's peak memory over device capacity per stage (status.memory).",
        labels=["namespace", "job", "stage"],
    )
    capacity = GaugeMetricFamily(
        "rljob_memory_capacity_bytes",
        "Device capacity the fractions are of (status.memory.capacityBytes).",
        labels=["namespace", "job", "kind", "device"],
    )
    ooms = GaugeMetricFamily(
        "rljob_ooms",
        "Every OOM seen, by kind (status.oomCounts).",
        labels=["namespace", "job", "kind"],
    )
    recent = GaugeMetricFamily(
        "rljob_recent_ooms",
        "OOMs in the entries status.oomEvents keeps, by kind and stage ('' when unknown).",
        labels=["namespace", "job", "kind", "stage"],
    )
    phases: Tally[str] = Tally({p.value: 0 for p in Phase})
    for (namespace, name), status in sorted(statuses.items()):
        phases[str(status.get("phase") or "Unknown")] += 1
        if status.get("iteration") is not None:
            iteration.add_metric([namespace, name], float(status["iteration"]))
        memory = status.get("memory") or {}
        kind, device = str(memory.get("kind", "")), str(memory.get("device", ""))
        if memory:
            capacity.add_metric([namespace, name, kind, device], float(memory["capacityBytes"]))
        for stage in memory.get("stages") or []:
            labels = [namespace, name, str(stage["name"])]
            peak_bytes.add_metric([*labels, kind, device], float(stage["peakBytes"]))
            fraction.add_metric(labels, float(stage["peakFraction"]))
        for oom_kind, count in sorted((status.get("oomCounts") or {}).items()):
            ooms.add_metric([namespace, name, oom_kind], float(count))
        by_stage: Tally[tuple[str, str]] = Tally()
        for entry in status.get("oomEvents") or []:
            by_stage[(str(entry["kind"]), str(entry.get("stage") or ""))] += int(
                entry.get("count") or 1
            )
        for (oom_kind, stage_name), count in sorted(by_stage.items()):
            recent.add_metric([namespace, name, oom_kind, stage_name], float(count))
    for phase, count in sorted(phases.items()):
        jobs.add_metric([phase], float(count))
    return [jobs, iteration, peak_bytes, fraction, capacity, ooms, recent]


class JobTable(Collector):
    """The latest status of every RLJob the operator saw, collected at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._statuses: dict[tuple[str, str], dict[str, Any]] = {}

    def observe(self, namespace: str, name: str, status: Mapping[str, Any] | None) -> None:
        with self._lock:
            self._statuses[(namespace, name)] = dict(status or {})

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._statuses.pop((namespace, name), None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = dict(self._statuses)
        yield from job_families(snapshot)


JOBS = JobTable()


def register(registry: CollectorRegistry = REGISTRY) -> None:
    """Add the job table to the registry that start_http_server serves (once per process)."""
    registry.register(JOBS)
