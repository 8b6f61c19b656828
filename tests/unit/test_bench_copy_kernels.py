"""bench/copy_kernels.py times four ways of launching a weight sync's copies on a GPU; on the
CPU each way must copy every pair (a timing of a way that skips copies would be worthless)."""

from __future__ import annotations

import pytest
import torch
from support.scripts import bench_module


@pytest.mark.parametrize("large", [1, 1 << 10, 1 << 30])
def test_every_way_copies_every_pair_with_the_cast(large: int) -> None:
    bench = bench_module("copy_kernels.py", "bench_copy_kernels")
    shape = {**bench.SHAPE, "hidden": 16, "mlp": 40, "layers": 2, "q": 16, "kv": 8, "vocab": 50}
    shapes = bench.shapes(shape)
    assert len(shapes) == 2 + 12 * 2  # embedding, final norm, 12 a layer
    torch.manual_seed(0)
    sources = [torch.randn(s) for s in shapes]
    numel = sum(s.numel() for s in sources)
    flat_src = torch.randn(numel)
    for way in ("foreach", "per_tensor", "hybrid"):
        dests = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
        flat_dst = torch.zeros(numel, dtype=torch.bfloat16)
        fns = bench.ways(sources, dests, flat_src, flat_dst, large)
        fns[way]()
        for d, s in zip(dests, sources, strict=True):
            assert torch.equal(d, s.to(torch.bfloat16)), way
        fns["flat"]()
        assert torch.equal(flat_dst, flat_src.to(torch.bfloat16))
    # The hybrid's split: every destination of at least `large` bytes one by one.
    expected = sum(d.numel() * 2 >= large for d in sources)
    assert fns["large_tensors"] == expected
