"""Benchmark: staged against single-stage awake, sweeping memFractionStatic on real GPUs (issue 8).

Runs the real colocated worker (local driver, FSDP2, torch engine) per (mode, fraction) and writes
bench/results/colocate-<model>-<device>.{json,md,png}: completion or OOM stage, per-stage peak
device memory, KV capacity, rollout tokens/s, weight sync / offload / onload against the
machine's measured copy bandwidths.

Model choice: Qwen2.5-3B (random bf16 init, no download) is the default on one H100: its training
state (fp32 master params 12 GB + grads 12 GB + AdamW 24 GB) fits 80 GB the way a user runs it,
7B's (~122 GB) does not. KL is off (kl_coef 0) so no reference copy sits on the GPU.

  python bench/colocate.py                        # 3B, both modes, 0.50..0.95, 3 iterations
  python bench/colocate.py --modes staged --fractions 0.9,0.92,0.95
  python bench/colocate.py --smoke                # CPU: tiny model, checks the plumbing only
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "worker_image", ROOT / "operator"):
    if str(extra) not in sys.path:  # runnable from a bare checkout on the device machine
        sys.path.insert(0, str(extra))

from rljob_worker.driver.local import LocalRun, run_local  # noqa: E402
from rljob_worker.loop import RankIteration  # noqa: E402

from rljob.api import RLJobSpec, WakeUp  # noqa: E402
from rljob.report import Stage, StageSample  # noqa: E402

GiB = 2**30
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


# -- the machine's own limits ------------------------------------------------------------------


def _time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int = 10) -> float:
    """Seconds of one dst.copy_(src), averaged over CUDA-event-timed repeats after a warm-up."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def measure_bandwidths(size_bytes: int = 2 * GiB) -> dict[str, float]:
    """Bytes per second of device-to-device, pinned host-to-device and device-to-host copies."""
    device_a = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    device_b = torch.empty_like(device_a)
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    figures = {
        "d2d_bytes_per_second": size_bytes / _time_copy(device_b, device_a),
        "h2d_pinned_bytes_per_second": size_bytes / _time_copy(device_a, host),
        "d2h_pinned_bytes_per_second": size_bytes / _time_copy(host, device_a),
    }
    del device_a, device_b, host
    torch.cuda.empty_cache()
    return figures


# -- the model ---------------------------------------------------------------------------------


def build_model(name: str, directory: Path) -> int:
    """Save a randomly initialised Qwen2.5-architecture model (bf16) and a tokenizer; return #params.

    The tokenizer is the builtin task's (a few hundred tokens): ids beyond it decode to nothing,
    which only affects rewards, not memory or speed.
    """
    from rljob_worker.model import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        eos_token_id=tokenizer.eos_token_id,
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
    failure: str | None = None
    oom_stage: str | None = None
    kv_capacity_tokens: int | None = None
    stage_peak_bytes: dict[str, int] = field(default_factory=dict)
    rollout_tokens_per_second: float | None = None
    weight_sync_seconds: float | None = None
    offload_seconds: float | None = None
    onload_seconds: float | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)


def make_spec(args: argparse.Namespace, model_path: str, mode: str, fraction: float) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"path": model_path, "dtype": "float32" if args.smoke else "bfloat16"},
            "algorithm": {"name": "grpo", "group_size": args.group_size, "kl_coef": 0.0,
                          "iterations": args.iterations, "seed": 0},
            "data": {"source": "builtin:arithmetic", "train_batch_size": args.prompts,
                     "max_response_length": args.response_length},
            "rollout": {"engine": "torch", "wake_up": mode, "mem_fraction_static": fraction},
        }
    )  # fmt: skip


def _last_stage_before_death(run: LocalRun, mode: str) -> str | None:
    """The stage a rank died in without a report: the one after its last sampled stage."""
    from rljob_worker.stages import stage_order

    if not run.samples:
        return None
    last = max(run.samples, key=lambda s: s.start_seconds)
    order = stage_order(WakeUp(mode), last.iteration)
    index = order.index(last.stage)
    return str(order[index + 1]) if index + 1 < len(order) else str(order[0])


def summarize_point(run: LocalRun, mode: str, fraction: float, tokens_per_rollout: int) -> Point:
    point = Point(mode=mode, fraction=fraction, completed=run.ok)
    if run.ooms:
        point.oom_stage = str(run.ooms[0].stage)
        point.failure = run.ooms[0].message[:300]
    elif run.errors:
        # torch_memory_saver can end the process when a mapping fails: count it as an OOM in
        # the stage the rank never finished, and keep the error text.
        point.oom_stage = _last_stage_before_death(run, mode)
        point.failure = next(iter(run.errors.values()))[-300:]
    iterations: list[RankIteration] = run.iterations
    if iterations:
        point.kv_capacity_tokens = min(i.kv_capacity_tokens for i in iterations)
    samples: list[StageSample] = run.samples
    for sample in samples:
        name = str(sample.stage)
        point.stage_peak_bytes[name] = max(
            point.stage_peak_bytes.get(name, 0), sample.device_peak_used_bytes
        )

    def mean_seconds(*stages: Stage) -> float | None:
        # Iteration 0 is the prologue (no training); the steady state starts at iteration 1.
        per_iteration: dict[tuple[int, int], float] = {}
        for s in samples:
            if s.iteration >= 1 and s.stage in stages:
                key = (s.iteration, s.rank)
                per_iteration[key] = per_iteration.get(key, 0.0) + s.seconds
        return sum(per_iteration.values()) / len(per_iteration) if per_iteration else None

    point.weight_sync_seconds = mean_seconds(Stage.WAKE_WEIGHTS)
    point.offload_seconds = mean_seconds(Stage.OFFLOAD_OPTIMIZER, Stage.OFFLOAD_TRAIN)
    point.onload_seconds = mean_seconds(Stage.SLEEP)
    rollout = mean_seconds(Stage.ROLLOUT)
    if rollout:
        point.rollout_tokens_per_second = tokens_per_rollout / rollout
    last = max((s.iteration for s in samples), default=0)
    point.timeline = [
        {"stage": str(s.stage), "start_seconds": s.start_seconds, "seconds": s.seconds,
         "peak_bytes": s.device_peak_used_bytes, "end_bytes": s.device_used_bytes}
        for s in sorted(samples, key=lambda s: s.start_seconds)
        if s.iteration == last and s.rank == 0
    ]  # fmt: skip
    return point


# -- outputs -----------------------------------------------------------------------------------


def write_markdown(result: dict[str, Any], path: Path) -> None:
    env = result["environment"]
    lines = [
        f"# Staged vs single-stage awake: {result['model']['name']} on {env['device']}",
        "",
        f"torch {env['torch']}, CUDA {env['cuda']}, torch_memory_saver {env['torch_memory_saver']}; "
        f"command: `{result['command']}`",
        "",
        "| mode | memFractionStatic | result | KV tokens | peak wake_weights GiB | "
        "peak wake_kv_cache GiB | peak rollout GiB | rollout tok/s | sync s | offload s | onload s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def gib(value: int | None) -> str:
        return f"{value / GiB:.1f}" if value else "-"

    def num(value: float | None, digits: int = 2) -> str:
        return f"{value:.{digits}f}" if value is not None else "-"

    for p in result["points"]:
        peaks = p["stage_peak_bytes"]
        outcome = "ok" if p["completed"] else f"OOM in {p['oom_stage']}"
        lines.append(
            f"| {p['mode']} | {p['fraction']:.2f} | {outcome} | {p['kv_capacity_tokens'] or '-'} | "
            f"{gib(peaks.get('wake_weights'))} | {gib(peaks.get('wake_kv_cache'))} | "
            f"{gib(peaks.get('rollout'))} | {num(p['rollout_tokens_per_second'], 0)} | "
            f"{num(p['weight_sync_seconds'])} | {num(p['offload_seconds'])} | "
            f"{num(p['onload_seconds'])} |"
        )
    lines += ["", "## Targets", ""]
    lines += [
        f"- {t['name']}: {t['measured']} ({'met' if t['met'] else 'MISSED'})"
        for t in result["targets"]
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    stage_colors = dict(zip([str(s) for s in Stage], palette, strict=False))
    fig, (timeline_ax, kv_ax) = plt.subplots(1, 2, figsize=(15, 5))
    for mode, style in (("single", "--"), ("staged", "-")):
        best = result["best"].get(mode)
        if best is None:
            continue
        point = next(p for p in result["points"] if p["mode"] == mode and p["fraction"] == best)
        t0 = point["timeline"][0]["start_seconds"] if point["timeline"] else 0.0
        for s in point["timeline"]:
            start, end = s["start_seconds"] - t0, s["start_seconds"] - t0 + s["seconds"]
            if mode == "staged":
                timeline_ax.axvspan(start, end, color=stage_colors[s["stage"]], alpha=0.15, lw=0)
                timeline_ax.text(start, 0, s["stage"], rotation=90, fontsize=7, va="bottom")
            timeline_ax.plot([start, end], [s["peak_bytes"] / GiB] * 2, style, color="black")
        timeline_ax.plot([], [], style, color="black", label=f"{mode} at {best:.2f} (stage peak)")
    if result["environment"]["device_total_bytes"]:
        capacity = result["environment"]["device_total_bytes"] / GiB
        timeline_ax.axhline(capacity, color="red", lw=0.8, label="device capacity")
    timeline_ax.set(xlabel="seconds into the iteration", ylabel="device memory used (GiB)",
                    title="One iteration at each mode's highest completing fraction")  # fmt: skip
    timeline_ax.legend(loc="lower right")
    for mode, marker in (("single", "s"), ("staged", "o")):
        points = [p for p in result["points"] if p["mode"] == mode]
        ok = [(p["fraction"], p["kv_capacity_tokens"]) for p in points if p["completed"]]
        failed = [p["fraction"] for p in points if not p["completed"]]
        if ok:
            kv_ax.plot(*zip(*ok, strict=True), marker=marker, label=f"{mode}: completed")
        if failed:
            kv_ax.scatter(failed, [0] * len(failed), marker="x", s=80, label=f"{mode}: OOM")
    kv_ax.set(xlabel="memFractionStatic", ylabel="KV capacity (tokens)",
              title="KV pool capacity against fraction")  # fmt: skip
    kv_ax.legend()
    fig.suptitle(f"{result['model']['name']} on {result['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    best, points = result["best"], result["points"]
    by = {(p["mode"], p["fraction"]): p for p in points}
    targets = []
    staged, single = best.get("staged"), best.get("single")
    single_fail = min(
        (p["fraction"] for p in points if p["mode"] == "single" and not p["completed"]),
        default=None,
    )
    targets.append({
        "name": "staged completes at >= 0.92 where single fails at <= 0.80",
        "measured": f"staged highest ok {staged}, single first OOM {single_fail}",
        "met": staged is not None and staged >= 0.92 and single_fail is not None and single_fail <= 0.80,
    })  # fmt: skip
    if staged is not None and single is not None:
        ratio = by[("staged", staged)]["kv_capacity_tokens"] / max(
            by[("single", single)]["kv_capacity_tokens"], 1
        )
        targets.append({"name": "KV capacity staged >= 1.4x single", "measured": f"{ratio:.2f}x",
                        "met": ratio >= 1.4})  # fmt: skip
    ideal = result.get("ideal_seconds", {})
    ref = by.get(("staged", staged)) if staged is not None else None
    for key, measured_key, bound in (
        ("weight_sync", "weight_sync_seconds", 2.0),
        ("offload", "offload_seconds", 1.5),
        ("onload", "onload_seconds", 1.5),
    ):
        if ref is not None and ideal.get(key) and ref[measured_key]:
            ratio = ref[measured_key] / ideal[key]
            targets.append({"name": f"{key} within {bound}x of bytes / bandwidth",
                            "measured": f"{ratio:.2f}x ({ref[measured_key]:.3f} s vs {ideal[key]:.3f} s)",
                            "met": ratio <= bound})  # fmt: skip
    return targets


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-3b", choices=sorted(QWEN25))
    parser.add_argument("--modes", default="single,staged")
    parser.add_argument("--fractions", default=",".join(f"{f:.2f}" for f in DEFAULT_FRACTIONS))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="GPUs (FSDP shards over them)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--keep-going", action="store_true", help="sweep past a mode's first OOM")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/rljob-bench-models"))
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, builtin tiny model, plumbing only"
    )
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    on_cuda = torch.cuda.is_available() and not args.smoke

    if args.smoke:
        model_name, model_path, n_params = "builtin:tiny-qwen2", "builtin:tiny-qwen2", 0
    else:
        model_name = args.model
        directory = args.model_dir / model_name
        directory.mkdir(parents=True, exist_ok=True)
        n_params = build_model(model_name, directory)
        model_path = str(directory)
    from importlib.metadata import version

    import torch_memory_saver  # noqa: F401  (its version goes into the result)

    environment = {
        "device": torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
        "device_total_bytes": torch.cuda.mem_get_info()[1] if on_cuda else 0,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "torch_memory_saver": version("torch_memory_saver"), "transformers": version("transformers"),
        "python": platform.python_version(), "ranks": args.ranks,
    }  # fmt: skip
    bandwidths = measure_bandwidths() if on_cuda else {}
    shard = max(args.ranks, 1)
    bytes_moved = {
        "weight_sync": 2 * n_params,  # bf16 engine weights written once per sync
        "offload": (8 * n_params + 4 * n_params) // shard,  # AdamW moments + fp32 master params
        "onload": (8 * n_params + 4 * n_params) // shard,
    }
    ideal = {}
    if bandwidths:
        ideal = {
            "weight_sync": bytes_moved["weight_sync"] / bandwidths["d2d_bytes_per_second"],
            "offload": bytes_moved["offload"] / bandwidths["d2h_pinned_bytes_per_second"],
            "onload": bytes_moved["onload"] / bandwidths["h2d_pinned_bytes_per_second"],
        }
    tokens_per_rollout = args.prompts // shard * args.group_size * args.response_length

    points: list[Point] = []
    for mode in modes:
        for fraction in fractions:
            started = time.monotonic()
            spec = make_spec(args, model_path, mode, fraction)
            run = run_local(spec, args.ranks, "cuda" if on_cuda else "cpu")
            point = summarize_point(run, mode, fraction, tokens_per_rollout)
            points.append(point)
            print(
                f"{mode:7s} {fraction:.2f}: {'ok' if point.completed else 'OOM in ' + str(point.oom_stage)}"
                f", KV {point.kv_capacity_tokens} tokens, {time.monotonic() - started:.0f} s",
                flush=True,
            )
            if not point.completed and not args.keep_going:
                break
    best = {
        mode: max((p.fraction for p in points if p.mode == mode and p.completed), default=None)
        for mode in modes
    }
    result: dict[str, Any] = {
        "command": " ".join(["python", "bench/colocate.py", *(argv or sys.argv[1:])]),
        "environment": environment,
        "model": {"name": model_name, "parameters": n_params, **QWEN25.get(model_name, {})},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "bandwidths": bandwidths,
        "bytes_moved": bytes_moved,
        "ideal_seconds": ideal,
        "points": [asdict(p) for p in points],
        "best": best,
    }
    result["targets"] = evaluate_targets(result)
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{model_name}-{environment['device']}").strip("-").lower()
    stem = args.out / f"colocate-{slug}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, Path(f"{stem}.md"))
    write_plot(result, Path(f"{stem}.png"))
    print(Path(f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
