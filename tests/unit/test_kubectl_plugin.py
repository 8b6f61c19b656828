"""Unit tests of `kubectl rljob`'s views: the describe tables and the plot, from a status."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from rljob.api import RLJobStatus
from rljob.kubectl_plugin import describe, plot

STATUS = RLJobStatus.model_validate(
    {
        "phase": "Running",
        "iteration": 2,
        "memory": {
            "iteration": 2, "kind": "cuda", "device": "NVIDIA H100 80GB HBM3",
            "capacityBytes": 80 * 2**30,
            "stages": [
                {"name": "train", "peakBytes": 40 * 2**30, "peakFraction": 0.5, "seconds": 1.5,
                 "rank": 3},
                {"name": "wake_kv_cache", "peakBytes": 76 * 2**30, "peakFraction": 0.95,
                 "seconds": 0.2, "rank": 6},
            ],
        },
        "memoryHistory": [
            {"iteration": i, "peakBytes": {"train": (40 + i) * 2**30, "rollout": 70 * 2**30}}
            for i in range(3)
        ],
        "oomEvents": [
            {"time": "2026-05-09T10:00:00Z", "kind": "CUDAOutOfMemory", "stage": "rollout",
             "rank": 5, "requestedBytes": 2**31, "freeBytes": 2**20},
            {"time": "2026-05-09T11:00:00Z", "kind": "OOMKilled", "pod": "w-1",
             "container": "ray-worker", "limitBytes": 64 * 2**30, "count": 3},
        ],
        "oomCounts": {"CUDAOutOfMemory": 1, "OOMKilled": 3},
    }
)  # fmt: skip


def test_describe_prints_worst_rank_per_stage_and_the_oom_history() -> None:
    console = Console(record=True, width=200)
    describe("big", STATUS, console)
    text = console.export_text()
    assert "NVIDIA H100 80GB HBM3" in text and "capacity 80.00 GiB" in text
    assert "wake_kv_cache" in text and "76.00 GiB" in text and "0.950" in text
    assert "OOMKilled 3" in text and "w-1/ray-worker" in text and "3 kill(s)" in text
    assert "requested 2.00 GiB" in text


def test_plot_draws_memory_history_to_a_png(tmp_path: Path) -> None:
    out = tmp_path / "memory.png"
    plot("big", STATUS, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_without_history_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no status\.memoryHistory"):
        plot("new", RLJobStatus(), tmp_path / "x.png")


def _condition(ctype: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {
        "type": ctype, "status": status, "reason": reason, "message": message,
        "lastTransitionTime": "2026-05-09T10:00:00Z",
    }  # fmt: skip


def test_describe_prints_the_causes_first_one_line_each() -> None:
    long = "pod/big-head container ray-head: Back-off pulling image " + "x" * 300
    status = RLJobStatus.model_validate(
        {
            "phase": "Failed",
            "conditions": [
                _condition("Created", "True", "RayJobCreated", "RayJob big created"),
                _condition("PodsReady", "False", "ImagePullBackOff", long),
                _condition("Failed", "True", "StartupTimeout", "not running after 900s;\nlast"),
                _condition("SpecApplied", "True", "Applied", ""),
            ],
        }
    )
    console = Console(record=True, width=80)
    describe("big", status, console)
    lines = console.export_text().splitlines()
    assert lines[0] == "Failed  StartupTimeout  not running after 900s; last"
    assert (
        lines[1].startswith("PodsReady  ImagePullBackOff  pod/big-head") and "x" * 300 in lines[1]
    )
    assert lines[2].startswith("RLJob big: phase Failed")


def test_describe_of_a_healthy_job_starts_with_its_phase() -> None:
    pending = _condition("PodsReady", "False", "PodsPending", "the Ray cluster is starting")
    status = RLJobStatus.model_validate({"phase": "Starting", "conditions": [pending]})
    console = Console(record=True, width=200)
    describe("ok", status, console)
    assert console.export_text().startswith("RLJob ok: phase Starting")
