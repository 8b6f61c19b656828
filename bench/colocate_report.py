"""The report of bench/colocate.py's sweep: colocate.md (tables, floors, the weight-sync
profile), colocate.png (memory and throughput per fraction) and the targets each run is held to.

Pure reporting over the result dictionary colocate.py measures; nothing here runs the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rljob.report import Stage

GiB = 2**30


def _floor_lines(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for p in sorted(result["points"], key=_place):
        floors = p.get("floors") or {}
        if not floors:
            continue
        lines += [
            "",
            f"Floors of {_label(p)} at {p['fraction']:.2f}: iteration {_num(p.get('iteration_seconds'))}"
            f" s, staging tax {_share(p.get('staging_tax'))}, rollout "
            f"{_num(p.get('rollout_tokens_per_second'), 0)} tok/s, answers mean "
            f"{_num(p.get('response_length_mean'), 0)} tokens (max {p.get('response_length_max')}, "
            f"{_share(p.get('truncated_share'))} at the cap)",
            "",
            "| stage | seconds | moves | floor s | x floor |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, row in floors.items():
            if "tokens" in row:
                moved = "-" if row["tokens"] is None else f"{row['tokens']:.0f} tokens"
            else:
                moved = f"{(row['bytes'] or 0) / 1e9:.2f} GB"
            lines.append(f"| {name} | {_num(row['seconds'], 3)} | {moved} | "
                         f"{_num(row['floor_seconds'], 3)} | {_num(row['ratio'])} |")  # fmt: skip
    return lines


def _label(point: dict[str, Any]) -> str:
    path = point.get("sync_path", "default")
    overlap = _overlap(point)
    return (
        f"{point['mode']}{_offload_note(point)}"
        + ("" if path == "default" else f" [{path}]")
        + ("" if overlap == "Off" else f" overlap {overlap}")
    )


def _overlap(point: dict[str, Any]) -> str:
    """spec.training.overlapStaging of the point (--overlap-staging); points stored before it
    existed ran each copy in its own stage: Off (their labels stay as they were)."""
    return str(point.get("overlap_staging", "Off"))


# -- outputs -----------------------------------------------------------------------------------


def _gib(value: float | None) -> str:
    return f"{value / GiB:.1f}" if value else "-"


def _num(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _offload(point: dict[str, Any]) -> str:
    return str(point.get("offload", "Always"))  # points stored before --offload ran Always


def _place(point: dict[str, Any]) -> tuple[str, float, str, str, str]:
    """What makes two points the same measurement: mode, fraction, offload, sync path and
    staging overlap."""
    path = point.get("sync_path", "default")
    return point["mode"], point["fraction"], _offload(point), path, _overlap(point)


def _offload_note(point: dict[str, Any]) -> str:
    """' (Auto: optimizer)' and the like: what an Auto point offloaded; nothing for Always."""
    if _offload(point) == "Always":
        return ""
    parts = [n for n, on in (("optimizer", point["offload_optimizer"]),
                             ("params", point["offload_params"])) if on]  # fmt: skip
    return f" (Auto: {' + '.join(parts) or 'no offload'})"


def _handoff(point: dict[str, Any]) -> str:
    """` (0.012)`: the hand-off part of the weight sync, where the run measured it."""
    seconds = point.get("weight_handoff_seconds")
    return "" if seconds is None else f" ({seconds:.3f})"


def _profile_lines(profile: dict[str, Any]) -> list[str]:
    if not profile:
        return []
    if "error" in profile:
        return [f"- weight-sync profile failed: {profile['error']}"]
    gathered = ""  # absent from runs before the per-bucket gather (now sync_send.gather_full)
    if "gather_full_copy_seconds" in profile:
        gathered = f" sync_send.gather_full per bucket + copy {profile['gather_full_copy_seconds'] * 1e3:.1f} ms"
        if "gather_full_copy_cold_seconds" in profile:  # and before the cold figure
            cold = profile["gather_full_copy_cold_seconds"] * 1e3
            gathered += f" ({cold:.1f} ms after emptying the allocator)"
        gathered += ";"
    ranks = int(profile.get("ranks", 1))
    over = f", over {ranks} ranks" if ranks > 1 else ""
    gathers = ""
    if "all_gather_seconds" in profile:
        gathers = (
            f"; the all-gathers alone {profile['all_gather_seconds'] * 1e3:.1f} ms "
            f"({profile['all_gather_bytes'] / 1e9:.1f} GB received)"
        )
    return [
        f"- weight-sync path by part ({int(profile['tensors'])} tensors, fp32 shards to bf16{over}): "
        f"DTensor cast + full_tensor + copy {profile['dtensor_cast_gather_copy_seconds'] * 1e3:.1f}"
        f" ms;{gathered} local cast-and-copy {profile['local_cast_copy_seconds'] * 1e3:.1f} ms; one"
        f" flat copy of the engine bytes {profile['flat_copy_seconds'] * 1e3:.1f} ms{gathers}"
    ]


def write_markdown(result: dict[str, Any], path: Path) -> None:
    env, model, bw = result["environment"], result["model"], result["bandwidths"]
    lines = [
        f"# Staged vs single-stage awake: {model['name']}, {env.get('engine', 'torch')} engine, "
        f"on {env['device']}",
        "",
        f"- device: {env['device']}, {env['device_total_bytes'] / GiB:.2f} GiB "
        f"({env['device_total_bytes']} bytes); torch {env['torch']}, CUDA {env['cuda']}, "
        f"torch_memory_saver {env['torch_memory_saver']}, transformers {env['transformers']}"
        + (f", sglang {env['sglang']}" if env.get("sglang") else ""),
        f"- model: {model['name']} architecture, random init, {model['parameters'] / 1e9:.2f} B "
        f"params; training state on the device {_gib(model['training_state_bytes'])} GiB "
        f"(fp32 params + grads + AdamW{', + fp32 reference' if model['reference'] else ''}); "
        f"engine weights {_gib(model['engine_weight_bytes'])} GiB bf16",
        f"- workload per iteration ({result['settings'].get('workload', 'small')}): "
        f"{result['settings']['prompts']} prompts x "
        f"{result['settings']['group_size']} samples x up to {result['settings']['response_length']} "
        f"tokens, GRPO kl_coef {result['settings']['kl_coef']}, micro-batch "
        f"{result['settings']['micro_batch_size']}"
        + (
            ", gradient checkpointing"
            if result["settings"].get("gradient_checkpointing") == "True"
            else ""
        )
        + (
            f", answers end on EOS (hazard {result['settings']['eos_hazard']} per token)"
            if result["settings"].get("eos_hazard") not in (None, "None")
            else ""
        ),
        f"- measured: device-to-device copy {_num(bw.get('d2d_copy_bytes_per_second', 0) / 1e9, 0)}"
        f" GB/s (HBM read+write {_num(bw.get('hbm_read_write_bytes_per_second', 0) / 1e9, 0)}"
        f" GB/s), pinned host-to-device {_num(bw.get('h2d_pinned_bytes_per_second', 0) / 1e9, 1)}"
        f" GB/s, device-to-host {_num(bw.get('d2h_pinned_bytes_per_second', 0) / 1e9, 1)} GB/s",
        "- commands: " + "; ".join(f"({i}) `{c}`" for i, c in enumerate(result["commands"], 1)),
        *_profile_lines(result.get("weight_sync_profile") or {}),
        "",
        "Times are medians over iterations 2..N (iteration 1 also pins host buffers). "
        "Peaks are device-wide (mem_get_info), sampled every 5 ms.",
        "",
        "| mode | memFractionStatic | result | KV tokens | peak wake_weights GiB | "
        "peak wake_kv_cache GiB | peak rollout GiB | rollout tok/s | sync s (hand-off) | "
        "offload s | onload s | staging tax | run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in sorted(result["points"], key=_place):
        peaks = p["stage_peak_bytes"]
        if p["completed"]:
            outcome = f"ok ({p['iterations_done']} it)"
        else:
            kind = "OOM" if p.get("failure_kind", "oom") == "oom" else "error"
            outcome = f"{kind} in {p['oom_stage']} (it {p['oom_iteration']})"
        lines.append(
            f"| {_label(p)} | {p['fraction']:.2f} | {outcome} | {p['kv_capacity_tokens'] or '-'} "
            f"| {_gib(peaks.get('wake_weights'))} | {_gib(peaks.get('wake_kv_cache'))} | "
            f"{_gib(peaks.get('rollout'))} | {_num(p['rollout_tokens_per_second'], 0)} | "
            f"{_num(p['weight_sync_seconds'], 3)}{_handoff(p)} | {_num(p['offload_seconds'])} | "
            f"{_num(p['onload_seconds'])} | "
            f"{_share(p.get('staging_tax'))} | "
            f"{p.get('run', 1)} |"
        )
    alone = result.get("alone")
    if alone and alone.get("rollout_tokens_per_second"):
        lines += ["", f"The engine alone ({alone['mode']} at {alone['fraction']:.2f}, no trainer "
                      f"on the device, same prompts and sampling): "
                      f"{alone['rollout_tokens_per_second']:.0f} rollout tok/s, KV "
                      f"{alone['kv_capacity_tokens']} tokens; colocated/alone "
                      f"{_num(alone.get('colocated_over_alone'))}."]  # fmt: skip
    lines += _floor_lines(result)
    lines += ["", "## Targets", ""]
    lines += [
        f"- {t['name']}: {t['measured']} (**{'met' if t['met'] else 'MISSED'}**)"
        for t in result["targets"]
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    stage_colors = dict(zip([str(s) for s in Stage], palette, strict=False))
    fig = plt.figure(figsize=(15, 10))
    grid = fig.add_gridspec(2, 2)
    capacity = result["environment"]["device_total_bytes"] / GiB
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])]
    for ax, mode in zip(axes, ("single", "staged"), strict=True):
        best = result["best"].get(mode)
        points = [p for p in result["points"] if p["mode"] == mode and p["fraction"] == best]
        if best is None or not points or not points[0]["timeline"]:
            ax.set_title(f"{mode}: no completing fraction")
            continue
        timeline = points[0]["timeline"]
        t0 = timeline[0]["start_seconds"]
        xs, ys = [0.0], [timeline[0]["peak_bytes"] / GiB]
        for s in timeline:
            start, end = s["start_seconds"] - t0, s["start_seconds"] - t0 + s["seconds"]
            ax.axvspan(start, end, color=stage_colors[s["stage"]], alpha=0.25, lw=0,
                       label=s["stage"])  # fmt: skip
            ax.hlines(s["peak_bytes"] / GiB, start, end, color="black", lw=2)
            xs += [end]
            ys += [s["end_bytes"] / GiB]
        ax.plot(xs, ys, "o:", color="gray", ms=3, label="used at stage end")
        ax.plot([], [], color="black", lw=2, label="stage peak (device-wide)")
        ax.axhline(capacity, color="red", lw=0.8, label=f"device {capacity:.1f} GiB")
        ax.set(xlabel=f"seconds into iteration {points[0]['iterations_done']}",
               ylabel="device memory used (GiB)", ylim=(0, max(capacity, max(ys)) * 1.08),
               title=f"{mode} at memFractionStatic {best:.2f}")  # fmt: skip
        ax.legend(loc="lower right", fontsize=7)
    kv_ax = fig.add_subplot(grid[1, :])
    for mode, marker, color in (("single", "s", "tab:orange"), ("staged", "o", "tab:blue")):
        points = sorted((p for p in result["points"] if p["mode"] == mode),
                        key=lambda p: p["fraction"])  # fmt: skip
        ok = [(p["fraction"], p["kv_capacity_tokens"] / 1e6) for p in points if p["completed"]]
        failed = [p for p in points if not p["completed"]]
        if ok:
            kv_ax.plot(*zip(*ok, strict=True), marker=marker, color=color,
                       label=f"{mode}: completed {result['settings']['iterations']} iterations")  # fmt: skip
        for index, p in enumerate(failed):
            y = (p["kv_capacity_tokens"] or planned_kv_tokens(result, p["fraction"])) / 1e6
            kv_ax.scatter([p["fraction"]], [y], marker="x", s=120, color=color)
            # Neighbouring OOMs (0.98, 0.99) alternate above and below their marker.
            kv_ax.annotate(f"{mode} OOM in\n{p['oom_stage']}", (p["fraction"], y),
                           textcoords="offset points", xytext=(-30, 10 if index % 2 else -28),
                           fontsize=8, color=color)  # fmt: skip
    kv_ax.scatter([], [], marker="x", color="gray", label="OOM (KV size it would have had)")
    kv_ax.set(xlabel="memFractionStatic", ylabel="KV pool capacity (million tokens)",
              title="KV pool capacity against memFractionStatic")  # fmt: skip
    kv_ax.grid(alpha=0.3)
    kv_ax.legend(loc="upper left")
    model, env = result["model"], result["environment"]
    fig.suptitle(f"{model['name']} (random init, bf16 engine, fp32 FSDP2 training) on "
                 f"{env['device']}, torch {env['torch']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def planned_kv_tokens(result: dict[str, Any], fraction: float) -> int:
    """The pool the torch engine sizes for a fraction (torch_engine.kv_pool_capacity_tokens);
    0 for sglang, whose sizing depends on what its own processes hold (no prediction here)."""
    if result["environment"].get("engine", "torch") != "torch":
        return 0
    model, total = result["model"], result["environment"]["device_total_bytes"]
    per_token = max(model["kv_bytes_per_token"], 1)
    return max(int(fraction * total) - model["engine_weight_bytes"], 0) // per_token // 16 * 16


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    best, points, ideal = result["best"], result["points"], result.get("ideal_seconds", {})
    # The stored points' targets are Always's; an Auto point at the same place is compared below.
    by = {
        (p["mode"], p["fraction"]): p for p in sorted(points, key=lambda p: _offload(p) == "Always")
    }
    targets = []
    staged, single = best.get("staged"), best.get("single")
    single_fail = min(
        (p["fraction"] for p in points if p["mode"] == "single" and not p["completed"]),
        default=None,
    )
    targets.append({
        "name": "staged completes 3 iterations at >= 0.92 where single fails at <= 0.80",
        "measured": f"staged highest completing {staged}, single lowest failing {single_fail} "
                    f"(highest completing {single})",
        "met": staged is not None and staged >= 0.92 and single_fail is not None
        and single_fail <= 0.80,
    })  # fmt: skip
    if staged is not None and single is not None:
        kv_staged = by[("staged", staged)]["kv_capacity_tokens"]
        kv_single = by[("single", single)]["kv_capacity_tokens"]
        ratio = kv_staged / max(kv_single, 1)
        targets.append({"name": "KV capacity at each mode's highest completing fraction: "
                                "staged >= 1.4x single",
                        "measured": f"{ratio:.2f}x ({kv_staged} vs {kv_single} tokens)",
                        "met": ratio >= 1.4})  # fmt: skip
    ref = by.get(("staged", staged)) if staged is not None else None
    for point in (p for p in points if (p.get("floors") or {}).get("weight_sync", {}).get("ratio")):
        sync = point["floors"]["weight_sync"]
        targets.append({"name": f"weight sync within 3x its HBM floor (fp32 read + bf16 write over "
                                f"HBM bandwidth), {_label(point)} at {point['fraction']:.2f}",
                        "measured": f"{sync['ratio']:.2f}x ({sync['seconds']:.3f} s measured, "
                                    f"{sync['floor_seconds']:.4f} s floor; hand-off "
                                    f"{_num(point.get('weight_handoff_seconds'), 3)} s)",
                        "met": sync["ratio"] <= 3.0})  # fmt: skip
    for key, measured_key, bound, what in (
        ("offload", "offload_seconds", 1.5, "bytes / pinned device-to-host bandwidth"),
        ("onload", "onload_seconds", 1.5, "bytes / pinned host-to-device bandwidth"),
    ):
        if ref is not None and ideal.get(key) and ref[measured_key]:
            ratio = ref[measured_key] / ideal[key]
            targets.append({"name": f"{key} within {bound}x of {what}",
                            "measured": f"{ratio:.2f}x ({ref[measured_key]:.3f} s measured, "
                                        f"{ideal[key]:.3f} s ideal; staged at {staged})",
                            "met": ratio <= bound})  # fmt: skip
    if ref is not None and ref.get("staging_tax") is not None:
        targets.append({"name": "staging tax (stages other than train and rollout) <= 5% of the "
                                "iteration, staged at its highest completing fraction",
                        "measured": f"{ref['staging_tax']:.1%}, dominated by "
                                    f"{ref['staging_dominant']} "
                                    f"({ref['stage_seconds'].get(ref['staging_dominant'], 0):.2f} s)",
                        "met": ref["staging_tax"] <= 0.05})  # fmt: skip
    for auto in (p for p in points if _offload(p) == "Auto"):
        always = next((p for p in points if _offload(p) == "Always" and p["mode"] == auto["mode"]
                       and p["fraction"] == auto["fraction"]), None)  # fmt: skip
        if always is None or always.get("staging_tax") is None:
            continue
        both = auto["completed"] and always["completed"] and auto.get("staging_tax") is not None
        targets.append({"name": f"offload Auto lowers the staging tax against Always, "
                                f"{auto['mode']} at {auto['fraction']:.2f}, both completing",
                        "measured": f"{_offload_note(auto).strip()} {_share(auto.get('staging_tax'))}"
                                    f" vs Always {_share(always['staging_tax'])}",
                        "met": both and auto["staging_tax"] < always["staging_tax"]})  # fmt: skip
    alone = result.get("alone")
    if alone and alone.get("colocated_over_alone") is not None:
        targets.append({"name": "colocated rollout throughput >= 0.9x the same engine alone",
                        "measured": f"{alone['colocated_over_alone']:.2f}x "
                                    f"({alone['mode']} at {alone['fraction']:.2f}: alone "
                                    f"{alone['rollout_tokens_per_second']:.0f} tok/s)",
                        "met": alone["colocated_over_alone"] >= 0.9})  # fmt: skip
    elif alone and alone.get("error"):
        targets.append({"name": "colocated rollout throughput >= 0.9x the same engine alone",
                        "measured": f"the engine-alone pass failed: {alone['error'][:200]}",
                        "met": False})  # fmt: skip
    checks = [(p["mode"], p["fraction"], k, c) for p in points for k, c in p["released"].items()]
    if checks:
        short = [
            f"{m} {f:.2f} {k}: {c['freed_bytes'] / GiB:.2f} of {c['released_bytes'] / GiB:.2f} GiB"
            for m, f, k, c in checks
            if c["freed_bytes"] < c["released_bytes"] - RELEASE_SLACK_BYTES
        ]
        worst = min(c["freed_bytes"] / max(c["released_bytes"], 1) for *_, c in checks)
        targets.append({"name": "every released byte back as free device memory (mem_get_info)",
                        "measured": f"{len(checks)} releases checked, lowest freed/released "
                                    f"{worst:.3f}" + (f"; short: {short}" if short else ""),
                        "met": not short})  # fmt: skip
    return targets


# Allocation rounding (2 MiB segments, pinned-to-device copies landing in cached blocks).
RELEASE_SLACK_BYTES = 64 << 20
