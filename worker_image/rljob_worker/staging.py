"""The training state's copies over PCIe behind other work: a side CUDA stream, its events, and
the record of which copy started in which stage and where its consumer waited.

The stage machine decides the order (stages.py); this module makes each step of it safe. On the
CPU, or with the overlap off, every copy is done where it starts, so the same order runs with
synchronous copies and bit-identical results; the record is kept either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rljob.api import OverlapStaging, RLJobSpec

# The transfers, by name: what the record says and what a wait names.
OPTIMIZER_TO_HOST = "optimizer to host"
OPTIMIZER_TO_DEVICE = "optimizer to device"
PARAMS_TO_HOST = "params to host"
PARAMS_TO_DEVICE = "params to device"


def overlap_staging(spec: RLJobSpec, device: torch.device) -> bool:
    """spec.training.overlapStaging for this rank: Auto is On on CUDA, Off elsewhere."""
    setting = spec.training.overlap_staging
    if setting is OverlapStaging.AUTO:
        return device.type == "cuda"
    return setting is OverlapStaging.ON


class Staging:
    """Runs the training state's copies, on a side stream where it overlaps, and records them.

    `copies(transfer)` runs the copies issued in its block. With a side stream it first makes
    that stream wait for the current stream's work so far (which wrote the sources, or last
    used the memory the targets were just given), issues the copies there, and records an event;
    `wait(transfer)` makes the current stream's later work wait for that event (the host goes
    on), or with `host=True` blocks the host until it (before a source is freed or a host buffer
    read). Without a side stream the copies run on the current stream and are done on
    exit, and the waits only record. Lifetimes: a copy to the host reads device storages the
    caller frees only after the host waited; a copy to the device writes storages allocated on the
    current stream, which waits for the event before it uses or frees them, so no storage
    needs `record_stream`.
    """

    def __init__(self, device: torch.device, overlap: bool) -> None:
        self.device = device
        # The order is the overlapped one wherever `overlap` is set (the CPU too); the copies
        # run on a side stream only on CUDA.
        self.overlap = overlap
        self.stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None
        self.stage = ""  # set by the stage machine: where the record says a step happened
        self.record: list[str] = []
        self._pending: dict[str, torch.cuda.Event | None] = {}

    @contextmanager
    def copies(self, transfer: str) -> Iterator[None]:
        if transfer in self._pending:
            raise RuntimeError(f"{transfer}: started again before anything waited for it")
        self.record.append(f"{self.stage}: start {transfer}")
        if self.stream is None:
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._pending[transfer] = None
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        event = torch.cuda.Event()
        event.record(self.stream)
        self._pending[transfer] = event

    def pending(self, transfer: str) -> bool:
        return transfer in self._pending

    def wait(self, transfer: str, *, host: bool = False, before: str = "") -> None:
        """The current stream's later work runs after `transfer`'s copies, the host going on;
        `host`: the host waits until they are done (before their sources are freed, or their
        host buffers read). Nothing to do where nothing is pending (waited for already, or
        never started). `before`: what needs them, for the record."""
        if transfer not in self._pending:
            return
        event = self._pending.pop(transfer)
        self.record.append(f"{self.stage}: wait {transfer}" + (f" before {before}" * bool(before)))
        if event is not None and host:
            event.synchronize()
        elif event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def take(self) -> tuple[str, ...]:
        """The record since the last take (one iteration's, for its report)."""
        record, self.record = tuple(self.record), []
        return record
