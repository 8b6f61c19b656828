"""The Ray driver's outcome when Ray itself fails: a rank's actor lost in a way that is neither
its own exception nor an actor death (Ray's memory monitor, a node), the ranks' event queue
lost, and run_ray raising. The driver must still name a failure and exit 1 (ray_main's quick
exit after its last line is what lets KubeRay retry); with `ray` stood in for (no cluster)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from ray.exceptions import OutOfMemoryError, RayActorError
from ray.util.queue import Empty

from rljob.api import driver_failure, parse_manifest
from rljob_worker.driver import ray_driver, ray_main
from rljob_worker.driver.ray_driver import RayRun, _watch

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


class _Queue:
    """ray.util.queue.Queue stand-in: a list, or an error on every get (its actor gone)."""

    def __init__(self, items: list[Any] | None = None, error: Exception | None = None) -> None:
        self.items, self.error = list(items or []), error

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        if not self.items:
            raise Empty
        return self.items.pop(0)

    def qsize(self) -> int:
        if self.error is not None:
            raise self.error
        return len(self.items)

    def get_nowait_batch(self, n: int) -> list[Any]:
        out, self.items = self.items[:n], self.items[n:]
        return out


def _ranks_end(monkeypatch: pytest.MonkeyPatch, outcomes: dict[str, Exception | None]) -> None:
    """Every rank's ref is ready at the first poll, with `outcomes[ref]` raised from ray.get."""

    def get(ref: str) -> None:
        if outcomes[ref] is not None:
            raise outcomes[ref]  # type: ignore[misc]

    fake = SimpleNamespace(
        wait=lambda refs, num_returns, timeout: (list(refs), []), get=get, kill=lambda *a, **k: None
    )
    monkeypatch.setattr(ray_driver, "ray", fake)


def _run() -> RayRun:
    return RayRun(world_size=2, device="cpu", last_iteration=3, nodes={0: "a", 1: "b"})


def test_a_rank_ray_killed_for_host_memory_is_a_death_not_an_escape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ray's memory monitor: OutOfMemoryError, a RayError that is neither RayActorError nor
    # RayTaskError. It escaped _watch, run_ray and main before: no outcome recorded at all.
    _ranks_end(monkeypatch, {"ref0": None, "ref1": OutOfMemoryError("node low on memory")})
    run = _run()
    _watch(run, _Queue(), {"ref0": 0, "ref1": 1}, [None, None], None, None, 10.0)  # type: ignore[arg-type]
    assert [(f.rank, f.how) for f in run.failures] == [(1, "died")]
    assert not run.ok and run.reason is not None and "rank 1" in run.reason


def test_a_lost_event_queue_fails_the_run_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both ranks returned, but what they reported went with the queue's actor: not a success.
    _ranks_end(monkeypatch, {"ref0": None, "ref1": None})
    run = _run()
    lost = _Queue(error=RayActorError(error_msg="The actor died: its node was lost"))
    _watch(run, lost, {"ref0": 0, "ref1": 1}, [None, None], None, None, 10.0)  # type: ignore[arg-type]
    assert not run.ok
    assert run.reason is not None and "event queue was lost" in run.reason, run.reason


def _driver_config(tmp_path: Path) -> tuple[str, Path]:
    """The driver's --config for examples/tiny-local.yaml: the job's name and the file."""
    name, spec = parse_manifest(yaml.safe_load((REPO / "examples/tiny-local.yaml").read_text()))
    config = tmp_path / "job.yaml"
    dumped = spec.model_dump(mode="json", by_alias=True)
    config.write_text(yaml.safe_dump({"name": name, "namespace": "ns", "spec": dumped}))
    return name, config


def test_run_ray_raising_is_a_failed_job_with_a_last_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    name, config = _driver_config(tmp_path)
    monkeypatch.setattr(ray, "init", lambda **_: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)

    def boom(*_a: Any, **_k: Any) -> None:
        raise RayActorError(error_msg="queue actor died")

    monkeypatch.setattr(ray_driver, "run_ray", boom)
    assert ray_main.main(["--config", str(config), "--no-publish"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"rljob driver: RLJob {name} failed: the driver: ") and "queue" in last
    # The operator's Failed message is this line's why (KubeRay's message ends with the line).
    why = driver_failure(f"Job entrypoint command failed with exit code 1:\n{last}\n")
    assert why is not None and why.startswith("the driver: RayActorError: ")


def test_no_ray_cluster_is_a_failed_job_with_a_last_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    name, config = _driver_config(tmp_path)

    def refused(**_: Any) -> None:
        raise ConnectionError("Could not find any running Ray instance")

    monkeypatch.setattr(ray, "init", refused)
    assert ray_main.main(["--config", str(config), "--no-publish", "--address", "auto"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"rljob driver: RLJob {name} failed: no Ray cluster at auto: ")
    why = driver_failure(f"Job entrypoint command failed with exit code 1:\n{last}\n")
    assert why == "no Ray cluster at auto: Could not find any running Ray instance", last


# What rank 0's all_reduce raised when its gloo peer's process exited (torch 2.14, seen here).
GLOO_ECHO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read "
    "error [127.0.0.1]:59548: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application."
)
CAUSE = "RewardError: spec.reward.function /data/r.py:score failed on row 12: KeyError: 'x'"


@pytest.mark.parametrize(
    ("failures", "blamed"),
    [
        # One poll takes both, rank 0 first: the echo yields to the rank that raised the cause.
        ([(0, "raised", GLOO_ECHO, 100.0), (1, "raised", CAUSE, 100.0)], "rank 1"),
        ([(1, "raised", CAUSE, 100.0), (0, "raised", GLOO_ECHO, 100.0)], "rank 1"),
        # A cause seen long after the echo is another failure: the first stands.
        ([(0, "raised", GLOO_ECHO, 100.0), (1, "raised", CAUSE, 300.0)], "rank 0"),
        # Only echoes: the first of them (nothing better to name).
        ([(0, "raised", GLOO_ECHO, 100.0), (1, "raised", GLOO_ECHO, 100.0)], "rank 0"),
        # A rank that died is the cause whatever the others raised.
        ([(1, "raised", CAUSE, 100.0), (0, "died", "actor died", 101.0)], "rank 0"),
    ],
)
def test_a_collective_echo_yields_to_the_rank_that_raised_the_cause(
    failures: list[tuple[int, str, str, float]], blamed: str
) -> None:
    from rljob.api import WakeUp
    from rljob_worker.driver.failure import RankFailure, failure_reason

    ranks = [RankFailure(r, f"node-{r}", how, error, t) for r, how, error, t in failures]  # type: ignore[arg-type]
    reason = failure_reason([], ranks, [], WakeUp.STAGED, 3, {})
    assert reason is not None and reason.startswith(blamed + " "), reason
