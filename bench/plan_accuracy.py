"""Plan accuracy: rljob.plan's per-stage prediction against every stored bench point.

Reads bench/results/colocate.json and bench/results/raw/*.json (bench/colocate.py's output),
rebuilds each point's spec from the run's settings, and writes bench/results/plan-accuracy.md
(and .json): per point and stage the measured device peak, the prediction and the error, the
points off by more than 5%, and "fits" against what the run did.

    .venv/bin/python bench/plan_accuracy.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rljob.api import RLJobSpec  # noqa: E402
from rljob.plan import GiB, ModePlan, plan_for_point  # noqa: E402

# bench/colocate.py's _QWEN25_COMMON: the one config field its result's "model" lacks.
QWEN25_VOCAB_SIZE = 151936
TOLERANCE = 0.05
# The runs made on the current tree, the plan as users get it: the stage machine frees cuBLAS's
# workspaces before both offload stages' empty_cache() (one H100, sglang 0.5.17, 2026-11-25).
# Every other stored run predates that, or half of it (v1: offload_train only), and then cuBLAS's
# 32 MiB workspace, taken out of a freed training block, kept that block's whole segment:
# 0.01-0.40 GiB by model size (docs/memory-plan.md, "The allocator finding").
CURRENT_RUNS = ("r2-", "r3-")
# The reference's dtype of runs that do not record it: every stored run predates the sharded
# loader (issue 30) and kept an fp32 reference; bench/colocate.py records it from then on.
STORED_REFERENCE_DTYPE = "float32"


def point_spec(
    settings: dict[str, str], mode: str, fraction: float, overlap: str = "Off"
) -> RLJobSpec:
    """bench/colocate.make_spec for a stored run (its settings are strings); offload as the run
    said (`--offload`; Always for the runs made before that option existed); the staging order
    as the point ran it (`--overlap-staging`; Off for the points made before it existed)."""
    return RLJobSpec.model_validate(
        {
            "model": {"path": "/bench/model", "dtype": "bfloat16"},
            "algorithm": {
                "name": "grpo",
                "groupSize": int(settings["group_size"]),
                "klCoef": float(settings["kl_coef"]),
                "iterations": int(settings["iterations"]),
            },
            "data": {
                "trainBatchSize": int(settings["prompts"]),
                "maxResponseLength": int(settings["response_length"]),
            },
            "rollout": {
                "engine": settings.get("engine", "torch"),
                "wakeUp": mode,
                "memFractionStatic": fraction,
            },
            "training": {
                "microBatchSize": int(settings["micro_batch_size"]),
                "overlapStaging": overlap,
            },
            "offload": settings.get("offload", "Always"),
        }
    )


def config_of(model: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
    )
    return {**{k: model[k] for k in keys}, "vocab_size": QWEN25_VOCAB_SIZE}


def compare(path: Path) -> list[dict[str, Any]]:
    """One row per point of one result file."""
    result = json.loads(path.read_text())
    env, settings = result["environment"], result["settings"]
    rows = []
    for point in result["points"]:
        overlap = point.get("overlap_staging", "Off")
        spec = point_spec(settings, point["mode"], point["fraction"], overlap)
        ranks = int(env.get("ranks") or settings.get("ranks") or 1)
        plan: ModePlan = plan_for_point(
            spec,
            config_of(result["model"]),
            env["device_total_bytes"],
            ranks,
            reference_dtype=env.get("reference_dtype", STORED_REFERENCE_DTYPE),
        )
        predicted = {str(s.stage): s.peak_bytes for s in plan.stages}
        stages = {}
        if point["completed"]:
            for stage, measured in point["stage_peak_bytes"].items():
                stages[stage] = {
                    "measured": measured,
                    "predicted": predicted[stage],
                    "error": (predicted[stage] - measured) / measured,
                }
        rows.append(
            {
                "file": str(path.relative_to(ROOT)),
                "current": path.name.startswith(CURRENT_RUNS),
                "device": env["device"],
                "capacity": env["device_total_bytes"],
                "engine": settings.get("engine", "torch"),
                "model": result["model"]["name"],
                "ranks": ranks,
                "mode": point["mode"],
                "fraction": point["fraction"],
                "completed": point["completed"],
                "oom_stage": point["oom_stage"],
                "plan_fits": plan.fits,
                "plan_misfit": plan.misfit_text(),
                "stages": stages,
                "predicted": predicted,
            }
        )
    return rows


def sources(results: Path) -> list[Path]:
    return [results / "colocate.json", *sorted((results / "raw").glob("*.json"))]


def render(rows: list[dict[str, Any]]) -> str:
    order = ["train", "offload_optimizer", "wake_weights", "offload_train", "wake_kv_cache",
             "rollout", "sleep"]  # fmt: skip

    def run_text(r: dict[str, Any]) -> str:
        return "completed" if r["completed"] else f"OOM in {r['oom_stage']}"

    def point(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["device"], r["engine"], r["model"], r["ranks"], r["mode"], r["fraction"])

    def rerun(r: dict[str, Any]) -> str:
        """The current tree's run of the same point, where there is one."""
        again = [c for c in rows if c["current"] and not r["current"] and point(c) == point(r)]
        return "".join(f" (rerun on the current tree: {c['file']}, {run_text(c)})" for c in again)

    def summary(subset: list[dict[str, Any]]) -> list[str]:
        off = [
            f"{r['file']} {r['mode']} {r['fraction']:.2f} {stage} ({s['error']:+.1%})"
            for r in subset
            for stage, s in r["stages"].items()
            if abs(s["error"]) > TOLERANCE
        ]
        disagree = [
            f"{r['file']} {r['mode']} {r['fraction']:.2f}: plan "
            f"{'fits' if r['plan_fits'] else 'misfit'}, run {run_text(r)}{rerun(r)}"
            for r in subset
            if r["plan_fits"] != r["completed"]
        ]
        errors = [abs(s["error"]) for r in subset for s in r["stages"].values()]
        # What spec.memoryPlan.margin must cover: a stage that needed more than its plan, as a
        # share of the card (the margin is one), not of the stage.
        under = min(
            (
                ((s["predicted"] - s["measured"]) / r["capacity"], f"{r['file']} {stage}")
                for r in subset
                for stage, s in r["stages"].items()
            ),
            default=(0.0, "none"),
        )
        return [
            f"stage peaks compared: {len(errors)}; largest |error| "
            f"{max(errors, default=0):.2%}; mean |error| "
            f"{(sum(errors) / len(errors) if errors else 0):.2%}",
            f"largest under-prediction as a share of the GPU: {max(-under[0], 0):.2%} ({under[1]})",
            f"off by more than {TOLERANCE:.0%}: " + ("; ".join(off) if off else "none"),
            "plan's fit against the run (a completed point the plan calls a misfit, or an OOM "
            "it calls fitting): " + ("; ".join(disagree) if disagree else "none disagree"),
        ]

    current = [r for r in rows if r["current"]]
    models = sorted({f"{r['engine']} {r['model']}" for r in current})
    lines = [
        "# Memory plan accuracy (rljob/plan.py against the stored bench points)",
        "",
        "Made by `.venv/bin/python bench/plan_accuracy.py` from `bench/results/colocate.json` "
        "and `bench/results/raw/*.json` (bf16 engine, fp32 masters + fp32 reference: every "
        "stored run predates issue 30's sharded loader, which keeps the reference in the "
        "engine's dtype, so each run is planned with the reference it had, "
        "plan_for_point(reference_dtype=...), taken from a run's environment and fp32 where "
        "absent; 4 "
        "prompts x 8 samples x 128 tokens, micro-batch 4; one H100 80GB or one H200 with 1 rank, two H200s "
        "with 2 ranks). Measured: the device-wide peak (mem_get_info, sampled every 5 ms) of "
        "rank 0, the highest over the point's iterations. Predicted: the plan's "
        "steady-iteration peak of that stage. In sample: the torch engine's constants were "
        "fitted to its Qwen2.5-3B points (c4..c10) and the training step's cached logits to "
        "the torch points at all three sizes; sglang's to s1 (staged) and s2 (single), 3B. "
        "Modelled from the code, not fitted: torch's caching allocator (the engine's weight "
        "region and the fp32 masters in whole segments) and sglang's pool sizing. a1 (H100, "
        "with RLJOB_ALLOCATOR_REPORT) and v1 (H200, with cuBLAS's workspaces released before "
        "offload_train's empty_cache) are this plan's out-of-sample checks; every run before "
        "v1 had the workspace pinning 0.01-0.40 GiB of freed training memory. The current "
        f"tree's runs ({', '.join(p.rstrip('-') for p in CURRENT_RUNS)}: one H100, "
        "2026-11-25, the workspaces freed before both offload stages' empty_cache) are "
        "in sample for one constant (the torch engine's baseline, "
        "ENGINE_OUTSIDE_REGIONS_BYTES, taken from r2) and out of sample otherwise. See the "
        "docs/memory-plan.md for what each disagreement is.",
        "",
        f"**On the current tree** ({', '.join(models)}):",
        "",
        *(f"- {line}" for line in summary(current)),
        "",
        "**Every stored run:**",
        "",
        *(f"- {line}" for line in summary(rows)),
        "",
        "| file | device | engine | model | ranks | mode | fraction | run | plan | "
        + " | ".join(order)
        + " |",
        "| --- " * (9 + len(order)) + "|",
    ]
    for r in rows:
        cells = []
        for stage in order:
            s = r["stages"].get(stage)
            if s:
                cells.append(
                    f"{s['measured'] / GiB:.2f} / {s['predicted'] / GiB:.2f} ({s['error']:+.1%})"
                )
            elif stage in r["predicted"]:
                cells.append(f"- / {r['predicted'][stage] / GiB:.2f}")
            else:
                cells.append("-")
        run = "ok" if r["completed"] else f"OOM {r['oom_stage']}"
        fit = "fits" if r["plan_fits"] else f"misfit: {r['plan_misfit']}"
        lines.append(
            f"| {r['file']} | {r['device']} | {r['engine']} | {r['model']} | {r['ranks']} "
            f"| {r['mode']} | {r['fraction']:.2f} "
            f"| {run} | {fit} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "Cells: measured / predicted GiB (error of the prediction). OOM points have no "
        "measured steady peak; the plan's prediction is shown.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    rows = [row for path in sources(args.results) for row in compare(path)]
    (args.results / "plan-accuracy.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = render(rows)
    (args.results / "plan-accuracy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
