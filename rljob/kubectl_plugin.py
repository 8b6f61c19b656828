"""`kubectl rljob` (the kubectl-rljob plugin): `describe NAME` prints what is wrong first (one
line per failed or blocking condition), then the newest checkpoint, where the run resumed and
the newest export, the latest iteration's per-stage memory (worst rank per stage), the latest
iterations' metrics, the OOM history and the attempts; `plot NAME -o FILE` draws memory per
stage over the iterations kept in status.memoryHistory, `curve NAME -o FILE` the learning curve
(reward, loss, KL, length) over those kept in status.metrics.

Reads the RLJob with the kubernetes client and the same kubeconfig/context kubectl uses.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rljob.api import GROUP, PLURAL, VERSION, Attempt, RLJobStatus
from rljob.curves import curve_title, metrics_table, plot_learning_curve
from rljob.plan import auto_lines
from rljob.report import STAGE_COLOURS, STAGE_ORDER, bytes_text


def _known(value: object) -> str:
    """`value` as text, `-` where it is not known (an entry without an iteration or rank)."""
    return "-" if value is None else str(value)


def _bytes(n: int | None) -> str:
    return "-" if n is None else bytes_text(n)


def memory_table(name: str, status: RLJobStatus) -> Table | None:
    """The latest iteration's stages: worst rank's peak, fraction of capacity, seconds, rank."""
    memory = status.memory
    if memory is None:
        return None
    what = "GPU memory" if memory.kind == "cuda" else "host memory (RSS; not GPU figures)"
    table = Table(
        title=f"RLJob {name}, iteration {memory.iteration}: {what}, {memory.device}, "
        f"capacity {_bytes(memory.capacity_bytes)}"
    )
    # status.plan (the driver's memory plan, issue 19): predicted beside measured. The plan
    # predicts GPU memory: held against a CPU run's host RSS its error would say nothing.
    predicted: dict[str, int] = {}
    if status.plan is not None and memory.kind == "cuda":
        predicted = {str(s.name): s.peak_bytes for s in status.plan.stages}
    elif status.plan is not None:
        table.caption = (
            f"status.plan predicts GPU memory (a {_bytes(status.plan.capacity_bytes)} card): "
            "not held against host figures"
        )
    columns = ["stage", "peak", "fraction", "seconds", "worst rank"]
    if predicted:
        columns += ["predicted", "plan error"]
    for column in columns:
        table.add_column(column, justify="left" if column == "stage" else "right")
    for stage in memory.stages:
        row = [
            str(stage.name),
            _bytes(stage.peak_bytes),
            f"{stage.peak_fraction:.3f}",
            f"{stage.seconds:.2f}",
            str(stage.rank),
        ]
        if predicted:
            plan_bytes = predicted.get(str(stage.name))
            row += [
                _bytes(plan_bytes),
                f"{(plan_bytes - stage.peak_bytes) / stage.peak_bytes:+.1%}"
                if plan_bytes is not None and stage.peak_bytes
                else "-",
            ]
        table.add_row(*row)
    return table


def oom_table(status: RLJobStatus) -> Table:
    """Every OOM entry status keeps, oldest first, with the all-time counts in the title."""
    counts = ", ".join(f"{k} {v}" for k, v in sorted(status.oom_counts.items())) or "none"
    table = Table(title=f"OOMs (all time: {counts}; the latest are listed, every one is an Event)")
    for column in ("time", "kind", "iteration", "stage", "rank", "pod/container", "node", "detail"):
        table.add_column(column)
    for oom in sorted(status.oom_events, key=lambda o: (o.time, o.id)):
        if oom.kind == "OOMKilled":
            detail = f"limit {_bytes(oom.limit_bytes)}, {oom.count or 1} kill(s)"
        else:
            detail = oom.request_text(bytes_text, unit="")
        where = "/".join(x for x in (oom.pod, oom.container) if x) or "-"
        table.add_row(
            oom.time,
            oom.kind,
            _known(oom.iteration),
            str(oom.stage or "-"),
            _known(oom.rank),
            where,
            oom.node or "-",
            detail,
        )
    return table


def _knobs(attempt: Attempt) -> str:
    """The memory knobs an attempt ran with; the training ones only where the policy set them."""
    knobs = {
        "memFractionStatic": attempt.mem_fraction_static,
        "wakeUp": attempt.wake_up,
        "microBatchSize": attempt.micro_batch_size,
        "gradientCheckpointing": attempt.gradient_checkpointing,
        "margin": attempt.margin,
        "weightSyncBucketMegabytes": attempt.weight_sync_bucket_megabytes,
    }
    return ", ".join(f"{name} {value}" for name, value in knobs.items() if value is not None)


def attempts_table(status: RLJobStatus) -> Table | None:
    """status.attempts (the OOM policy's retries, a checkpointing job's runs), first to last."""
    if not status.attempts:
        return None
    table = Table(title=f"attempts ({len(status.attempts)})")
    columns = ("attempt", "RayJob", "started", "result", "knobs", "OOM", "resumed from iteration")
    for column in (*columns, "changed", "message"):
        table.add_column(column)
    for attempt in status.attempts:
        oom = f"{attempt.oom_stage or '-'} rank {_known(attempt.oom_rank)}"
        resumed = attempt.resumed_from.iteration if attempt.resumed_from else None
        table.add_row(
            str(attempt.attempt),
            attempt.ray_job or "-",
            _known(attempt.started_at),
            attempt.result or "-",
            _knobs(attempt),
            oom if attempt.oom_stage or attempt.oom_rank is not None else "-",
            _known(resumed),
            _known(attempt.changed),
            attempt.message or "-",
        )
    return table


def progress_lines(status: RLJobStatus) -> list[str]:
    """The newest complete checkpoint, the one the current run resumed from and the newest
    export (the trained model), a line each."""
    lines = []
    if status.checkpoint is not None:
        cp = status.checkpoint
        blocked = (
            f" (the loop stood still {cp.blocked_seconds:.1f} s)"
            if cp.blocked_seconds is not None
            else ""
        )
        lines.append(
            f"checkpoint: iteration {cp.iteration} in {cp.path}, completed {cp.completed_at}, "
            f"{bytes_text(cp.bytes)}, {cp.seconds:.1f} s{blocked}"
        )
    if status.resumed_from is not None:
        point = status.resumed_from
        attempt = f" (attempt {point.attempt})" if point.attempt is not None else ""
        lines.append(f"resumed from: iteration {point.iteration} in {point.path}{attempt}")
    if status.export is not None:
        lines.append(f"exported: iteration {status.export.iteration} in {status.export.path}")
    return lines


# Conditions that say something is wrong when they hold this status, most telling first.
PROBLEMS = (("Failed", "True"), ("PodsReady", "False"), ("SpecApplied", "False"))
# A False PodsReady that only says "not yet" is no problem.
NOT_A_PROBLEM = {"PodsPending"}


def cause_lines(status: RLJobStatus) -> list[str]:
    """One line per condition that says what is wrong: `Type  Reason  message` (without the
    message where it has none)."""
    by_type = {c.type: c for c in status.conditions}
    lines = []
    for ctype, bad in PROBLEMS:
        c = by_type.get(ctype)
        if c is not None and c.status == bad and c.reason not in NOT_A_PROBLEM:
            message = " ".join(c.message.split())
            lines.append("  ".join(part for part in (ctype, c.reason, message) if part))
    return lines


def describe(name: str, status: RLJobStatus, console: Console) -> None:
    for line in cause_lines(status):
        # One line each, however long: soft_wrap leaves the line to the terminal.
        console.print(line, style="bold red", soft_wrap=True, markup=False, highlight=False)
    phase = status.phase.value if status.phase else "-"
    console.print(f"RLJob {name}: phase {phase}, iteration {_known(status.iteration)}")
    for line in progress_lines(status):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    table = memory_table(name, status)
    console.print(table if table is not None else "no memory reported yet")
    if status.metrics:
        console.print(metrics_table(status.metrics, f"RLJob {name}: metrics", rows=DESCRIBE_ROWS))
    else:
        console.print("no metrics reported yet")
    for line in auto_lines(status.plan) if status.plan else []:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    console.print(oom_table(status))
    attempts = attempts_table(status)
    if attempts is not None:
        console.print(attempts)


# describe's metrics: the newest few iterations (`curve` draws all that status keeps).
DESCRIBE_ROWS = 5


def curve(name: str, status: RLJobStatus, seed: int | None, out: Path) -> None:
    """The learning curve over the iterations in status.metrics, as `rljob run` draws it."""
    if not status.metrics:
        raise ValueError(f"RLJob {name} has no status.metrics yet")
    device = status.memory.device if status.memory is not None else None
    plot_learning_curve(status.metrics, out, curve_title(name, device, seed))


def plot(name: str, status: RLJobStatus, out: Path) -> None:
    """Peak bytes per stage over the iterations in status.memoryHistory, one line per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not status.memory_history:
        raise ValueError(f"RLJob {name} has no status.memoryHistory yet")
    memory = status.memory
    figure, axis = plt.subplots(figsize=(9, 4.5))
    for stage, colour in zip(STAGE_ORDER, STAGE_COLOURS, strict=True):
        points = [
            (p.iteration, p.peak_bytes[stage.value] / 2**30)
            for p in status.memory_history
            if stage.value in p.peak_bytes
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, marker="o", color=colour, label=stage.value)
    if memory is not None:
        axis.axhline(memory.capacity_bytes / 2**30, color="black", ls=":", label="capacity")
        axis.set_title(f"RLJob {name}: peak memory per stage ({memory.device}, {memory.kind})")
    axis.set_xlabel("iteration")
    axis.set_ylabel("GiB" + (" (host)" if memory is not None and memory.kind == "host" else ""))
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def _read_rljob(
    name: str, namespace: str | None, kubeconfig: str | None
) -> tuple[RLJobStatus, int | None]:
    """The RLJob's status and its spec.algorithm.seed (the curve's title names it)."""
    from kubernetes import client, config

    _contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    namespace = namespace or (active or {}).get("context", {}).get("namespace") or "default"
    api = config.new_client_from_config(config_file=kubeconfig)
    rljob: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    seed = ((rljob.get("spec") or {}).get("algorithm") or {}).get("seed")
    return RLJobStatus.model_validate(rljob.get("status") or {}), seed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubectl rljob", description=__doc__)
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube)")
    commands = parser.add_subparsers(dest="command", required=True)
    for command, text in (
        ("describe", "per-stage memory, the latest metrics and the OOM history"),
        ("plot", "memory per stage over the iterations, as an image"),
        ("curve", "reward, loss, KL and response length over the iterations, as an image"),
    ):
        sub = commands.add_parser(command, help=text)
        sub.add_argument("name", help="the RLJob's name")
        sub.add_argument("-n", "--namespace", help="namespace (default: the context's)")
        if command != "describe":
            default = "memory.png" if command == "plot" else "learning-curve.png"
            sub.add_argument("-o", "--output", type=Path, default=Path(default))
    return parser


def main(argv: list[str] | None = None) -> int:
    """The kubectl-rljob console script; returns the exit code."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    console = Console()
    errors = Console(stderr=True)
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        status, seed = _read_rljob(args.name, args.namespace, args.kubeconfig)
        if args.command == "describe":
            describe(args.name, status, console)
        else:
            if args.command == "plot":
                plot(args.name, status, args.output)
            else:
                curve(args.name, status, seed, args.output)
            console.print(f"wrote {args.output}")
    except ApiException as exc:
        errors.print(f"kubectl rljob: RLJob {args.name}: HTTP {exc.status} {exc.reason}")
        return 1
    except ConfigException as exc:
        where = args.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        errors.print(f"kubectl rljob: no usable kubeconfig at {where}: {exc}")
        return 1
    except HTTPError as exc:  # no answer from the apiserver (urllib3 retried already)
        errors.print(f"kubectl rljob: the apiserver did not answer: {exc}")
        return 1
    except (OSError, ValueError) as exc:  # the plot's file, a status that does not parse
        errors.print(f"kubectl rljob: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
