"""bench/train_alone.py: the train stage alone on a synthetic rollout of a workload's shape. On
the CPU with the tiny model (--smoke): every configuration's step runs, says where its seconds
went, and packing cuts the same tokens into fewer, less padded micro-batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import train_alone  # noqa: E402
from colocate import WORKLOADS  # noqa: E402

pytestmark = pytest.mark.worker


def test_realistic_lengths_are_geometric_cut_at_the_cap() -> None:
    workload = WORKLOADS["realistic"]
    lengths = train_alone.response_lengths(workload, 20000, seed=0)
    p, cap = workload.eos_hazard, workload.response_length
    assert p is not None
    # E[min(cap, G)] for G geometric on 1, 2, ...: (1 - (1 - p)^cap) / p (~369 here).
    expected_mean = (1 - (1 - p) ** cap) / p
    assert sum(lengths) / len(lengths) == pytest.approx(expected_mean, rel=0.03)
    assert max(lengths) == cap and min(lengths) >= 1
    at_cap = sum(n == cap for n in lengths) / len(lengths)
    assert at_cap == pytest.approx((1 - p) ** (cap - 1), abs=0.01)  # ~7.7%
    assert set(train_alone.response_lengths(WORKLOADS["small"], 50, seed=0)) == {128}


def test_smoke_run_reports_each_pass_and_packing_pads_less(tmp_path: Path) -> None:
    out = tmp_path / "train-alone.json"
    code = train_alone.main(["--smoke", "--workload", "realistic", "--micro-batch-size", "2",
                             "--pack", "on,off", "--profile-rows", "4", "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    on, off = result["configs"]
    assert (on["pack"], off["pack"]) == (True, False)
    answers = sum(train_alone.response_lengths(train_alone.Workload(4, 4, 32, 2, True, 0.1), 16, 0))
    # The same rollout both ways: its answers plus 16 encoded prompts.
    assert on["tokens"] == off["tokens"] > answers
    assert on["micro_batches"] < off["micro_batches"] == 8  # 16 rows, 2 a micro-batch unpacked
    assert on["tokens"] <= on["padded_tokens"] < off["padded_tokens"]
    for row in (on, off):
        assert set(row["pass_seconds"]) == {
            "old_logprobs", "ref_logprobs", "setup", "forward_backward", "optimizer_step"
        }  # fmt: skip
        assert sum(row["pass_seconds"].values()) <= row["seconds"][-1]
        assert row["real_tokens_per_second"] > 0
    assert "aten::" in out.with_suffix(".profile.txt").read_text()


def test_two_ranks_each_train_their_share_of_the_rollout(tmp_path: Path) -> None:
    """--ranks 2 (gloo here, one card each on a GPU): each rank's step runs on every other
    prompt's answers, FSDP over both; rank 0 reports."""
    out = tmp_path / "train-alone-2.json"
    code = train_alone.main(["--smoke", "--workload", "realistic", "--micro-batch-size", "2",
                             "--pack", "on", "--ranks", "2", "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert (result["ranks"], result["rows"]) == (2, 8)  # 16 answers, half on rank 0
    (row,) = result["configs"]
    assert row["seconds"] and row["seconds"][-1] > 0 and row["real_tokens_per_second"] > 0
