"""Unit tests of `kubectl rljob`'s views: the describe tables and the plot, from a status."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from rljob.api import RLJobStatus
from rljob.kubectl_plugin import cause_lines, describe, memory_table, oom_table, plot

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


def test_describe_prints_a_dash_for_an_iteration_not_known() -> None:
    """A job before its first iteration, an OOMKilled entry (no iteration) beside a CUDA OOM
    of iteration 4: `-`, never `None`."""
    status = RLJobStatus.model_validate(
        {
            "phase": "Starting",
            "oomEvents": [
                {"time": "2026-05-09T10:00:00Z", "kind": "CUDAOutOfMemory", "stage": "rollout",
                 "iteration": 4, "rank": 0},
                {"time": "2026-05-09T11:00:00Z", "kind": "OOMKilled", "pod": "w-1",
                 "container": "ray-worker", "limitBytes": 2**30},
            ],
        }
    )  # fmt: skip
    console = Console(record=True, width=200)
    describe("new", status, console)
    text = console.export_text()
    assert "None" not in text
    assert text.startswith("RLJob new: phase Starting, iteration -\n")
    rows = {line.split("│")[2].strip(): line.split("│")[3].strip() for line in _oom_rows(text)}
    assert rows == {"CUDAOutOfMemory": "4", "OOMKilled": "-"}


def _oom_rows(text: str) -> list[str]:
    """The OOM table's body rows (`│ time │ kind │ iteration │ ...`)."""
    return [line for line in text.splitlines() if line.startswith("│ 2026-")]


PLAN = {
    "capacityBytes": 80 * 2**30, "wakeUp": "staged", "memFractionStatic": 0.8, "fits": True,
    "offloadOptimizer": False, "offloadParams": False,
    "stages": [{"name": "train", "peakBytes": 30 * 2**30, "peakFraction": 0.375}],
}  # fmt: skip


def _memory(kind: str) -> dict[str, object]:
    return {
        "iteration": 1, "kind": kind, "device": "cpu" if kind == "host" else "NVIDIA H100",
        "capacityBytes": 64 * 2**30 if kind == "host" else 80 * 2**30,
        "stages": [{"name": "train", "peakBytes": 3 * 2**30, "peakFraction": 0.05,
                    "seconds": 2.0, "rank": 0}],
    }  # fmt: skip


def test_the_plan_is_held_against_gpu_figures_only() -> None:
    """status.plan predicts GPU memory: beside a CPU run's host RSS its error (+900%) says
    nothing, so a host table shows neither the prediction nor an error, and says why."""
    host = RLJobStatus.model_validate({"memory": _memory("host"), "plan": PLAN})
    table = memory_table("cpu-job", host)
    assert table is not None
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    assert "plan error" not in text and "predicted" not in text and "%" not in text
    assert "3.00 GiB" in text and "status.plan predicts GPU memory" in text
    gpu = RLJobStatus.model_validate({"memory": _memory("cuda"), "plan": PLAN})
    console = Console(record=True, width=200)
    console.print(memory_table("gpu-job", gpu))
    text = console.export_text()
    assert "plan error" in text and "+900.0%" in text


def test_a_problem_without_a_message_is_its_type_and_reason_without_trailing_blanks() -> None:
    status = RLJobStatus.model_validate(
        {"conditions": [_condition("Failed", "True", "RayJobFailed", " \n")]}
    )
    assert cause_lines(status) == ["Failed  RayJobFailed"]


@pytest.mark.parametrize(
    ("sizes", "detail"),
    [
        ({"requestedBytes": 2**31, "freeBytes": 2**20}, "requested 2.00 GiB with 1.0 MiB free"),
        ({"requestedBytes": 2**31}, "requested 2.00 GiB"),
        ({"freeBytes": 2**20}, "1.0 MiB free"),
        ({}, "no size given"),  # an sglang process's OOM names neither
        # Below a MiB the figure is KiB or bytes, never "0.0 MiB".
        (
            {"requestedBytes": 3 * 2**20, "freeBytes": 20 * 2**10},
            "requested 3.0 MiB with 20.0 KiB free",
        ),
        ({"freeBytes": 512}, "512 B free"),
        ({"freeBytes": 0}, "0 B free"),
    ],
)
def test_a_cuda_oom_detail_says_the_sizes_it_has(sizes: dict[str, int], detail: str) -> None:
    oom = {"time": "2026-05-09T10:00:00Z", "kind": "CUDAOutOfMemory", "rank": 0, **sizes}
    console = Console(record=True, width=200)
    console.print(oom_table(RLJobStatus.model_validate({"oomEvents": [oom]})))
    (row,) = _oom_rows(console.export_text())
    assert row.split("│")[-2].strip() == detail


def test_describe_prints_the_attempts_the_last_checkpoint_and_where_the_run_resumed() -> None:
    status = RLJobStatus.model_validate(
        {
            "phase": "Running",
            "iteration": 9,
            "checkpoint": {"iteration": 8, "path": "/ckpt/j/iter-8",
                           "completedAt": "2026-05-09T12:00:00Z", "bytes": 3 * 2**30,
                           "seconds": 12.5, "blockedSeconds": 0.4},
            "resumedFrom": {"iteration": 4, "path": "/ckpt/j/iter-4", "attempt": 2},
            "export": {"iteration": 8, "path": "/models/j"},
            "attempts": [
                {"attempt": 1, "rayJob": "j", "memFractionStatic": 0.85, "wakeUp": "single",
                 "result": "CUDAOutOfMemory", "oomStage": "wake_kv_cache", "oomRank": 1,
                 "message": "retrying with wakeUp staged",
                 "startedAt": "2026-05-09T10:00:00Z"},
                {"attempt": 2, "rayJob": "j-a2", "memFractionStatic": 0.85, "wakeUp": "staged",
                 "result": "Running", "changed": "rollout.wakeUp single -> staged",
                 "startedAt": "2026-05-09T11:00:00Z",
                 "resumedFrom": {"iteration": 4, "path": "/ckpt/j/iter-4"}},
            ],
        }
    )  # fmt: skip
    console = Console(record=True, width=250)
    describe("j", status, console)
    text = console.export_text()
    assert (
        "checkpoint: iteration 8 in /ckpt/j/iter-8, completed 2026-05-09T12:00:00Z, 3.00 GiB, "
        "12.5 s (the loop stood still 0.4 s)" in text
    )
    assert "resumed from: iteration 4 in /ckpt/j/iter-4 (attempt 2)" in text
    assert "exported: iteration 8 in /models/j" in text
    rows = [line for line in text.splitlines() if line.startswith(("│ 1 ", "│ 2 "))]
    assert len(rows) == 2, text
    first, second = ([cell.strip() for cell in row.split("│")[1:-1]] for row in rows)
    assert first[:4] == ["1", "j", "2026-05-09T10:00:00Z", "CUDAOutOfMemory"]
    assert "wake_kv_cache rank 1" in first and "retrying with wakeUp staged" in first
    assert second[:4] == ["2", "j-a2", "2026-05-09T11:00:00Z", "Running"]
    assert "rollout.wakeUp single -> staged" in second and "4" in second
    assert "memFractionStatic 0.85, wakeUp staged" in second


def test_describe_without_attempts_or_checkpoints_says_nothing_of_them() -> None:
    console = Console(record=True, width=200)
    describe("plain", STATUS, console)
    text = console.export_text()
    assert "checkpoint" not in text and "resumed" not in text and "attempt" not in text
    assert "exported" not in text
