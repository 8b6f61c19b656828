"""The trainer's side of the weight sync alone, part by part (issue 33).

On one H200 the 3B sync in one bucket waited 9.8-12.6 ms for its bucket (`next_bucket` in
bench/sync_trip.py's split) with the send plan in use, while the cast alone over the same 434
tensors takes 5.5 ms on the card (bench/copy_kernels.py). This builds the bench's random model
as an FSDP2 Trainer on one rank, with no engine, and times what the stage's wait for its first
bucket holds, several syncs in a row:

- `next`: Trainer.weight_buckets' first bucket, as the stage asks for it (host, to the bucket);
- `params`: dict(model.named_parameters()) (the generator's first line);
- `holds`: the send plan's check that the bucket's params and shards are the planned ones;
- `launch` / `gpu`: gather_full called directly: host time to its return, then the GPU time of
  its kernels (CUDA events around the call).

`--engine-casts`: the sync an engine that casts gets on one rank (the policy's own fp32 buffer
as one bucket, no cast: docs/weight-sync.md); `launch` is then the as-stored path's host time.

With `--sampler-ms N` the memory meter's sampler thread (memory._Sampler: mem_get_info every
N ms, as every stage runs it) polls meanwhile, so its share shows. One GPU, torch only.

    python bench/gather_probe.py --model qwen2.5-3b --sampler-ms 0 5 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _spec(model: Path, bucket_mb: int) -> Any:
    from rljob.api import parse_manifest

    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "gather-probe"},
        "spec": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "algorithm": {"groupSize": 4, "iterations": 1, "learningRate": 1e-6},
            "data": {"trainBatchSize": 4, "maxResponseLength": 16},
            "rollout": {"weightSyncBucketMegabytes": bucket_mb},
            "resources": {"gpusPerWorker": 1},
        },
    }
    return parse_manifest(doc)[1]


def probe(
    trainer: Any,
    bucket_bytes: int,
    syncs: int,
    idle: float,
    empty: bool,
    engine_casts: bool = False,
) -> list[dict[str, float]]:
    from rljob.plan import plan_buckets
    from rljob_worker.sync_send import gather_full, gather_planned

    dtype = torch.bfloat16
    cuda = trainer.device.type == "cuda"
    rows = []
    for _ in range(syncs):
        if cuda:
            torch.cuda.synchronize()
        time.sleep(idle)  # the card idle before the sync, as after the loop's host-only stages
        if cuda and empty:
            torch.cuda.empty_cache()  # as the stage does before the engine's resume
        started = time.perf_counter()
        buckets = trainer.weight_buckets(bucket_bytes, dtype, engine_casts=engine_casts)
        first = next(buckets)
        waited = time.perf_counter() - started
        del first
        for _ in buckets:
            pass
        if cuda:
            torch.cuda.synchronize()

        started = time.perf_counter()
        params = dict(trainer.model.named_parameters())
        named = time.perf_counter() - started
        sizes = [(name, p.numel() * dtype.itemsize) for name, p in params.items()]
        # engine_casts on one rank: the whole model, as stored (the first bucket otherwise).
        names = list(params) if engine_casts else plan_buckets(sizes, bucket_bytes)[0]
        bucket = [(name, params[name]) for name in names]
        plan = trainer._send_plans.get(tuple(names))
        started = time.perf_counter()
        held = plan.holds([t for _, t in bucket]) if plan is not None else False
        holds = time.perf_counter() - started

        if cuda:
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        started = time.perf_counter()
        out: Any = (
            gather_planned(bucket, dtype, trainer._send_plans, as_stored=True)
            if engine_casts
            else gather_full(bucket, dtype, trainer._send_plans)
        )
        launch = time.perf_counter() - started
        gpu = 0.0
        if cuda:
            end.record()
            end.synchronize()
            gpu = begin.elapsed_time(end) / 1e3
        done = time.perf_counter() - started
        del out
        rows.append({
            "next_s": waited, "params_s": named, "holds_s": holds, "plan_held": float(held),
            "launch_s": launch, "gpu_s": gpu, "gather_wall_s": done,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-3b")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/rljob-bench-models"))
    parser.add_argument("--bucket-mb", type=int, default=8192)
    parser.add_argument("--syncs", type=int, default=8)
    parser.add_argument("--sampler-ms", type=float, nargs="+", default=[0.0, 5.0])
    parser.add_argument(
        "--idle-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="the card left idle this long before each sync (each value a run)",
    )
    parser.add_argument(
        "--empty-cache",
        type=int,
        nargs="+",
        default=[0],
        help="1: torch.cuda.empty_cache() before each sync, as the stage does (each a run)",
    )
    parser.add_argument(
        "--engine-casts",
        action="store_true",
        help="the one-rank sync to an engine that casts: the trainer's buffer as it is",
    )
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import colocate

    from rljob_worker.memory import _Probe, _Sampler
    from rljob_worker.train import Trainer

    model_dir = args.models_dir / args.model
    if not (model_dir / "config.json").exists():
        colocate.build_model(args.model, model_dir)
    device = torch.device(args.device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    trainer = Trainer(_spec(model_dir, args.bucket_mb), model_dir, device, pad_id=0)
    result: dict[str, Any] = {"model": args.model, "device": str(device), "runs": []}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    runs = [(i, d, e) for e in args.empty_cache for d in args.idle_ms for i in args.sampler_ms]
    for interval, idle, empty in runs:
        sampler = None
        if interval > 0:
            sampler = _Sampler(_Probe(device), interval / 1e3)
            sampler.start()
        rows = probe(
            trainer, args.bucket_mb << 20, args.syncs, idle / 1e3, bool(empty), args.engine_casts
        )
        if sampler is not None:
            sampler.stop_event.set()
            sampler.join()
        kept = rows[1:]  # the first sync builds the plan
        medians = {k: statistics.median(r[k] for r in kept) for k in kept[0]}
        result["runs"].append(
            {
                "sampler_ms": interval,
                "idle_ms": idle,
                "empty_cache": empty,
                "syncs": rows,
                "medians": medians,
            }
        )
        print(
            f"empty_cache {empty}, idle {idle:g} ms, sampler {interval:g} ms: next {medians['next_s'] * 1e3:.2f} ms | params "
            f"{medians['params_s'] * 1e3:.2f} | holds {medians['holds_s'] * 1e3:.2f} "
            f"(plan held {medians['plan_held']:.0f}) | gather launch "
            f"{medians['launch_s'] * 1e3:.2f}, gpu {medians['gpu_s'] * 1e3:.2f}, wall "
            f"{medians['gather_wall_s'] * 1e3:.2f} | first next {rows[0]['next_s'] * 1e3:.2f} ms",
            flush=True,
        )
    dist.destroy_process_group()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"gather-probe-{args.model}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
