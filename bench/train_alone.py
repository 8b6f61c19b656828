"""Benchmark: the train stage alone (no engine on the card) at a workload's shape, and where its
seconds go: each pass (TrainStats.pass_seconds), micro-batches, padded tokens and model FLOP/s.

The colocated bench (colocate.py) runs the train stage between rollouts; this runs it by itself
on a synthetic rollout of the workload's shape, so a change to the update is measured in minutes
without an engine, and the iteration's "train alone" (issue 33's 1.15x target) has a figure
of its own. The rollout is synthetic: the builtin arithmetic task's prompts (encoded by the
model's tokenizer) and random answer tokens whose lengths follow the workload (colocate.py's
Workload: every answer at the cap for `small`; geometric lengths with mean ~1/eos_hazard, cut at
the cap, for `realistic`), half of them rewarded. The update does not care what the tokens say,
only how many there are and how they fall into micro-batches.

  python bench/train_alone.py --workload realistic --micro-batch-size 2 --pack on,off
  python bench/train_alone.py --model qwen2.5-7b --ranks 2 --pack on   # FSDP over two cards
  python bench/train_alone.py --smoke             # CPU: tiny model, checks the plumbing only

With `--ranks N` each rank is a process on its own card (gloo on the CPU), the rollout's prompts
dealt out as the colocated loop deals them (rank r takes every N-th), each rank's answers its
own; the seconds are rank 0's, whose steps end with every rank's (FSDP's collectives). An OOM
on one rank leaves the others waiting in a collective: size the micro-batch by the plan.

Per configuration (micro-batch size x packing): one untimed warm-up step on a few rows (AdamW
allocates its moments at the first step), then `--iterations` timed train steps on the whole
rollout. `--profile-rows N` profiles one more step on N rows (torch.profiler) and writes the
kernels' table beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "worker_image", ROOT / "operator", ROOT / "bench"):
    if str(extra) not in sys.path:  # runnable from a bare checkout on the device machine
        sys.path.insert(0, str(extra))

from colocate import QWEN25, WORKLOADS, Workload, build_model  # noqa: E402

from rljob.api import RLJobSpec  # noqa: E402
from rljob_worker.policy_update import Experience  # noqa: E402

WARMUP_ROWS = 8


def response_lengths(workload: Workload, count: int, seed: int) -> list[int]:
    """Answer lengths of one rollout of `workload`: at the cap without an EOS hazard (the small
    workload's answers never end early), else geometric (each token ends the answer with
    probability eos_hazard), cut at the cap."""
    cap = workload.response_length
    if workload.eos_hazard is None:
        return [cap] * count
    rng = random.Random(seed)
    hazard = workload.eos_hazard
    lengths = []
    for _ in range(count):
        # Inverse CDF of the geometric distribution on 1, 2, ...
        u = 1.0 - rng.random()
        lengths.append(min(cap, 1 + int(math.log(u) / math.log(1.0 - hazard))))
    return lengths


def synthetic_experience(
    workload: Workload, prompt_ids: list[list[int]], vocab: int, seed: int
) -> Experience:
    """One rank's rollout: each prompt `group_size` times, random answers of the workload's
    lengths, rewards 0 or 1 (so GRPO's advantages are not all 0)."""
    group = workload.group_size
    rows = len(prompt_ids) * group
    lengths = response_lengths(workload, rows, seed)
    generator = torch.Generator().manual_seed(seed)
    responses = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    rng = random.Random(seed + 1)
    return Experience(
        prompt_ids=[list(prompt_ids[i // group]) for i in range(rows)],
        response_ids=responses,
        rewards=[float(rng.random() < 0.5) for _ in range(rows)],
        group_ids=[i // group for i in range(rows)],
    )


def subset(experience: Experience, rows: int) -> Experience:
    return Experience(
        experience.prompt_ids[:rows],
        experience.response_ids[:rows],
        experience.rewards[:rows],
        experience.group_ids[:rows],
    )


def plan_figures(trainer: Any, experience: Experience) -> dict[str, int]:
    """The whole rollout's micro-batches as the update cuts them (one rank), and their padded
    tokens (rows x the longest row of each) against the real ones."""
    from rljob_worker.policy_update import PolicyUpdate

    update = PolicyUpdate(trainer.spec, trainer.model, None, trainer.optimizer, trainer.pad_id,
                          trainer.device, pack=trainer.pack_micro_batches)  # fmt: skip
    (batches,) = update.micro_batches(experience, [list(range(len(experience)))])
    lengths = experience.sequence_lengths()
    return {
        "micro_batches": len(batches),
        "tokens": sum(lengths),
        "padded_tokens": sum(len(b) * max(lengths[r] for r in b) for b in batches),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(trainer: Any, experience: Experience, iterations: int) -> dict[str, Any]:
    """One warm-up step on WARMUP_ROWS rows, then `iterations` timed steps on every row; rank
    0's seconds and parts of the last, and the device's peak over the timed ones."""
    device = trainer.device
    trainer.train_step(subset(experience, WARMUP_ROWS))
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, parts = [], {}
    for _ in range(iterations):
        started = time.perf_counter()
        stats = trainer.train_step(experience)
        _sync(device)
        seconds.append(time.perf_counter() - started)
        parts = stats.pass_seconds
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"seconds": seconds, "pass_seconds": parts, "peak_allocated_bytes": peak}


def flops(n_params: int, tokens: int, checkpointing: bool, reference: bool) -> dict[str, float]:
    """Model FLOPs of each pass over `tokens` (2 per parameter per token forward, 4 backward,
    2 more with the forward recomputed; attention's own left out, as MFU figures do)."""
    train = (8 if checkpointing else 6) * n_params * tokens
    out = {"old_logprobs": 2.0 * n_params * tokens, "forward_backward": float(train)}
    if reference:
        out["ref_logprobs"] = 2.0 * n_params * tokens
    return out


def _spec(args: argparse.Namespace, workload: Workload, model_path: str, micro: int) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"path": model_path, "dtype": "float32" if args.smoke else "bfloat16"},
            "algorithm": {"name": "grpo", "group_size": workload.group_size,
                          "kl_coef": args.kl_coef, "seed": 0},
            "data": {"source": "builtin:arithmetic", "train_batch_size": args.prompts,
                     "max_response_length": workload.response_length},
            "rollout": {"engine": "torch"},
            "training": {"micro_batch_size": micro,
                         "gradient_checkpointing": workload.gradient_checkpointing},
        }
    )  # fmt: skip


def _profile(trainer: Any, experience: Experience, rows: int, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        trainer.train_step(subset(experience, rows))
        _sync(trainer.device)
    key = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40)
    by_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    out.write_text(f"# {rows} rows, sorted by {key}\n{table}\n# by cpu_time_total\n{by_cpu}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-3b", choices=sorted(QWEN25))
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/rljob-bench-models"))
    parser.add_argument("--workload", default="realistic", choices=sorted(WORKLOADS))
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per rollout (default: the workload's)")  # fmt: skip
    parser.add_argument("--micro-batch-size", default="2", help="comma-separated sizes")
    parser.add_argument("--pack", default="on,off", help="on, off or both (micro-batch packing)")
    parser.add_argument("--kl-coef", type=float, default=0.001, help="> 0 keeps a reference")
    parser.add_argument("--iterations", type=int, default=1, help="timed steps per config")
    parser.add_argument("--profile-rows", type=int, default=0, help="profile a step on N rows")
    parser.add_argument("--deadline-seconds", type=float, default=None,
                        help="start no new configuration after this many seconds")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("train-alone.json"))
    parser.add_argument("--smoke", action="store_true", help="CPU, builtin tiny model")
    parser.add_argument("--ranks", type=int, default=1, help="FSDP ranks, one card each")
    args = parser.parse_args(argv)
    store = Path(tempfile.mkdtemp(prefix="rljob-train-alone-")) / "store"
    prompts = args.prompts or _workload(args).prompts
    if prompts % args.ranks:
        # Unpacked micro-batch counts would differ between ranks, and FSDP's collectives hang.
        parser.error(f"--ranks {args.ranks} must divide the rollout's {prompts} prompts")
    if args.ranks == 1:
        return _rank_main(0, args, store)
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(args, store), nprocs=args.ranks, join=True)
    return 0


def _workload(args: argparse.Namespace) -> Workload:
    """--workload's shape; with --smoke, a few rows of short answers (of mixed lengths where
    the workload's vary)."""
    workload = WORKLOADS[args.workload]
    if args.smoke:
        hazard = 0.1 if workload.eos_hazard else None
        workload = Workload(4, 4, 32, 2, workload.gradient_checkpointing, hazard)
    return workload


def _rank_main(rank: int, args: argparse.Namespace, store: Path) -> int:
    """One rank's steps (rank 0 reports); the whole run where --ranks is 1."""
    started = time.perf_counter()
    workload = _workload(args)
    args.prompts = args.prompts or workload.prompts
    micro_sizes = [int(m) for m in args.micro_batch_size.split(",")]
    packs = [{"on": True, "off": False}[p] for p in args.pack.split(",")]

    from rljob_worker.model import load_tokenizer, resolve_model_path
    from rljob_worker.task import ArithmeticTask
    from rljob_worker.train import Trainer

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=args.ranks)  # fmt: skip
    if args.smoke:
        model_path: str = "builtin:tiny-qwen2"
        model_dir = resolve_model_path(model_path)
    else:
        model_dir = args.models_dir / args.model
        build_model(args.model, model_dir)
        model_path = str(model_dir)
    tokenizer = load_tokenizer(model_dir)
    encode = lambda text: tuple(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    prompts = [list(p.prompt_ids) for p in ArithmeticTask(0, encode=encode).sample(args.prompts, 0)]
    vocab = len(tokenizer) if args.smoke else 151936
    experience = synthetic_experience(workload, prompts[rank :: args.ranks], vocab, seed=rank)

    trainer = Trainer(_spec(args, workload, model_path, micro_sizes[0]), model_dir, device,
                      pad_id=tokenizer.pad_token_id or 0)  # fmt: skip
    n_params = sum(p.numel() for p in trainer.model.parameters())
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke run)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": "builtin:tiny-qwen2" if args.smoke else args.model,
        "parameters": n_params,
        "workload": args.workload,
        "ranks": args.ranks,
        "rows": len(experience),  # this rank's (rank 0's)
        "gradient_checkpointing": workload.gradient_checkpointing,
        "reference": trainer.reference is not None,
        "configs": [],
    }
    for micro in micro_sizes:
        for pack in packs:
            late = [bool(args.deadline_seconds)
                    and time.perf_counter() - started > args.deadline_seconds]  # fmt: skip
            dist.broadcast_object_list(late, src=0)  # rank 0's clock decides for every rank
            if late[0]:
                if rank == 0:
                    print(f"deadline: micro-batch {micro} pack {pack} not run", flush=True)
                continue
            trainer.spec = _spec(args, workload, model_path, micro)
            trainer.pack_micro_batches = pack
            row: dict[str, Any] = {"micro_batch_size": micro, "pack": pack,
                                   **plan_figures(trainer, experience)}  # fmt: skip
            try:
                row.update(timed_steps(trainer, experience, args.iterations))
            except torch.OutOfMemoryError as error:
                row["oom"] = str(error).splitlines()[0]
                torch.cuda.empty_cache()
            if "seconds" in row:
                model_flops = flops(n_params, row["padded_tokens"],
                                    workload.gradient_checkpointing, result["reference"])  # fmt: skip
                row["tflops_per_second"] = {
                    part: model_flops[part] / row["pass_seconds"][part] / 1e12
                    for part in model_flops
                    if row["pass_seconds"].get(part)
                }
                row["real_tokens_per_second"] = row["tokens"] / row["seconds"][-1]
            result["configs"].append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if args.profile_rows:
        trainer.pack_micro_batches = True
        _profile(trainer, experience, args.profile_rows, args.out.with_suffix(".profile.txt"))
    if rank == 0:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
