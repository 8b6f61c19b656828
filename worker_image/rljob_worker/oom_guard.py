"""The Ray containers' OOM guard: a kernel OOM kill inside the container ends the container.

When a Ray container reaches its memory limit, the kernel kills the process it scores worst,
and Ray scores its workers worst (oom_score_adj 1000): a rank dies, `ray start` lives on, the
container never exits, and the kubelet never reports OOMKilled. The job then fails as "the actor
died unexpectedly", and KubeRay deletes the pods: an OOM nobody sees. cgroup v2 nodes whose
kubelet sets memory.oom.group kill the whole container instead; this guard does the same on
every node. It polls the container's cgroup OOM-kill counter (v2 memory.events, v1
memory.oom_control) and, when it grows, says so on the container's log and kills every process
it can, so `ray start --block` ends; the container runtime, which saw the cgroup's OOM event,
reports the container as OOMKilled, and the operator takes it from there (pod, container,
limit). render.py starts it in the background before KubeRay's `ray start`.

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


def end_container() -> None:
    """SIGKILL every process this one may signal (all but itself and the namespace's init):
    the raylet goes, so `ray start --block` and with it the container end."""
    os.kill(-1, signal.SIGKILL)


def main() -> int:
    seen = watch(oom_kills)
    if seen is None:
        print("rljob oom-guard: this kernel keeps no cgroup OOM-kill count; off", file=sys.stderr)
        return 0
    limit = memory_limit()
    print(
        f"rljob oom-guard: the kernel OOM-killed a process in this container (cgroup oom_kill "
        f"{seen[0]} -> {seen[1]}, memory limit {limit} bytes): ending the container so that "
        "Kubernetes reports it as OOMKilled",
        file=sys.stderr,
        flush=True,
    )
    end_container()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
