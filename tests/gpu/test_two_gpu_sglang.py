"""SGLang tensor parallel and the Ray driver on two GPUs of one host (issue 20; marker gpu).

Runs on nvidia-h200-x2 with the project's GPU set on PYTHONPATH: the core, extra and ray groups
of hack/sglang-gpu-install.sh (docs/development.md, "GPU tests with SGLang"). Where fewer than two GPUs exist
it is skipped with that reason; with RLJOB_GPU_SGLANG=1 a missing sglang or ray is an error.

NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0, the device notes): set here before any
process starts, so the rank processes, the Ray cluster and its actors inherit it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

RANKS = 2

if torch.cuda.device_count() < RANKS:
    pytest.skip(f"needs {RANKS} GPUs on one host (nvidia-h200-x2)", allow_module_level=True)
for _package in ("sglang", "ray"):
    if importlib.util.find_spec(_package) is None:
        if os.environ.get("RLJOB_GPU_SGLANG") == "1":
            raise RuntimeError(
                f"RLJOB_GPU_SGLANG=1 but {_package} does not import: install the GPU set with "
                "hack/sglang-gpu-install.sh (core, extra and ray) and put its site on PYTHONPATH"
            )
        pytest.skip(
            f"{_package} is not installed (hack/sglang-gpu-install.sh)", allow_module_level=True
        )
os.environ["NCCL_NVLS_ENABLE"] = "0"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from support.gpu_models import random_qwen2, random_qwen25_05b  # noqa: E402
from support.ranks import run_ranks  # noqa: E402

from rljob.api import JobConfig, RLJobSpec, WakeUp, parse_manifest  # noqa: E402
from rljob.report import Stage, StageSample  # noqa: E402
from rljob_worker.driver.local import run_local  # noqa: E402
from rljob_worker.driver.ray_driver import rank_actor_name, run_ray  # noqa: E402
from rljob_worker.engines.base import SamplingParams  # noqa: E402
from rljob_worker.engines.torch_engine import TorchEngine  # noqa: E402
from rljob_worker.model import load_causal_lm, load_tokenizer  # noqa: E402
from rljob_worker.stages import stage_order  # noqa: E402

GiB = 2**30
ITERATIONS = 2
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
# Each rank's own prompts (distinct lengths): the group's engine answers both in one batch.
PROMPTS = {
    0: [[5, 6, 7, 8, 9], [11, 12], [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]],
    1: [[7] * 9, [21, 22, 23]],
}


def _spec(
    model: Path,
    *,
    tp: int,
    iterations: int = ITERATIONS,
    wake_up: WakeUp = WakeUp.STAGED,
    fraction: float = 0.4,
    name: str = "two-gpus",
) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "algorithm": {"groupSize": 4, "iterations": iterations, "learningRate": 1e-4},
            "data": {"trainBatchSize": 4, "maxResponseLength": 16},
            "rollout": {
                "engine": "sglang",
                "wakeUp": str(wake_up),
                "memFractionStatic": fraction,
                "tensorParallelSize": tp,
                "weightSyncBucketMegabytes": 16,
            },
            "resources": {"gpusPerWorker": RANKS},
        },
    }
    return parse_manifest(doc)[1]


@pytest.fixture(scope="module")
def qwen05b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_qwen25_05b(tmp_path_factory.mktemp("qwen2.5-0.5b-shape"))


def _nvidia_smi(*arguments: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *arguments], capture_output=True, text=True, check=True
    ).stdout


def _gpu_used_mib() -> list[int]:
    """Device-wide memory in use per GPU, by nvidia-smi (what other processes hold included)."""
    out = _nvidia_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits")
    return [int(line) for line in out.split()]


def _wait_for_gpus_back(baseline: list[int], seconds: float = 60) -> list[int]:
    """Poll until every GPU is back within 1 GiB of `baseline`; the last reading."""
    deadline = time.monotonic() + seconds
    while True:
        used = _gpu_used_mib()
        if all(u <= b + 1024 for u, b in zip(used, baseline, strict=True)):
            return used
        if time.monotonic() > deadline:
            return used
        time.sleep(1)


# --- SGLang tensor parallel = 2 through engines/tensor_parallel.py ---------------------------


def _rank_gpus() -> dict[int, set[str]]:
    """The GPUs (UUIDs) on which each process this test started (a rank of run_local) holds a
    CUDA context, by nvidia-smi; the sglang schedulers, the ranks' children, are not counted."""
    out = _nvidia_smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader")
    ranks = {child.pid for child in psutil.Process().children(recursive=False)}
    held: dict[int, set[str]] = {}
    for line in out.splitlines():
        pid, _, uuid = (part.strip() for part in line.partition(","))
        if pid.isdigit() and int(pid) in ranks:
            held.setdefault(int(pid), set()).add(uuid)
    return held


def test_tp2_one_engine_over_both_gpus_runs_staged_iterations_with_memory_per_rank(
    qwen05b_dir: Path,
) -> None:
    spec = _spec(qwen05b_dir, tp=2)
    # Which GPU each rank process is on, read while it runs (at each rollout's end). The
    # samples name the device's model only, and two cards of one model share that name.
    placement: dict[int, set[str]] = {}

    def watch(event: object) -> None:
        if isinstance(event, StageSample) and event.stage == Stage.ROLLOUT:
            for pid, uuids in _rank_gpus().items():
                placement.setdefault(pid, set()).update(uuids)

    run = run_local(spec, RANKS, "cuda", on_event=watch)
    assert run.ok, (run.errors, run.ooms)
    assert sorted((i.rank, i.iteration) for i in run.iterations) == [
        (rank, iteration) for rank in range(RANKS) for iteration in range(ITERATIONS + 1)
    ]
    for item in run.iterations:
        assert list(item.stages) == [str(s) for s in stage_order(WakeUp.STAGED, item.iteration)]
    # One engine for the group: both ranks report its one KV pool.
    capacities = {i.kv_capacity_tokens for i in run.iterations}
    assert len(capacities) == 1 and capacities.pop() > 0
    latest = run.reports[-1]
    for rank in range(RANKS):
        own = [s for s in latest.samples if s.rank == rank]
        assert {s.stage for s in own} == set(Stage) - {Stage.CHECKPOINT}  # no spec.checkpoint
        assert all(s.kind == "cuda" and s.device_total_bytes > 0 for s in own)
        used = {s.stage: s.device_used_bytes for s in own}
        # The engine's TP shard on this rank's GPU holds a KV pool in rollout, given back in sleep.
        assert used[Stage.ROLLOUT] - used[Stage.SLEEP] > 0.1 * own[0].device_total_bytes
        for s in own:
            print(
                f"rank {rank} {s.stage:<18} peak {s.device_peak_used_bytes / GiB:6.2f} GiB "
                f"end {s.device_used_bytes / GiB:6.2f} GiB on {s.device} ({s.seconds:.3f}s)"
            )
    # Two distinct GPUs, one per rank: each rank process holds a context on one GPU only, and
    # not the same one (by UUID).
    print(f"rank processes' GPUs: {placement}")
    assert len(placement) == RANKS, placement
    assert all(len(uuids) == 1 for uuids in placement.values()), placement
    assert len(set().union(*placement.values())) == RANKS, placement


def _weight_check(sent: dict[str, str], held: dict[str, str]) -> dict[str, Any]:
    """Digests of what was sent (or is on disk) against the engine's, every name of `sent`."""
    return {
        "compared": len(sent),
        "mismatched": sorted(n for n in sent if n in held and held[n] != sent[n]),
        "missing": sorted(n for n in sent if n not in held),
    }


def _tp_rank_main(
    rank: int, init_method: str, dirs: list[str], sharded: bool, results: Any
) -> None:
    """One rank of a TP=2 group: the engine starts on checkpoint dirs[0]; for each checkpoint an
    FSDP2 trainer over both ranks holds it and sends it in buckets, staged; `sharded`, shard to
    shard (tp_shards: no full tensor on either rank), what the trainer holds digested from the
    full gather beside it.

    After each update it records: the engine's weights read back from both TP ranks' shards
    (named_weights) against what the trainer sent, digest by digest; the greedy answers; and
    the engine's teacher-forced log-probs of prompt + answer."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    import torch
    import torch.distributed as dist

    from rljob_worker.engines import make_engine
    from rljob_worker.engines.base import TAG_CUDA_GRAPH, TAG_KV_CACHE, TAG_WEIGHTS
    from rljob_worker.loop import tensor_digest
    from rljob_worker.tp_shards import ShardedBucket, parse_payload
    from rljob_worker.train import Trainer

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=init_method, rank=rank, world_size=RANKS, device_id=device
    )
    out: dict[str, Any] = {"answers": [], "logprobs": [], "weights": []}
    engine: Any = None

    def held() -> dict[str, str]:
        return {name: tensor_digest(t) for name, t in engine.named_weights()}

    def answer() -> None:
        answers = engine.generate(PROMPTS[rank], GREEDY)
        out["answers"].append(answers)
        scored = [p + a for p, a in zip(PROMPTS[rank], answers, strict=True)]
        out["logprobs"].append(engine.prompt_logprobs(scored))

    try:
        first = Path(dirs[0])
        eos = [load_tokenizer(first).eos_token_id]
        engine = make_engine(_spec(first, tp=2), device=str(device), eos_token_ids=eos, node="one")
        # The engine starts with every tag released (weights undefined until an update), as
        # iteration 0 of the loop does: A too comes from a trainer, as the loop's first sync.
        for path in map(Path, dirs):
            trainer = Trainer(_spec(path, tp=2), path, device, pad_id=0)
            engine.resume([TAG_WEIGHTS])
            sent: dict[str, str] = {}
            for bucket in trainer.weight_buckets(1 << 20, torch.bfloat16):
                if not sharded:
                    engine.update_weights(bucket)
                sent.update((name, tensor_digest(tensor)) for name, tensor in bucket)
                del bucket  # two buckets at most: the next one's gather overlaps this hand-off
            if sharded:
                out["shard_world"] = engine.shard_world
                kinds: dict[str, int] = {}
                stored: set[str | None] = set()
                pieces = trainer.shard_buckets(
                    1 << 20, torch.bfloat16, engine.shard_world,
                    own_as_stored=engine.shard_own_as_stored,
                )  # fmt: skip
                for piece in pieces:
                    assert isinstance(piece, ShardedBucket), "every bucket goes shard to shard"
                    payload = parse_payload(piece.name)
                    stored.add(payload.stored)
                    for entry in payload.entries:
                        kinds[entry.kind] = kinds.get(entry.kind, 0) + 1
                    engine.update_weights_sharded(piece)
                    del piece
                out["kinds"] = kinds
                # Where every bucket's own blocks came from: the trainer's fp32 buffer as it is
                # (the policy's shards in one buffer), or the bucket's buffer.
                out.setdefault("own_as_stored", set()).update(str(s) for s in stored)
            engine.flush_cache()
            out["flattened"] = engine.flattened_buckets
            out["direct"] = engine.direct_buckets
            out["weights"].append(_weight_check(sent, held()))
            del trainer
            torch.cuda.empty_cache()
            engine.resume([TAG_KV_CACHE, TAG_CUDA_GRAPH])
            answer()
            engine.release([TAG_CUDA_GRAPH, TAG_KV_CACHE, TAG_WEIGHTS])
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if engine is not None:
            engine.shutdown()
        dist.destroy_process_group()
        results.put((rank, out))


def _reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(. | ids[:i]) for i = 1 .. len(ids), float32: row i-1 scores position i."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


# SGLang's bf16 log-probs may be at most this many times as far from a float32 reference as
# transformers' own bf16 forward is (on the same ids), and no more than FLOOR_NATS from it where
# that distance is tiny. A weight-sync error moves them by whole nats.
BF16_SPREAD_FACTOR = 3.0
FLOOR_NATS = 0.1


@pytest.mark.parametrize("sync_path", ["tensors", "flattened_bucket", "direct", "sharded"])
def test_tp2_weights_equal_the_trainers_after_every_update_and_answers_part_only_at_near_ties(
    tmp_path: Path, sync_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints A, B and C, each sent by an FSDP2 trainer over both ranks to one engine
    ("sharded": rljob's loader, each bucket shard to shard, rljob_worker.tp_shards).

    After each update: every weight the engine holds, read back from both TP ranks' shards, is
    the trainer's bit for bit; SGLang's teacher-forced log-probs agree with a float32 reference
    within bf16's spread; and each greedy answer equals the torch engine's up to the first
    position where the two engines' top tokens are a near-tie (their float32 log-probs closer
    than the bf16 error measured there), which is where TP's split reductions may flip them."""
    dirs = []
    for seed, name in ((1, "a"), (2, "b"), (3, "c")):
        (tmp_path / name).mkdir()
        dirs.append(random_qwen2(tmp_path / name, seed=seed))
    from rljob_worker.engines.sglang_engine import WEIGHT_SYNC_ENV

    # The ranks (spawned) inherit it: one payload or buffer per rank and bucket, or one handle per
    # tensor.
    sharded = sync_path == "sharded"
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "direct" if sharded else sync_path)
    # The direct path must place every tensor itself (its schedulers inherit this): a fallback
    # to sglang's load_weights would pass the weights check while measuring the wrong path.
    monkeypatch.setenv("RLJOB_SGLANG_DIRECT_STRICT", "1")
    out = run_ranks(_tp_rank_main, RANKS, [str(d) for d in dirs], sharded, timeout_seconds=900)
    for rank in range(RANKS):
        assert "error" not in out[rank], out[rank].get("error")
        assert out[rank]["flattened"] == (sync_path == "flattened_bucket")
        assert out[rank]["direct"] == (sync_path in ("direct", "sharded"))
        if sharded:
            print(f"rank {rank}: tensors by kind {out[rank]['kinds']}")
            assert out[rank]["shard_world"] == RANKS
            # The row-parallel weights go by columns and most others by the rank's own rows.
            assert out[rank]["kinds"].get("cols", 0) > 0 and out[rank]["kinds"].get("rows", 0) > 0
            # Each rank's own blocks read where the trainer stores them, in fp32 (the default).
            assert out[rank]["own_as_stored"] == {"float32"}, out[rank]["own_as_stored"]

    # 1. Weights: every parameter, on every rank's read of both TP ranks' shards, bit for bit.
    checks = [
        (rank, checkpoint.name, check)
        for rank in range(RANKS)
        for checkpoint, check in zip(dirs, out[rank]["weights"], strict=True)
    ]
    for rank, name, check in checks:
        print(f"rank {rank} weights after the update to {name}: {check}")
    for _, _, check in checks:
        assert check["compared"] > 0 and not check["mismatched"] and not check["missing"]

    eos = [load_tokenizer(dirs[0]).eos_token_id]
    near_ties = 0
    for index, checkpoint in enumerate(dirs):
        reference = TorchEngine(
            checkpoint, device="cuda", dtype="bfloat16", kv_capacity_tokens=1024, eos_token_ids=eos
        )
        try:
            expected = {r: reference.generate(PROMPTS[r], GREEDY) for r in PROMPTS}
        finally:
            reference.shutdown()
        fp32: Any = load_causal_lm(checkpoint, torch.float32)
        bf16: Any = load_causal_lm(checkpoint, torch.bfloat16)
        fp32, bf16 = fp32.to("cuda"), bf16.to("cuda")
        sglang_error = bf16_error = 0.0
        ties: list[tuple[int, int, float]] = []
        for rank in range(RANKS):
            answers, scored = out[rank]["answers"][index], out[rank]["logprobs"][index]
            want = expected[rank]
            print(f"\nrank {rank} on {checkpoint.name}\n  sglang {answers}\n  torch  {want}")
            for prompt, got, wanted, logprobs in zip(
                PROMPTS[rank], answers, want, scored, strict=True
            ):
                ids = prompt + got
                exact = _reference_logprobs(fp32, ids)
                rows = torch.arange(len(ids) - 1, device=exact.device)
                target = torch.tensor(ids[1:], device=exact.device)
                truth = exact[rows, target]
                ours = torch.tensor(logprobs, device=exact.device)
                theirs = _reference_logprobs(bf16, ids)[rows, target]
                sglang_error = max(sglang_error, (ours - truth).abs().max().item())
                bf16_error = max(bf16_error, (theirs - truth).abs().max().item())
                # The first output position where the engines' greedy tokens part.
                part = next(
                    (i for i, (g, w) in enumerate(zip(got, wanted, strict=False)) if g != w), None
                )
                if part is None:
                    # Equal as far as both go: one engine may keep the EOS it stopped at.
                    extra = got[len(wanted) :] or wanted[len(got) :]
                    assert extra in ([], eos), (got, wanted)
                    continue
                position = len(prompt) + part - 1  # the row that scores output token `part`
                gap = abs(exact[position, wanted[part]] - exact[position, got[part]]).item()
                ties.append((rank, part, gap))
        del fp32, bf16
        torch.cuda.empty_cache()
        tolerance = max(BF16_SPREAD_FACTOR * bf16_error, FLOOR_NATS)
        print(
            f"{checkpoint.name}: max |log-prob - float32|: sglang TP2 {sglang_error:.4f}, "
            f"transformers bf16 {bf16_error:.4f} nats (tolerance {tolerance:.4f}); "
            f"answers parting (rank, token, float32 gap between the two tokens): {ties}"
        )
        # 2. Log-probs: SGLang's bf16 is as close to float32 as bf16 itself allows.
        assert sglang_error <= tolerance
        # 3. Greedy: a parting is a near-tie, within both engines' measured bf16 error.
        for rank, part, gap in ties:
            assert gap <= 2 * max(sglang_error, bf16_error), (checkpoint.name, rank, part, gap)
        near_ties += len(ties)
    print(f"answers that parted from the torch engine's at a near-tie: {near_ties}")


# --- The Ray driver on GPUs -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster with both GPUs, in its own processes like a RayJob's (they inherit
    this environment: PYTHONPATH with the GPU set, NCCL_NVLS_ENABLE=0). Started as the CPU
    multi-node test starts its cluster (`ray.cluster_utils.Cluster`): a bare `ray start --head`
    of Ray 2.60 left the driver's client refused with `Unauthenticated: InvalidAuthToken`
    (seen on the CPU machine)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "num_gpus": RANKS, "include_dashboard": False},
    )
    try:
        yield str(cluster.address)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_ray_main_runs_two_gpu_workers_and_writes_the_status_it_would_publish(
    tp: int, ray_cluster: str, qwen05b_dir: Path, tmp_path: Path
) -> None:
    """What the RayJob runs, `python -m rljob_worker.driver.ray_main`, with no apiserver: the
    status block goes to a file and is checked."""
    job = JobConfig(name=f"two-gpus-tp{tp}", namespace="default", spec=_spec(qwen05b_dir, tp=tp))
    config, status_file = tmp_path / "job.yaml", tmp_path / "status.json"
    config.write_text(job.to_yaml())
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rljob_worker.driver.ray_main", "--config", str(config),
         "--address", ray_cluster, "--status-out", str(status_file), "--no-publish"],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    print(f"\nTP {tp}: exit {proc.returncode} after {time.monotonic() - started:.0f}s")
    print(proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    document = json.loads(status_file.read_text())
    assert document["ok"] is True and document["reason"] is None
    status = document["status"]
    assert status["iteration"] == ITERATIONS
    assert not status.get("oomEvents")
    memory = status["memory"]
    assert memory["kind"] == "cuda" and memory["capacityBytes"] > 0
    assert [s["name"] for s in memory["stages"]] == [str(s) for s in stage_order(WakeUp.STAGED)]
    assert {s["rank"] for s in memory["stages"]} <= {0, 1}
    for stage in memory["stages"]:
        assert 0 < stage["peakBytes"] <= memory["capacityBytes"]
        print(f"  {stage['name']:<18} worst rank {stage['rank']} peak "
              f"{stage['peakBytes'] / GiB:6.2f} GiB ({stage['peakFraction']:.3f})")  # fmt: skip


@pytest.fixture()
def ray_connected(ray_cluster: str) -> Iterator[None]:
    ray.init(address=ray_cluster, namespace="rljob-gpu-tests", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _kill_when(job: str, rank: int, iteration: int, stage: Stage, killed_at: list[float]) -> Any:
    """An on_event hook: SIGKILL rank `rank`'s actor process (`ray.kill`) as soon as it
    reports the end of `stage` in `iteration`."""

    def hook(event: object) -> None:
        if (
            isinstance(event, StageSample)
            and (event.rank, event.iteration, event.stage) == (rank, iteration, stage)
            and not killed_at
        ):
            ray.kill(ray.get_actor(rank_actor_name(job, rank)), no_restart=True)
            killed_at.append(time.monotonic())

    return hook


def test_a_worker_killed_mid_iteration_ends_the_job_naming_rank_and_stage_and_frees_both_gpus(
    ray_connected: None, qwen05b_dir: Path
) -> None:
    job = "two-gpus-kill"
    spec = _spec(qwen05b_dir, tp=1, name=job)
    baseline = _gpu_used_mib()
    killed_at: list[float] = []
    grace = 20.0
    run = run_ray(
        spec, job=job, on_event=_kill_when(job, 1, 1, Stage.SLEEP, killed_at), grace_seconds=grace
    )
    assert killed_at, "rank 1 never reached the end of iteration 1"
    ended_after = time.monotonic() - killed_at[0]
    print(f"\nreason: {run.reason}\nended {ended_after:.1f}s after the kill; errors {run.errors}")
    assert not run.ok
    assert run.reason is not None
    assert run.reason.startswith(f"rank 1 (node {run.nodes[1]}) died in stage train of iteration 2")
    assert ended_after < grace + 30
    # What both ranks measured before the kill: every stage of iterations 0 and 1, per rank.
    for rank in range(RANKS):
        for iteration in (0, 1):
            own = [s for s in run.samples if (s.rank, s.iteration) == (rank, iteration)]
            assert [s.stage for s in sorted(own, key=lambda s: s.start_seconds)] == list(
                stage_order(WakeUp.STAGED, iteration)
            )
            assert all(s.kind == "cuda" and s.device_peak_used_bytes > 0 for s in own)
    used = _wait_for_gpus_back(baseline)
    print(f"GPU memory used (MiB): before {baseline}, after {used}")
    assert all(u <= b + 1024 for u, b in zip(used, baseline, strict=True)), (baseline, used)


def test_a_tp_leader_killed_outright_fails_the_other_rank_naming_the_leader_in_bounded_time(
    ray_connected: None, qwen05b_dir: Path
) -> None:
    """Rank 0 runs the group's engine (its schedulers on both GPUs). Killed as it ends
    wake_kv_cache, rank 1 is then in a call to the engine (wake_kv_cache or rollout, over the
    group's gloo link, not an NCCL collective), which must end with an error naming rank 0."""
    job = "two-gpus-leader-kill"
    spec = _spec(qwen05b_dir, tp=2, name=job)
    baseline = _gpu_used_mib()
    killed_at: list[float] = []
    grace = 30.0
    run = run_ray(
        spec,
        job=job,
        on_event=_kill_when(job, 0, 1, Stage.WAKE_KV_CACHE, killed_at),
        grace_seconds=grace,
    )
    assert killed_at, "rank 0 never reached wake_kv_cache of iteration 1"
    ended_after = time.monotonic() - killed_at[0]
    print(f"\nreason: {run.reason}\nended {ended_after:.1f}s after the kill; errors {run.errors}")
    assert not run.ok
    assert run.reason is not None and run.reason.startswith("rank 0 ")
    other = run.errors.get(1, "")
    assert "rank 0" in other and "stopped answering" in other, run.errors
    assert ended_after < grace
    # The leader's sglang schedulers die with it: nothing is left on either GPU.
    used = _wait_for_gpus_back(baseline)
    print(f"GPU memory used (MiB): before {baseline}, after {used}")
    assert all(u <= b + 1024 for u, b in zip(used, baseline, strict=True)), (baseline, used)
