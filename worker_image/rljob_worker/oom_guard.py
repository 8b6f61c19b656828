"""The Ray containers' OOM guard: a kernel OOM kill inside the container ends the container.

When a Ray container reaches its memory limit, the kernel kills the process it scores worst,
and Ray scores its workers worst (oom_score_adj 1000): a rank dies, `ray start` lives on, the
container never exits, and the kubelet never reports OOMKilled. The job then fails as "the actor
died unexpectedly", and KubeRay deletes the pods: an OOM nobody sees. cgroup v2 nodes whose
kubelet sets memory.oom.group kill the whole container instead; this guard does the same on
every node. It polls the container's cgroup OOM-kill counter (v2 memory.events, v1
memory.oom_control) and, when it grows, says so on the container's log and kills every process
of that cgroup (its cgroup.procs, nested cgroups included), so `ray start --block` ends and the
container with it. It never signals a process outside that cgroup (a pod with hostPID cannot
take the node's processes with it), and it guards only a cgroup it sits in itself, so on a
host, or in a privileged container that sees the host's root cgroup, it stays off. The
container runtime, which saw the cgroup's OOM event, reports the container as OOMKilled, and
the operator takes it from there (pod, container, limit). render.py starts it in the
background before KubeRay's `ray start`.

    python -m rljob_worker.oom_guard     # watch until an OOM kill, then end the container
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
POLL_SECONDS = 0.5


def memory_cgroup(root: Path = CGROUP) -> Path | None:
    """The container's memory cgroup directory: cgroup v2's unified one, or v1's memory one."""
    for path in (root, root / "memory"):
        if (path / "memory.events").is_file() or (path / "memory.oom_control").is_file():
            return path
    return None


def oom_kills(root: Path = CGROUP) -> int | None:
    """The container cgroup's count of OOM kills, or None where this kernel keeps none."""
    for path in (root / "memory.events", root / "memory" / "memory.oom_control"):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def memory_limit(root: Path = CGROUP) -> int | None:
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        return int(raw) if raw.isdigit() else None
    return None


def watch(
    read: Callable[[], int | None],
    sleep: Callable[[float], None] = time.sleep,
    interval: float = POLL_SECONDS,
) -> tuple[int, int] | None:
    """Poll `read` until the count grows: (before, after); None when there is no counter."""
    before = read()
    if before is None:
        return None
    while True:
        sleep(interval)
        now = read()
        if now is not None and now > before:
            return before, now


def cgroup_pids(cgroup: Path, nested: bool = True) -> set[int]:
    """Every process in `cgroup` (and, with `nested`, the cgroups below it): cgroup.procs, as
    this PID namespace numbers them."""
    pids: set[int] = set()
    below = cgroup.glob("**/cgroup.procs") if nested else []
    for procs in [cgroup / "cgroup.procs", *below]:
        try:
            text = procs.read_text()
        except OSError:
            continue
        pids.update(int(word) for word in text.split() if word.isdigit())
    return pids


def end_container(cgroup: Path, rounds: int = 3) -> list[int]:
    """SIGKILL every process of the container's cgroup but this one and the namespace's init
    (the raylet goes, so `ray start --block` and with it the container end); a few rounds, for
    what was starting meanwhile. Returns the pids signalled."""
    signalled: list[int] = []
    spare = {os.getpid(), 1}
    for _ in range(rounds):
        left = sorted(cgroup_pids(cgroup) - spare - set(signalled))
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            signalled.append(pid)
        time.sleep(0.1)
    return signalled


def guarded_cgroup(root: Path = CGROUP, pid: int | None = None) -> tuple[Path | None, str]:
    """The memory cgroup to guard, or None and why not. Only a cgroup this process sits in
    itself: a container's own. Run by hand on a host, or in a privileged container that sees
    the host's hierarchy, /sys/fs/cgroup's memory cgroup is the root, which holds the whole
    machine below it and this process only somewhere down there: the guard stays off."""
    cgroup = memory_cgroup(root)
    if cgroup is None:
        return None, "this kernel keeps no cgroup OOM-kill count"
    if (os.getpid() if pid is None else pid) not in cgroup_pids(cgroup, nested=False):
        return None, f"{cgroup} is not this container's own memory cgroup"
    return cgroup, ""


def main() -> int:
    cgroup, why_not = guarded_cgroup()
    seen = watch(oom_kills) if cgroup is not None else None
    if cgroup is None or seen is None:
        print(f"rljob oom-guard: {why_not or 'no OOM-kill count'}; off", file=sys.stderr)
        return 0
    limit = memory_limit()
    print(
        f"rljob oom-guard: the kernel OOM-killed a process in this container (cgroup oom_kill "
        f"{seen[0]} -> {seen[1]}, memory limit {limit} bytes): ending the container so that "
        "Kubernetes reports it as OOMKilled",
        file=sys.stderr,
        flush=True,
    )
    end_container(cgroup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
