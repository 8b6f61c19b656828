"""metrics.jsonl: every finished iteration's learning figures, kept beside the checkpoints.

status.metrics holds the newest MAX_METRICS iterations (etcd bounds an object's size); the
file holds them all, one JSON object a line, with status.metrics' fields and names
(IterationMetrics, camelCase), so a 2000-iteration job's curve survives the job and the
cluster. The job's driver writes it (driver/metrics_log.py); `rljob curve FILE` draws it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rljob.report import IterationMetrics

METRICS_FILE = "metrics.jsonl"


class MetricsFileError(ValueError):
    """A metrics file that cannot be read, naming the file and the line."""


def write_atomically(path: Path, text: str) -> None:
    """`text` as `path`'s whole content: written beside it, made durable, then renamed over it,
    so a reader (or a run killed mid-write) sees the old file or the new one, never a part."""
    staging = path.with_name(f".{path.name}.tmp")
    with open(staging, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    staging.rename(path)


def metrics_line(entry: dict[str, Any]) -> str:
    return json.dumps(entry, separators=(",", ":"), allow_nan=False)


def entry_of(metrics: IterationMetrics) -> dict[str, Any]:
    """One line's object: status.metrics' JSON for the iteration (absent figures left out)."""
    return metrics.model_dump(mode="json", by_alias=True, exclude_none=True)


def read_entries(path: Path) -> list[dict[str, Any]]:
    """The objects of `path`, one a line (blank lines skipped); a line that is not a JSON
    object with an integer `iteration` is a MetricsFileError naming it."""
    return [entry for _, entry in _numbered(path)]


def _numbered(path: Path) -> list[tuple[int, dict[str, Any]]]:
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise MetricsFileError(f"{path} line {number}: not JSON ({error.msg})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("iteration"), int):
            raise MetricsFileError(
                f"{path} line {number}: not an iteration's metrics (an object with an integer "
                "'iteration')"
            )
        entries.append((number, entry))
    return entries


def read_metrics(path: Path) -> list[IterationMetrics]:
    """The iterations of a metrics file in iteration order (a later line of the same iteration
    replaces an earlier one)."""
    by_iteration: dict[int, IterationMetrics] = {}
    for number, entry in _numbered(path):
        try:
            by_iteration[entry["iteration"]] = IterationMetrics.model_validate(entry)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise MetricsFileError(f"{path} line {number}: {where}: {first['msg']}") from None
    return [by_iteration[i] for i in sorted(by_iteration)]


def text_of(entries: Iterable[dict[str, Any]]) -> str:
    return "".join(metrics_line(e) + "\n" for e in entries)


def main(argv: list[str]) -> int:
    """`rljob curve METRICS_FILE [-o PNG]`: the learning curve of a metrics file, as `rljob run`
    and `kubectl rljob curve` draw it, over every iteration the file holds."""
    import argparse
    import sys

    from rljob.curves import plot_learning_curve

    parser = argparse.ArgumentParser(
        prog="rljob curve", description="Draw the learning curve of a job's metrics.jsonl."
    )
    parser.add_argument("file", type=Path, help=f"a job's <checkpoint.path>/{METRICS_FILE}")
    parser.add_argument("-o", "--output", type=Path, default=Path("learning-curve.png"))
    args = parser.parse_args(argv)
    try:
        metrics = read_metrics(args.file)
        plot_learning_curve(metrics, args.output, f"{args.file}: learning curve")
    except (OSError, UnicodeDecodeError, ValueError) as error:  # MetricsFileError is one
        print(f"rljob curve: {error}", file=sys.stderr)
        return 2
    print(f"{args.output}: iterations {metrics[0].iteration}-{metrics[-1].iteration}")
    return 0
