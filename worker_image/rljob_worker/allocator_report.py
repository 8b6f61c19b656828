"""Why the caching allocator keeps device memory after empty_cache(): the pinned segments.

empty_cache() gives back only segments with no live block. A segment that holds one small live
tensor among freed ones stays reserved whole; the memory plan sees that as device memory in use
that no tensor accounts for. With RLJOB_ALLOCATOR_REPORT=DIR set, each rank records its
allocations (torch.cuda.memory._record_memory_history, Python stacks) and writes, at the end of
offload_train (after its empty_cache, where only the pinned segments are left), one JSON per
iteration: every segment still reserved with free bytes in it, its live blocks and where each
was allocated. `summarize` is a pure function of torch.cuda.memory_snapshot()'s segments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

REPORT_ENV = "RLJOB_ALLOCATOR_REPORT"
_LIVE = ("active_allocated", "active_pending_free")
_FRAMES = 6  # innermost frames of the project's and torch's Python code kept per block


def report_dir() -> Path | None:
    raw = os.environ.get(REPORT_ENV, "").strip()
    return Path(raw) if raw else None


def start_recording() -> bool:
    """Record allocation stacks from now on, when the report is asked for and CUDA is here."""
    if report_dir() is None or not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    return True


def _where(frames: Iterable[Mapping[str, Any]]) -> str:
    kept = [
        f"{Path(f.get('filename', '?')).name}:{f.get('line', '?')} {f.get('name', '?')}"
        for f in frames
        if "rljob" in str(f.get("filename", "")) or "torch" in str(f.get("filename", ""))
    ]
    return " < ".join(kept[:_FRAMES]) or "(no stack recorded)"


def summarize(segments: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Totals, and each pinned segment (live blocks and free bytes together), largest free first."""
    reserved = allocated = pinned_free = 0
    pinned = []
    for seg in segments:
        blocks = seg.get("blocks", [])
        live = [b for b in blocks if b.get("state") in _LIVE]
        live_bytes = sum(int(b["size"]) for b in live)
        total = int(seg["total_size"])
        reserved += total
        allocated += live_bytes
        free = total - live_bytes
        if live and free > 0:
            pinned_free += free
            pinned.append(
                {
                    "segment_bytes": total,
                    "free_bytes": free,
                    "pool": seg.get("segment_type", "?"),
                    "live": [
                        {"bytes": int(b["size"]), "where": _where(b.get("frames", []))}
                        for b in sorted(live, key=lambda b: -int(b["size"]))
                    ],
                }
            )
    pinned.sort(key=lambda s: -s["free_bytes"])
    return {
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "pinned_free_bytes": pinned_free,
        "pinned_segments": pinned,
    }


def write_report(rank: int, iteration: int, stage: str) -> Path | None:
    """The summary of this rank's allocator now, as DIR/rank{R}-iter{I}-{stage}.json."""
    directory = report_dir()
    if directory is None or not torch.cuda.is_available():
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}-iter{iteration}-{stage}.json"
    path.write_text(json.dumps(summarize(torch.cuda.memory_snapshot()), indent=1) + "\n")
    return path
