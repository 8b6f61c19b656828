"""Tensor parallel > 1: one sglang engine per group of ranks, driven by every rank of the group.

Two real processes in a real gloo process group call make_engine as the loop does; the engine
they share is SGLangEngineStandIn (tests/support/sglang_standin.py: sglang cannot run here), and
weights travel with the stand-in of sglang's serializer, which is the same ForkingPickler, so
rank 1's tensors really cross into rank 0's process as handles. Each rank sees only its own
"GPU" through CUDA_VISIBLE_DEVICES, as a Ray actor does; no CUDA call is made.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from datetime import timedelta
from typing import Any

import pytest
from support.ranks import run_ranks

pytestmark = pytest.mark.worker

WORLD = 2
ITERATIONS = 2
# Each rank's one visible GPU, as Ray sets CUDA_VISIBLE_DEVICES for an actor with num_gpus=1.
GPU_IDS = ("3", "5")
# Prompts of distinct lengths per rank: the stand-in answers [len(prompt), 7].
PROMPTS = {0: [[1, 2], [1, 2, 3]], 1: [[4, 4, 4, 4]]}
# How late rank 1 arrives at each resume in the "slow_peer" scenario.
SLOW_PEER_SECONDS = 0.5


def _spec() -> Any:
    from rljob.api import RLJobSpec

    return RLJobSpec.model_validate(
        {
            "model": {"path": "/models/qwen", "dtype": "bfloat16"},
            "rollout": {"engine": "sglang", "tensorParallelSize": 2, "memFractionStatic": 0.8},
            "resources": {"workers": 1, "gpusPerWorker": 2},
        }
    )


def _rank_main(rank: int, init_method: str, scenario: str, results: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = GPU_IDS[rank]
    import torch
    import torch.distributed as dist
    from support.sglang_standin import (
        HANDOFF_DIRECT_STAND_IN,
        HANDOFF_FLAT_STAND_IN,
        HANDOFF_STAND_IN,
        SGLangEngineStandIn,
    )
    from support.sglang_standin import NEWEST as SGLANG_NEWEST

    from rljob_worker.engines import make_engine, sglang_engine
    from rljob_worker.engines.base import (
        ALL_TAGS,
        TAG_CUDA_GRAPH,
        TAG_KV_CACHE,
        TAG_WEIGHTS,
        ShardedWeights,
    )
    from rljob_worker.engines.base import SamplingParams as Sampling
    from rljob_worker.tp_shards import PAYLOAD_PREFIX, ShardedBucket

    built: list[SGLangEngineStandIn] = []
    resumed_at: list[float] = []  # when the leader's engine resumed memory (CLOCK_MONOTONIC)

    class TimedStandIn(SGLangEngineStandIn):
        def _answer(self, method: str, kwargs: dict[str, Any]) -> Any:
            if method == "resume_memory_occupation":
                resumed_at.append(time.monotonic())
            return super()._answer(method, kwargs)

    def engine_class(**kwargs: Any) -> SGLangEngineStandIn:
        built.append(TimedStandIn(**kwargs))
        return built[-1]

    def arrive_at_resume() -> None:
        # "slow_peer": rank 1 finishes each stage before a resume late, as a rank still
        # offloading its params (the first offload pins host memory for seconds) does.
        if scenario == "slow_peer" and rank == 1:
            time.sleep(SLOW_PEER_SECONDS)
        out.setdefault("arrived_at_resume", []).append(time.monotonic())

    sglang_engine._load_engine_class = lambda: engine_class  # type: ignore[assignment]
    # The stand-in imitates the newest supported release; sglang is not installed here.
    sglang_engine.installed_contract = lambda: SGLANG_NEWEST  # type: ignore[assignment]
    # "flattened": the installed sglang has the flattened-bucket path (one payload per bucket).
    # "direct": rljob's loader in the schedulers (one buffer per rank and bucket).
    # "sharded", "sharded_apart": the direct path, buckets sent shard to shard (tp_shards), all
    # ranks under one payload name, or rank 1 under another; "sharded_stored": as "sharded",
    # each rank's own blocks as stored beside its buffer; "sharded_buffer": as that, with rank 1
    # alone asking for the own blocks in the buffer (RLJOB_TP_SHARDED_SYNC=buffer).
    direct = scenario in ("direct", "sharded", "sharded_apart", "sharded_stored", "sharded_buffer")
    handoff = HANDOFF_DIRECT_STAND_IN if direct else HANDOFF_STAND_IN
    if scenario == "flattened":
        handoff = HANDOFF_FLAT_STAND_IN
    # The hand-off each scenario takes is the one decision: the group's and its engine's. The
    # variable is unset (the default, direct) and must not matter.
    os.environ.pop(sglang_engine.WEIGHT_SYNC_ENV, None)
    sglang_engine.load_tensor_handoff = lambda: handoff  # type: ignore[assignment]
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    out: dict[str, Any] = {"generated": [], "loaded": [], "engines_here": 0}
    # "sharded_apart": rank 1 alone has the shard-to-shard sync switched off.
    os.environ.pop("RLJOB_TP_SHARDED_SYNC", None)
    if scenario == "sharded_apart" and rank == 1:
        os.environ["RLJOB_TP_SHARDED_SYNC"] = "0"
    if scenario == "sharded_buffer" and rank == 1:
        os.environ["RLJOB_TP_SHARDED_SYNC"] = "buffer"
    # "sharded_stored" also writes the weight sync's spans (bench/sync_trip.py's file).
    from rljob_worker.weight_sync import TIMINGS_ENV

    os.environ.pop(TIMINGS_ENV, None)
    if scenario == "sharded_stored":
        os.environ[TIMINGS_ENV] = tempfile.mkstemp(suffix=".jsonl")[1]
    try:
        node = f"node-{rank}" if scenario == "spans_nodes" else "node-a"
        engine = make_engine(_spec(), device="cuda:0", node=node)
        out["engines_here"] = len(built)
        out["kv"] = engine.kv_capacity_tokens
        out["released_at_start"] = sorted(engine.released_tags)
        if scenario == "leader_fails" and built:
            built[0].refuse["update_weights_from_tensor"] = "weights do not fit"
        for iteration in range(ITERATIONS):
            if scenario == "leader_dies" and rank == 0 and iteration == 1:
                # Killed outright (SIGKILL, a node lost): no error message goes to the group.
                results.put((rank, {"died_at": time.monotonic()}))
                results.close()
                results.join_thread()  # the queue's feeder thread has sent it before the kill
                os.kill(os.getpid(), signal.SIGKILL)
            arrive_at_resume()
            engine.resume([TAG_WEIGHTS])
            assert isinstance(engine, ShardedWeights)  # a TensorParallelEngine
            out["shard_world"] = engine.shard_world
            out["own_as_stored"] = engine.shard_own_as_stored
            if scenario.startswith("sharded"):
                # Each rank's own buffer under the bucket's one name (rank 1 apart: another).
                layout = (
                    '{"world":2,"entries":[]}' if rank == 0 or scenario != "sharded_apart" else "x"
                )
                stored = None
                if scenario == "sharded_stored":
                    stored = torch.full((6,), 100 * iteration + rank, dtype=torch.uint8)
                engine.update_weights_sharded(
                    ShardedBucket(
                        [], PAYLOAD_PREFIX + layout, torch.full((4,), 10 * iteration + rank),
                        stored,
                    )
                )  # fmt: skip
            else:
                # Distinct tensors per rank show which rank's tensor each TP scheduler loaded.
                engine.update_weights(
                    [
                        ("layer.a", torch.full((3,), float(10 * iteration + rank))),
                        ("layer.b", torch.arange(4.0) + 100 * rank + iteration),
                    ]
                )
            if built:  # copy what the schedulers loaded while rank 1's tensors are alive
                out["loaded"].append(
                    {n: [t.tolist() for t in ts] for n, ts in built[0].loaded.items()}
                )
            engine.flush_cache()
            arrive_at_resume()
            engine.resume([TAG_KV_CACHE, TAG_CUDA_GRAPH])
            out["generated"].append(
                engine.generate(PROMPTS[rank], Sampling(max_new_tokens=2, seed=1000 * rank))
            )
            engine.release(ALL_TAGS)
            out.setdefault("released_after", []).append(sorted(engine.released_tags))
        engine.shutdown()
        if built:
            out["visible_devices"] = built[0].visible_devices
            out["init"] = built[0].calls[0][1]
            out["calls"] = built[0].names()
            out["sampling"] = next(kw for n, kw in built[0].calls if n == "generate")
        out["visible_after"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        out["flattened_loads"] = built[0].flattened_loads if built else None
        out["direct_loads"] = built[0].direct_loads if built else None
        out["direct_names"] = built[0].direct_names if built else None
        out["resumed_at"] = resumed_at
        if os.environ.get(TIMINGS_ENV):
            with open(os.environ[TIMINGS_ENV]) as spans:
                out["spans"] = [json.loads(line)["call"] for line in spans]
    except Exception as exc:
        out["error"] = (type(exc).__name__, str(exc))
        out["failed_at"] = time.monotonic()
    finally:
        dist.destroy_process_group()
        results.put((rank, out))


def _run(scenario: str) -> dict[int, dict[str, Any]]:
    return run_ranks(_rank_main, WORLD, scenario)


@pytest.mark.parametrize("scenario", ["iterations", "flattened", "direct"])
def test_one_engine_per_group_on_the_groups_gpus_each_rank_gets_its_own_answers(
    scenario: str,
) -> None:
    """Per tensor ("iterations"), one flattened payload per rank and bucket ("flattened"), or
    one buffer per rank and bucket for rljob's loader ("direct"): TP rank i's scheduler loads
    rank i's tensors."""
    from support.sglang_standin import staged_iteration_calls

    from rljob_worker.engines.base import ALL_TAGS, request_seed
    from rljob_worker.engines.sglang_direct import DIRECT_LOADER

    out = _run(scenario)
    assert "error" not in out[0] and "error" not in out[1], out
    # One load per bucket and iteration on the path taken, none on the others.
    assert out[0]["flattened_loads"] == (ITERATIONS if scenario == "flattened" else 0)
    assert out[0]["direct_loads"] == (ITERATIONS if scenario == "direct" else 0)
    # Only rljob's loader takes buckets shard to shard (the engine spans both ranks).
    assert out[0]["shard_world"] == out[1]["shard_world"] == (2 if scenario == "direct" else None)
    # Only the direct path declares rljob's loader to sglang at start-up.
    declared = out[0]["init"].get("custom_weight_loader")
    assert declared == ([DIRECT_LOADER] if scenario == "direct" else None)
    # Only the leader starts sglang, over both ranks' GPUs in rank order, from the first.
    assert (out[0]["engines_here"], out[1]["engines_here"]) == (1, 0)
    assert out[0]["visible_devices"] == "3,5"
    assert (out[0]["init"]["tp_size"], out[0]["init"]["base_gpu_id"]) == (2, 0)
    # The leader's own CUDA_VISIBLE_DEVICES is back to its one GPU afterwards.
    assert (out[0]["visible_after"], out[1]["visible_after"]) == ("3", "5")
    # Every rank knows the engine's KV capacity and released tags.
    assert out[0]["kv"] == out[1]["kv"] > 0
    assert out[0]["released_at_start"] == out[1]["released_at_start"] == sorted(ALL_TAGS)
    assert out[1]["released_after"] == [sorted(ALL_TAGS)] * ITERATIONS

    for iteration in range(ITERATIONS):
        # Rank r's answers are for rank r's prompts (lengths differ per rank).
        assert out[0]["generated"][iteration] == [[2, 7], [3, 7]]
        assert out[1]["generated"][iteration] == [[4, 7]]
        # TP rank i's scheduler loaded rank i's own tensor, every bucket, every iteration.
        loaded = out[0]["loaded"][iteration]
        assert loaded["layer.a"] == [[10.0 * iteration] * 3, [10.0 * iteration + 1] * 3]
        assert loaded["layer.b"] == [
            [float(x + iteration) for x in range(4)],
            [float(x + 100 + iteration) for x in range(4)],
        ]
    # One sglang call per stage step for the whole group, not one per rank.
    per_iteration = staged_iteration_calls(buckets=1)
    calls = out[0]["calls"]
    assert calls[-len(per_iteration) * ITERATIONS - 1 :] == [
        *per_iteration * ITERATIONS,
        "shutdown",
    ]
    # Both ranks' prompts in one batch, each request with its rank's seed and its index.
    seeds = [params["sampling_seed"] for params in out[0]["sampling"]["sampling_params"]]
    assert seeds == [request_seed(0, 0), request_seed(0, 1), request_seed(1000, 0)]


def test_a_bucket_sent_shard_to_shard_gives_tp_rank_i_rank_is_buffer_under_one_name() -> None:
    from rljob_worker.tp_shards import PAYLOAD_PREFIX

    out = _run("sharded")
    assert "error" not in out[0] and "error" not in out[1], out
    # The engine spans both ranks with rljob's loader: the trainer may send shard to shard,
    # and with no rank's switch at "buffer", its own blocks as stored.
    assert out[0]["shard_world"] == out[1]["shard_world"] == 2
    assert out[0]["own_as_stored"] is out[1]["own_as_stored"] is True
    assert out[0]["direct_loads"] == ITERATIONS
    name = PAYLOAD_PREFIX + '{"world":2,"entries":[]}'
    for iteration in range(ITERATIONS):
        loaded = out[0]["loaded"][iteration]
        assert loaded[name] == [[10 * iteration] * 4, [10 * iteration + 1] * 4]


def test_a_bucket_with_its_own_blocks_as_stored_gives_tp_rank_i_rank_is_two_tensors() -> None:
    """The stored own blocks travel just before the bucket's buffer (tp_shards.STORED_NAME),
    each TP rank getting its rank's, within the same load."""
    from rljob_worker.tp_shards import PAYLOAD_PREFIX, STORED_NAME

    out = _run("sharded_stored")
    assert "error" not in out[0] and "error" not in out[1], out
    assert out[0]["own_as_stored"] is out[1]["own_as_stored"] is True
    name = PAYLOAD_PREFIX + '{"world":2,"entries":[]}'
    assert out[0]["direct_names"] == [[STORED_NAME, name]] * ITERATIONS
    for iteration in range(ITERATIONS):
        loaded = out[0]["loaded"][iteration]
        assert loaded[STORED_NAME] == [[100 * iteration] * 6, [100 * iteration + 1] * 6]
        assert loaded[name] == [[10 * iteration] * 4, [10 * iteration + 1] * 4]
    # The group's own parts of a sync, for bench/sync_trip.py: each rank serialized its handles
    # and joined the gather once a bucket, and heard the leader's answer after the update and
    # the flush (and after every other request to the engine).
    for rank in (0, 1):
        spans = out[rank]["spans"]
        assert spans.count("serialize") == spans.count("tp_gather") == ITERATIONS, spans
        assert spans.count("tp_answer") >= 2 * ITERATIONS, spans


def test_one_ranks_switch_to_buffer_keeps_every_ranks_own_blocks_in_the_buffer() -> None:
    out = _run("sharded_buffer")
    assert "error" not in out[0] and "error" not in out[1], out
    assert out[0]["shard_world"] == out[1]["shard_world"] == 2
    assert out[0]["own_as_stored"] is out[1]["own_as_stored"] is False


def test_ranks_that_send_a_sharded_bucket_under_different_layouts_fail_together() -> None:
    """Rank 1 sends another layout's name: both ranks fail naming it. Rank 1 also has the
    sync switched off (RLJOB_TP_SHARDED_SYNC=0): the engine tells neither rank to shard, so
    no rank's environment alone picks the collective the others wait in."""
    out = _run("sharded_apart")
    for rank in (0, 1):
        assert out[rank]["shard_world"] is None
        _, message = out[rank]["error"]
        assert "rank 1 sent a different bucket than rank 0" in message, out[rank]


def test_the_leader_resumes_memory_only_once_every_rank_of_the_group_has_arrived() -> None:
    """A resume maps memory on every GPU of the group: the leader must not do it while another
    rank is still in the stage before (offloading its params), or it maps the KV pool on a GPU
    that rank still fills (the TP-2 OOM on two H200s, docs/two-gpu.md)."""
    out = _run("slow_peer")
    assert "error" not in out[0] and "error" not in out[1], out
    arrived, resumed = out[1]["arrived_at_resume"], out[0]["resumed_at"]
    # Two resumes per iteration (weights, then KV cache and CUDA graphs), each one call.
    assert len(arrived) == len(resumed) == 2 * ITERATIONS
    # CLOCK_MONOTONIC is one clock for the host's processes.
    for late, done in zip(arrived, resumed, strict=True):
        assert done >= late, (arrived, resumed)
    # The leader itself arrived SLOW_PEER_SECONDS earlier: it waited for rank 1.
    assert resumed[0] - out[0]["arrived_at_resume"][0] >= SLOW_PEER_SECONDS * 0.9


def test_a_failure_on_the_leader_fails_every_rank_of_the_group_naming_the_leader() -> None:
    out = _run("leader_fails")
    assert out[0]["error"][0] == "SGLangEngineError"
    assert "weights do not fit" in out[0]["error"][1]
    name, message = out[1]["error"]
    assert name == "TensorParallelPeerError"
    assert "update_weights failed on rank 0" in message
    assert "tensor-parallel group [0, 1]" in message
    assert "weights do not fit" in message


def test_a_group_that_spans_nodes_is_refused_on_every_rank() -> None:
    out = _run("spans_nodes")
    for rank in range(WORLD):
        name, message = out[rank]["error"]
        assert name == "ValueError"
        assert "spans nodes ['node-0', 'node-1']" in message
        assert out[rank]["engines_here"] == 0


def test_a_leader_killed_outright_fails_the_other_rank_naming_the_leader_in_seconds() -> None:
    # The open case of the tensor-parallel work: the leader sends no error, it is just gone.
    # The other rank's next call waits on the leader over gloo; the broken connection must end
    # it with an error that names the leader and the group, not a wait for the group timeout.
    out = _run("leader_dies")
    assert "error" not in out[0]
    name, message = out[1]["error"]
    assert name == "TensorParallelPeerError", (name, message)
    assert "rank 0" in message and "tensor-parallel group [0, 1]" in message
    assert "stopped answering" in message
    assert out[1]["failed_at"] - out[0]["died_at"] < 30
