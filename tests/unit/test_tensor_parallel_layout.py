"""Where tensor-parallel groups fall: consecutive ranks, one node each, GPU ids for sglang."""

from __future__ import annotations

import pytest

from rljob_worker.engines.tensor_parallel import (
    physical_gpu_id,
    tensor_parallel_layout,
    visible_gpus,
)

pytestmark = pytest.mark.unit

TWO_NODES_OF_FOUR = ["pod-a"] * 4 + ["pod-b"] * 4


@pytest.mark.parametrize(
    ("rank", "tp_size", "group", "tp_rank"),
    [
        (0, 1, (0,), 0),
        (5, 1, (5,), 0),
        (0, 2, (0, 1), 0),
        (3, 2, (2, 3), 1),
        (6, 2, (6, 7), 0),
        (2, 4, (0, 1, 2, 3), 2),
        (4, 4, (4, 5, 6, 7), 0),
    ],
)
def test_groups_are_consecutive_ranks_on_one_node(
    rank: int, tp_size: int, group: tuple[int, ...], tp_rank: int
) -> None:
    layout = tensor_parallel_layout(rank, TWO_NODES_OF_FOUR, tp_size)
    assert layout.group == group
    assert layout.tp_rank == tp_rank
    assert layout.leader == group[0]
    assert layout.is_leader == (tp_rank == 0)
    assert len(layout.groups) == len(TWO_NODES_OF_FOUR) // tp_size


def test_a_group_across_two_nodes_is_refused_naming_ranks_and_nodes() -> None:
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2, 3\] spans nodes \['pod-a', 'pod-b'\]"):
        tensor_parallel_layout(0, ["pod-a"] * 2 + ["pod-b"] * 6, 4)
    # Interleaved nodes (ranks not numbered node by node) are refused as well.
    with pytest.raises(ValueError, match="spans nodes"):
        tensor_parallel_layout(0, ["pod-a", "pod-b"] * 2, 2)


@pytest.mark.parametrize("tp_size", [0, 3])
def test_a_size_that_does_not_divide_the_ranks_is_refused(tp_size: int) -> None:
    with pytest.raises(ValueError, match=f"tensorParallelSize={tp_size} must divide the job's 8"):
        tensor_parallel_layout(0, TWO_NODES_OF_FOUR, tp_size)


@pytest.mark.parametrize(
    ("visible", "device", "expected"),
    [
        (None, "cuda:3", "3"),  # every GPU visible: the index is the id
        ("4,6", "cuda:1", "6"),
        ("7", "cuda", "7"),  # a Ray actor: its one GPU
        ("GPU-0a1b,GPU-2c3d", "cuda:0", "GPU-0a1b"),
    ],
)
def test_physical_gpu_id_reads_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, device: str, expected: str
) -> None:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert physical_gpu_id(device) == expected


def test_physical_gpu_id_refuses_a_device_the_process_cannot_see(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(ValueError, match="cuda:1 is not among"):
        physical_gpu_id("cuda:1")


@pytest.mark.parametrize("before", [None, "1"])
def test_visible_gpus_is_restored_even_after_an_error(
    monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    import os

    if before is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
    with pytest.raises(RuntimeError), visible_gpus(["1", "3"]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
        raise RuntimeError("engine failed to start")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
