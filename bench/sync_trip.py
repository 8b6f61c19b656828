"""Where a weight sync's time goes, from the timings file the worker writes with
RLJOB_SGLANG_DIRECT_TIMINGS=<file> set (rljob_worker.weight_sync.TIMINGS_ENV).

    python bench/sync_trip.py FILE [--skip 1] [--json OUT]

The file holds JSON lines on one host's wall clock: the stage's spans (`sync`, each
`next_bucket` wait, the device `synchronize`), the adapter's requests to sglang (`update`,
`flush`) and the direct loader's own part of each update (`loader`, one a TP rank). Each sync is
split into:

- next_bucket: the stage waiting for the trainer's next bucket (the gather's host work, and the
  wait for it where the prefetch did not hide it); of it, apart (weight_sync.prefetched),
  `bucket_issue` (a bucket's gather called: the host's work, its kernels enqueued) and
  `bucket_kernels` (the host waiting for a bucket's kernels, collectives with the other ranks
  included), shown as rows of their own but not added again;
- serialize, tp_gather (TP > 1, one engine over several ranks: tensor_parallel.py): the bucket's
  IPC handles made, then gathered from every rank of the group on its leader (gloo), which
  waits there for the slowest rank's bucket;
- way_in: an update request sent until the loader began in sglang's scheduler (the payload's
  pickling, the tokenizer manager, the scheduler's turn, the CUDA IPC open), per TP rank the
  last to begin;
- loader: the loader's call (its copies and their device synchronize), from the last TP rank's
  start to the last one done;
- way_back: the loader done until the request was answered (the scheduler's barrier and the
  reply's trip back);
- tp_answer (TP > 1): the leader's outcome broadcast to the group after each request to the
  engine (each bucket's, and the flush's);
- flush: the flush_cache request after the last bucket (none with sglang 0.5.17: the first
  update's request flushes in its scheduler, inside that request's way back);
- synchronize: the stage's device synchronize;
- other: the rest of the sync (the stage's own Python).

Each rank's first `--skip` syncs (1: the first builds the plans) are left out of the medians, and
where only some ranks sent requests (TP > 1: the TP leader), only those ranks' syncs count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

PARTS = (
    "next_bucket",
    "serialize",
    "tp_gather",
    "way_in",
    "loader",
    "way_back",
    "tp_answer",
    "flush",
    "synchronize",
    "other",
)
# The spans summed as they are (the rest are worked out from the requests and their loaders).
SPANS = ("next_bucket", "serialize", "tp_gather", "tp_answer", "flush", "synchronize")
# Inside next_bucket: shown on their own, not part of the sum.
OF_NEXT_BUCKET = ("bucket_issue", "bucket_kernels")


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _within(span: dict[str, Any], outer: dict[str, Any]) -> bool:
    return bool(outer["start"] <= span["start"] and span["end"] <= outer["end"])


def split(lines: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each sync's parts in seconds, in order, with its `sync` total and `buckets` count."""
    syncs = sorted((x for x in lines if x.get("call") == "sync"), key=lambda x: x["start"])
    result = []
    for sync in syncs:
        # The rank's own spans (its pid), and the loaders that ran inside its update requests
        # (sglang's schedulers: other pids). One engine a file: with ranks of their own engines
        # writing to one file, a loader inside another rank's request would be counted twice.
        inside = [
            x
            for x in lines
            if x.get("call") not in ("sync", None)
            and (x["call"] == "loader" or x["pid"] == sync["pid"])
            and _within(x, sync)
        ]
        parts = dict.fromkeys(PARTS, 0.0)
        updates = [x for x in inside if x["call"] == "update"]
        for update in updates:
            loaders = [x for x in inside if x["call"] == "loader" and _within(x, update)]
            if not loaders:
                raise ValueError(
                    f"an update request at {update['start']:.6f} has no loader line inside it: "
                    "was the direct loader in use, and did its schedulers see the variable?"
                )
            last_in = max(x["start"] for x in loaders)
            last_out = max(x["end"] for x in loaders)
            parts["way_in"] += last_in - update["start"]
            parts["loader"] += last_out - last_in
            parts["way_back"] += update["end"] - last_out
        for name in SPANS + OF_NEXT_BUCKET:
            parts[name] = sum(x["end"] - x["start"] for x in inside if x["call"] == name)
        total = sync["end"] - sync["start"]
        parts["other"] = total - sum(parts[p] for p in PARTS if p != "other")
        result.append({"sync": total, "buckets": float(len(updates)), "pid": sync["pid"], **parts})
    return result


def medians(syncs: list[dict[str, float]], skip: int) -> dict[str, float]:
    """Medians over the syncs after each rank's first `skip`; where some ranks sent requests and
    others none (TP > 1: only the TP leader talks to sglang), the senders' syncs only."""
    senders = {s["pid"] for s in syncs if s["buckets"]}
    by_pid: dict[float, list[dict[str, float]]] = {}
    for sync in syncs:
        if not senders or sync["pid"] in senders:
            by_pid.setdefault(sync["pid"], []).append(sync)
    kept = [s for group in by_pid.values() for s in group[skip:]]
    if not kept:
        raise ValueError(f"{len(syncs)} syncs in the file, none left after skipping {skip}")
    return {key: statistics.median(s[key] for s in kept) for key in kept[0] if key != "pid"}


def render(syncs: list[dict[str, float]], skip: int) -> str:
    middle = medians(syncs, skip)
    rows = [
        f"{len(syncs)} syncs, medians after each rank's first {skip}: "
        f"sync {middle['sync'] * 1e3:.2f} ms, {middle['buckets']:.0f} buckets",
        "| part | ms | share |",
        "| --- | ---: | ---: |",
    ]
    for part in PARTS:
        share = middle[part] / middle["sync"] if middle["sync"] else 0.0
        rows.append(f"| {part} | {middle[part] * 1e3:.2f} | {share:.1%} |")
        if part == "next_bucket":
            for sub in OF_NEXT_BUCKET:
                share = middle[sub] / middle["sync"] if middle["sync"] else 0.0
                rows.append(f"| - of it, {sub} | {middle[sub] * 1e3:.2f} | {share:.1%} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timings", type=Path)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    syncs = split(read(args.timings))
    print(render(syncs, args.skip))
    if args.json is not None:
        args.json.write_text(json.dumps({"syncs": syncs, "skip": args.skip}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
