"""The memory plan's start-up row (rljob/plan/load.py LoadPeak) and the reference in the engine's
dtype, against hand-computed bytes; the 32B dry run's figures (bench/plans/qwen32b-*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob.api import RLJobSpec, load_manifest
from rljob.plan import (
    BUILTIN_MODEL_SHAPES,
    SGLANG_TP_RESIDENT_BYTES,
    TRAIN_RESIDUAL_BYTES,
    GiB,
    ModelShape,
    mode_plan,
    parts,
    plan,
    shape_for,
)
from rljob.plan_cli import main as plan_main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
H200 = 150109880320
TINY = BUILTIN_MODEL_SHAPES["builtin:tiny-qwen2"]


def _spec(dtype: str = "bfloat16", kl: float = 0.05, memory: str = "64Gi") -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen2", "dtype": dtype},
            "algorithm": {"groupSize": 2, "klCoef": kl, "iterations": 2},
            "data": {"trainBatchSize": 4, "maxResponseLength": 8},
            "rollout": {"engine": "torch", "wakeUp": "staged", "memFractionStatic": 0.5},
            "training": {"microBatchSize": 2},
            "resources": {"workers": 1, "gpusPerWorker": 2, "memory": memory},
        }
    )


def test_load_row_is_the_shards_the_context_and_one_fp32_slice() -> None:
    spec = _spec()
    m = mode_plan(spec, TINY, 80 * GiB, world=2)
    assert m.load is not None
    p = m.parts
    # The largest slice: half the 320 x 64 embedding = 10240 elements; on the device in fp32
    # (40960 bytes), on the host as stored (bf16) plus its fp32 cast: 10240 x 6 = 61440.
    assert m.load.device_bytes - (p.context - TRAIN_RESIDUAL_BYTES + p.train_params) == 40960
    assert m.load.host_bytes_per_rank == 61440
    assert (m.load.ranks_per_node, m.load.host_bytes_per_node) == (2, 122880)
    assert m.load.fits and m.fits


def test_reference_is_planned_in_the_engine_dtype_unless_a_run_had_fp32() -> None:
    # A 3B-sized model on one rank: the bf16 reference saves 2 bytes per parameter over the
    # fp32 one the stored runs kept, and costs 2 over none, within the allocator's rounding of
    # whole segments (reserved_bytes: 4% of the difference here).
    shape = ModelShape(36, 2048, 11008, 16, 2, 151936, True)
    spec = _spec().model_copy(
        update={"model": _spec().model.model_copy(update={"path": "/models/3b"})}
    )
    bf16 = parts(spec, shape, 80 * GiB, world=1).train_params
    fp32 = parts(spec, shape, 80 * GiB, world=1, reference_dtype="float32").train_params
    assert abs((fp32 - bf16) - 2 * shape.parameters) < 0.05 * 2 * shape.parameters
    without = parts(_spec(kl=0.0), shape, 80 * GiB, world=1).train_params
    assert abs((bf16 - without) - 2 * shape.parameters) < 0.05 * 2 * shape.parameters


def test_a_card_smaller_than_the_load_fails_the_plan_naming_load() -> None:
    spec = _spec()
    load = mode_plan(spec, TINY, 80 * GiB, world=2).load
    assert load is not None
    m = mode_plan(spec, TINY, load.device_bytes + 1, world=2)
    assert not m.fits
    assert m.misfit_text().startswith("load needs")


def test_qwen32b_on_8_h200_loads_in_28_gib_and_4_35_gib_of_host_per_pod() -> None:
    device_bytes = {}
    for tp in (1, 4):
        _, spec = load_manifest(REPO / "bench" / "plans" / f"qwen32b-8xh200-tp{tp}.yaml")
        shape = shape_for(spec)
        assert shape is not None
        load = plan(spec, shape, H200).chosen.load
        assert load is not None and load.fits
        # Rank 0's slice of the 152064 x 5120 embedding: 19008 rows x 5120 = 97320960
        # elements, as stored (bf16) plus fp32: x 6 bytes; eight ranks per worker pod.
        assert load.host_bytes_per_rank == 97320960 * 6
        assert load.host_bytes_per_node == 8 * 97320960 * 6
        device_bytes[tp] = load.device_bytes
    # Shards: 32.76 B params / 8 x (4 + 2) bytes = 24.6 GB, plus context and one slice.
    assert 27.5 * GiB < device_bytes[1] < 28.5 * GiB
    # The engine started first: at TP 4 its group's communicators stay on the device.
    assert device_bytes[4] - device_bytes[1] == SGLANG_TP_RESIDENT_BYTES


def test_host_memory_below_the_slices_fails_the_plan(tmp_path: Path) -> None:
    text = (REPO / "bench" / "plans" / "qwen32b-8xh200-tp4.yaml").read_text()
    manifest = tmp_path / "small-host.yaml"
    manifest.write_text(
        text.replace("gpusPerWorker: 8", "gpusPerWorker: 8\n    memory: 4Gi\n    sharedMemory: 1Gi")
    )
    _, spec = load_manifest(manifest)
    shape = shape_for(spec)
    assert shape is not None
    m = plan(spec, shape, H200).modes
    assert all(not mode.fits for mode in m.values())
    assert "4.35 GiB of host memory per worker pod" in next(iter(m.values())).misfit_text()


def test_rljob_plan_prints_the_load_row(capsys: pytest.CaptureFixture[str]) -> None:
    plan_main([str(REPO / "bench" / "plans" / "qwen32b-8xh200-tp4.yaml")])
    lines = [
        line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("load")
    ]
    assert len(lines) == 2  # one per wakeUp mode
    _, spec = load_manifest(REPO / "bench" / "plans" / "qwen32b-8xh200-tp4.yaml")
    shape = shape_for(spec)
    assert shape is not None
    load = plan(spec, shape, H200).chosen.load
    assert load is not None
    assert f"{load.device_bytes / GiB:.2f}" in lines[0]
    assert "host 4.35 GiB per worker pod: 8 x 0.54" in lines[0]
