"""Inside a rank of a weight-gather test: run sync_send.gather_full and describe what it gave, for
the CPU (tests/worker) and GPU (tests/gpu) tests to assert on alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def counted_all_gathers() -> Iterator[list[int]]:
    """Count the flat all-gathers gather_full makes (sync_send.FLAT_ALL_GATHER, each call appended
    to the yielded list) while still running them; the real function is back on exit."""
    import torch.distributed as dist

    from rljob_worker.sync_send import FLAT_ALL_GATHER

    calls: list[int] = []
    real = getattr(dist, FLAT_ALL_GATHER)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    setattr(dist, FLAT_ALL_GATHER, counted)
    try:
        yield calls
    finally:
        setattr(dist, FLAT_ALL_GATHER, real)


def gather_and_describe(
    named: Sequence[tuple[str, Any]], expected: Sequence[Any]
) -> dict[str, Any]:
    """gather_full(named, bfloat16) against `expected` (the full bf16 tensors, in order): names,
    bit-for-bit equality per tensor, shapes, dtypes, devices, and the all-gathers it made."""
    import torch

    from rljob_worker import sync_send

    with counted_all_gathers() as gathers:
        got = sync_send.gather_full(named, torch.bfloat16)
    return {
        "names": [name for name, _ in got],
        "equal": [torch.equal(g, e) for (_, g), e in zip(got, expected, strict=True)],
        "shapes": [tuple(g.shape) for _, g in got],
        "dtypes": sorted({str(g.dtype) for _, g in got}),
        "devices": sorted({str(g.device) for _, g in got}),
        "flat_gathers": len(gathers),
    }
