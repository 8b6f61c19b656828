"""The Ray containers' OOM guard: reading the cgroup's OOM-kill count, and when it fires.

Ending a real container on a real kernel OOM kill is the e2e layer's
(tests/e2e/test_kind.py::test_worker_oomkilled_appears_in_status_and_as_warning_within_5s).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rljob_worker.oom_guard import memory_limit, oom_kills, watch

pytestmark = pytest.mark.unit


def test_cgroup_v2_counts_from_memory_events(tmp_path: Path) -> None:
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\n")
    (tmp_path / "memory.max").write_text("419430400\n")
    assert oom_kills(tmp_path) == 2
    assert memory_limit(tmp_path) == 400 << 20


def test_cgroup_v1_counts_from_memory_oom_control(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
    )
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("419430400\n")
    assert oom_kills(tmp_path) == 1
    assert memory_limit(tmp_path) == 400 << 20


def test_no_counter_and_no_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    assert oom_kills(tmp_path) is None
    assert memory_limit(tmp_path) is None
    assert watch(lambda: oom_kills(tmp_path), sleep=lambda _: None) is None


def test_watch_fires_on_the_first_increase_only(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    counts: Iterator[int] = iter([0, 0, 0, 1])
    polls = []

    def step(seconds: float) -> None:  # the file changes between polls, as the kernel does it
        polls.append(seconds)
        events.write_text(f"oom 0\noom_kill {next(counts)}\n")

    events.write_text("oom 0\noom_kill 0\n")
    assert watch(lambda: oom_kills(tmp_path), sleep=step, interval=0.25) == (0, 1)
    assert polls == [0.25] * 4


def test_a_counter_already_above_zero_is_the_baseline(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("oom_kill 4\n")
    counts = iter([4, 5])

    def step(_: float) -> None:
        events.write_text(f"oom_kill {next(counts)}\n")

    assert watch(lambda: oom_kills(tmp_path), sleep=step) == (4, 5)
