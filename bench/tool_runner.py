"""builtin:python under many concurrent calls (issue 32): the pool of forking runners against the
interpreter spawned per call that it replaced, in a process whose event loop is also busy.

`python bench/tool_runner.py` runs, per runner (--runners spawn pool) and per number of
concurrent calls (--calls 64 256), --repeats rounds of that many calls at once (each its own
expression `I*7+1`, each answer checked) while a coroutine keeps the event loop busy with small
awaits (as sglang's tokenizer manager does in a rank). It reports calls/s (the first round,
which starts the pool's processes, and the best and median of the rest), the busy coroutine's
awaits/s, and the host's load. The spawn runner (SpawnedPythonExpression) is kept here only,
for this comparison: it is the tool as it was before the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rljob_worker.agentic.tools import PythonExpression, _expression, _expression_schema

REPO = Path(__file__).resolve().parents[1]

# The per-call child of builtin:python before the pool: an interpreter per expression.
_SPAWNED_CHILD = """
import math, resource, sys
memory, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
SAFE = {n: getattr(__builtins__, n) for n in (
    "abs", "all", "any", "bin", "bool", "chr", "divmod", "float", "hex", "int", "len", "list",
    "max", "min", "oct", "ord", "pow", "range", "reversed", "round", "sorted", "str", "sum",
    "tuple", "set", "dict", "zip", "enumerate", "map", "filter", "True", "False", "None")}
try:
    print(repr(eval(sys.stdin.read(), {"__builtins__": SAFE, "math": math})))
except BaseException as error:
    print(f"Error: {type(error).__name__}: {error}")
    sys.exit(1)
"""


class SpawnedPythonExpression:
    """builtin:python as it was before the pool: `python -I -S` spawned from this process per
    call (asyncio.create_subprocess_exec). For comparison only (here and multi_turn.py)."""

    name = "python"
    schema = _expression_schema(name, PythonExpression.schema["function"]["description"])

    def __init__(self, memory_megabytes: int) -> None:
        self.memory_bytes = memory_megabytes << 20

    async def __call__(self, arguments: dict[str, Any], timeout_seconds: float) -> str:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", _SPAWNED_CHILD,
            str(self.memory_bytes), str(math.ceil(timeout_seconds) + 1),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(
                child.communicate(_expression(arguments).encode()), timeout_seconds
            )
        except BaseException:
            if child.returncode is None:
                child.kill()
                await child.wait()
            raise
        text = out.decode(errors="replace").strip()
        if child.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"exit {child.returncode}: {text or last[0]}")
        return text


def make_runner(kind: str, memory_megabytes: int = 256) -> Any:
    return (
        SpawnedPythonExpression(memory_megabytes)
        if kind == "spawn"
        else PythonExpression(memory_megabytes)
    )


async def _round(tool: Any, calls: int, timeout_seconds: float) -> dict[str, float]:
    """`calls` calls at once beside a coroutine doing small awaits; every answer checked."""
    done = False
    awaits = 0

    async def busy() -> None:
        nonlocal awaits
        while not done:
            await asyncio.sleep(0)
            awaits += 1

    spinner = asyncio.create_task(busy())
    started = time.perf_counter()
    answers = await asyncio.gather(
        *(tool({"expression": f"{i}*7+1"}, timeout_seconds) for i in range(calls)),
        return_exceptions=True,
    )
    seconds = time.perf_counter() - started
    done = True
    await spinner
    wrong = [(i, a) for i, a in enumerate(answers) if a != str(i * 7 + 1)]
    if wrong:
        raise RuntimeError(f"{len(wrong)} of {calls} answers wrong, first: {wrong[0]!r}")
    return {
        "seconds": seconds,
        "calls_per_second": calls / seconds,
        "awaits_per_second": awaits / seconds,
    }


def measure(kind: str, calls: int, repeats: int, timeout_seconds: float) -> dict[str, Any]:
    tool = make_runner(kind)

    async def rounds() -> list[dict[str, float]]:
        return [await _round(tool, calls, timeout_seconds) for _ in range(repeats)]

    try:
        measured = asyncio.run(rounds())
    finally:
        if isinstance(tool, PythonExpression):
            tool.close()
    warm = [r["calls_per_second"] for r in measured[1:]] or [measured[0]["calls_per_second"]]
    return {
        "runner": kind,
        "calls": calls,
        "first_calls_per_second": round(measured[0]["calls_per_second"], 1),
        "best_calls_per_second": round(max(warm), 1),
        "median_calls_per_second": round(statistics.median(warm), 1),
        "busy_awaits_per_second": round(
            statistics.median(r["awaits_per_second"] for r in measured)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runners", nargs="+", choices=["spawn", "pool"], default=["spawn", "pool"]
    )
    parser.add_argument("--calls", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tool_runner")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for calls in args.calls:
        for kind in args.runners:
            row = measure(kind, calls, args.repeats, args.timeout_seconds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "load_average_before": round(load_before, 1),
        "load_average_after": round(os.getloadavg()[0], 1),
        "command": "python bench/tool_runner.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# builtin:python under concurrent calls: spawn per call against the pool",
        "",
        f"Machine: {result['machine']}; Python {result['python']}; load average "
        f"{result['load_average_before']} before, {result['load_average_after']} after.",
        f"Command: `{result['command']}`",
        "",
        "| calls at once | runner | calls/s, first round | calls/s, best | calls/s, median | "
        "busy loop awaits/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['calls']} | {row['runner']} | {row['first_calls_per_second']} | "
            f"{row['best_calls_per_second']} | {row['median_calls_per_second']} | "
            f"{row['busy_awaits_per_second']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
