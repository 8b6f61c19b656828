"""The allocator report: which live blocks keep reserved segments from going back (pure part)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob_worker import allocator_report
from rljob_worker.allocator_report import summarize

MiB = 1 << 20


def _frame(path: str, line: int, name: str) -> dict[str, object]:
    return {"filename": path, "line": line, "name": name}


SEGMENTS = [
    {  # 20 MiB large-pool segment: one 2 MiB tensor alive keeps 18 MiB from empty_cache
        "total_size": 20 * MiB,
        "segment_type": "large",
        "blocks": [
            {
                "size": 2 * MiB,
                "state": "active_allocated",
                "frames": [
                    _frame("/usr/lib/python3/threading.py", 1, "run"),
                    _frame("/src/rljob_worker/train.py", 420, "train_step"),
                    _frame("/site/torch/optim/adamw.py", 77, "step"),
                ],
            },
            {"size": 18 * MiB, "state": "inactive"},
        ],
    },
    {  # fully used: reserved and allocated, nothing pinned
        "total_size": 4 * MiB,
        "segment_type": "large",
        "blocks": [{"size": 4 * MiB, "state": "active_allocated", "frames": []}],
    },
    {  # 2 MiB small-pool segment, 1.5 MiB free around two live blocks, one pending free
        "total_size": 2 * MiB,
        "segment_type": "small",
        "blocks": [
            {"size": MiB // 4, "state": "active_allocated"},
            {"size": MiB // 4, "state": "active_pending_free", "frames": []},
            {"size": 3 * MiB // 2, "state": "inactive"},
        ],
    },
]


def test_pinned_segments_and_totals() -> None:
    report = summarize(SEGMENTS)
    assert report["reserved_bytes"] == 26 * MiB
    assert report["allocated_bytes"] == 2 * MiB + 4 * MiB + MiB // 2
    assert report["pinned_free_bytes"] == 18 * MiB + 3 * MiB // 2
    first, second = report["pinned_segments"]  # largest free first; the full one is not pinned
    assert (first["segment_bytes"], first["free_bytes"], first["pool"]) == (
        20 * MiB,
        18 * MiB,
        "large",
    )
    assert first["live"] == [
        {"bytes": 2 * MiB, "where": "train.py:420 train_step < adamw.py:77 step"}
    ]
    assert second["free_bytes"] == 3 * MiB // 2
    assert [b["where"] for b in second["live"]] == ["(no stack recorded)"] * 2


def test_an_empty_allocator_pins_nothing() -> None:
    assert summarize([]) == {
        "reserved_bytes": 0,
        "allocated_bytes": 0,
        "pinned_free_bytes": 0,
        "pinned_segments": [],
    }


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(allocator_report.REPORT_ENV, raising=False)
    assert allocator_report.report_dir() is None
    assert allocator_report.write_report(0, 1, "offload_train") is None
    monkeypatch.setenv(allocator_report.REPORT_ENV, str(tmp_path))
    assert allocator_report.report_dir() == tmp_path
