"""Benchmark: staged against single-stage awake, sweeping memFractionStatic on real GPUs (issue 8).

Runs the real colocated worker (local driver, FSDP2, the engine --engine names: torch or sglang)
per (mode, fraction) and writes bench/results/colocate.{json,md,png} (sglang: under
bench/results/sglang/, beside the torch results): completion or OOM stage, per-stage peak device
memory, KV capacity (the engine's own figure), rollout tokens/s, weight sync / offload / onload
against the machine's measured copy bandwidths, and the staging tax (every stage that is neither
train nor rollout, as a share of the iteration). Each point runs in fresh rank processes
(run_local), as a job would. After the sweep, the same engine runs alone (no trainer on the
device, same prompts, same sampling, same fraction) at the highest completing staged fraction,
for colocated-against-alone rollout throughput.
The report (colocate.md, colocate.png, the targets) is colocate_report.py's.

Model choice: Qwen2.5-3B (random bf16 init, no download) is the default on one H100: GRPO with a
KL reference, the way verl's recipes run it, keeps fp32 policy params 12.4 GB + grads 12.4 GB +
AdamW 24.7 GB + fp32 reference 12.4 GB = 62 GB on the device while training, which fits 80 GB
with activations; 7B's (~150 GB) does not. --kl-coef 0 drops the reference.

  python bench/colocate.py                        # 3B, both modes, 0.50..0.95, 3 iterations
  python bench/colocate.py --single-fractions 0.6,0.65,0.7 --staged-fractions 0.9,0.95
  python bench/colocate.py --merge a/colocate.json b/colocate.json   # one result from several calls
  python bench/colocate.py --engine sglang        # the same sweep with sglang.Engine
  python bench/colocate.py --smoke                # CPU: tiny model, checks the plumbing only
  python bench/colocate.py --workload realistic --engine sglang --modes staged --fractions 0.9
  python bench/colocate.py --engine sglang --modes staged --fractions 0.9 \
      --sync-path before,tensors,flattened         # the weight-sync paths beside their floor
  python bench/colocate.py --engine sglang --modes staged --fractions 0.9 \
      --overlap-staging off,on                     # the staging tax without and with overlap

Issue 33: --workload realistic runs 128 prompts x 8 samples with answers of varying length up to
1024 tokens (Workload); every point prints each moving stage beside its floor measured in the
same run (its bytes over the measured bandwidth, the rollout's tokens over the same engine
alone) and their ratio (stage_floors).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "worker_image", ROOT / "operator", ROOT / "bench"):
    if str(extra) not in sys.path:  # runnable from a bare checkout on the device machine
        sys.path.insert(0, str(extra))

from colocate_report import (  # noqa: E402 (the report of the result measured here)
    GiB,
    _gib,
    _num,
    _place,
    evaluate_targets,
    write_markdown,
    write_plot,
)
from spawned import free_port, run_spawned_ranks  # noqa: E402 (the probe's rank processes)

from rljob.api import RLJobSpec, WakeUp  # noqa: E402
from rljob.plan import plan_for_point, plan_line  # noqa: E402 (issue 19: the plan beside each point)
from rljob.report import Stage, StageSample  # noqa: E402
from rljob_worker.cli_run import _positive  # noqa: E402 (rljob run's check of a count)
from rljob_worker.driver.local import LocalRun, run_local  # noqa: E402
from rljob_worker.loop import RankIteration  # noqa: E402

_QWEN25_COMMON: dict[str, Any] = {
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
}
# transformers' Qwen2Config fields of the released Qwen2.5 sizes (only the architecture).
QWEN25: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}  # fmt: skip
DEFAULT_FRACTIONS = [round(0.50 + 0.05 * i, 2) for i in range(10)]


@dataclass(frozen=True)
class Workload:
    """What one iteration does (issue 33). `small` is the quick point every stored figure before
    issue 33 used; `realistic` is what the users of 7B-32B models run, scaled to one card: 128
    prompts x 8 samples, responses up to 1024 tokens whose lengths vary, micro-batches of 4 with
    gradient checkpointing (what a user sets for 1k-token sequences at these sizes).

    Response lengths: the models are randomly initialised (no download), whose sampled answers
    never end on their own (EOS is one token in 151936). `eos_hazard` makes them end the way
    answers of a task do, on EOS with a length cap: the model's config.json declares EOS and
    about hazard x vocab other ids as its end-of-sequence ids (stop_set), so each generated
    token ends the answer with about this probability: geometric lengths (mean ~1/hazard, ~370
    tokens with the 1024 cap, ~8% cut at the cap). Both engines stop on them, so the rollout has
    the stragglers and the short answers a real batch has; the report prints the lengths it got
    (mean, max, share at the cap)."""

    prompts: int
    group_size: int
    response_length: int
    micro_batch_size: int
    gradient_checkpointing: bool
    eos_hazard: float | None


WORKLOADS = {
    "small": Workload(8, 8, 128, 4, False, None),
    "realistic": Workload(128, 8, 1024, 4, True, 1 / 400),
}


# -- the machine's own limits ------------------------------------------------------------------


def _time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int = 10) -> float:
    """Median seconds of one dst.copy_(src), each timed with CUDA events, after a warm-up."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def measure_host_bandwidths(size_bytes: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    """On the CPU (--smoke): one host memcpy rate stands in for every link, so the floors and
    their ratios are computed by the same code as on a GPU (the figures mean nothing there)."""
    source = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - began)
    rate = size_bytes / statistics.median(times)
    return {
        "d2d_copy_bytes_per_second": rate,
        "hbm_read_write_bytes_per_second": 2 * rate,
        "h2d_pinned_bytes_per_second": rate,
        "d2h_pinned_bytes_per_second": rate,
        "host_memcpy_stands_in": 1.0,
    }


def measure_bandwidths(size_bytes: int = 2 * GiB) -> dict[str, float]:
    """Bytes copied per second: device-to-device, pinned host-to-device and device-to-host.

    A device-to-device copy of N bytes reads N and writes N: its HBM traffic is twice the
    copy rate reported here (both are in the result).
    """
    device_a = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8, device="cuda")
    device_b = torch.empty_like(device_a)
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    d2d = size_bytes / _time_copy(device_b, device_a)
    figures = {
        "d2d_copy_bytes_per_second": d2d,
        "hbm_read_write_bytes_per_second": 2 * d2d,
        "h2d_pinned_bytes_per_second": size_bytes / _time_copy(device_a, host),
        "d2h_pinned_bytes_per_second": size_bytes / _time_copy(host, device_a),
    }
    del device_a, device_b, host
    torch.cuda.empty_cache()
    return figures


def profile_weight_sync(
    model_name: str, repeats: int = 3, ranks: int = 1, bucket_mb: int = 512, tp: int = 1
) -> dict[str, float]:
    """Seconds of the weight-sync path by part, with the model's shapes sharded over `ranks` GPUs.

    fp32 shards into bf16 engine tensors: (a) per tensor, a DTensor cast, full_tensor and copy_
    (what Trainer.weight_buckets did before sync_send.gather_full), (b) sync_send.gather_full per
    `bucket_mb` MiB bucket (the run's --bucket-mb) and the engine's copy_ (what it does now),
    (c) the rank's own shards without DTensor (local cast-and-copy per tensor; with one rank,
    the same bytes as the engine's), (d) one flat copy of all the engine bytes (the HBM floor)
    and, with more than one rank, (e) the all-gathers alone, one per bucket, as gather_full
    sends them (NCCL between the GPUs). With one engine over all the ranks (`tp` == `ranks`),
    also the shard-to-shard send (rljob_worker/tp_shards.py) per bucket: (f) whole (the trainer's
    sync_send.shard_bucket), (g) its buffers' fill alone (the casts), (h) its exchange alone (one
    all_to_all_single a bucket) and, for comparison, (i) the same bytes as an all-gather.
    Median of `repeats` after a warm-up, as rank 0 saw them. One rank runs in this process; more
    run in their own processes on cuda:0..ranks-1, as the loop's ranks do.
    """
    if ranks == 1:
        address = f"tcp://127.0.0.1:{free_port()}"
        return _profile_rank(0, 1, address, model_name, repeats, bucket_mb)
    work = (model_name, repeats, bucket_mb, tp)
    return dict(run_spawned_ranks(_profile_rank, ranks, work, 300))


def _profile_rank(
    rank: int,
    world: int,
    init_method: str,
    model_name: str,
    repeats: int,
    bucket_mb: int,
    tp: int = 1,
) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rljob_worker.sync_send import flat_all_gather, flat_chunk_elements, gather_full
    from rljob_worker.train import plan_buckets

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=device)  # fmt: skip
    mesh = init_device_mesh("cuda", (world,))
    config = {**_QWEN25_COMMON, **QWEN25[model_name]}
    with torch.device("meta"):
        meta = list(Qwen2ForCausalLM(Qwen2Config(**config)).named_parameters())
    shapes = [p.shape for _, p in meta]
    shards = [distribute_tensor(torch.randn(s, device="cuda"), mesh, [Shard(0)]) for s in shapes]
    targets = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    own = [torch.empty_like(s.to_local(), dtype=torch.bfloat16) for s in shards]
    flat_src = torch.empty(sum(t.numel() for t in targets), dtype=torch.bfloat16, device="cuda")
    flat_dst = torch.empty_like(flat_src)

    def dtensor_path() -> None:
        for shard, target in zip(shards, targets, strict=True):
            target.copy_(shard.to(torch.bfloat16).full_tensor())  # type: ignore[attr-defined]

    named = [(str(i), shard) for i, shard in enumerate(shards)]
    buckets = plan_buckets([(n, t.numel() * 2) for n, t in named], bucket_mb << 20)
    by_name = dict(named)
    target_of = {str(i): t for i, t in enumerate(targets)}

    def gather_full_path() -> None:
        for names in buckets:
            for name, full in gather_full([(n, by_name[n]) for n in names], torch.bfloat16):
                target_of[name].copy_(full)

    def local_path() -> None:
        for shard, target in zip(shards, own, strict=True):
            target.copy_(shard.to_local())

    # What gather_full sends per bucket: each tensor's full chunk (padded), in bf16.
    sends = [
        torch.empty(sum(flat_chunk_elements(by_name[n].shape, world) for n in names),
                    dtype=torch.bfloat16, device="cuda")
        for names in buckets
    ]  # fmt: skip
    receives = [
        torch.empty(world * send.numel(), dtype=send.dtype, device="cuda") for send in sends
    ]

    def all_gathers() -> None:
        for send, receive in zip(sends, receives, strict=True):
            flat_all_gather(receive, send)

    def timed(work: Any, cold: bool = False) -> float:
        # cold: the caching allocator emptied first, as the loop's wake_weights does.
        work()
        times = []
        for _ in range(repeats):
            if cold:
                torch.cuda.empty_cache()
            torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
            work()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    figures = {
        "tensors": float(len(shapes)),
        "ranks": float(world),
        "dtensor_cast_gather_copy_seconds": timed(dtensor_path),
        "gather_full_copy_seconds": timed(gather_full_path),
        "gather_full_copy_cold_seconds": timed(gather_full_path, cold=True),
        "local_cast_copy_seconds": timed(local_path),
        "flat_copy_seconds": timed(lambda: flat_dst.copy_(flat_src)),
    }
    if world > 1:
        figures["all_gather_seconds"] = timed(all_gathers)
        figures["all_gather_bytes"] = float(sum(r.numel() * r.element_size() for r in receives))
    if world > 1 and tp == world:
        figures.update(_profile_shard_send(meta, shards, config, bucket_mb, world, timed))
    dist.destroy_process_group()
    return figures  # the tensors go with this frame; the caller empties the cache


def _profile_shard_send(
    meta: list[tuple[str, Any]],
    shards: list[Any],
    config: dict[str, Any],
    bucket_mb: int,
    world: int,
    timed: Any,
) -> dict[str, float]:
    """profile_weight_sync's (f)-(i): the shard-to-shard send of `shards` (the model's params,
    Shard(0) over `world` ranks, named as `meta`) in `bucket_mb` MiB buckets."""
    from rljob_worker import tp_shards
    from rljob_worker.engines.sglang_weights import DenseLayout
    from rljob_worker.sync_send import flat_all_gather, shard_bucket
    from rljob_worker.train import plan_buckets

    layout = DenseLayout.from_config(config, world)
    named = {name: shard for (name, _), shard in zip(meta, shards, strict=True)}
    buckets = plan_buckets([(n, t.numel() * 2) for n, t in named.items()], bucket_mb << 20)
    plans: dict[Any, Any] = {}

    def send() -> None:
        for names in buckets:
            # The own blocks in the buffer (RLJOB_TP_SHARDED_SYNC=buffer): this profile's shards
            # lie apart, and the fill it times is the whole cast; the loop's runs time the default.
            sent = shard_bucket([(n, named[n]) for n in names], torch.bfloat16, plans, layout,
                                own_as_stored=False)  # fmt: skip
            assert sent is not None, "every bucket of a Qwen2.5 model goes shard to shard"

    send()  # the plans
    kept = list(plans.values())
    device = shards[0].to_local().device
    buffers = [tp_shards.fill(plan, device) for plan in kept]

    def exchanges() -> None:
        for plan, buffer in zip(kept, buffers, strict=True):
            tp_shards.exchange(plan, buffer)

    def as_all_gathers() -> None:  # the same bytes as an all-gather (the other collective)
        for plan, buffer in zip(kept, buffers, strict=True):
            _, sent = tp_shards.regions(plan.layout, buffer)
            out = torch.empty(world * sent.numel(), dtype=sent.dtype, device=device)
            flat_all_gather(out, sent)

    return {
        "shard_send_seconds": timed(send),
        "shard_fill_seconds": timed(lambda: [tp_shards.fill(p, device) for p in kept]),
        "shard_exchange_seconds": timed(exchanges),
        "shard_exchange_as_all_gather_seconds": timed(as_all_gathers),
        "shard_exchange_bytes": float(sum((world - 1) * p.layout.region_bytes for p in kept)),
        "shard_payload_bytes": float(sum(p.layout.payload_bytes for p in kept)),
    }


# -- the model ---------------------------------------------------------------------------------


def stop_set(hazard: float, vocab: int, eos_id: int, first_free: int) -> list[int]:
    """EOS and enough other ids that a random model ends an answer with probability `hazard`
    per token: about hazard x vocab ids (their softmax mass sums to about that share, with
    little spread, since each id's logit is an independent random row against the hidden state;
    one rescaled EOS row was tried first and varied 1000-fold between answers). The extra ids
    are drawn above `first_free`, past the tokenizer's own tokens, with a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    extra = max(round(hazard * vocab) - 1, 0)
    drawn = torch.randperm(vocab - first_free, generator=generator)[:extra] + first_free
    return [eos_id, *sorted(int(i) for i in drawn)]


def build_model(name: str, directory: Path, eos_hazard: float | None = None) -> int:
    """Save a randomly initialised Qwen2.5-architecture model (bf16) and a tokenizer; return #params.

    The tokenizer is the builtin task's (a few hundred tokens): ids beyond it decode to nothing,
    which only affects rewards, not memory or speed. With `eos_hazard`, config.json's
    eos_token_id lists EOS and about eos_hazard x vocab other ids (stop_set), so answers end
    after a geometric number of tokens.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rljob_worker.model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        # With eos_hazard, a list: sglang stops on every id of config.json's eos_token_id, and
        # the loop (model.stop_token_ids) passes the same ids to the torch engine.
        eos_token_id=tokenizer.eos_token_id
        if eos_hazard is None
        else stop_set(
            eos_hazard, _QWEN25_COMMON["vocab_size"], tokenizer.eos_token_id, len(tokenizer)
        ),
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        **_QWEN25_COMMON,
        **QWEN25[name],
    )
    if not (directory / "config.json").exists():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = Qwen2ForCausalLM(config).bfloat16()
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())


# -- one (mode, fraction) point ----------------------------------------------------------------


@dataclass
class Point:
    mode: str
    fraction: float
    completed: bool
    iterations_done: int = 0
    wall_seconds: float = 0.0
    failure: str | None = None
    failure_kind: str = "oom"  # or "error": a Python error, not an OOM (see summarize_point)
    oom_stage: str | None = None
    oom_iteration: int | None = None
    kv_capacity_tokens: int | None = None
    kv_pool_bytes: int | None = None
    stage_peak_bytes: dict[str, int] = field(default_factory=dict)  # rank 0's GPU
    # The other ranks' GPUs, by rank (str), where there are several.
    stage_peak_bytes_other_ranks: dict[str, dict[str, int]] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    rollout_tokens_per_second: float | None = None
    weight_sync_seconds: float | None = None
    # Its part in the engine's update_weights (the hand-off); the rest is the trainer's gather.
    weight_handoff_seconds: float | None = None
    offload_seconds: float | None = None
    onload_seconds: float | None = None
    # Device memory (mem_get_info) given back by each release, against the bytes released.
    released: dict[str, dict[str, int]] = field(default_factory=dict)
    # Steady seconds of the stages that are neither train nor rollout, over all stages.
    staging_tax: float | None = None
    staging_dominant: str | None = None  # the largest of those stages
    # spec.offload and what it came to: Always offloads what training.offload* allow, Auto
    # the least the memory plan says the point needs (issue 19).
    offload: str = "Always"
    offload_optimizer: bool = True
    offload_params: bool = True
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # Issue 33: the weight-sync path the point ran (SYNC_PATHS), the rollout's answers (rank 0,
    # steady iterations), and each stage's floor beside its seconds (stage_floors).
    sync_path: str = "default"
    # spec.training.overlapStaging the point ran with (--overlap-staging; Off, the spec's
    # default, for points stored before it).
    overlap_staging: str = "Off"
    response_tokens: float | None = None  # generated per rollout, rank 0
    response_length_mean: float | None = None
    response_length_max: int | None = None
    truncated_share: float | None = None  # answers cut at maxResponseLength
    iteration_seconds: float | None = None  # the steady iteration, every stage
    floors: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # The train stage's parts (TrainStats.pass_seconds: log-prob passes, forward/backward,
    # optimizer steps), rank 0's, steady.
    train_pass_seconds: dict[str, float] = field(default_factory=dict)
    # Issue 30 (--checkpoint-every): spec.checkpoint.everyIterations the point ran with, rank
    # 0's saves (iteration, bytes, seconds to durable, seconds the loop stood still), and the
    # steady checkpoint stage's share of the steady iteration.
    checkpoint_every: int | None = None
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_share: float | None = None


def make_spec(
    args: argparse.Namespace, model_path: str, mode: str, fraction: float, overlap: str = "Auto"
) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"path": model_path, "dtype": "float32" if args.smoke else "bfloat16"},
            "algorithm": {"name": "grpo", "group_size": args.group_size, "kl_coef": args.kl_coef,
                          "iterations": args.iterations, "seed": 0},
            "data": {"source": "builtin:arithmetic", "train_batch_size": args.prompts,
                     "max_response_length": args.response_length},
            "rollout": {"engine": args.engine, "wake_up": mode, "mem_fraction_static": fraction,
                        "tensor_parallel_size": args.tp,
                        "weight_sync_bucket_megabytes": getattr(args, "bucket_mb", None) or 512},
            "training": {"micro_batch_size": args.micro_batch_size,
                         "gradient_checkpointing": args.gradient_checkpointing,
                         "overlap_staging": overlap},
            # One worker with the ranks' GPUs: a tensor-parallel group lies within one worker.
            "resources": {"gpus_per_worker": args.ranks if args.tp > 1 else 1},
            # Always by default, as every stored point was measured: offload as
            # training.offload* say; Auto (the product's default since issue 19) offloads only
            # what the memory plan says the KV pool needs.
            "offload": args.offload,
            **checkpoint_spec(args, mode, fraction, overlap),
        }
    )  # fmt: skip


def checkpoint_spec(
    args: argparse.Namespace, mode: str, fraction: float, overlap: str
) -> dict[str, Any]:
    """spec.checkpoint for --checkpoint-every N (issue 30: what a save costs an iteration): the
    asynchronous save (the default mode) every N iterations into a directory of the point's
    own, the newest one kept, never resumed from (each point starts at iteration 0)."""
    every = getattr(args, "checkpoint_every", None)
    if not every:
        return {}
    directory = Path(args.checkpoint_dir) / f"{mode}-{fraction:.2f}-overlap-{overlap}"
    return {"checkpoint": {"path": str(directory), "every_iterations": every, "keep": 1,
                           "resume": "Never", "mode": args.checkpoint_mode}}  # fmt: skip


class StageProgress:
    """Each stage rank 0 ends, as it ends: a line printed and a JSON line appended to
    `path`, so a point cut short (a call's time limit) still tells where its time went."""

    def __init__(self, path: Path, point: str) -> None:
        self.path, self.point, self.began = path, point, time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, event: object) -> None:
        if not isinstance(event, StageSample) or event.rank != 0:
            return
        elapsed = time.monotonic() - self.began
        with self.path.open("a") as out:
            out.write(json.dumps({"point": self.point, "elapsed_seconds": round(elapsed, 3),
                                  **event.model_dump(mode="json")}) + "\n")  # fmt: skip
        print(
            f"  [{elapsed:7.1f} s] iteration {event.iteration} {event.stage}: "
            f"{event.seconds:.2f} s, peak {_gib(event.device_peak_used_bytes)} GiB",
            flush=True,
        )


def _micro_batch_arg(text: str) -> int | str:
    return text if text == "auto" else _positive(text)


def fitting_micro_batch(
    args: argparse.Namespace,
    model_path: str,
    mode: str,
    fraction: float,
    overlap: str,
    capacity_bytes: int,
) -> int:
    """--micro-batch-size auto: the workload's micro-batch, halved until the memory plan's
    training stages (train, offload_optimizer) fit a card of `capacity_bytes` at the first point
    (what the OOM policy would do after a training OOM, done before the run); 1 if none does."""
    shape = {**_QWEN25_COMMON, **QWEN25[args.model]}
    size = args.micro_batch_size
    while True:
        sized = argparse.Namespace(**{**vars(args), "micro_batch_size": size})
        m = plan_for_point(make_spec(sized, model_path, mode, fraction, overlap), shape,
                           capacity_bytes, args.ranks)  # fmt: skip
        training = [s for s in m.stages if s.stage in (Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER)]
        if size == 1 or all(s.fits for s in training):
            print(f"micro-batch auto: {size} (train planned "
                  f"{max(s.peak_bytes for s in training) / GiB:.2f} GiB)", flush=True)  # fmt: skip
            return size
        size = max(1, size // 2)


def failure_kind(error: str) -> str:
    """ "oom" or "error" for a rank's traceback: cuBLAS reports a failed workspace allocation
    (CUBLAS_STATUS_ALLOC_FAILED) as a RuntimeError, which is an OOM all the same."""
    return "oom" if "ALLOC_FAILED" in error or "out of memory" in error else "error"


def _last_stage_before_death(run: LocalRun, mode: str) -> tuple[str | None, int | None]:
    """The stage a rank died in without a report: the one after its last sampled stage."""
    from rljob_worker.stages import stage_order

    if not run.samples:
        # Died before the first stage: the engine could not allocate its weights and KV pool
        # even on an otherwise empty device (the fraction leaves no room for the CUDA context).
        return "engine_start", None
    last = max(run.samples, key=lambda s: s.start_seconds)
    order = stage_order(WakeUp(mode), last.iteration)
    index = order.index(last.stage)
    if index + 1 < len(order):
        return str(order[index + 1]), last.iteration
    return str(stage_order(WakeUp(mode), last.iteration + 1)[0]), last.iteration + 1


def _steady(values: dict[int, float]) -> float | None:
    """Median over the steady iterations: from iteration 2 on where there are any, since
    iteration 1 also pins the host buffers (first offload) and iteration 0 has no training."""
    steady = [v for i, v in values.items() if i >= 2] or [v for i, v in values.items() if i >= 1]
    return statistics.median(steady) if steady else None


def syncs_of_the_last_rank_in(
    iterations: list[RankIteration],
) -> tuple[dict[int, float], dict[int, float]]:
    """Each iteration's weight sync and hand-off seconds as the rank that reached the sync last
    ran them: the least sync over the ranks. Every other rank's sync also holds its wait for
    that one at the first all-gather, the ranks' skew (at 7B on two H200s up to 1.7 s of a
    60 ms sync). On one rank, rank 0's."""
    last_in: dict[int, RankIteration] = {}
    for item in iterations:
        seconds = item.weight_sync_seconds
        if seconds is None:
            continue
        held = last_in.get(item.iteration)
        if held is None or seconds < (held.weight_sync_seconds or 0.0):
            last_in[item.iteration] = item
    syncs = {k: t for k, v in last_in.items() if (t := v.weight_sync_seconds) is not None}
    handoffs = {k: t for k, v in last_in.items() if (t := v.weight_handoff_seconds) is not None}
    return syncs, handoffs


def _offloads(spec: RLJobSpec, iterations: list[RankIteration]) -> tuple[bool, bool]:
    """(optimizer, params) as rank 0 offloaded them (its plan's choice under offload Auto, as
    each iteration reports); the flags, where it reported no iteration."""
    for item in iterations:
        if item.offload_optimizer is not None and item.offload_params is not None:
            return item.offload_optimizer, item.offload_params
    return spec.training.offload_optimizer, spec.training.offload_params


def summarize_point(
    run: LocalRun,
    mode: str,
    fraction: float,
    model: dict[str, Any],
    args: argparse.Namespace,
    spec: RLJobSpec,
) -> Point:
    iterations: list[RankIteration] = [i for i in run.iterations if i.rank == 0]
    offloads = _offloads(spec, iterations)
    point = Point(mode=mode, fraction=fraction, completed=run.ok, offload=args.offload,
                  offload_optimizer=offloads[0], offload_params=offloads[1])  # fmt: skip
    if run.ooms:
        point.oom_stage, point.oom_iteration = str(run.ooms[0].stage), run.ooms[0].iteration
        point.failure = run.ooms[0].message[:300]
    elif run.errors:
        error = next(iter(run.errors.values()))
        point.failure = error[-300:]
        if "without a report" in error:
            # torch_memory_saver can end the process when a mapping fails: an OOM in the
            # stage the rank never finished (its sample was never recorded).
            point.oom_stage, point.oom_iteration = _last_stage_before_death(run, mode)
        else:  # a Python error; its stage recorded a sample before it propagated
            point.failure_kind = failure_kind(error)
            failed = max(run.samples, key=lambda s: s.start_seconds, default=None)
            if failed is not None:
                point.oom_stage, point.oom_iteration = str(failed.stage), failed.iteration
    point.iterations_done = max((i.iteration for i in iterations), default=0)
    if iterations:
        point.kv_capacity_tokens = min(i.kv_capacity_tokens for i in iterations)
        point.kv_pool_bytes = kv_pool_bytes(args.engine, point.kv_capacity_tokens, model)
    samples: list[StageSample] = [s for s in run.samples if s.rank == 0]
    per_stage: dict[str, dict[int, float]] = {}
    for sample in samples:
        name = str(sample.stage)
        point.stage_peak_bytes[name] = max(
            point.stage_peak_bytes.get(name, 0), sample.device_peak_used_bytes
        )
        per_stage.setdefault(name, {})[sample.iteration] = sample.seconds
    point.stage_seconds = {
        k: v for k, v in ((n, _steady(t)) for n, t in per_stage.items()) if v is not None
    }
    point.staging_tax, point.staging_dominant = staging_tax(point.stage_seconds)

    def summed(*stages: Stage) -> float | None:
        by_iteration: dict[int, float] = {}
        for stage in stages:
            for i, seconds in per_stage.get(str(stage), {}).items():
                by_iteration[i] = by_iteration.get(i, 0.0) + seconds
        return _steady(by_iteration)

    passes: dict[str, dict[int, float]] = {}
    for item in iterations:
        for part, seconds in (item.train.pass_seconds if item.train else {}).items():
            passes.setdefault(part, {})[item.iteration] = seconds
    point.train_pass_seconds = {
        k: v for k, v in ((n, _steady(t)) for n, t in passes.items()) if v is not None
    }
    syncs, handoffs = syncs_of_the_last_rank_in(run.iterations)
    point.weight_sync_seconds = _steady(syncs)
    point.weight_handoff_seconds = _steady(handoffs)
    point.offload_seconds = summed(Stage.OFFLOAD_OPTIMIZER, Stage.OFFLOAD_TRAIN)
    point.onload_seconds = summed(Stage.SLEEP)
    rollout = summed(Stage.ROLLOUT)
    stats = {i.iteration: i.rollout for i in iterations if i.rollout is not None}
    if stats:
        point.response_tokens = _steady({k: float(v.response_tokens) for k, v in stats.items()})
        responses = sum(v.responses for v in stats.values())
        point.response_length_mean = sum(v.response_tokens for v in stats.values()) / responses
        point.response_length_max = max(v.response_length_max for v in stats.values())
        point.truncated_share = sum(v.truncated for v in stats.values()) / responses
    rollouts = per_stage.get(str(Stage.ROLLOUT), {})
    if stats and rollouts:
        # The tokens this rank generated (answers end on EOS), not prompts x samples x cap.
        point.rollout_tokens_per_second = _steady(
            {i: stats[i].response_tokens / t for i, t in rollouts.items() if i in stats and t}
        )
    elif rollout:
        point.rollout_tokens_per_second = model["tokens_per_rollout"] / rollout
    if point.stage_seconds:
        point.iteration_seconds = sum(point.stage_seconds.values())
    if spec.checkpoint is not None:
        point.checkpoint_every = spec.checkpoint.every_iterations
        # By the checkpoint's own iteration: an asynchronous save is reported in the iteration
        # whose boundary found it complete (often the next), the last one by the run's end.
        saved = {i.checkpoint.iteration: i.checkpoint for i in iterations if i.checkpoint}
        saved.update({c.iteration: c for c in run.checkpoints if c.iteration not in saved})
        point.checkpoints = [
            {"iteration": n, "bytes": c.bytes, "seconds": c.seconds,
             "blocked_seconds": c.blocked_seconds}
            for n, c in sorted(saved.items())
        ]  # fmt: skip
        stage = point.stage_seconds.get(str(Stage.CHECKPOINT))
        if stage is not None and point.iteration_seconds:
            point.checkpoint_share = stage / point.iteration_seconds
    last = max((s.iteration for s in samples), default=0)
    ordered = sorted((s for s in samples if s.iteration == last), key=lambda s: s.start_seconds)
    point.timeline = [
        {"stage": str(s.stage), "start_seconds": s.start_seconds, "seconds": s.seconds,
         "peak_bytes": s.device_peak_used_bytes, "end_bytes": s.device_used_bytes,
         # torch's allocator at the stage's end: what the plan's residual terms are made of
         "allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes}
        for s in ordered
    ]  # fmt: skip
    # Every rank's peaks where there are several: a tensor-parallel engine's leader takes
    # memory on the other ranks' GPUs too, and the plan is checked against each (rank 0's
    # stay in stage_peak_bytes, as every stored point has them).
    for sample in run.samples:
        if sample.rank != 0:
            peaks = point.stage_peak_bytes_other_ranks.setdefault(str(sample.rank), {})
            name = str(sample.stage)
            peaks[name] = max(peaks.get(name, 0), sample.device_peak_used_bytes)
    # Host memory (smoke runs) says nothing about device releases: checked on CUDA only.
    if point.completed and last >= 1 and samples[0].kind == "cuda":
        card_pool = kv_pool_bytes(args.engine, point.kv_capacity_tokens or 0, model, per_gpu=True)
        for rank in sorted({s.rank for s in run.samples}):
            mine = sorted(
                (s for s in run.samples if s.rank == rank and s.iteration == last),
                key=lambda s: s.start_seconds,
            )
            checks = release_check(mine, model, card_pool, offloads)
            point.released.update({k if rank == 0 else f"rank {rank} {k}": c for k, c in checks.items()})  # fmt: skip
    return point


def kv_pool_bytes(
    engine: str, capacity_tokens: int, model: dict[str, Any], per_gpu: bool = False
) -> int:
    """The KV pool's device bytes for the capacity the engine reports: K and V, every layer.
    The torch engine adds one null block (16 tokens); sglang's pool (MHATokenToKVPool) one
    padding page of a token. `per_gpu`: one GPU's part of a tensor-parallel engine's pool (its
    KV heads), the whole pool at TP 1."""
    extra = 16 if engine == "torch" else 1
    key = "kv_bytes_per_token_per_gpu" if per_gpu else "kv_bytes_per_token"
    return (capacity_tokens + extra) * model.get(key, model["kv_bytes_per_token"])


def staging_tax(stage_seconds: dict[str, float]) -> tuple[float | None, str | None]:
    """(share of the iteration in stages other than train and rollout, the largest of them)."""
    total = sum(stage_seconds.values())
    staging = {k: v for k, v in stage_seconds.items() if k not in ("train", "rollout")}
    if total <= 0 or "rollout" not in stage_seconds:
        return None, None
    return sum(staging.values()) / total, max(staging, key=staging.__getitem__, default=None)


def release_check(
    ordered: list[StageSample],
    model: dict[str, Any],
    kv_pool_bytes: int,
    offloads: tuple[bool, bool] = (True, True),
) -> dict[str, dict[str, int]]:
    """Device memory each release gave back on one rank's GPU (mem_get_info at its stage
    ends, `ordered`) against that GPU's share of the bytes released.

    offload_optimizer frees the rank's AdamW moments (plus gradients and activations cached
    since train, hence >=); offload_train its sharded params; sleep the engine's weights and KV
    pool on this GPU (`kv_pool_bytes`: this GPU's part of the pool; at tensor parallel N each
    GPU holds 1/N of the weights and its KV heads) while it loads the offloaded training state
    back, so its freed bytes are (end of rollout - end of sleep) + bytes loaded back. A part
    that `offloads` (optimizer, params) keeps on the device releases nothing and is not checked.
    """
    end = {str(s.stage): s.device_used_bytes for s in ordered}
    order = [str(s.stage) for s in ordered]
    before = {order[i]: end[order[i - 1]] for i in range(1, len(order))}
    checks = {}
    optimizer_bytes = model["optimizer_bytes"] if offloads[0] else 0
    param_bytes = model["train_param_bytes"] if offloads[1] else 0
    if "offload_optimizer" in before and optimizer_bytes:
        checks["offload_optimizer"] = {"released_bytes": optimizer_bytes,
                                       "freed_bytes": before["offload_optimizer"] - end["offload_optimizer"]}  # fmt: skip
    if "offload_train" in before and param_bytes:
        checks["offload_train"] = {"released_bytes": param_bytes,
                                   "freed_bytes": before["offload_train"] - end["offload_train"]}  # fmt: skip
    if "sleep" in before:
        loaded = param_bytes + optimizer_bytes
        engine_bytes = model.get("engine_weight_bytes_per_gpu", model["engine_weight_bytes"])
        checks["sleep"] = {"released_bytes": engine_bytes + kv_pool_bytes,
                           "freed_bytes": before["sleep"] - end["sleep"] + loaded}  # fmt: skip
    return checks


# -- the engine alone --------------------------------------------------------------------------


def _engine_alone_main(spec_json: str, ranks: int, device: str) -> dict[str, Any]:
    """In a fresh process: rank 0's engine with no trainer on the device, awake throughout, doing
    the rollouts of iterations 0..N with the loop's own rollout (same prompts, same sampling
    seeds); seconds per rollout and tokens generated."""
    from rljob_worker.engines import make_engine
    from rljob_worker.loop import RankConfig, _Rollout
    from rljob_worker.model import load_tokenizer, resolve_model_path, stop_token_ids
    from rljob_worker.reward import Scorer
    from rljob_worker.task import make_task

    spec = RLJobSpec.model_validate_json(spec_json)
    tokenizer = load_tokenizer(resolve_model_path(spec.model.path))
    eos = stop_token_ids(tokenizer, resolve_model_path(spec.model.path))
    engine = make_engine(spec, device=device, eos_token_ids=eos)
    try:
        # The sglang adapter starts with every tag released (the stage machine wakes them);
        # alone, the engine is awake throughout.
        if engine.released_tags:
            engine.resume(sorted(engine.released_tags))
        rollout = _Rollout(spec, RankConfig(rank=0, world_size=ranks, device=device), engine,
                           tokenizer, make_task(spec.data, spec.algorithm.seed, tokenizer),
                           Scorer(spec.reward), eos)  # fmt: skip
        seconds: dict[int, float] = {}
        tokens: dict[int, int] = {}
        for iteration in range(spec.algorithm.iterations + 1):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            began = time.perf_counter()
            experience = rollout(iteration)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[iteration] = time.perf_counter() - began
            tokens[iteration] = sum(len(r) for r in experience.response_ids)
        return {
            "seconds": seconds,
            "tokens": tokens,
            "kv_capacity_tokens": engine.kv_capacity_tokens,
        }
    finally:
        engine.shutdown()


def engine_alone(spec: RLJobSpec, ranks: int, device: str, point: dict[str, Any],
                 model: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The engine alone at `point`'s mode and fraction, in a fresh process, against `point`'s
    colocated rollout: the same tokens-per-rollout figure over the same steady iterations."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    began = time.monotonic()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        alone = pool.submit(_engine_alone_main, spec.model_dump_json(), ranks, device).result()
    seconds = {int(k): v for k, v in alone["seconds"].items()}
    tokens = {int(k): v for k, v in alone["tokens"].items()}
    # Tokens per second of each steady rollout: the answers' lengths vary between rollouts.
    steady = _steady({i: seconds[i] / max(tokens[i], 1) for i in seconds})
    figure: dict[str, Any] = {
        "mode": point["mode"],
        "fraction": point["fraction"],
        "rollout_seconds": seconds,
        "generated_tokens": alone["tokens"],
        "kv_capacity_tokens": alone["kv_capacity_tokens"],
        "rollout_tokens_per_second": 1 / steady if steady else None,
        "wall_seconds": time.monotonic() - began,
    }
    colocated = point.get("rollout_tokens_per_second")
    if colocated and figure["rollout_tokens_per_second"]:
        figure["colocated_over_alone"] = colocated / figure["rollout_tokens_per_second"]
    return figure


# -- floors (issue 33) -------------------------------------------------------------------------

# --sync-path: the weight sync's hand-off and overlap, set for the point's rank processes.
# before: one tensor per parameter, each bucket gathered after the last was handed over (main
# before issue 33); tensors: the same hand-off, the next gather overlapping it; flattened: one
# buffer per bucket (sglang's flattened_bucket), overlapped; direct: one buffer per bucket that
# rljob's loader in the schedulers copies into sglang's parameters (engines/sglang_direct.py),
# overlapped; direct-serial: the same, each bucket gathered after the last was loaded. default:
# what the worker picks.
SYNC_PATHS: dict[str, dict[str, str]] = {
    "default": {},
    "before": {"RLJOB_SGLANG_WEIGHT_SYNC": "tensors", "RLJOB_WEIGHT_SYNC_OVERLAP": "0"},
    "tensors": {"RLJOB_SGLANG_WEIGHT_SYNC": "tensors", "RLJOB_WEIGHT_SYNC_OVERLAP": "1"},
    "flattened": {"RLJOB_SGLANG_WEIGHT_SYNC": "flattened_bucket", "RLJOB_WEIGHT_SYNC_OVERLAP": "1"},
    "direct": {"RLJOB_SGLANG_WEIGHT_SYNC": "direct", "RLJOB_WEIGHT_SYNC_OVERLAP": "1"},
    "direct-serial": {"RLJOB_SGLANG_WEIGHT_SYNC": "direct", "RLJOB_WEIGHT_SYNC_OVERLAP": "0"},
}


# --overlap-staging: spec.training.overlapStaging per point (issue 33 part 3).
OVERLAP_SETTINGS = {"auto": "Auto", "on": "On", "off": "Off"}


class environment_set:
    """os.environ updated for a block (the rank processes run_local starts inherit it)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.before: dict[str, str | None] = {}

    def __enter__(self) -> None:
        self.before = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *_: object) -> None:
        for key, value in self.before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def weight_sync_floor_bytes(model: dict[str, Any]) -> int:
    """HBM bytes the weight sync cannot do without, per rank: its fp32 shard of the policy read
    once, the engine's bf16 weights (its TP shard) written once."""
    # The fp32 policy shard, as recorded; results stored before it was recorded had an fp32
    # reference beside it in train_param_bytes (half of it, where there was a reference).
    policy = model.get("policy_shard_bytes") or (
        model["train_param_bytes"] // (2 if model["reference"] else 1)
    )
    return policy + model["engine_weight_bytes"] // model.get("tp", 1)


def stage_floors(point: dict[str, Any], model: dict[str, Any], bandwidths: dict[str, float],
                 alone: dict[str, Any] | None,
                 sync_profile: dict[str, Any] | None = None) -> dict[str, dict[str, float | None]]:  # fmt: skip
    """Each moving stage's seconds beside its floor (its bytes over the link's bandwidth measured
    in the same run; the rollout's tokens over the same engine alone), and their ratio.

    With more than one rank and --profile-sync, also `weight_sync_with_link`: the sync against
    the larger of its HBM floor and the all-gathers alone (profile_weight_sync, same run), as a
    rank with an engine of its own must receive the other ranks' shards over the GPUs' link,
    which the HBM floor does not count. Its bytes are what a rank receives."""
    if not bandwidths or not point["completed"]:
        return {}
    optimizer = model["optimizer_bytes"] if point.get("offload_optimizer", True) else 0
    params = model["train_param_bytes"] if point.get("offload_params", True) else 0
    seconds = point["stage_seconds"]
    rows: dict[str, tuple[float | None, float, float | None]] = {
        "offload_optimizer": (seconds.get("offload_optimizer"), optimizer,
                              bandwidths["d2h_pinned_bytes_per_second"]),
        "weight_sync": (point.get("weight_sync_seconds"), weight_sync_floor_bytes(model),
                        bandwidths["hbm_read_write_bytes_per_second"]),
        "offload_train": (seconds.get("offload_train"), params,
                          bandwidths["d2h_pinned_bytes_per_second"]),
        "sleep": (seconds.get("sleep"), optimizer + params,
                  bandwidths["h2d_pinned_bytes_per_second"]),
    }  # fmt: skip
    floors: dict[str, dict[str, float | None]] = {}
    for name, (measured, moved, bandwidth) in rows.items():
        floor = moved / bandwidth if bandwidth else None
        floors[name] = {"seconds": measured, "bytes": float(moved), "floor_seconds": floor,
                        "ratio": measured / floor if measured and floor else None}  # fmt: skip
    link = (sync_profile or {}).get("all_gather_seconds")
    ranks = (sync_profile or {}).get("ranks") or 1
    hbm = floors["weight_sync"]["floor_seconds"]
    if link and hbm and ranks > 1:
        measured = point.get("weight_sync_seconds")
        floor = max(hbm, link)
        received = sync_profile["all_gather_bytes"] * (ranks - 1) / ranks  # type: ignore[index]
        floors["weight_sync_with_link"] = {
            "seconds": measured, "bytes": float(received), "floor_seconds": floor,
            "ratio": measured / floor if measured else None,
        }  # fmt: skip
    same = alone and (alone.get("mode"), alone.get("fraction")) == (
        point["mode"],
        point["fraction"],
    )
    alone_rate = alone.get("rollout_tokens_per_second") if same and alone else None
    tokens = point.get("response_tokens")
    floor = tokens / alone_rate if tokens and alone_rate else None
    measured = seconds.get("rollout")
    floors["rollout"] = {"seconds": measured, "tokens": tokens, "floor_seconds": floor,
                         "ratio": measured / floor if measured and floor else None}  # fmt: skip
    return floors


def model_figures(name: str, n_params: int, args: argparse.Namespace) -> dict[str, Any]:
    """Bytes of everything the iteration moves, from the architecture (ranks shard training)."""
    shard = max(args.ranks, 1)
    arch = QWEN25.get(name, {})
    kv_per_token = kv_per_gpu = 0
    tp = max(args.tp, 1)
    if arch:
        head_dim = arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
        kv_per_token = 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * head_dim * 2
        # sglang gives each TP rank kv_heads / tp heads (one, replicated, where fewer).
        heads_per_gpu = max(arch["num_key_value_heads"] // tp, 1)
        kv_per_gpu = 2 * arch["num_hidden_layers"] * heads_per_gpu * head_dim * 2
    reference = args.kl_coef > 0
    # fp32 policy (+ the reference in the engine's bf16, since the sharded loader of issue 30)
    param_bytes = (4 + (2 if reference else 0)) * n_params // shard
    optimizer_bytes = 8 * n_params // shard  # AdamW exp_avg + exp_avg_sq, fp32
    return {
        "name": name,
        "parameters": n_params,
        **arch,
        "reference": reference,
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_per_token_per_gpu": kv_per_gpu,
        "engine_weight_bytes": 2 * n_params,
        "engine_weight_bytes_per_gpu": 2 * n_params // tp,  # TP shards (norms replicated: KiB)
        "tp": args.tp,
        "policy_shard_bytes": 4 * n_params // shard,  # fp32, what the weight sync reads
        "train_param_bytes": param_bytes,
        "optimizer_bytes": optimizer_bytes,
        "training_state_bytes": param_bytes + optimizer_bytes + 4 * n_params // shard,
        "tokens_per_rollout": args.prompts // shard * args.group_size * args.response_length,
    }


def finish(result: dict[str, Any], out: Path) -> None:
    """Best fractions, targets, and the three files (written after every point)."""
    points = result["points"]
    result["best"] = {
        mode: max((p["fraction"] for p in points if p["mode"] == mode and p["completed"]),
                  default=None)
        for mode in ("single", "staged")
    }  # fmt: skip
    for point in points:
        point["floors"] = stage_floors(point, result["model"], result["bandwidths"],
                                       result.get("alone"), result.get("weight_sync_profile"))  # fmt: skip
    result["targets"] = evaluate_targets(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "colocate.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, out / "colocate.md")
    write_plot(result, out / "colocate.png")


def merge(paths: list[Path], out: Path) -> None:
    """Several runs' colocate.json (e.g. one per device call) into one result."""
    results = [json.loads(p.read_text()) for p in paths]
    for run, result in enumerate(results, 1):
        for point in result["points"]:
            point["run"] = run  # which command (numbered in the md) ran it
            if point["failure"] and point["oom_stage"] is None:  # written before "engine_start"
                point["oom_stage"] = "engine_start"
    merged = results[0]
    for other in results[1:]:
        for key, default in (("device", None), ("engine", "torch"), ("ranks", 1), ("tp", 1)):
            theirs = other["environment"].get(key, default)
            ours = merged["environment"].get(key, default)
            if theirs != ours:
                raise SystemExit(f"cannot merge runs of {key} {theirs} and {ours}")
        if other["model"]["name"] != merged["model"]["name"]:
            raise SystemExit(f"cannot merge runs of model {other['model']['name']} and "
                             f"{merged['model']['name']}")  # fmt: skip
        merged["commands"] += other["commands"]
        merged.setdefault("bandwidth_runs", [merged["bandwidths"]]).append(other["bandwidths"])
        if other.get("weight_sync_profile"):
            merged["weight_sync_profile"] = other["weight_sync_profile"]
        if other.get("alone"):
            merged["alone"] = other["alone"]
        done = {_place(p) for p in other["points"]}
        for point in other["points"]:  # results written before failure_kind knew cuBLAS
            if point["failure"] and point.get("failure_kind") == "error":
                point["failure_kind"] = failure_kind(point["failure"])
        merged["points"] = [p for p in merged["points"] if _place(p) not in done] + other["points"]
    finish(merged, out)


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-3b", choices=sorted(QWEN25))
    parser.add_argument("--engine", default="torch", choices=("torch", "sglang"))
    parser.add_argument("--tp", type=int, default=1,
                        help="spec.rollout.tensorParallelSize (sglang; divides --ranks)")  # fmt: skip
    parser.add_argument("--no-alone", dest="alone", action="store_false",
                        help="skip the engine-alone pass after the sweep")  # fmt: skip
    parser.add_argument("--modes", default="single,staged")
    parser.add_argument("--fractions", default=",".join(f"{f:.2f}" for f in DEFAULT_FRACTIONS))
    parser.add_argument("--single-fractions", help="overrides --fractions for single")
    parser.add_argument("--staged-fractions", help="overrides --fractions for staged")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="GPUs (FSDP shards over them)")
    parser.add_argument("--workload", default="small", choices=sorted(WORKLOADS),
                        help="small: the quick point; realistic: 128 prompts x 8 samples x up "
                             "to 1024 tokens ending on EOS (see Workload); the flags below "
                             "override single values")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=None, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--response-length", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=_micro_batch_arg, default=None,
                        help="a number, or auto: the workload's halved until the plan's "
                             "training stages fit the card (CUDA only)")  # fmt: skip
    parser.add_argument("--bucket-mb", type=int, default=512,
                        help="spec.rollout.weightSyncBucketMegabytes: the weight sync's bucket, "
                             "MiB (the spec's default 512)")  # fmt: skip
    parser.add_argument("--sync-path", default="default",
                        help=f"comma list of {', '.join(SYNC_PATHS)}: each point runs once per "
                             "weight-sync path (see SYNC_PATHS)")  # fmt: skip
    parser.add_argument(
        "--overlap-staging",
        default="off",
        help="comma list of auto,on,off: each point once per setting "
        "(spec.training.overlapStaging; docs/performance.md)",
    )
    parser.add_argument("--checkpoint-every", type=_positive, default=None,
                        help="spec.checkpoint.everyIterations for every point (issue 30: the "
                             "save's share of an iteration); none by default")  # fmt: skip
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/rljob-bench-checkpoints"),
                        help="each point's checkpoints go under it, deleted after the point")  # fmt: skip
    parser.add_argument("--checkpoint-mode", default="Async", choices=("Async", "Sync"))
    parser.add_argument("--kl-coef", type=float, default=0.001, help="> 0 keeps a reference")
    parser.add_argument("--offload", default="Always", choices=("Always", "Auto"),
                        help="spec.offload (Always: as every stored point ran)")  # fmt: skip
    parser.add_argument("--keep-going", action="store_true", help="sweep past a mode's first OOM")
    parser.add_argument("--deadline-seconds", type=float, default=None,
                        help="start no new point, nor the engine-alone pass, after this many seconds")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results (torch), bench/results/sglang (sglang)")  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/rljob-bench-models"))
    parser.add_argument("--profile-sync", action="store_true",
                        help="time the weight-sync path by part first (see profile_weight_sync)")  # fmt: skip
    parser.add_argument("--merge", type=Path, nargs="+", help="combine colocate.json files")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, builtin tiny model, plumbing only"
    )
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    for name in ("prompts", "group_size", "response_length", "micro_batch_size"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(workload, name))
    args.gradient_checkpointing = workload.gradient_checkpointing
    args.eos_hazard = workload.eos_hazard
    sync_paths = [p.strip() for p in args.sync_path.split(",") if p.strip()]
    unknown = [p for p in sync_paths if p not in SYNC_PATHS]
    if unknown or not sync_paths:
        parser.error(f"--sync-path {args.sync_path!r}: each must be one of {list(SYNC_PATHS)}")
    overlaps = [OVERLAP_SETTINGS.get(o.strip()) for o in args.overlap_staging.split(",")]
    if not overlaps or None in overlaps:
        parser.error(f"--overlap-staging {args.overlap_staging!r}: each must be one of "
                     f"{list(OVERLAP_SETTINGS)}")  # fmt: skip
    if args.out is None:
        args.out = ROOT / "bench" / "results" / ("sglang" if args.engine == "sglang" else "")
    if args.merge:
        merge(args.merge, args.out)
        print((args.out / "colocate.md").read_text())
        return 0
    began = time.monotonic()
    on_cuda = torch.cuda.is_available() and not args.smoke
    plan = {
        mode.strip(): [float(f) for f in (getattr(args, f"{mode.strip()}_fractions", None)
                                          or args.fractions).split(",")]
        for mode in args.modes.split(",")
    }  # fmt: skip

    if args.smoke:
        from rljob_worker.model import load_causal_lm, resolve_model_path

        model_name = model_path = "builtin:tiny-qwen2"
        # Its parameters, so the smoke's floors have bytes to divide (by a host memcpy rate).
        tiny = load_causal_lm(resolve_model_path(model_path), torch.float32)
        n_params = sum(p.numel() for p in tiny.parameters())
        del tiny
    else:
        model_name = args.model
        # A model whose answers end on EOS is another model: its own directory.
        suffix = f"-stop{round(1 / args.eos_hazard)}" if args.eos_hazard else ""
        directory = args.model_dir / f"{model_name}{suffix}"
        directory.mkdir(parents=True, exist_ok=True)
        n_params = build_model(model_name, directory, args.eos_hazard)
        model_path = str(directory)
    from importlib.metadata import version

    environment = {
        "device": torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
        "device_total_bytes": torch.cuda.mem_get_info()[1] if on_cuda else 0,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "torch_memory_saver": version("torch_memory_saver"), "transformers": version("transformers"),
        "python": platform.python_version(), "ranks": args.ranks, "engine": args.engine,
        "tp": args.tp,
        # The frozen reference's dtype (the engine's since issue 30's loader; every run stored
        # before it kept fp32, which bench/plan_accuracy.py assumes where this is absent).
        "reference_dtype": "bfloat16",
    }  # fmt: skip
    if args.engine == "sglang":
        environment["sglang"] = version("sglang")
    bandwidths = measure_bandwidths() if on_cuda else measure_host_bandwidths()
    sync_profile: dict[str, Any] = {}
    if on_cuda and args.profile_sync:
        try:
            sync_profile = profile_weight_sync(
                model_name,
                ranks=args.ranks,
                bucket_mb=getattr(args, "bucket_mb", None) or 512,
                tp=args.tp,
            )
        except Exception as error:  # an auxiliary measurement: recorded, and the sweep goes on
            sync_profile = {"error": f"{type(error).__name__}: {error}"[:500]}
    if on_cuda:
        torch.cuda.empty_cache()
    if args.micro_batch_size == "auto":
        args.micro_batch_size = workload.micro_batch_size
        if on_cuda and model_name in QWEN25:
            mode, fractions = next(iter(plan.items()))
            args.micro_batch_size = fitting_micro_batch(
                args, model_path, mode, fractions[0], str(overlaps[0]),
                environment["device_total_bytes"],
            )  # fmt: skip
    model = model_figures(model_name, n_params, args)
    bytes_moved = {
        "weight_sync": weight_sync_floor_bytes(model),  # fp32 shard read, bf16 weights written
        "offload": model["optimizer_bytes"] + model["train_param_bytes"],
        "onload": model["optimizer_bytes"] + model["train_param_bytes"],
    }
    ideal = {}
    if bandwidths:
        ideal = {
            "weight_sync": bytes_moved["weight_sync"]
            / bandwidths["hbm_read_write_bytes_per_second"],
            "offload": bytes_moved["offload"] / bandwidths["d2h_pinned_bytes_per_second"],
            "onload": bytes_moved["onload"] / bandwidths["h2d_pinned_bytes_per_second"],
        }
    result: dict[str, Any] = {
        "commands": [" ".join(["python", "bench/colocate.py", *(argv or sys.argv[1:])])],
        "environment": environment,
        "model": model,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "bandwidths": bandwidths,
        "bytes_moved": bytes_moved,
        "ideal_seconds": ideal,
        "weight_sync_profile": sync_profile,
        "points": [],
    }
    print(f"{environment['device']}: bandwidths {bandwidths}, ideal seconds {ideal}, "
          f"weight sync profile {sync_profile}", flush=True)  # fmt: skip
    points_to_run = [
        (m, f, path, str(overlap))
        for m, fs in plan.items() for f in fs for path in sync_paths for overlap in overlaps
    ]  # fmt: skip
    # This run's points append their stages here: a run into a folder used before starts it
    # anew (two 7B runs in one step folder on 2026-11-27 shared one file).
    (args.out / "stages.jsonl").unlink(missing_ok=True)
    failed_modes: set[str] = set()
    for mode, fraction, sync_path, overlap in points_to_run:
        tag = f"[{sync_path}, overlap {overlap}]"
        if mode in failed_modes:
            continue
        if args.deadline_seconds and time.monotonic() - began > args.deadline_seconds:
            print(f"deadline: {mode} {fraction:.2f} {tag} not run", flush=True)
            continue
        started = time.monotonic()
        spec = make_spec(args, model_path, mode, fraction, overlap)
        if on_cuda and model_name in QWEN25:  # issue 19: the memory plan beside the point
            shape = {**_QWEN25_COMMON, **QWEN25[model_name]}
            print(plan_line(spec, shape, environment["device_total_bytes"], args.ranks))
        progress = StageProgress(args.out / "stages.jsonl", f"{mode} {fraction:.2f} {tag}")
        with environment_set(SYNC_PATHS[sync_path]):
            run = run_local(spec, args.ranks, "cuda" if on_cuda else "cpu", on_event=progress)
        point = summarize_point(run, mode, fraction, model, args, spec)
        if spec.checkpoint is not None:  # a point's checkpoints take the next one's disk
            shutil.rmtree(spec.checkpoint.path, ignore_errors=True)
        point.sync_path = sync_path
        point.overlap_staging = overlap
        point.wall_seconds = time.monotonic() - started
        result["points"].append(asdict(point))
        finish(result, args.out)
        status = "ok" if point.completed else f"OOM in {point.oom_stage} ({point.failure})"
        print(
            f"{mode:7s} {fraction:.2f} {tag}: {status}, KV {point.kv_capacity_tokens} tokens, "
            f"peaks {{{', '.join(f'{k}: {_gib(v)}' for k, v in point.stage_peak_bytes.items())}}} GiB, "
            f"stage s {{{', '.join(f'{k}: {v:.2f}' for k, v in point.stage_seconds.items())}}}, "
            f"sync {_num(point.weight_sync_seconds, 3)} s "
            f"(hand-off {_num(point.weight_handoff_seconds, 3)} s), "
            f"{point.wall_seconds:.0f} s wall",
            flush=True,
        )
        if point.train_pass_seconds:
            print(f"  train's parts: {', '.join(f'{k} {v:.2f} s' for k, v in point.train_pass_seconds.items())}",
                  flush=True)  # fmt: skip
        for saved in point.checkpoints:
            print(f"  checkpoint of iteration {saved['iteration']}: {saved['bytes'] / 1e9:.2f} GB, "
                  f"blocked {_num(saved['blocked_seconds'], 2)} s, durable after "
                  f"{saved['seconds']:.2f} s", flush=True)  # fmt: skip
        if point.checkpoint_share is not None:
            print(f"  checkpoint stage {point.stage_seconds[str(Stage.CHECKPOINT)]:.2f} s of a "
                  f"{point.iteration_seconds:.2f} s iteration: {point.checkpoint_share:.1%}",
                  flush=True)  # fmt: skip
        for rank, peaks in point.stage_peak_bytes_other_ranks.items():
            print(f"  rank {rank}'s GPU peaks {{{', '.join(f'{k}: {_gib(v)}' for k, v in peaks.items())}}} GiB", flush=True)  # fmt: skip
        if not point.completed and not args.keep_going:
            failed_modes.add(mode)
    completed = [p for p in result["points"] if p["completed"]]
    past_deadline = bool(args.deadline_seconds) and time.monotonic() - began > args.deadline_seconds
    if args.alone and completed and past_deadline:
        print("deadline: the engine-alone pass not run", flush=True)
    elif args.alone and completed:
        # At the highest completing staged fraction (else the highest completing point).
        point = max(completed, key=lambda p: (p["mode"] == "staged", p["fraction"]))
        spec = make_spec(args, model_path, point["mode"], point["fraction"])
        try:
            result["alone"] = engine_alone(spec, args.ranks, "cuda" if on_cuda else "cpu", point,
                                           model)  # fmt: skip
        except Exception as error:  # recorded as a missed target, with the error
            result["alone"] = {"mode": point["mode"], "fraction": point["fraction"],
                               "error": f"{type(error).__name__}: {error}"[:1000]}  # fmt: skip
        print(f"engine alone: {result['alone']}", flush=True)
    finish(result, args.out)
    print((args.out / "colocate.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
