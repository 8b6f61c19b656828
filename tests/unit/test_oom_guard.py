"""The Ray containers' OOM guard: reading the cgroup's OOM-kill count, and when it fires.

Ending a real container on a real kernel OOM kill is the e2e layer's
(tests/e2e/test_kind.py::test_worker_oomkilled_appears_in_status_and_as_warning_within_5s).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rljob_worker.oom_guard import (
    cgroup_pids,
    end_container,
    guarded_cgroup,
    memory_cgroup,
    memory_limit,
    oom_kills,
    watch,
)

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


def test_the_memory_cgroup_is_where_the_counter_is(tmp_path: Path) -> None:
    assert memory_cgroup(tmp_path) is None
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill 0\n")
    assert memory_cgroup(tmp_path) == tmp_path / "memory"
    (tmp_path / "memory.events").write_text("oom_kill 0\n")
    assert memory_cgroup(tmp_path) == tmp_path


def _gone(proc: subprocess.Popen[bytes], seconds: float = 5.0) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_ending_the_container_kills_the_cgroups_processes_and_no_other(tmp_path: Path) -> None:
    """Real processes: two listed in the cgroup (one in a nested cgroup) are SIGKILLed; one that
    is not listed, this process and init are spared, as on a node with hostPID."""
    inside = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    outside = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "memory.events").write_text("oom_kill 1\n")
        (tmp_path / "cgroup.procs").write_text(f"1\n{os.getpid()}\n{inside[0].pid}\n")
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "cgroup.procs").write_text(f"{inside[1].pid}\n")
        assert cgroup_pids(tmp_path) == {1, os.getpid(), inside[0].pid, inside[1].pid}

        assert sorted(end_container(tmp_path)) == sorted(p.pid for p in inside)
        assert all(_gone(p) for p in inside)
        assert all(p.returncode == -9 for p in inside)
        time.sleep(0.2)
        assert outside.poll() is None
    finally:
        for proc in [*inside, outside]:
            proc.kill()
            proc.wait()


def test_a_process_gone_before_its_signal_is_skipped(tmp_path: Path) -> None:
    done = subprocess.Popen(["true"])
    done.wait()
    (tmp_path / "cgroup.procs").write_text(f"{done.pid}\n")
    assert end_container(tmp_path, rounds=1) == []


def test_only_the_containers_own_cgroup_is_guarded(tmp_path: Path) -> None:
    """A container's memory cgroup lists the guard itself; a host's root memory cgroup (a run by
    hand on a cgroup v1 host, a privileged container) holds it only somewhere below: off."""
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill 0\n")
    (tmp_path / "memory" / "cgroup.procs").write_text("1\n7\n")
    (tmp_path / "memory" / "user.slice").mkdir()
    (tmp_path / "memory" / "user.slice" / "cgroup.procs").write_text("4242\n")
    cgroup, why_not = guarded_cgroup(tmp_path, pid=4242)
    assert cgroup is None and "not this container's own memory cgroup" in why_not
    assert guarded_cgroup(tmp_path, pid=7) == (tmp_path / "memory", "")
    assert guarded_cgroup(tmp_path / "nothing", pid=7)[0] is None
