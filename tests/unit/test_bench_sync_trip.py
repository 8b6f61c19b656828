"""bench/sync_trip.py: a weight sync's timings file split into its parts, checked against
spans whose parts are worked out by hand; and the worker's own writers (the stage, the sglang
adapter, the direct loader) putting their spans in the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.scripts import bench_module

T0 = 1_000.0


def span(call: str, start_ms: float, end_ms: float, **more: object) -> dict[str, object]:
    return {"pid": 1, "call": call, "start": T0 + start_ms / 1e3, "end": T0 + end_ms / 1e3, **more}


def one_sync(offset_ms: float, flush_ms: float) -> list[dict[str, object]]:
    """A 50 ms sync of one bucket at TP 2: next_bucket 5 ms; the update 25 ms, its two loaders
    starting 7 and 9 ms in and ending 15 and 16 ms in; the last next_bucket 1 ms; the flush;
    the synchronize 2 ms; the rest the stage's own."""
    o = offset_ms
    return [
        span("sync", o, o + 50),
        span("next_bucket", o, o + 5),
        span("update", o + 5, o + 30),
        span("loader", o + 12, o + 20, bytes=8),
        span("loader", o + 14, o + 21, bytes=8),
        span("next_bucket", o + 30, o + 31),
        span("flush", o + 32, o + 32 + flush_ms),
        span("synchronize", o + 40, o + 42),
    ]


def test_a_sync_splits_into_the_parts_worked_out_by_hand(tmp_path: Path) -> None:
    bench = bench_module("sync_trip.py", "bench_sync_trip")
    lines = one_sync(0, flush_ms=8) + one_sync(100, flush_ms=6) + one_sync(200, flush_ms=4)
    timings = tmp_path / "t.jsonl"
    timings.write_text("".join(json.dumps(x) + "\n" for x in reversed(lines)))
    syncs = bench.split(bench.read(timings))
    assert len(syncs) == 3
    first = syncs[0]
    expected = {
        "next_bucket": 6.0,
        "way_in": 9.0,  # the update sent at 5 ms, the last TP rank's loader began at 14
        "loader": 7.0,  # from 14 to the last one done at 21
        "way_back": 9.0,  # from 21 to the answer at 30
        "flush": 8.0,
        "synchronize": 2.0,
        "other": 50.0 - 6 - 9 - 7 - 9 - 8 - 2,
    }
    assert first["sync"] == pytest.approx(0.050)
    assert first["buckets"] == 1
    for part, ms in expected.items():
        assert first[part] == pytest.approx(ms / 1e3), part
    # The first sync (it builds the loader's plan) is skipped: the median of 6 and 4 ms.
    assert bench.medians(syncs, skip=1)["flush"] == pytest.approx(0.005)
    table = bench.render(syncs, skip=1)
    assert "| flush | 5.00 | 10.0% |" in table and "medians after each rank's first 1" in table


def test_an_update_without_its_loaders_line_is_named(tmp_path: Path) -> None:
    bench = bench_module("sync_trip.py", "bench_sync_trip")
    lines = [x for x in one_sync(0, flush_ms=8) if x["call"] != "loader"]
    with pytest.raises(ValueError, match="no loader line"):
        bench.split(lines)


def test_nothing_left_after_the_skip_is_refused() -> None:
    bench = bench_module("sync_trip.py", "bench_sync_trip")
    with pytest.raises(ValueError, match="none left"):
        bench.medians(bench.split(one_sync(0, flush_ms=8)), skip=1)


def test_at_tp_2_only_the_rank_that_sent_requests_counts_each_skipping_its_own_first() -> None:
    """Through a TP-2 engine both trainer ranks sync, only the leader sends: the other rank's
    syncs (no buckets) stay out of the medians, and the skip is per rank."""
    bench = bench_module("sync_trip.py", "bench_sync_trip")
    leader = one_sync(0, flush_ms=8) + one_sync(100, flush_ms=6) + one_sync(200, flush_ms=4)
    other = [{**x, "pid": 2} for x in leader if x["call"] in ("sync", "next_bucket", "synchronize")]
    syncs = bench.split(leader + other)
    assert len(syncs) == 6 and sum(1 for s in syncs if s["buckets"] == 0) == 3
    middle = bench.medians(syncs, skip=1)
    assert middle["buckets"] == 1 and middle["flush"] == pytest.approx(0.005)
    assert middle["loader"] == pytest.approx(0.007)


def test_at_tp_2_the_groups_collectives_are_parts_of_their_own() -> None:
    """Through a TP-2 engine the leader also serializes the bucket's handles, gathers every
    rank's, and broadcasts each request's outcome: each its own part, out of `other`."""
    bench = bench_module("sync_trip.py", "bench_sync_trip")
    lines = [
        *one_sync(0, flush_ms=0),
        span("serialize", 5, 5.5),  # inside the update span's gap: before the request
        span("tp_gather", 31, 31.75),  # after the update: nothing else overlaps it
        span("tp_answer", 42, 44),
        span("tp_answer", 44, 45),  # the flush's broadcast
        span("tp_gather", 60, 61),  # after the sync ended: not this sync's
        span("bucket_issue", 0.5, 2),  # inside the first next_bucket (0 to 5 ms)
        span("bucket_kernels", 2, 4.5),
    ]
    (sync,) = bench.split(lines)
    assert sync["serialize"] == pytest.approx(0.0005)
    assert sync["tp_gather"] == pytest.approx(0.00075)
    assert sync["tp_answer"] == pytest.approx(0.003)
    # Parts of next_bucket, shown apart and not counted twice.
    assert sync["bucket_issue"] == pytest.approx(0.0015)
    assert sync["bucket_kernels"] == pytest.approx(0.0025)
    assert sync["next_bucket"] == pytest.approx(0.006)
    # 50 - next_bucket 6 - way_in 9 - loader 7 - way_back 9 - synchronize 2 - the three parts
    assert sync["other"] == pytest.approx((50 - 6 - 9 - 7 - 9 - 2 - 0.5 - 0.75 - 3) / 1e3)
    table = bench.render([sync], skip=0)
    assert "| tp_answer | 3.00 | 6.0% |" in table
    assert "| - of it, bucket_kernels | 2.50 | 5.0% |" in table
