"""Unit tests of the operator's metrics: the families a table of RLJob statuses yields, the
handler timer counting errors, and the text a scrape returns."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rljob_operator.metrics import RECONCILE_ERRORS, JobTable, job_families, timed

STATUS = {
    "phase": "Running",
    "iteration": 3,
    "memory": {
        "iteration": 3, "kind": "cuda", "device": "H100", "capacityBytes": 1000,
        "stages": [
            {"name": "train", "peakBytes": 400, "peakFraction": 0.4, "seconds": 1, "rank": 0},
            {"name": "wake_kv_cache", "peakBytes": 950, "peakFraction": 0.95, "seconds": 1,
             "rank": 1},
        ],
    },
    "oomCounts": {"CUDAOutOfMemory": 2, "OOMKilled": 30},
    "oomEvents": [
        {"id": "a", "time": "t", "kind": "CUDAOutOfMemory", "stage": "rollout"},
        {"id": "b", "time": "t", "kind": "CUDAOutOfMemory", "stage": "rollout"},
        {"id": "c", "time": "t", "kind": "OOMKilled", "count": 4},
    ],
}  # fmt: skip


def samples(statuses: dict[tuple[str, str], dict[str, object]]) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in job_families(statuses):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_job_metrics_mirror_status() -> None:
    got = samples({("ns", "a"): STATUS, ("ns", "b"): {"phase": "Succeeded"}})
    assert got[("rljob_jobs", (("phase", "Running"),))] == 1
    assert got[("rljob_jobs", (("phase", "Succeeded"),))] == 1
    assert got[("rljob_jobs", (("phase", "Failed"),))] == 0
    job = (("job", "a"), ("namespace", "ns"))
    assert got[("rljob_iteration", job)] == 3
    kv = tuple(sorted((*job, ("stage", "wake_kv_cache"))))
    assert got[("rljob_stage_peak_fraction", kv)] == 0.95
    assert got[("rljob_stage_peak_bytes", tuple(sorted((*kv, ("kind", "cuda"),
                                                          ("device", "H100")))))] == 950  # fmt: skip
    assert got[("rljob_ooms", tuple(sorted((*job, ("kind", "OOMKilled")))))] == 30
    recent = tuple(sorted((*job, ("kind", "CUDAOutOfMemory"), ("stage", "rollout"))))
    assert got[("rljob_recent_ooms", recent)] == 2
    killed = tuple(sorted((*job, ("kind", "OOMKilled"), ("stage", ""))))
    assert got[("rljob_recent_ooms", killed)] == 4


def test_forgotten_job_leaves_no_series_and_scrape_parses() -> None:
    table, registry = JobTable(), CollectorRegistry()
    registry.register(table)
    table.observe("ns", "a", STATUS)
    table.forget("ns", "a")
    table.observe("ns", "b", {"phase": "Pending"})
    text = generate_latest(registry).decode()
    names = {s.labels.get("job") for f in text_string_to_metric_families(text) for s in f.samples}
    assert "a" not in names and "b" not in names  # phase counts carry no job label
    assert 'rljob_jobs{phase="Pending"} 1.0' in text


def test_timed_handler_counts_errors_and_reraises() -> None:
    @timed("unit-test")
    def broken() -> None:
        raise RuntimeError("boom")

    before = RECONCILE_ERRORS.labels("unit-test")._value.get()
    with pytest.raises(RuntimeError):
        broken()
    assert RECONCILE_ERRORS.labels("unit-test")._value.get() == before + 1
