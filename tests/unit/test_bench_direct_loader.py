"""bench/direct_loader.py: both ways of loading a bucket are timed on the same payload and must
leave the stand-in model holding the same parameters (the bench refuses a run where they
differ), so its milliseconds compare two correct loads."""

from __future__ import annotations

import pytest
from support.scripts import bench_module


@pytest.mark.parametrize("tp", [1, 2])
def test_both_ways_are_timed_and_land_the_same_weights(tp: int) -> None:
    bench = bench_module("direct_loader.py", "bench_direct_loader")
    result = bench.measure(layers=2, tp_size=tp, repeats=2)
    assert result["tensors"] == 2 * 12 + 2  # embedding, final norm, 12 a layer; the head tied
    assert result["per-tensor views"] > 0 and result["bucket plan"] > 0


def test_a_plan_that_lands_elsewhere_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = bench_module("direct_loader.py", "bench_direct_loader")
    real = bench.sglang_direct.copy_bucket

    def shifted(model, name, buffer, tp=None):  # type: ignore[no-untyped-def]
        rest = real(model, name, buffer, tp)
        next(iter(model.parameters())).data.add_(1)
        return rest

    monkeypatch.setattr(bench.sglang_direct, "copy_bucket", shifted)
    with pytest.raises(RuntimeError, match="different parameters"):
        bench.measure(layers=2, tp_size=1, repeats=1)


def test_the_senders_host_work_is_timed_on_a_gather_that_gives_the_tensors_back() -> None:
    bench = bench_module("direct_loader.py", "bench_direct_loader")
    result = bench.sender(layers=2, repeats=2)
    assert result["gather_full"] > 0 and result["flatten and payload_name"] > 0
    # The planned gather too (the bench checks its tensors against the full ones).
    assert result["gather_full planned"] > 0 and result["flatten and payload_name planned"] > 0
