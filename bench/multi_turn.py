"""Multi-turn rollout (issue 32): the async path against the same conversations run turn by turn.

`python bench/multi_turn.py` (CPU, torch engine, the builtin tiny model) or, on a GPU,
`python bench/multi_turn.py --engine sglang --device cuda --model DIR` measures, per number of
turns (--turns 2 3 4):
- throughput: trajectory tokens (everything after the prompt) per second, async
  (MultiTurnRollout.run: every conversation at its own pace) against turn-by-turn
  (run_turn_by_turn: turn k of every conversation as one batch, then all their tools);
- p50/p99 conversation latency and the straggler share: (last end - median end) / the rollout;
- with --partial F: the partial rollout as well (MultiTurnRollout.run_partial, spec.rollout.
  multiTurn.partialRollout): --rollouts back-to-back rollouts, each training --conversations
  conversations in groups of --group-size, with F times as many groups again under way; each
  stops once enough groups have ended and carries the rest over to the next rollout. Its
  tokens/s are over the rollouts after the first (the steady state: the first has nothing
  carried in), the first's beside them;
- with --engines 2: the prefix-cache hit rate (cached prompt tokens / prompt tokens sent) of
  sticky against random routing, where the engine reports cached tokens (sglang; torch has no
  prefix cache, so n/a).

Each conversation calls builtin:python (a process forked by the tool's pool of runners; with
--python-runner spawn an interpreter spawned per call, as before the pool) after each of its
first turns-1 turns and answers at the last one: the bench fixes the turn count (BenchRollout.calls_of);
generation is the engine's own. With --tool-seconds S every tool turn also waits a drawn time
(log-normal, median S, sigma 1, capped at 10 S; seeded by conversation and turn, so both modes
wait the same) before its tools run: a stand-in for tools that take time (a code runner, a
search API), which builtin:python's milliseconds are not. Results: JSON and a Markdown table
with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rljob.api import BUILTIN_CALCULATOR, DataSpec, MultiTurnSpec, PartialRolloutSpec
from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.driver import Limits, MultiTurnRollout, Trajectory
from rljob_worker.agentic.routing import EngineRouter, Routing
from rljob_worker.agentic.tool_calls import ParsedCall, ToolCall
from rljob_worker.agentic.tools import make_tools
from rljob_worker.engines.base import ALL_TAGS, SamplingParams
from rljob_worker.model import load_tokenizer, resolve_model_path
from rljob_worker.task import make_task

REPO = Path(__file__).resolve().parents[1]
# --spread: a turn's cap is --turn-tokens times one of these (mean 1.17, most turns short).
SPREAD = (0.25, 0.25, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 4.0)


class BenchRollout(MultiTurnRollout):
    """Every conversation takes exactly `turns` turns: a python call after each turn but the
    last, whatever the (tiny, untrained) model wrote."""

    turns = 2
    spread = False
    tool_seconds = 0.0

    def tool_delay(self, t: Trajectory) -> float:
        """Seconds tool turn `t.turns` of conversation `t.conversation` waits (--tool-seconds):
        the same draw in both modes."""
        if self.tool_seconds <= 0:
            return 0.0
        draw = random.Random(t.conversation * 7919 + t.turns).lognormvariate(
            math.log(self.tool_seconds), 1.0
        )
        return min(draw, 10 * self.tool_seconds)

    async def _tool_turn(
        self, t: Trajectory, calls: list[ParsedCall], ended_with_eos: bool
    ) -> None:
        if calls:
            await asyncio.sleep(self.tool_delay(t))
        await super()._tool_turn(t, calls, ended_with_eos)

    def turn_tokens(self, t: Trajectory) -> int | None:
        """With --spread, each turn's length cap is drawn (seeded by conversation and turn, so
        both modes get the same) from 1/4 to 4 times --turn-tokens, long-tailed as agent turns
        are; the untrained model rarely samples end-of-sequence, so the cap is the length."""
        cap = self.limits.max_turn_tokens
        if not self.spread or cap is None:
            return cap
        factor = random.Random(t.conversation * 1009 + t.turns).choice(SPREAD)
        return max(1, int(cap * factor))

    def calls_of(self, t: Trajectory) -> list[ParsedCall]:
        if t.turns < self.turns:
            return [ToolCall("python", {"expression": f"sum(range({t.conversation + 10}))"})]
        return []


def with_context(model: Path, positions: int) -> Path:
    """A copy of the model folder `model` (in a temporary folder kept for the process's life)
    whose config.json says `positions` for max_position_embeddings; nothing else changes."""
    import shutil
    import tempfile

    copy = Path(tempfile.mkdtemp(prefix="rljob-bench-context-")) / model.name
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (copy / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copy


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"


def _engines(args: argparse.Namespace, model_path: str, eos: list[int]) -> list[Any]:
    engines: list[Any] = []
    per_gpu = engines_per_gpu(args.engines, args.gpus)
    for index in range(args.engines):
        if args.engine == "torch":
            from rljob_worker.engines.torch_engine import TorchEngine

            reference = TorchEngine(model_path, device=args.device, dtype=args.dtype,
                                    kv_capacity_tokens=args.kv_tokens, eos_token_ids=eos)  # fmt: skip
            reference.batch_window_seconds = args.batch_window
            engines.append(reference)
        else:
            from transformers import AutoModelForCausalLM

            from rljob_worker.engines.sglang_engine import SGLangEngine

            gpu = index % args.gpus  # engines dealt round the GPUs, each its card's share
            # One event loop for all of them: the rollout awaits every engine's answers on it.
            shared = engines[0].event_loop if engines else None
            engine = SGLangEngine(model_path=model_path, dtype=args.dtype, base_gpu_id=gpu,
                                  mem_fraction_static=args.mem_fraction / per_gpu,
                                  event_loop=shared)  # fmt: skip
            # It starts with every tag released and its weights' contents gone: load them.
            engine.resume(["weights"])
            hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
            engine.update_weights(
                [(n, p.detach().to(f"cuda:{gpu}")) for n, p in hf.named_parameters()]
            )
            del hf
            engine.flush_cache()
            engine.resume([t for t in ALL_TAGS if t != "weights"])
            engines.append(engine)
    return engines


def engines_per_gpu(engines: int, gpus: int) -> int:
    """How many engines share the busiest GPU when `engines` are dealt round `gpus`."""
    if gpus < 1 or engines < 1:
        raise ValueError(f"--engines {engines} --gpus {gpus}: both must be at least 1")
    return -(-engines // gpus)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(rollout: BenchRollout, runner: Any, prompts: list[list[int]], mode: str,
            sampling: SamplingParams) -> dict[str, Any]:  # fmt: skip
    run = rollout.run if mode == "async" else rollout.run_turn_by_turn
    start = time.perf_counter()
    trajectories: list[Trajectory] = runner(run(prompts, sampling))
    seconds = time.perf_counter() - start
    ends = [t.finished_seconds for t in trajectories]
    latencies = [t.seconds for t in trajectories]
    tokens = sum(len(t.response_ids) for t in trajectories)
    sent = sum(t.prompt_tokens for t in trajectories)
    cached = [t.cached_tokens for t in trajectories if t.cached_tokens is not None]
    return {
        "mode": mode,
        "seconds": round(seconds, 3),
        "trajectory_tokens": tokens,
        "sampled_tokens": sum(sum(t.loss_mask) for t in trajectories),
        "tokens_per_second": round(tokens / seconds, 1),
        "turns": sum(t.turns for t in trajectories),
        "tool_calls": sum(t.tool_calls for t in trajectories),
        "tool_errors": sum(t.tool_errors for t in trajectories),
        "tool_timeouts": sum(t.tool_timeouts for t in trajectories),
        "cut_off": sum(t.cut_off for t in trajectories),
        "p50_latency_seconds": round(statistics.median(latencies), 3),
        "p99_latency_seconds": round(_percentile(latencies, 0.99), 3),
        "straggler_share": round((max(ends) - statistics.median(ends)) / seconds, 3),
        "prefix_cache_hit_rate": round(sum(cached) / sent, 3) if cached and sent else None,
    }


def measure_partial(rollout: BenchRollout, runner: Any, prompts: list[list[int]],
                    sampling: SamplingParams, group_size: int, over_sample: float,
                    rollouts: int) -> dict[str, Any]:  # fmt: skip
    """--partial: `rollouts` partial rollouts, each training len(prompts) conversations (whole
    groups of `group_size`) with ceil(groups x over_sample) more groups under way; new
    conversations cycle through `prompts`."""
    if len(prompts) % group_size:
        raise ValueError(f"--conversations {len(prompts)} is not a multiple of --group-size")
    groups = len(prompts) // group_size
    under_way = PartialRolloutSpec(over_sample=over_sample).groups_under_way(groups)
    carried: list[Trajectory] = []
    started = 0
    parts: list[dict[str, Any]] = []
    for k in range(rollouts):
        new = (under_way - len({t.group for t in carried})) * group_size
        fresh = rollout.start([prompts[(started + i) % len(prompts)] for i in range(new)],
                              group_size, first=started)  # fmt: skip
        started += new
        batch = [*carried, *fresh]
        before = sum(len(t.response_ids) for t in batch)
        sampled_before = sum(sum(t.loss_mask) for t in batch)
        seed = None if sampling.seed is None else sampling.seed + k
        start = time.perf_counter()
        result = runner(rollout.run_partial(batch, replace(sampling, seed=seed), groups))
        seconds = time.perf_counter() - start
        parts.append({
            "seconds": round(seconds, 3),
            "trajectory_tokens": sum(len(t.response_ids) for t in batch) - before,
            "sampled_tokens": sum(sum(t.loss_mask) for t in batch) - sampled_before,
            "trained": len(result.trained),
            "resumed": sum(t.rollouts > 1 for t in result.trained),
            "paused": result.paused,
            "carried": len(result.carried),
        })  # fmt: skip
        carried = result.carried
    steady = parts[1:] or parts
    seconds = sum(p["seconds"] for p in steady)
    tokens = sum(p["trajectory_tokens"] for p in steady)
    return {
        "mode": "async-partial",
        "seconds": round(seconds, 3),
        "trajectory_tokens": tokens,
        "sampled_tokens": sum(p["sampled_tokens"] for p in steady),
        "tokens_per_second": round(tokens / seconds, 1),
        "first_rollout_tokens_per_second": round(
            parts[0]["trajectory_tokens"] / parts[0]["seconds"], 1
        ),
        "group_size": group_size,
        "over_sample": over_sample,
        "rollouts": parts,
        "p50_latency_seconds": None,
        "p99_latency_seconds": None,
        "straggler_share": None,
        "prefix_cache_hit_rate": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["torch", "sglang"], default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="builtin:tiny-qwen2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--turn-tokens", type=int, default=24, help="tokens one turn may sample")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--kv-tokens", type=int, default=65536, help="torch engine KV pool")
    parser.add_argument("--gpus", type=int, default=1,
                        help="sglang: engines dealt round this many GPUs (two engines on two "
                        "GPUs: one each, at the whole --mem-fraction)")  # fmt: skip
    parser.add_argument("--mem-fraction", type=float, default=0.6,
                        help="sglang: of each GPU, shared by the engines on it")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    parser.add_argument("--spread", action="store_true", help="long-tailed turn lengths")
    parser.add_argument("--tool-seconds", type=float, default=0.0,
                        help="median extra seconds a tool turn takes (log-normal; 0: none)")  # fmt: skip
    parser.add_argument("--batch-window", type=float, default=0.0,
                        help="torch engine: seconds a batch waits for more requests")  # fmt: skip
    parser.add_argument("--python-runner", choices=["pool", "spawn"], default="pool",
                        help="builtin:python's runner: the pool (the product's) or, to compare, "
                        "an interpreter spawned per call (bench/tool_runner.py)")  # fmt: skip
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="measure from the first rollout (default: one untimed pass first)")  # fmt: skip
    parser.add_argument("--context", type=int, default=None,
                        help="a copy of --model whose config.json says this many positions "
                        "(max_position_embeddings): the builtin tiny model's 256 hold too few "
                        "turns; its weights are random, so a longer context changes no quality")  # fmt: skip
    parser.add_argument("--partial", type=float, nargs="+", default=[], metavar="F",
                        help="also the partial rollout, F times the trained groups again under "
                        "way (spec.rollout.multiTurn.partialRollout.overSample), once per F")  # fmt: skip
    parser.add_argument("--group-size", type=int, default=8, help="--partial: a group's size")
    parser.add_argument("--rollouts", type=int, default=4,
                        help="--partial: rollouts back to back (the first is not the steady state)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "multi_turn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = str(resolve_model_path(args.model))
    if args.context is not None:
        model_path = str(with_context(Path(model_path), args.context))
    tokenizer = load_tokenizer(model_path)
    eos = [tokenizer.eos_token_id]
    engines = _engines(args, model_path, eos)
    tools = make_tools(MultiTurnSpec(tools=["builtin:calculator", "builtin:python"],
                                     tool_timeout_seconds=10))  # fmt: skip
    if args.python_runner == "spawn":
        from tool_runner import SpawnedPythonExpression  # bench/, this script's folder

        tools.close()
        tools.tools["python"] = SpawnedPythonExpression(256)
    task = make_task(DataSpec(source=BUILTIN_CALCULATOR, max_prompt_length=1024), 0, tokenizer,
                     tools.schemas)  # fmt: skip
    prompts = [list(p.prompt_ids) for p in task.sample(args.conversations, salt=0)]
    sampling = SamplingParams(max_new_tokens=1, temperature=1.0, seed=11)
    runner = getattr(engines[0], "run_async", None) or asyncio.run
    rows: list[dict[str, Any]] = []
    routings = [Routing.STICKY, Routing.RANDOM] if args.engines > 1 else [Routing.STICKY]
    # The model's context: no request asks past it (the builtin model's is 256 tokens, too few
    # for several turns of the calculator task on sglang: give --model a longer one there).
    context = json.loads((Path(model_path) / "config.json").read_text()).get(
        "max_position_embeddings"
    )

    # The partial rollout has more conversations under way than it trains.
    concurrent = args.conversations
    for over_sample in args.partial:
        groups = args.conversations // args.group_size
        under_way = PartialRolloutSpec(over_sample=over_sample).groups_under_way(groups)
        concurrent = max(concurrent, under_way * args.group_size)

    def rollout_of(turns: int, routing: Routing) -> BenchRollout:
        limits = Limits(max_turns=turns, max_response_length=turns * (4 * args.turn_tokens + 64),
                        max_tool_response_length=32, max_concurrent_conversations=concurrent,
                        max_turn_tokens=args.turn_tokens, context_length=context)  # fmt: skip
        for engine in engines:  # each measurement starts with a cold cache
            engine.flush_cache()
        rollout = BenchRollout(
            EngineRouter(engines, routing, seed=turns), ChatFormat(tokenizer, tools.schemas),
            tools, limits, eos, lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
        )  # fmt: skip
        rollout.turns, rollout.spread = turns, args.spread
        rollout.tool_seconds = args.tool_seconds
        return rollout

    if args.warmup:
        # Untimed: the first rollout of a process pays for start-up work (the engine's first
        # batches, the tool runners' first forks). On an H100 the first measured row, 2 turns
        # turn by turn, ran at a third of the 3-turn row's tokens/s without it. Without the
        # tools' drawn waits (--tool-seconds): they warm nothing and took a minute at 3 s.
        warm = rollout_of(min(args.turns), Routing.STICKY)
        warm.tool_seconds = 0.0
        measure(warm, runner, prompts, "turn-by-turn", sampling)
    for turns in args.turns:
        for routing in routings:
            for mode in ("turn-by-turn", "async"):
                row = {"turns_per_conversation": turns, "routing": str(routing),
                       **measure(rollout_of(turns, routing), runner, prompts, mode, sampling)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            for over_sample in args.partial:
                row = {"turns_per_conversation": turns, "routing": str(routing),
                       **measure_partial(rollout_of(turns, routing), runner, prompts, sampling,
                                         args.group_size, over_sample, args.rollouts)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "machine": _machine(args.device),
        # The host is shared: its 1-minute load average, at the end, next to the figures.
        "load_average": round(os.getloadavg()[0], 1),
        "torch": torch.__version__,
        "engine": args.engine,
        "engines": args.engines,
        "gpus": args.gpus,
        "model": args.model,
        "conversations": args.conversations,
        "turn_tokens": args.turn_tokens,
        "spread": args.spread,
        "tool_seconds": args.tool_seconds,
        "python_runner": args.python_runner,
        "command": "python bench/multi_turn.py " + " ".join(
            f"--{k.replace('_', '-')}" if v is True else
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k not in ("out", "warmup") and v is not False
        ) + ("" if args.warmup else " --no-warmup"),
        "rows": rows,
    }  # fmt: skip
    tools.close()
    for engine in engines:
        engine.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Multi-turn rollout: {result['engine']} engine x{result['engines']}, {result['model']}",
        "",
        f"Machine: {result['machine']} (load average {result.get('load_average')} at the end); "
        f"torch {result['torch']}; {result['conversations']} "
        f"conversations, up to {result['turn_tokens']} sampled tokens a turn"
        f"{' times 1/4..4 (--spread)' if result.get('spread') else ''}, builtin:python after "
        "every turn but the last"
        + (
            f", each tool turn waiting a log-normal time of median {result['tool_seconds']} s."
            if result.get("tool_seconds")
            else "."
        )
        + f" builtin:python's runner: {result.get('python_runner', 'spawn')}.",
        f"Command: `{result['command']}`",
        "",
        "| turns | routing | mode | tokens/s | speed-up | p50 s | p99 s | straggler share | "
        "prefix-cache hit |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base: dict[tuple[int, str], float] = {}
    for row in result["rows"]:
        key = (row["turns_per_conversation"], row["routing"])
        if row["mode"] == "turn-by-turn":
            base[key] = row["tokens_per_second"]
        speed = row["tokens_per_second"] / base[key] if key in base else None
        hit = row["prefix_cache_hit_rate"]
        lines.append(
            f"| {key[0]} | {key[1]} | {row['mode']} | {row['tokens_per_second']} | "
            f"{'-' if speed is None else f'{speed:.2f}x'} | {_cell(row['p50_latency_seconds'])} | "
            f"{_cell(row['p99_latency_seconds'])} | {_cell(row['straggler_share'])} | "
            f"{'n/a' if hit is None else hit} |"
        )
    partial = [row for row in result["rows"] if row["mode"] == "async-partial"]
    if partial:
        lines += [
            "",
            "async-partial: tokens/s over the rollouts after the first; per rollout (seconds, "
            "trajectory tokens, trained / resumed among them / paused at its end):",
            "",
        ]
        for row in partial:
            parts = "; ".join(
                f"{p['seconds']} s, {p['trajectory_tokens']} tok, "
                f"{p['trained']}/{p['resumed']}/{p['paused']}"
                for p in row["rollouts"]
            )
            lines.append(
                f"- {row['turns_per_conversation']} turns, groups of {row['group_size']}, "
                f"over-sample {row['over_sample']}: first rollout "
                f"{row['first_rollout_tokens_per_second']} tok/s; {parts}"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
