"""Memory accounting at every stage boundary: one StageSample per rank, stage and iteration.

Also the OOM boundary: a torch.OutOfMemoryError inside a stage becomes an OOMRecord (stage, rank,
requested and free bytes) and a StageOOM that ends the run, with every sample so far kept.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import psutil
import torch

from rljob.report import LoadSample, OOMRecord, Stage, StageSample

# RLJOB_INJECT_OOM=STAGE[@rank=R][@iteration=I] raises a real torch.OutOfMemoryError at the
# start of that stage, so tests can prove every stage boundary records OOMs the same way.
INJECT_OOM_ENV = "RLJOB_INJECT_OOM"

_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_REQUESTED_RE = re.compile(r"Tried to allocate ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB)")
_FREE_RE = re.compile(r"of which ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB) is free")


class StageOOM(RuntimeError):
    """A CUDA OOM caught at a stage boundary; `record` is what goes into status.oomEvents."""

    def __init__(self, record: OOMRecord) -> None:
        super().__init__(
            f"CUDA out of memory in stage {record.stage} (iteration {record.iteration}, rank "
            f"{record.rank}): {record.request_text()}. Lower spec.rollout.memFractionStatic, "
            f"use wakeUp: staged, or shrink batch sizes. Cause: {record.message}"
        )
        self.record = record


@dataclass(frozen=True)
class OOMInjection:
    """Where a test wants a real torch.OutOfMemoryError raised."""

    stage: Stage
    rank: int | None = None
    iteration: int | None = None
    requested_bytes: int = 2 << 30

    @classmethod
    def from_env(cls, value: str | None = None) -> OOMInjection | None:
        """Parse RLJOB_INJECT_OOM (or `value`): 'rollout', 'train@rank=1@iteration=2'."""
        raw = os.environ.get(INJECT_OOM_ENV, "") if value is None else value
        if not raw.strip():
            return None
        stage, *qualifiers = raw.strip().split("@")
        fields: dict[str, int] = {}
        for qualifier in qualifiers:
            key, _, number = qualifier.partition("=")
            if key not in ("rank", "iteration"):
                raise ValueError(f"{INJECT_OOM_ENV}={raw!r}: unknown qualifier {key!r}")
            fields[key] = int(number)
        return cls(stage=Stage(stage), **fields)

    def applies(self, stage: Stage, rank: int, iteration: int) -> bool:
        return (
            stage == self.stage
            and self.rank in (None, rank)
            and self.iteration in (None, iteration)
        )

    def error(
        self, device: torch.device, free_bytes: int, total_bytes: int
    ) -> torch.OutOfMemoryError:
        # Same wording as the CUDA caching allocator, so the parser below is tested on it.
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_fmt(self.requested_bytes)}. "
            f"GPU {device.index or 0} has a total capacity of {_fmt(total_bytes)} of which "
            f"{_fmt(free_bytes)} is free. (injected by {INJECT_OOM_ENV} at stage {self.stage})"
        )


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


LIBRARY_OOM_MARKERS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_library_oom(error: BaseException) -> bool:
    """A CUDA library's allocation failure, raised as a RuntimeError rather than an OOM error."""
    return any(marker in str(error) for marker in LIBRARY_OOM_MARKERS)


def _parse_bytes(pattern: re.Pattern[str], message: str) -> int | None:
    match = pattern.search(message)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def parse_oom_message(message: str) -> tuple[int | None, int | None]:
    """(requested_bytes, free_bytes) from a CUDA OOM message; None where it says nothing."""
    return _parse_bytes(_REQUESTED_RE, message), _parse_bytes(_FREE_RE, message)


class _Probe:
    """Reads one device's memory: CUDA through torch, host through psutil (same fields)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.process = psutil.Process()
        self.name = torch.cuda.get_device_name(device) if self.cuda else "cpu"

    def device_used_total(self) -> tuple[int, int]:
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            return total - free, total
        host = psutil.virtual_memory()
        return host.total - host.available, host.total

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocator(self) -> tuple[int, int]:
        """(allocated, reserved) now; on host both are the process RSS."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        rss = self.process.memory_info().rss
        return rss, rss

    def allocator_peak(self) -> tuple[int, int]:
        if self.cuda:
            return (
                torch.cuda.max_memory_allocated(self.device),
                torch.cuda.max_memory_reserved(self.device),
            )
        return 0, 0  # host peaks come from the sampler thread


class _Sampler(threading.Thread):
    """Polls device-wide use during a stage (and once at each end): only the device's free
    memory tells which torch_memory_saver regions are really mapped, and shows other processes."""

    def __init__(self, probe: _Probe, interval_seconds: float, process: bool = False) -> None:
        super().__init__(daemon=True, name="rljob-memory-sampler")
        self.probe = probe
        self.interval_seconds = interval_seconds
        self.stop_event = threading.Event()
        self.peak_device_used = 0
        self.peak_process = 0
        # The process's RSS: on the host it is the device; on CUDA only where asked (load).
        self.process = process or not probe.cuda

    def sample_once(self) -> None:
        used, _ = self.probe.device_used_total()
        self.peak_device_used = max(self.peak_device_used, used)
        if self.process:
            self.peak_process = max(self.peak_process, self.probe.process.memory_info().rss)

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_seconds):
            self.sample_once()


class MemoryMeter:
    """Measures each stage of one rank; `stage()` is the boundary every stage runs inside."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        on_sample: Callable[[StageSample], None] | None = None,
        inject: OOMInjection | None = None,
        node: str = "",
        interval_seconds: float | None = None,
    ) -> None:
        self.rank = rank
        self.probe = _Probe(device)
        self.on_sample = on_sample
        self.inject = inject
        self.node = node
        self.interval_seconds = interval_seconds or (0.005 if self.probe.cuda else 0.02)
        self.samples: list[StageSample] = []
        self.load_sample: LoadSample | None = None

    @property
    def kind(self) -> str:
        return "cuda" if self.probe.cuda else "host"

    @contextmanager
    def load(self) -> Iterator[None]:
        """Measure the start-up (models built and loaded) into `load_sample`: device-wide and
        allocator peaks as a stage's, and the process's host RSS peak on any device."""
        probe = self.probe
        probe.reset_peak()
        sampler = _Sampler(probe, self.interval_seconds, process=True)
        sampler.sample_once()
        sampler.start()
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            sampler.stop_event.set()
            sampler.join()
            sampler.sample_once()
        used, total = probe.device_used_total()
        peak_allocated = probe.allocator_peak()[0] if probe.cuda else sampler.peak_process
        self.load_sample = LoadSample(
            rank=self.rank,
            kind="cuda" if probe.cuda else "host",
            device=probe.name,
            seconds=seconds,
            peak_allocated_bytes=peak_allocated,
            device_peak_used_bytes=max(sampler.peak_device_used, used),
            device_total_bytes=total,
            host_peak_bytes=sampler.peak_process,
            node=self.node,
        )

    @contextmanager
    def stage(self, stage: Stage, iteration: int) -> Iterator[None]:
        """Run a stage inside the boundary: record its sample, turn a CUDA OOM into StageOOM."""
        probe = self.probe
        probe.reset_peak()
        used_at_start, total = probe.device_used_total()
        sampler = _Sampler(probe, self.interval_seconds)
        sampler.sample_once()
        sampler.start()
        start_wall, start = time.time(), time.perf_counter()
        oom: OOMRecord | None = None
        try:
            if self.inject is not None and self.inject.applies(stage, self.rank, iteration):
                raise self.inject.error(probe.device, total - used_at_start, total)
            yield
        except torch.OutOfMemoryError as error:
            oom = self._oom_record(stage, iteration, error)
        except RuntimeError as error:
            # cuBLAS/cuDNN report a failed workspace allocation as a plain RuntimeError: it is
            # the same out-of-memory, and status must say so (seen at memFractionStatic 0.98).
            if not is_library_oom(error):
                raise
            oom = self._oom_record(stage, iteration, error)
        finally:
            seconds = time.perf_counter() - start
            sampler.stop_event.set()
            sampler.join()
            sampler.sample_once()
            self._record(stage, iteration, start_wall, seconds, sampler)
        if oom is not None:
            raise StageOOM(oom)

    def _record(
        self,
        stage: Stage,
        iteration: int,
        start_wall: float,
        seconds: float,
        sampler: _Sampler,
    ) -> None:
        probe = self.probe
        allocated, reserved = probe.allocator()
        used, total = probe.device_used_total()
        if probe.cuda:
            # torch's allocator statistics count torch_memory_saver regions even while paused
            # (their virtual addresses stay allocated), so they are reported as torch gives them
            # but never read as device use: the device peak is the sampled device-wide use.
            peak_allocated, peak_reserved = probe.allocator_peak()
        else:
            peak_allocated = peak_reserved = max(sampler.peak_process, allocated)
        device_peak = max(sampler.peak_device_used, used)
        sample = StageSample(
            iteration=iteration,
            rank=self.rank,
            stage=stage,
            kind="cuda" if probe.cuda else "host",
            device=probe.name,
            start_seconds=start_wall,
            seconds=seconds,
            peak_allocated_bytes=peak_allocated,
            peak_reserved_bytes=peak_reserved,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            device_used_bytes=used,
            device_peak_used_bytes=device_peak,
            device_total_bytes=total,
            node=self.node,
        )
        self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)

    def _oom_record(self, stage: Stage, iteration: int, error: BaseException) -> OOMRecord:
        message = str(error)
        requested, free = parse_oom_message(message)
        if free is None:
            used, total = self.probe.device_used_total()
            free = total - used
        return OOMRecord(
            time=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            kind="CUDAOutOfMemory",
            stage=stage,
            iteration=iteration,
            rank=self.rank,
            node=self.node,
            requested_bytes=requested,
            free_bytes=free,
            message=message.splitlines()[0][:1000] if message else type(error).__name__,
        )
