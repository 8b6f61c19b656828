"""The Ray driver on a Ray local cluster (2 CPUs): 2 rank actors run the tiny example for real.

Compared with the local driver on the same spec; a rank killed mid-stage ends the job, named;
and the RayJob the operator renders starts this driver with the ConfigMap it renders.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import yaml

from rljob.api import JOB_CONFIG_DIR, JOB_CONFIG_FILE, JobConfig, RLJobSpec, WakeUp, parse_manifest
from rljob.report import IterationReport, Stage, StageSample
from rljob_operator.render import Owner, config_map, config_map_name, ray_job
from rljob_worker.driver.failure import position_at_failure
from rljob_worker.driver.local import LocalRun, run_local
from rljob_worker.driver.ray_driver import RayRun, rank_actor_name, run_ray
from rljob_worker.driver.ray_main import _parser, main
from rljob_worker.loop import RankIteration
from rljob_worker.memory import OOMInjection
from rljob_worker.model import resolve_model_path
from rljob_worker.stages import stage_order

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-local.yaml"
RANKS = 2


def _example() -> tuple[str, RLJobSpec]:
    return parse_manifest(yaml.safe_load(EXAMPLE.read_text()))


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray local cluster with 2 CPUs (one per rank bundle), shut down even when a test fails.

    The model cache is built first and its path set before ray.init, so the Ray workers (which
    inherit this environment) only load it."""
    root = tmp_path_factory.mktemp("rljob-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLJOB_CACHE_DIR", str(root))
        resolve_model_path(_example()[1].model.path)
        context = ray.init(
            num_cpus=RANKS,
            include_dashboard=False,
            object_store_memory=80 * 2**20,
            namespace=f"rljob-test-{uuid.uuid4().hex[:8]}",
            log_to_driver=False,
        )
        try:
            yield str(context.address_info["address"])  # type: ignore[attr-defined]
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def iteration_calls() -> list[tuple[IterationReport, int | None]]:
    return []


@pytest.fixture(scope="module")
def ray_run(ray_address: str, iteration_calls: list[tuple[IterationReport, int | None]]) -> RayRun:
    name, spec = _example()
    return run_ray(
        spec,
        job=name,
        on_iteration=lambda report, status: iteration_calls.append((report, status.iteration)),
    )


@pytest.fixture(scope="module")
def local_run(ray_address: str) -> LocalRun:
    """The local driver on the same spec (after the Ray run; both share the 2 cores)."""
    return run_local(_example()[1], RANKS, "cpu")


def _stages(run: LocalRun, rank: int, iteration: int) -> list[Stage]:
    own = [s for s in run.samples if s.rank == rank and s.iteration == iteration]
    return [s.stage for s in sorted(own, key=lambda s: s.start_seconds)]


def test_ray_driver_runs_the_tiny_example_on_two_actors_for_every_iteration(
    ray_run: RayRun,
) -> None:
    spec = _example()[1]
    assert spec.algorithm.iterations >= 2
    assert ray_run.ok, ray_run.reason
    assert ray_run.reason is None
    assert sorted((i.rank, i.iteration) for i in ray_run.iterations) == [
        (rank, iteration)
        for rank in range(RANKS)
        for iteration in range(spec.algorithm.iterations + 1)
    ]
    for rank in range(RANKS):
        for iteration in range(spec.algorithm.iterations + 1):
            assert _stages(ray_run, rank, iteration) == list(stage_order(WakeUp.STAGED, iteration))
    # Every sample names the node its rank ran on (the host name, in a RayJob the pod).
    assert {s.node for s in ray_run.samples} <= {n.split(" ")[0] for n in ray_run.nodes.values()}
    assert sorted(ray_run.nodes) == list(range(RANKS))


def test_ray_and_local_drivers_give_the_same_stages_and_report_shape(
    ray_run: RayRun, local_run: LocalRun
) -> None:
    assert local_run.ok, local_run.errors
    for rank in range(RANKS):
        for iteration in range(_example()[1].algorithm.iterations + 1):
            assert _stages(ray_run, rank, iteration) == _stages(local_run, rank, iteration)
    ray_reports, local_reports = ray_run.reports, local_run.reports
    assert [r.iteration for r in ray_reports] == [r.iteration for r in local_reports]
    for ours, theirs in zip(ray_reports, local_reports, strict=True):
        assert {(s.rank, s.stage) for s in ours.samples} == {
            (s.rank, s.stage) for s in theirs.samples
        }
        assert (ours.reward_mean is None) == (theirs.reward_mean is None)
        assert (ours.kl_mean is None) == (theirs.kl_mean is None)
    ray_status, local_status = ray_run.status(), local_run.status()
    assert (
        ray_status.model_dump(mode="json", by_alias=True, exclude_none=True).keys()
        == local_status.model_dump(mode="json", by_alias=True, exclude_none=True).keys()
    )
    assert ray_status.iteration == local_status.iteration == _example()[1].algorithm.iterations
    assert ray_status.memory is not None and local_status.memory is not None
    assert [s.name for s in ray_status.memory.stages] == [
        s.name for s in local_status.memory.stages
    ]
    assert ray_status.memory.kind == "host" and ray_status.memory.capacity_bytes > 0
    assert ray_status.oom_events == local_status.oom_events == []


def test_on_iteration_is_called_once_per_iteration_when_every_rank_finished_it(
    ray_run: RayRun, iteration_calls: list[tuple[IterationReport, int | None]]
) -> None:
    iterations = _example()[1].algorithm.iterations
    assert [report.iteration for report, _ in iteration_calls] == list(range(iterations + 1))
    for report, status_iteration in iteration_calls:
        assert status_iteration == report.iteration
        assert {s.rank for s in report.samples} == set(range(RANKS))
        assert report.reward_mean is not None


def test_killing_one_actor_mid_stage_ends_the_job_naming_rank_node_and_stage_within_30s(
    ray_address: str,
) -> None:
    name, spec = _example()
    job = f"{name}-kill"
    killed_at: list[float] = []

    def kill_rank_1_as_it_starts_training_iteration_2(event: object) -> None:
        # Rank 1 just reported iteration 1 done (after its last stage's sample): it is now
        # starting iteration 2's `train`, the longest stage (collectives with rank 0 inside).
        # Not on the sleep stage's sample: the kill then raced the rank's iteration report,
        # and a lost report made status.iteration 0 (CI, 9645290).
        if (
            isinstance(event, RankIteration)
            and (event.rank, event.iteration) == (1, 1)
            and not killed_at
        ):
            ray.kill(ray.get_actor(rank_actor_name(job, 1)), no_restart=True)
            killed_at.append(time.monotonic())

    run = run_ray(
        spec, job=job, on_event=kill_rank_1_as_it_starts_training_iteration_2, grace_seconds=5
    )
    ended_after = time.monotonic() - killed_at[0]
    assert ended_after < 30, f"the job took {ended_after:.1f}s to end after the kill"
    assert not run.ok
    assert run.reason is not None
    # Timed for iteration 2's train; on a loaded machine the kill can land a few stages later in
    # the same iteration (a cold `make test` beside two other suites: "in stage sleep"), so the
    # stage is read from the reason, and must be one of iteration 2's.
    named = re.match(
        rf"rank 1 \(node {re.escape(run.nodes[1])}\) died in stage (\w+) of iteration 2: ",
        run.reason,
    )
    assert named is not None, run.reason
    killed_in = Stage(named.group(1))
    assert killed_in in stage_order(WakeUp.STAGED, 2)
    assert run.reason.endswith("killed by `ray.kill`.")  # Ray's own account of the death
    # Killed mid-stage: no sample of that stage from rank 1, and nothing it sent before is lost.
    assert (1, 2, killed_in) not in {(s.rank, s.iteration, s.stage) for s in run.samples}
    for rank in range(RANKS):
        for iteration in (0, 1):
            assert _stages(run, rank, iteration) == list(stage_order(WakeUp.STAGED, iteration))
    status = run.status()
    assert status.iteration == 1
    assert status.memory is not None and status.memory.iteration >= 1
    assert {1} <= run.errors.keys()
    # Every actor of the job is gone afterwards (nothing left holding the CPUs).
    for rank in range(RANKS):
        with pytest.raises(ValueError):
            ray.get_actor(rank_actor_name(job, rank))


def test_cuda_oom_on_one_rank_ends_the_job_with_the_oom_as_the_reason_and_no_hang(
    ray_address: str,
) -> None:
    name, spec = _example()
    inject = OOMInjection(Stage.WAKE_WEIGHTS, rank=1, iteration=2)
    started = time.monotonic()
    run = run_ray(spec, job=f"{name}-oom", inject_oom=inject, grace_seconds=5)
    assert time.monotonic() - started < 120
    assert not run.ok
    (oom,) = run.ooms
    assert (oom.rank, oom.stage, oom.iteration) == (1, Stage.WAKE_WEIGHTS, 2)
    assert oom.node == run.nodes[1].split(" ")[0]
    assert run.reason is not None
    assert run.reason.startswith(
        f"rank 1 (node {oom.node}) ran out of memory in stage wake_weights of iteration 2"
    )
    # The failing rank measured up to and including the stage that failed.
    assert _stages(run, 1, 2) == [Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER, Stage.WAKE_WEIGHTS]
    status = run.status()
    assert status.iteration == 1
    assert status.oom_counts == {"CUDAOutOfMemory": 1}
    assert status.memory is not None and status.memory.iteration == 2


def test_rendered_rayjob_starts_this_driver_on_the_rendered_configmap(
    ray_address: str, tmp_path: Path
) -> None:
    name, spec = _example()
    owner = Owner(name=name, namespace="team-a", uid=str(uuid.uuid4()))
    rendered_job = ray_job(owner, spec)
    rendered_config = config_map(owner, spec)
    # The entrypoint names a module that exists here, with arguments its parser takes, and the
    # --config path is where the head pod mounts this ConfigMap.
    program, *args = shlex.split(rendered_job["spec"]["entrypoint"])
    assert program == "python" and args[0] == "-m"
    module, driver_args = args[1], args[2:]
    assert importlib.util.find_spec(module) is not None
    parsed = _parser().parse_args(driver_args)
    assert parsed.config == Path(JOB_CONFIG_DIR) / JOB_CONFIG_FILE
    head = rendered_job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    (volume,) = [n for n, v in volumes.items() if "configMap" in v]
    assert volumes[volume]["configMap"]["name"] == config_map_name(name)
    assert rendered_config["metadata"]["name"] == config_map_name(name)
    assert mounts[volume] == JOB_CONFIG_DIR

    # The mounted file is the ConfigMap's data key; run the entrypoint on it as the head would,
    # against this cluster (a RayJob gives the driver RAY_ADDRESS the same way).
    config_path = tmp_path / JOB_CONFIG_FILE
    config_path.write_text(rendered_config["data"][JOB_CONFIG_FILE])
    result_path = tmp_path / "result.json"
    argv = [*driver_args, "--status-out", str(result_path)]
    argv[argv.index("--config") + 1] = str(config_path)
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", module, *argv],
        env={**os.environ, "RAY_ADDRESS": ray_address},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(result_path.read_text())
    assert json.loads(completed.stdout) == result
    assert result["ok"] is True and result["reason"] is None
    assert result["job"] == {"name": name, "namespace": "team-a"}
    assert result["status"]["iteration"] == spec.algorithm.iterations
    assert [s["name"] for s in result["status"]["memory"]["stages"]] == [
        str(s) for s in stage_order(WakeUp.STAGED)
    ]
    assert JobConfig.from_yaml(config_path.read_text()).spec == spec
    assert time.monotonic() - started < 300


def test_driver_refuses_a_config_that_is_not_a_job_config_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "namespace": "y", "spec": {"algorithm": 3}}))
    assert main(["--config", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2


def _sample(iteration: int, stage: Stage, start: float) -> StageSample:
    return StageSample(
        iteration=iteration, rank=1, stage=stage, kind="host", device="cpu",
        start_seconds=start, seconds=0.1, peak_allocated_bytes=0, peak_reserved_bytes=0,
        allocated_bytes=0, reserved_bytes=0, device_used_bytes=0, device_peak_used_bytes=0,
        device_total_bytes=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("last", "raised", "expected"),
    [
        (None, False, None),  # nothing finished yet: setup
        ((0, Stage.WAKE_KV_CACHE), False, (0, Stage.ROLLOUT)),  # died in the next stage
        ((0, Stage.WAKE_KV_CACHE), True, (0, Stage.WAKE_KV_CACHE)),  # raised inside that one
        ((0, Stage.SLEEP), False, (1, Stage.TRAIN)),  # iteration 0 has no train: the next has
        ((1, Stage.OFFLOAD_TRAIN), False, (1, Stage.WAKE_KV_CACHE)),
        ((2, Stage.SLEEP), False, (2, Stage.SLEEP)),  # after its last stage
    ],
)
def test_position_at_failure_is_the_stage_after_the_last_sample_unless_the_rank_raised(
    last: tuple[int, Stage] | None, raised: bool, expected: tuple[int, Stage] | None
) -> None:
    samples = []
    if last is not None:
        order = [(i, s) for i in range(last[0] + 1) for s in stage_order(WakeUp.STAGED, i)]
        samples = [_sample(i, s, n) for n, (i, s) in enumerate(order[: order.index(last) + 1])]
    assert position_at_failure(samples, WakeUp.STAGED, 2, raised=raised) == expected
