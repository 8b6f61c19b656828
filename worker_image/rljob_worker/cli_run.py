"""`rljob run MANIFEST`: run an RLJob manifest on this machine with the local driver.

Shows a progress bar per iteration, prints the per-iteration metrics and per-stage memory tables,
and writes the status the operator would publish (status.json / status.yaml), every iteration's
report, a memory timeline and a learning curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rljob.api import (
    REASON_CHECKPOINT_FAILED,
    Attempt,
    AttemptKnobs,
    Phase,
    RLJobSpec,
    RLJobStatus,
    history_with,
    load_manifest,
)
from rljob.curves import curve_title, metrics_table, plot_learning_curve
from rljob.plan import auto_lines
from rljob.report import (
    STAGE_COLOURS,
    STAGE_ORDER,
    IterationReport,
    LoadSample,
    MemorySummary,
    OOMRecord,
    Stage,
    StageSample,
    bytes_text,
    summarize,
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rljob run",
        description="Run an RLJob manifest locally: one process per rank (CPU on gloo, GPUs on "
        "NCCL), the same colocated loop the cluster runs.",
    )
    parser.add_argument("manifest", type=Path, help="RLJob YAML, as for kubectl apply")
    parser.add_argument("--out", type=Path, help="output directory (default ./out/<job name>)")
    parser.add_argument(
        "--ranks", type=_positive, help="processes (default: the spec's world size)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--verify-weights",
        action="store_true",
        help="after every weight update, check each engine weight equals the training tensor",
    )
    parser.add_argument(
        "--inject-oom",
        metavar="STAGE[@rank=R][@iteration=I]",
        help="raise a real CUDA OOM at that stage (to see how failures are reported)",
    )
    parser.add_argument(
        "--publish",
        metavar="NAMESPACE/NAME",
        help="also write the driver's part of that RLJob's status (server-side apply) and its "
        "Events, with the kubeconfig in $KUBECONFIG (or the in-cluster ServiceAccount)",
    )
    return parser


def _device(choice: str, spec: RLJobSpec) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() and spec.resources.gpus_per_worker > 0 else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    return choice


def _preflight(spec: RLJobSpec, ranks: int, device: str) -> None:
    """What the rank processes would fail on, checked before any starts (each would print its
    own traceback, a minute later): the engine's device, the split of prompts over ranks and
    of ranks into tensor-parallel groups (all on this one machine), PPO's mini-batches over each
    rank's responses, where the export goes, the multiTurn tools' loading, the data file's rows
    (with the tools in the template) and the reward function's loading."""
    from rljob.api import EngineName
    from rljob_worker.agentic.tools import make_tools
    from rljob_worker.engines.tensor_parallel import tensor_parallel_layout
    from rljob_worker.export import export_target_problem
    from rljob_worker.loop import prompts_per_rank
    from rljob_worker.model import load_tokenizer, resolve_model_path
    from rljob_worker.reward import Scorer
    from rljob_worker.task import make_task, validation_problems

    if spec.rollout.engine == EngineName.SGLANG and device != "cuda":
        raise ValueError(
            f"spec.rollout.engine sglang needs a CUDA GPU, and this run is on {device} "
            "(engine: torch runs the same stages on the CPU)"
        )
    tensor_parallel_layout(0, ["local"] * ranks, spec.rollout.tensor_parallel_size)
    # The spec's rules check its own world size; --ranks may change how much each rank trains on.
    responses = prompts_per_rank(spec, ranks) * spec.algorithm.group_size
    if spec.algorithm.ppo_mini_batches > responses:
        raise ValueError(
            f"spec.algorithm.ppoMiniBatches={spec.algorithm.ppo_mini_batches} is more than the "
            f"{responses} responses each of the {ranks} ranks trains on per iteration"
        )
    model_path = resolve_model_path(spec.model.path)
    refused = export_target_problem(spec, model_path)
    if refused is not None:  # an export over the checkpoints, the model or the data
        raise ValueError(refused)
    # A missing file, bad rows, prompts over maxPromptLength (DatasetError, a ValueError), with
    # the tool schemas the ranks give the chat template (a user tool that cannot load fails).
    multi_turn = spec.rollout.multi_turn_settings
    schemas = make_tools(multi_turn).schemas if multi_turn is not None else None
    tokenizer = load_tokenizer(model_path)
    make_task(spec.data, spec.algorithm.seed, tokenizer, schemas)
    validation_problems(spec.data, spec.algorithm.seed, tokenizer, schemas)  # the same checks
    Scorer(spec.reward).close()  # a reward file or module that does not load (RewardLoadError)


def _cause(run: Any) -> str | None:
    """status.cause of a failed run, one line: the first OOM, else the first rank's error."""
    from rljob_worker.driver.failure import headline

    if run.ooms:
        oom = min(run.ooms, key=lambda o: o.time)
        return f"CUDAOutOfMemory in stage {oom.stage} (rank {oom.rank}, iteration {oom.iteration})"
    if run.checkpoint_failures:
        return f"{REASON_CHECKPOINT_FAILED}: {run.checkpoint_failures[0].describe()}"[:512]
    if run.errors:
        rank, error = min(run.errors.items())
        return f"rank {rank} failed: {headline(error)}"[:512]
    return None


def load_lines(status: RLJobStatus, loads: list[LoadSample]) -> list[str]:
    """Each rank's measured start-up peak, then the plan's load row to hold them against."""
    lines = [
        f"start-up load, rank {s.rank}: peak {bytes_text(s.device_peak_used_bytes)} "
        f"{'host' if s.kind == 'host' else 'device'}-wide, "
        f"torch allocated {bytes_text(s.peak_allocated_bytes)}, host RSS peak "
        f"{bytes_text(s.host_peak_bytes)}, {s.seconds:.1f} s"
        for s in sorted(loads, key=lambda s: s.rank)
    ]
    planned = status.plan.load if status.plan is not None else None
    if lines and planned is not None:
        lines.append(
            f"start-up load, plan: {bytes_text(planned.peak_bytes)} per rank "
            f"({planned.peak_fraction:.3f}), host {bytes_text(planned.host_bytes_per_node)} per "
            "worker pod for the slices"
        )
    return lines


def memory_table(summary: MemorySummary, reports: list[IterationReport]) -> Table:
    """Worst rank per stage of the latest iteration, with device and capacity in the title."""
    kind = (
        "host memory (process RSS; peak is host-wide use)"
        if summary.kind == "host"
        else "GPU memory"
    )
    table = Table(
        title=f"iteration {summary.iteration}: {kind}, {summary.device}, "
        f"capacity {bytes_text(summary.capacity_bytes)}"
    )
    if summary.kind == "cuda":
        table.caption = (
            "peak used: device-wide (mem_get_info); torch peak allocated also counts "
            "torch_memory_saver regions while they are released"
        )
    for column in ("stage", "peak used", "fraction", "torch peak allocated", "seconds", "rank"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    latest = next(r for r in reports if r.iteration == summary.iteration)
    allocated: defaultdict[Stage, int] = defaultdict(int)
    for sample in latest.samples:
        allocated[sample.stage] = max(allocated[sample.stage], sample.peak_allocated_bytes)
    for stage in summary.stages:
        table.add_row(
            str(stage.name),
            bytes_text(stage.peak_bytes),
            f"{stage.peak_fraction:.3f}",
            bytes_text(allocated[stage.name]),
            f"{stage.seconds:.3f}",
            str(stage.rank),
        )
    return table


def plot_timeline(samples: list[StageSample], path: Path, title: str) -> None:
    """Memory over time per rank (stage peaks and ends), stages shaded from rank 0's timings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not samples:
        return
    origin = min(s.start_seconds for s in samples)
    colour = dict(zip(STAGE_ORDER, STAGE_COLOURS, strict=True))
    figure, axis = plt.subplots(figsize=(11, 4.5))
    for sample in samples:
        if sample.rank == 0:
            start = sample.start_seconds - origin
            axis.axvspan(
                start, start + sample.seconds, color=colour[sample.stage], alpha=0.18, lw=0
            )
    for rank in sorted({s.rank for s in samples}):
        own = sorted((s for s in samples if s.rank == rank), key=lambda s: s.start_seconds)
        times: list[float] = []
        peaks: list[float] = []
        allocated: list[float] = []
        for sample in own:
            start = sample.start_seconds - origin
            # Each stage contributes its peak over its span and its end value at its end.
            times += [start, start + sample.seconds]
            peaks += [sample.device_peak_used_bytes / 2**30] * 2
            allocated += [sample.peak_allocated_bytes / 2**30, sample.allocated_bytes / 2**30]
        used = "host peak used" if own[0].kind == "host" else "device peak used"
        axis.step(times, peaks, where="post", label=f"rank {rank} {used}")
        if own[0].kind == "host":
            # On CUDA torch's allocated bytes include released memory-saver regions: not drawn.
            axis.plot(times, allocated, ls="--", label=f"rank {rank} process RSS")
    kind = samples[0].kind
    axis.set_xlabel("seconds since start")
    axis.set_ylabel("GiB" + (" (host)" if kind == "host" else ""))
    axis.set_title(title, fontsize=10)
    handles, _ = axis.get_legend_handles_labels()
    handles += [Patch(color=colour[s], alpha=0.4, label=str(s)) for s in STAGE_ORDER]
    axis.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


class _Progress:
    """One bar step per iteration that every rank finished, with reward, loss, KL, entropy and
    stage times."""

    def __init__(self, iterations: int, ranks: int) -> None:
        from tqdm import tqdm

        self.ranks = ranks
        self.bar = tqdm(total=iterations + 1, desc="iterations", unit="it", file=sys.stderr)
        self.done: dict[int, list[Any]] = defaultdict(list)
        self.seconds: dict[int, dict[str, float]] = defaultdict(dict)

    def __call__(self, event: object) -> None:
        from rljob_worker.loop import RankIteration

        if isinstance(event, StageSample):
            held = self.seconds[event.iteration]
            held[str(event.stage)] = max(held.get(str(event.stage), 0.0), event.seconds)
        elif isinstance(event, RankIteration):
            self.done[event.iteration].append(event)
            if len(self.done[event.iteration]) == self.ranks:
                self._advance(event.iteration)

    def _advance(self, iteration: int) -> None:
        from rljob_worker.driver import iteration_reports

        # Combined over the ranks as reports.json combines them (token-weighted KL and loss).
        (report,) = iteration_reports((), self.done[iteration])
        postfix = {"reward": f"{report.reward_mean or 0.0:.3f}"}
        if report.kl_mean is not None:
            postfix["kl"] = f"{report.kl_mean:.2e}"
        if report.policy_loss is not None:
            postfix["loss"] = f"{report.policy_loss:.3f}"
        if report.entropy_mean is not None:
            postfix["entropy"] = f"{report.entropy_mean:.3f}"
        postfix.update({k: f"{v:.2f}s" for k, v in self.seconds[iteration].items()})
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def write_outputs(
    out: Path, name: str, status: RLJobStatus, reports: list[IterationReport], seed: int
) -> list[str]:
    """status.json / status.yaml (the RLJob status schema), reports.json, memory-timeline.png
    and learning-curve.png (from status.metrics, as `kubectl rljob curve` draws it)."""
    out.mkdir(parents=True, exist_ok=True)
    document = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    (out / "status.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / "status.yaml").write_text(yaml.safe_dump({"status": document}, sort_keys=False))
    (out / "reports.json").write_text(
        json.dumps([r.model_dump(mode="json", by_alias=True) for r in reports], indent=1) + "\n"
    )
    samples = [s for r in reports for s in r.samples]
    memory = status.memory
    title = f"RLJob {name}: memory per stage"
    if memory is not None:
        title += f" ({memory.device}, {bytes_text(memory.capacity_bytes)}, {memory.kind})"
    plot_timeline(samples, out / "memory-timeline.png", title)
    written = ["status.json", "status.yaml", "reports.json", "memory-timeline.png"]
    if any(m.reward_mean is not None for m in status.metrics):
        device = memory.device if memory is not None else None
        plot_learning_curve(
            status.metrics, out / "learning-curve.png", curve_title(name, device, seed)
        )
        written.append("learning-curve.png")
    return written


def _attempt(
    spec: RLJobSpec, ranks: int, device: str, args: argparse.Namespace, publisher: Any,
    inject: Any, job: str,
) -> Any:  # fmt: skip
    """One attempt of the run `job`: the ranks, with a progress bar (and the status
    publisher, if any)."""
    from rljob_worker.driver.local import run_local

    progress = _Progress(spec.algorithm.iterations, ranks)
    listener: Any = progress
    if publisher is not None:
        from rljob_worker.publish import PublishingListener

        listener = PublishingListener(publisher, ranks, then=progress)
    try:
        run = run_local(
            spec,
            ranks,
            device,
            on_event=listener,
            verify_weights=args.verify_weights,
            inject_oom=inject,
            job=job,
        )
    finally:
        progress.close()
    if publisher is not None:
        listener.flush()
    return run


def _apply_env(spec: RLJobSpec, console: Console) -> None:
    """spec.env's literal values into this process's environment, which the ranks inherit (and
    the preflight's tokenizer load sees); says what the cluster alone would have supplied."""
    from rljob_worker.local_env import local_env

    env = local_env(spec, os.environ)
    os.environ.update(env.values)
    if env.values:
        console.print("spec.env: set " + ", ".join(sorted(env.values)) + " for the ranks")
    if env.unexpanded:
        console.print(
            "[yellow]spec.env: no earlier entry (nor envFrom) defines "
            f"{escape('; '.join(env.unexpanded))}; the pod keeps such a reference as written, "
            "as here (the kubelet never expands the image's variables)[/yellow]"
        )
    if env.cluster_only:
        console.print(
            "[yellow]spec.env/envFrom from Secrets and ConfigMaps are read on a cluster only; "
            f"here your shell's environment stands in: {escape('; '.join(env.cluster_only))}"
            "[/yellow]"
        )
    if spec.volumes:
        console.print(
            f"spec.volumes ({len(spec.volumes)}) are not mounted locally: the spec's paths are "
            "read on this machine"
        )


def main(argv: list[str]) -> int:
    """`rljob run`; returns the process exit code."""
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        name, spec = load_manifest(args.manifest)
        _apply_env(spec, console)
        device = _device(args.device, spec)
        from rljob_worker.memory import OOMInjection

        inject = OOMInjection.from_env(args.inject_oom) if args.inject_oom else None
        ranks = args.ranks or spec.world_size
        _preflight(spec, ranks, device)
    except (OSError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        console.print(f"[red]rljob run: {escape(str(error))}[/red]")
        return 2
    out = args.out or Path("out") / name
    console.print(
        f"RLJob [bold]{name}[/bold]: {ranks} rank(s) on {device}, engine {spec.rollout.engine}, "
        f"wakeUp {spec.rollout.wake_up}, {spec.algorithm.iterations} iteration(s) "
        "(iteration 0 is the first rollout)"
    )
    from rljob.oom_policy import (
        Outcome,
        capacity_note,
        first_knobs,
        next_attempt,
        plan_fits,
    )
    from rljob_worker.driver import continued

    publisher = None
    if args.publish:
        from rljob_worker.publish import StatusPublisher

        namespace, _, job_name = args.publish.partition("/")
        if not namespace or not job_name:
            console.print(f"[red]rljob run: --publish {args.publish!r}: use NAMESPACE/NAME[/red]")
            return 2
        publisher = StatusPublisher.from_env_or_kubeconfig(namespace, job_name)

    capacity: list[int] = []  # the card the ranks measured, once an attempt has reported it

    def fits(knobs: AttemptKnobs) -> bool | None:
        """The plan's veto, where it can plan without the GPU (a builtin model or
        spec.model.shape): this process must not hold a CUDA context. On the card the ranks
        measured where they reported it, else on spec.memoryPlan.gpuMemory."""
        return plan_fits(spec, knobs, capacity[0] if capacity else None)

    # Locally this command is the operator too: it applies spec.oomPolicy (docs/memory-plan.md)
    # between attempts, each a fresh set of rank processes. --inject-oom applies to the
    # first attempt only, so a policy can be tried on the CPU.
    knobs = first_knobs(spec)
    attempts: list[Attempt] = []
    changed = ""  # the retry's status.attempts[].changed (Decision.changed)
    earlier_ooms: list[OOMRecord] = []  # the OOMs of the attempts before the last
    # What the attempts before the last reported that status keeps, as the cluster's driver
    # keeps what an earlier one wrote (publish.continued): a retry resumed from a checkpoint
    # would otherwise show neither that checkpoint (until it saves one) nor the iterations
    # before it in metrics and memoryHistory.
    earlier = RLJobStatus()
    earlier_reports: list[IterationReport] = []
    # This run's identity in its checkpoints: its retries continue from them, also with
    # checkpoint.resume Never; a later `rljob run` is another job (checkpoint.resume_point).
    job = uuid.uuid4().hex
    while True:
        number = len(attempts) + 1
        if publisher is not None:
            publisher.attempt = number  # stamped on this attempt's OOM entries
        run = _attempt(
            knobs.apply(spec),
            ranks,
            device,
            args,
            publisher,
            inject if number == 1 else None,
            job,
        )
        for oom in run.ooms:
            oom.attempt = number
        oom = run.ooms[0] if run.ooms else None
        result = "Succeeded" if run.ok else "CUDAOutOfMemory" if oom else "Failed"
        attempt = Attempt.ran_with(
            number,
            knobs,
            changed=changed,
            result=result,
            oom_stage=oom.stage if oom else None,
            oom_rank=oom.rank if oom else None,
            resumed_from=run.resume_point,
        )
        attempts.append(attempt)
        if run.ok or oom is None:
            break
        memory = run.status().memory
        if memory is not None and memory.capacity_bytes:
            capacity[:] = [memory.capacity_bytes]
        status_now = run.status()
        planned = {s.name: s.peak_bytes for s in status_now.plan.stages} if status_now.plan else {}
        measured = Outcome(
            "CUDAOutOfMemory",
            oom.stage,
            oom.rank,
            requested_bytes=oom.requested_bytes,
            free_bytes=oom.free_bytes,
            capacity_bytes=status_now.plan.capacity_bytes if status_now.plan else None,
            planned_peak_bytes=planned.get(oom.stage) if oom.stage else None,
        )
        decision = next_attempt(spec, knobs, number, measured, fits)
        if decision.retry:
            decision = dataclasses.replace(
                decision,
                message=decision.message + capacity_note(spec, capacity[0] if capacity else None),
            )
        attempt.message = decision.message[:1024]
        if not decision.retry or decision.knobs is None:
            if spec.oom_policy.max_retries:
                console.print(f"[red]{decision.reason}: {escape(decision.message)}[/red]")
            break
        console.print(f"[yellow]{decision.reason}: {escape(decision.message)}[/yellow]")
        changed = decision.changed(knobs, spec)
        knobs = decision.knobs
        earlier_ooms.extend(run.ooms)
        earlier = continued(run.status(), earlier)
        earlier_reports.extend(run.reports)
        if publisher is not None:
            publisher.next_attempt()
    status = continued(run.status(earlier_ooms), earlier)
    reports = run.reports
    # The history the driver keeps in the cluster (kubectl rljob plot draws it), from every
    # iteration's reports, every attempt's (a later attempt's iteration replaces an earlier
    # one's): worst rank per stage.
    for report in [*earlier_reports, *reports]:
        status.memory_history = history_with(status.memory_history, summarize(report))
    # Locally this command is the operator too, so it also sets the phase and the attempts.
    status.phase = Phase.SUCCEEDED if run.ok else Phase.FAILED
    status.cause = _cause(run)
    if len(attempts) > 1 or spec.oom_policy.max_retries or run.resumed_from is not None:
        status.attempts = attempts
    written = write_outputs(out, name, status, reports, spec.algorithm.seed)
    # Every rank's start-up (status.memory.load keeps the worst rank's).
    loads = [i.load for i in run.iterations if i.load is not None]
    dumped = [load.model_dump(mode="json", by_alias=True) for load in loads]
    (out / "load.json").write_text(json.dumps(dumped, indent=1) + "\n")
    written.append("load.json")
    table_console = Console()
    if status.metrics:
        table_console.print(metrics_table(status.metrics, f"RLJob {name}: per iteration"))
    if status.memory is not None:
        table_console.print(memory_table(status.memory, reports))
    for line in load_lines(status, loads):
        table_console.print(line, soft_wrap=True, markup=False, highlight=False)
    for line in auto_lines(status.plan) if status.plan else []:
        table_console.print(line, soft_wrap=True, markup=False, highlight=False)
    mismatched = [
        (i.rank, i.iteration, i.weights.mismatched)
        for i in run.iterations
        if i.weights and i.weights.mismatched
    ]
    for rank, iteration, names in mismatched:
        console.print(
            f"[red]rank {rank} iteration {iteration}: engine weights differ: {names}[/red]"
        )
    for oom in [*earlier_ooms, *run.ooms]:
        console.print(
            f"[red]CUDA OOM in stage {oom.stage} (iteration {oom.iteration}, rank {oom.rank}): "
            f"{oom.request_text()}[/red]"
        )
    for rank, failure in sorted(run.errors.items()):
        console.print(f"[red]rank {rank} failed:[/red]\n{escape(failure.rstrip())}")
    console.print(f"wrote {out}/: {', '.join(written)}")
    return 0 if run.ok and not mismatched else 1
