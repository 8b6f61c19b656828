"""bench/colocate.py on the CPU (--smoke): the sweep, the staging tax and the engine-alone pass.

The GPU figures come from the same code on the device machines; here the plumbing runs for real
(2 ranks' worth of processes, FSDP2 on gloo, the torch engine) and the written result is read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.scripts import bench_module

from rljob.plan import plan_for_point

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 2


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, str(REPO / "bench" / "colocate.py"), "--smoke",
               "--iterations", str(ITERATIONS), "--prompts", "2", "--group-size", "2",
               "--response-length", "8", "--modes", "staged,single", "--fractions", "0.5",
               "--out", str(out)]  # fmt: skip
    # The weight sync's spans (bench/sync_trip.py's input), written by the ranks' stages.
    env = {**os.environ, "RLJOB_SGLANG_DIRECT_TIMINGS": str(out / "sync-timings.jsonl")}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "colocate.json").read_text())
    data["_markdown"] = (out / "colocate.md").read_text()
    data["_timings"] = str(out / "sync-timings.jsonl")  # a str: the result is dumped as JSON
    return data


def test_every_point_completes_its_iterations_with_a_staging_tax(result: dict) -> None:
    assert {(p["mode"], p["completed"]) for p in result["points"]} == {
        ("staged", True),
        ("single", True),
    }
    for point in result["points"]:
        assert point["iterations_done"] == ITERATIONS
        seconds = point["stage_seconds"]
        other = {k: v for k, v in seconds.items() if k not in ("train", "rollout")}
        assert point["staging_tax"] == pytest.approx(sum(other.values()) / sum(seconds.values()))
        assert point["staging_dominant"] == max(other, key=other.__getitem__)
        assert 0 < point["staging_tax"] < 1
        # Where train's seconds went (the policy update's passes), within the stage's seconds.
        passes = point["train_pass_seconds"]
        assert {"old_logprobs", "ref_logprobs", "forward_backward", "optimizer_step"} <= set(passes)
        assert 0 < sum(passes.values()) <= seconds["train"]
        # The weight sync's hand-off to the engine is a part of it, and shown beside it.
        assert 0 < point["weight_handoff_seconds"] <= point["weight_sync_seconds"]
        assert f"{point['weight_handoff_seconds']:.3f})" in result["_markdown"]


def test_every_weight_sync_leaves_its_spans_for_the_split(result: dict) -> None:
    """With RLJOB_SGLANG_DIRECT_TIMINGS set, each rank's stage writes its syncs' spans (the
    torch engine sends no sglang requests: no update spans), which bench/sync_trip.py splits."""
    trip = bench_module("sync_trip.py", "bench_sync_trip")
    lines = trip.read(Path(result["_timings"]))
    pids = {x["pid"] for x in lines}
    assert len(pids) == len(result["points"])  # one rank a point here, a process each
    syncs = trip.split(lines)
    # Iteration 0's weights and each iteration's update: ITERATIONS + 1 syncs a point.
    assert len(syncs) == len(pids) * (ITERATIONS + 1)
    for sync in syncs:
        assert sync["buckets"] == 0 and sync["next_bucket"] > 0
        # Of the wait for each bucket: its gather's host work and the wait for its kernels.
        assert 0 < sync["bucket_issue"] + sync["bucket_kernels"] <= sync["next_bucket"]
        assert sync["other"] >= 0
        assert sum(sync[p] for p in trip.PARTS) == pytest.approx(sync["sync"])


def test_the_engine_alone_runs_the_same_rollouts_and_is_compared(result: dict) -> None:
    alone = result["alone"]
    assert "error" not in alone, alone.get("error")
    # The highest completing staged point, every iteration's rollout (0..N), full responses.
    assert (alone["mode"], alone["fraction"]) == ("staged", 0.5)
    assert sorted(int(i) for i in alone["rollout_seconds"]) == list(range(ITERATIONS + 1))
    assert all(0 < t <= 2 * 2 * 8 for t in alone["generated_tokens"].values())
    staged = next(p for p in result["points"] if p["mode"] == "staged")
    assert alone["kv_capacity_tokens"] == staged["kv_capacity_tokens"]
    assert alone["colocated_over_alone"] == pytest.approx(
        staged["rollout_tokens_per_second"] / alone["rollout_tokens_per_second"]
    )
    names = [t["name"] for t in result["targets"]]
    assert any("the same engine alone" in n for n in names)
    assert any(n.startswith("staging tax") for n in names)
    assert "The engine alone (staged at 0.50" in result["_markdown"]
    assert result["environment"]["engine"] == "torch"


def test_runs_of_two_engines_do_not_merge(result: dict, tmp_path: Path) -> None:
    ours = tmp_path / "torch.json"
    theirs = tmp_path / "sglang.json"
    ours.write_text(json.dumps(result))
    other = json.loads(json.dumps(result))
    other["environment"]["engine"] = "sglang"
    theirs.write_text(json.dumps(other))
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "colocate.py"), "--merge", str(ours), str(theirs),
         "--out", str(tmp_path / "merged")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "cannot merge runs of engine sglang and torch" in done.stderr


def test_an_auto_point_merges_beside_always_and_its_staging_tax_is_compared(
    result: dict, tmp_path: Path
) -> None:
    """--offload Auto at the same mode and fraction is another point, not a replacement: the
    merged table shows both and a target compares their staging tax."""
    always = tmp_path / "always.json"
    auto = tmp_path / "auto.json"
    always.write_text(json.dumps(result))
    other = json.loads(json.dumps(result))
    for point in other["points"]:
        point.update(offload="Auto", offload_optimizer=False, offload_params=False)
        point["staging_tax"] = point["staging_tax"] / 2
    auto.write_text(json.dumps(other))
    out = tmp_path / "merged"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "colocate.py"), "--merge", str(always), str(auto),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    merged = json.loads((out / "colocate.json").read_text())
    assert sorted((p["mode"], p.get("offload", "Always")) for p in merged["points"]) == [
        ("single", "Always"), ("single", "Auto"), ("staged", "Always"), ("staged", "Auto"),
    ]  # fmt: skip
    compared = [t for t in merged["targets"] if t["name"].startswith("offload Auto lowers")]
    assert [t["met"] for t in compared] == [True, True]
    assert "| staged (Auto: no offload) | 0.50 |" in (out / "colocate.md").read_text()


SYNC_PATHS = ["before", "flattened"]


@pytest.fixture(scope="module")
def realistic(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """--workload realistic, scaled down to the CPU (its sizes overridden), once per weight-sync
    path; the torch engine ignores the hand-off choice, the overlap switch is real."""
    out = tmp_path_factory.mktemp("realistic")
    command = [sys.executable, str(REPO / "bench" / "colocate.py"), "--smoke",
               "--workload", "realistic", "--prompts", "2", "--group-size", "2",
               "--response-length", "8", "--iterations", str(ITERATIONS), "--modes", "staged",
               "--fractions", "0.5", "--sync-path", ",".join(SYNC_PATHS), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "colocate.json").read_text())
    data["_markdown"] = (out / "colocate.md").read_text()
    return data


def test_realistic_workload_reports_each_stage_beside_its_floor_per_sync_path(
    realistic: dict,
) -> None:
    settings = realistic["settings"]
    assert settings["workload"] == "realistic"
    # The realistic workload's own choices, where the command did not override them.
    assert (settings["micro_batch_size"], settings["gradient_checkpointing"]) == ("4", "True")
    assert float(settings["eos_hazard"]) == pytest.approx(1 / 400)
    bandwidths = realistic["bandwidths"]
    assert [p["sync_path"] for p in realistic["points"]] == SYNC_PATHS
    alone = realistic["alone"]
    for point in realistic["points"]:
        assert point["completed"], point["failure"]
        floors = point["floors"]
        assert set(floors) == {"offload_optimizer", "weight_sync", "offload_train", "sleep",
                               "rollout"}  # fmt: skip
        # Each floor is the stage's bytes over the bandwidth measured in the same run.
        sync = floors["weight_sync"]
        model = realistic["model"]
        assert sync["bytes"] == model["policy_shard_bytes"] + model["engine_weight_bytes"] > 0
        assert sync["floor_seconds"] == pytest.approx(
            sync["bytes"] / bandwidths["hbm_read_write_bytes_per_second"]
        )
        assert sync["seconds"] == point["weight_sync_seconds"]
        for name, link in (("offload_optimizer", "d2h"), ("offload_train", "d2h"),
                           ("sleep", "h2d")):  # fmt: skip
            row = floors[name]
            assert row["bytes"] > 0
            assert row["floor_seconds"] == pytest.approx(
                row["bytes"] / bandwidths[f"{link}_pinned_bytes_per_second"]
            )
            assert row["seconds"] == point["stage_seconds"][name]
        assert floors["sleep"]["bytes"] == (
            floors["offload_optimizer"]["bytes"] + floors["offload_train"]["bytes"]
        )
        for row in floors.values():
            assert row["ratio"] == pytest.approx(row["seconds"] / row["floor_seconds"])
        # The rollout's floor: the tokens it generated at the engine-alone pass's rate.
        rollout = floors["rollout"]
        assert 0 < point["response_tokens"] <= 2 * 2 * 8
        assert rollout["floor_seconds"] == pytest.approx(
            point["response_tokens"] / alone["rollout_tokens_per_second"]
        )
        assert 0 < point["response_length_mean"] <= point["response_length_max"] <= 8
        assert 0 <= point["truncated_share"] <= 1
        assert point["iteration_seconds"] == pytest.approx(sum(point["stage_seconds"].values()))
        label = f"staged [{point['sync_path']}]"
        assert (
            f"Floors of {label} at 0.50: iteration {point['iteration_seconds']:.2f} s"
            in (realistic["_markdown"])
        )
        assert f"| {label} | 0.50 | ok (2 it)" in realistic["_markdown"]
    names = [t["name"] for t in realistic["targets"]]
    assert sum("weight sync within 3x its HBM floor" in n for n in names) == len(SYNC_PATHS)


def _colocate_module() -> Any:
    return bench_module("colocate.py", "bench_colocate")


def test_each_gpu_of_a_tp2_engine_gives_back_its_share_of_what_sleep_released() -> None:
    """The release check per GPU, on the stored 3B runs on two H200s (single 0.70): at TP 2 one
    engine's weights and KV pool are split over both cards, so rank 0's card frees its half of
    the weights and its one KV head of two. Before, the check asked one card for the whole
    engine's bytes and read 0.499; it must read what TP 1's card read (0.997)."""
    colocate = _colocate_module()
    runs = REPO / "bench" / "results" / "raw" / "two-gpu-3b-tp-h200x2"
    ratios = {}
    for tp in (1, 2):
        stored = json.loads((runs / f"tp{tp}.json").read_text())
        (point,) = [p for p in stored["points"] if p["mode"] == "single" and p["completed"]]
        args = argparse.Namespace(ranks=2, tp=tp, kl_coef=0.001, prompts=8, group_size=8,
                                  response_length=128)  # fmt: skip
        model = {
            **colocate.model_figures("qwen2.5-3b", stored["model"]["parameters"], args),
            # Those runs kept an fp32 reference: what sleep loaded back.
            "train_param_bytes": stored["model"]["train_param_bytes"],
        }
        samples = [
            SimpleNamespace(stage=s["stage"], device_used_bytes=s["end_bytes"])
            for s in point["timeline"]
        ]
        card_pool = colocate.kv_pool_bytes(
            "sglang", point["kv_capacity_tokens"], model, per_gpu=True
        )
        sleep = colocate.release_check(samples, model, card_pool)["sleep"]
        if tp == 2:
            # Half of 2 x 3,085,938,688 weight bytes, and 5,381,472 tokens (+1 padding) of
            # 2 x 36 layers x 1 KV head x 128 x 2 B = 18,432 B.
            assert sleep["released_bytes"] == 3_085_938_688 + 5_381_473 * 18_432
        else:
            assert sleep["released_bytes"] == 6_171_877_376 + 2_633_222 * 36_864
        ratios[tp] = sleep["freed_bytes"] / sleep["released_bytes"]
    assert 0.995 < ratios[1] < 1.0
    assert abs(ratios[2] - ratios[1]) < 0.002


def test_overlap_staging_on_and_off_run_as_two_points_of_one_invocation(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "bench" / "colocate.py"), "--smoke", "--no-alone",
               "--iterations", str(ITERATIONS), "--prompts", "2", "--group-size", "2",
               "--response-length", "8", "--modes", "staged", "--fractions", "0.5",
               "--overlap-staging", "off,on", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    points = json.loads((tmp_path / "colocate.json").read_text())["points"]
    assert [(p["overlap_staging"], p["completed"]) for p in points] == [("Off", True), ("On", True)]
    assert all(p["staging_tax"] is not None for p in points)
    markdown = (tmp_path / "colocate.md").read_text()
    # Off, the spec's default (and what every point stored before the field ran), is unlabelled
    assert "| staged | 0.50 | ok (2 it)" in markdown
    assert "| staged overlap On | 0.50 | ok (2 it)" in markdown
    bad = subprocess.run([*command[:-4], "--overlap-staging", "sometimes"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--overlap-staging 'sometimes'" in bad.stderr


def test_micro_batch_auto_halves_the_realistic_workloads_until_the_plan_says_training_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--micro-batch-size auto at 3B, realistic workload (micro-batch 4): on an H100 80GB the
    plan's train stage does not fit at 4 (83.27 of 79.18 GiB, as printed on one on 2026-11-26),
    so auto halves it to a size whose train stage fits; on a 140 GiB H200 it keeps 4."""
    colocate = _colocate_module()
    workload = colocate.WORKLOADS["realistic"]

    def args() -> argparse.Namespace:
        return argparse.Namespace(
            model="qwen2.5-3b", smoke=False, group_size=workload.group_size, kl_coef=0.001,
            iterations=2, prompts=workload.prompts, response_length=workload.response_length,
            engine="sglang", tp=1, micro_batch_size=workload.micro_batch_size,
            gradient_checkpointing=workload.gradient_checkpointing, ranks=1, offload="Always",
        )  # fmt: skip

    shape = {**colocate._QWEN25_COMMON, **colocate.QWEN25["qwen2.5-3b"]}

    def train_fits(size: int, capacity: int) -> bool:
        a = args()
        a.micro_batch_size = size
        m = plan_for_point(colocate.make_spec(a, "/m", "staged", 0.9, "Off"), shape, capacity, 1)
        return all(s.fits for s in m.stages if s.stage in ("train", "offload_optimizer"))

    h100, h200 = 85_017_493_504, 150_119_079_936  # mem_get_info totals seen on the cards
    assert not train_fits(4, h100) and train_fits(4, h200)
    asked = args()
    chosen = colocate.fitting_micro_batch(asked, "/m", "staged", 0.9, "Off", h100)
    assert asked.micro_batch_size == workload.micro_batch_size  # the caller's args untouched
    assert chosen < 4 and train_fits(chosen, h100) and not train_fits(chosen * 2, h100)
    assert f"micro-batch auto: {chosen} (train planned" in capsys.readouterr().out
    assert colocate.fitting_micro_batch(args(), "/m", "staged", 0.9, "Off", h200) == 4
    # Nothing fits a card too small for the state itself: the smallest is used, and said.
    assert colocate.fitting_micro_batch(args(), "/m", "staged", 0.9, "Off", 20 << 30) == 1
    with pytest.raises(argparse.ArgumentTypeError, match="is not a positive whole number"):
        colocate._micro_batch_arg("0")
    assert colocate._micro_batch_arg("auto") == "auto" and colocate._micro_batch_arg("2") == 2


def test_checkpoint_every_saves_each_trained_iteration_and_reports_its_share(
    tmp_path: Path,
) -> None:
    """--checkpoint-every 1 (issue 30: what the save costs an iteration): each trained iteration
    (1 and 2; iteration 0 only rolls out) saves, rank 0's account of each is recorded, the
    checkpoint stage's share is of the steady iteration, and the point's checkpoints are gone
    after it (the next point needs the disk). Every stage is also logged as it ends."""
    root = tmp_path / "checkpoints"
    command = [sys.executable, str(REPO / "bench" / "colocate.py"), "--smoke", "--no-alone",
               "--iterations", str(ITERATIONS), "--prompts", "2", "--group-size", "2",
               "--response-length", "8", "--modes", "staged", "--fractions", "0.5",
               "--checkpoint-every", "1", "--checkpoint-dir", str(root), "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = json.loads((tmp_path / "colocate.json").read_text())["points"]
    assert point["completed"] and point["checkpoint_every"] == 1
    # The newest is always reported; iteration 1's only if its writer was agreed done before
    # iteration 2's save (under load it is agreed in the same iteration as 2's, and the iteration
    # reports the newest: checkpoint.Keeper.take).
    assert [c["iteration"] for c in point["checkpoints"]] in ([1, 2], [2])
    for saved in point["checkpoints"]:
        assert saved["bytes"] > 0 and 0 < saved["blocked_seconds"] <= saved["seconds"]
    seconds = point["stage_seconds"]
    assert point["checkpoint_share"] == pytest.approx(seconds["checkpoint"] / sum(seconds.values()))
    assert "checkpoint of iteration 2:" in done.stdout
    assert not any(root.iterdir())
    # Each stage rank 0 ended, as it ended (a point cut by a call's limit keeps these).
    lines = [json.loads(x) for x in (tmp_path / "stages.jsonl").read_text().splitlines()]
    assert {(x["iteration"], x["stage"]) for x in lines} >= {(1, "checkpoint"), (2, "checkpoint")}
    assert all(x["rank"] == 0 for x in lines)
    assert [x["seconds"] for x in lines if x["iteration"] == 2 and x["stage"] == "checkpoint"] == [
        seconds["checkpoint"]
    ]


def test_bucket_mb_sets_the_weight_sync_bucket_and_the_plan_counts_it() -> None:
    """--bucket-mb reaches spec.rollout.weightSyncBucketMegabytes (the next lease's sweep of
    the direct hand-off's bucket count), and the plan's weight-sync stage grows with it (two
    buckets of full tensors at a time) on two ranks, while the spec's default stays 512. On one
    rank the sync hands the trainer's own buffer (rljob.plan.sync_as_stored): no bucket, and the
    size changes nothing."""
    colocate = _colocate_module()
    workload = colocate.WORKLOADS["small"]
    shape = {**colocate._QWEN25_COMMON, **colocate.QWEN25["qwen2.5-3b"]}

    def wake_weights_peak(bucket_mb: int | None, ranks: int = 2) -> tuple[int, int]:
        a = argparse.Namespace(
            model="qwen2.5-3b", smoke=False, group_size=workload.group_size, kl_coef=0.001,
            iterations=2, prompts=workload.prompts, response_length=workload.response_length,
            engine="sglang", tp=1, micro_batch_size=workload.micro_batch_size,
            gradient_checkpointing=workload.gradient_checkpointing, ranks=ranks,
            offload="Always", bucket_mb=bucket_mb,
        )  # fmt: skip
        spec = colocate.make_spec(a, "/m", "staged", 0.9, "Off")
        plan = plan_for_point(spec, shape, 150_119_079_936, ranks)
        (stage,) = [s for s in plan.stages if s.stage == "wake_weights"]
        return spec.rollout.weight_sync_bucket_megabytes, stage.peak_bytes

    default, large = wake_weights_peak(None), wake_weights_peak(2048)
    assert default[0] == 512 and large[0] == 2048
    assert large[1] > default[1]
    assert wake_weights_peak(None, ranks=1)[1] == wake_weights_peak(2048, ranks=1)[1]


def test_over_two_ranks_the_sync_is_also_set_beside_the_all_gathers_it_cannot_beat() -> None:
    """stage_floors' weight_sync_with_link: the larger of the HBM floor and the all-gathers
    alone (profile_weight_sync, same run), and the bytes a rank receives; absent on one rank."""
    colocate = bench_module("colocate.py", "bench_colocate_floors")
    point = {"completed": True, "mode": "staged", "fraction": 0.9, "weight_sync_seconds": 0.06,
             "stage_seconds": {"offload_optimizer": 1.0, "offload_train": 1.0, "sleep": 2.0}}  # fmt: skip
    model = {"optimizer_bytes": 8e9, "train_param_bytes": 4e9, "policy_shard_bytes": 4_000,
             "engine_weight_bytes": 6_000, "reference": False}  # fmt: skip
    bandwidths = {"d2h_pinned_bytes_per_second": 5e10, "h2d_pinned_bytes_per_second": 5e10,
                  "hbm_read_write_bytes_per_second": 1e6}  # fmt: skip
    # HBM floor: (4000 + 6000) B / 1e6 B/s = 10 ms; the all-gathers took 25 ms, then 4 ms.
    profile = {"ranks": 2.0, "all_gather_seconds": 0.025, "all_gather_bytes": 12_000.0}
    floors = colocate.stage_floors(point, model, bandwidths, None, profile)
    assert floors["weight_sync"]["floor_seconds"] == pytest.approx(0.010)
    link = floors["weight_sync_with_link"]
    assert link["floor_seconds"] == pytest.approx(0.025)
    assert link["ratio"] == pytest.approx(0.06 / 0.025)
    assert link["bytes"] == 6_000.0  # half of the gathered buffer came over the link
    faster_link = colocate.stage_floors(
        point, model, bandwidths, None, {**profile, "all_gather_seconds": 0.004}
    )["weight_sync_with_link"]
    assert faster_link["floor_seconds"] == pytest.approx(0.010)  # the HBM floor is the larger
    assert "weight_sync_with_link" not in colocate.stage_floors(
        point, model, bandwidths, None, {**profile, "ranks": 1.0}
    )
    assert "weight_sync_with_link" not in colocate.stage_floors(point, model, bandwidths, None)


def test_the_link_probe_gathers_every_ranks_part_and_reports_its_bandwidths(
    tmp_path: Path,
) -> None:
    """bench/link_probe.py on gloo (2 ranks): one all_gather row per size, each rank's part
    checked in place; the bus bandwidth is half the algorithm bandwidth at two ranks."""
    out = tmp_path / "link.json"
    command = [sys.executable, str(REPO / "bench" / "link_probe.py"), "--backend", "gloo",
               "--ranks", "2", "--mb", "1", "4", "--repeats", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["kind"], r["bytes"]) for r in rows] == [
        ("all_gather", 1 << 20),
        ("all_gather", 4 << 20),
    ]
    for row in rows:
        assert row["algbw_bytes_per_second"] == pytest.approx(row["bytes"] / row["seconds"])
        assert row["busbw_bytes_per_second"] == pytest.approx(row["algbw_bytes_per_second"] / 2)
    assert result["backend"] == "gloo" and result["ranks"] == 2


def _shard_profile_rank(rank: int, init_method: str, results: Any) -> None:
    import torch
    from support.ranks import gloo_rank
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    colocate = bench_module("colocate.py", "bench_colocate_shard_profile")
    config: dict[str, Any] = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
              "tie_word_embeddings": False}  # fmt: skip
    with gloo_rank(rank, 2, init_method, results) as out:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            meta = list(Qwen2ForCausalLM(Qwen2Config(**config)).named_parameters())
        shards = [distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)]) for _, p in meta]
        runs: list[int] = []

        def timed(work: Any) -> float:
            runs.append(1)
            work()
            return 0.5

        out.update(colocate._profile_shard_send(meta, shards, config, 1, 2, timed))
        out["runs"] = len(runs)


def test_the_sync_profile_times_the_shard_to_shard_send_by_part_on_two_ranks() -> None:
    """profile_weight_sync's shard-to-shard rows on gloo (their figures mean nothing there):
    every part runs, and the bytes exchanged are what a rank receives of a one-bucket model of
    two layers: per layer its columns of the other rank's o_proj rows (8 x 8) and down_proj
    rows (8 x 12) and half of each norm (8 + 8), and half of the final norm: 360 elements in
    bf16 (as tests/unit/test_tp_shards.py counts them)."""
    from support.ranks import run_ranks

    out = run_ranks(_shard_profile_rank, 2)
    for rank in (0, 1):
        assert "error" not in out[rank], out[rank]
        assert out[rank]["runs"] == 4
        assert out[rank]["shard_exchange_bytes"] == 720.0
        for part in ("send", "fill", "exchange", "exchange_as_all_gather"):
            assert out[rank][f"shard_{part}_seconds"] == 0.5


def test_each_iterations_sync_is_the_one_of_the_rank_that_reached_it_last() -> None:
    """The rank that reached the first all-gather last waited for nobody: its sync (the least)
    and its own hand-off stand for the iteration, not rank 0's, whose sync may hold the wait."""
    from rljob_worker.loop import RankIteration

    colocate = bench_module("colocate.py", "bench_colocate_syncs")

    def it(rank: int, iteration: int, sync: float | None, handoff: float | None) -> Any:
        return RankIteration(rank=rank, iteration=iteration, stages=(), reward_sum=0.0,
                             reward_count=0, kl_mean=None, loss=None, kv_capacity_tokens=0,
                             weight_sync_seconds=sync, weight_handoff_seconds=handoff)  # fmt: skip

    iterations = [
        it(0, 2, 1.75, 0.02), it(1, 2, 0.064, 0.03),  # rank 0 waited 1.7 s for rank 1
        it(0, 3, 0.065, 0.01), it(1, 3, 0.092, 0.04),
        it(0, 4, None, None), it(1, 4, 0.070, 0.02),  # rank 0 reported no sync
    ]  # fmt: skip
    syncs, handoffs = colocate.syncs_of_the_last_rank_in(iterations)
    assert syncs == {2: 0.064, 3: 0.065, 4: 0.070}
    assert handoffs == {2: 0.03, 3: 0.01, 4: 0.02}  # each from the same rank as its sync
    one_rank = [i for i in iterations if i.rank == 0]
    assert colocate.syncs_of_the_last_rank_in(one_rank)[0] == {2: 1.75, 3: 0.065}
