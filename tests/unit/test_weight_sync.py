"""The weight sync's flat buckets and its overlapped gather (rljob_worker.weight_sync), and the
SGLang adapter's choice between the flattened-bucket and the per-tensor hand-off.

The flat buffer is checked against each supported sglang release's own FlattenedTensorBucket
(its tensor_bucket.py, a torch-only module, loaded from the release's wheel as
test_sglang_contract.py fetches it): what the schedulers rebuild is what training sent, byte
for byte. sglang.Engine itself cannot run here; the adapter drives SGLangEngineStandIn.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.sglang_standin import (
    HANDOFF_FLAT_STAND_IN,
    HANDOFF_STAND_IN,
    SGLangEngineStandIn,
    deserialize,
    serialize,
)
from test_sglang_contract import sglang_source

from rljob_worker import weight_sync
from rljob_worker.engines import sglang_engine
from rljob_worker.engines.base import TAG_WEIGHTS
from rljob_worker.engines.sglang_engine import (
    CONTRACTS,
    SUPPORTED_SGLANG_VERSIONS,
    WEIGHT_SYNC_ENV,
    SGLangEngine,
    SGLangVersionError,
    TensorHandoff,
    flattened_bucket_metadata,
)
from rljob_worker.weight_sync import (
    copy_pairs,
    flatten,
    prefetched,
    sglang_flattened_bucket,
    split_copies,
)

BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _mixed_bucket() -> list[tuple[str, torch.Tensor]]:
    """Separate tensors of three dtypes and odd sizes (a bf16 of 3 elements moves the next
    fp32 off its alignment unless the packer aligns it)."""
    torch.manual_seed(0)
    return [
        ("model.norm.weight", torch.randn(3).bfloat16()),
        ("lm_head.weight", torch.randn(5, 7)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(2, 3, 4).bfloat16()),
        ("positions", torch.arange(5, dtype=torch.int64)),
    ]


def _one_buffer_bucket() -> list[tuple[str, torch.Tensor]]:
    """What sync_send.gather_full gives on more than one rank: views of one buffer, each tensor at
    the start of its padded block (gaps between them)."""
    buffer = torch.randn(64).bfloat16()
    return [
        ("a.weight", buffer[0:12].view(3, 4)),
        ("b.weight", buffer[16:21]),
        ("c.weight", buffer[24:48].view(2, 3, 4)),
    ]


def _assert_same(got: list[tuple[str, torch.Tensor]], sent: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (_, g), (_, s) in zip(got, sent, strict=True):
        assert (g.shape, g.dtype) == (s.shape, s.dtype)
        assert _bytes(g) == _bytes(s)


@pytest.mark.parametrize("make", [_mixed_bucket, _one_buffer_bucket])
def test_flatten_and_back_gives_the_same_names_shapes_dtypes_and_bytes(
    make: Callable[[], list[tuple[str, torch.Tensor]]],
) -> None:
    sent = make()
    flat = flatten(sent)
    assert flat.buffer.dtype == torch.uint8 and flat.buffer.dim() == 1
    _assert_same(flat.tensors(), sent)
    for entry, (_, tensor) in zip(flat.entries, sent, strict=True):
        assert entry.end - entry.start == tensor.numel() * tensor.element_size()
        assert entry.start % tensor.element_size() == 0


def test_a_bucket_already_in_one_buffer_is_viewed_not_copied() -> None:
    sent = _one_buffer_bucket()
    flat = flatten(sent)
    assert not flat.packed
    storage = sent[0][1].untyped_storage().data_ptr()
    assert flat.buffer.untyped_storage().data_ptr() == storage
    assert [(e.start, e.end) for e in flat.entries] == [(0, 24), (32, 42), (48, 96)]
    # The views see later writes to the gathered buffer: nothing was copied.
    sent[1][1].fill_(3.0)
    assert torch.equal(flat.tensors()[1][1], torch.full((5,), 3.0, dtype=torch.bfloat16))


def test_separate_tensors_are_packed_once_each_aligned_to_its_dtype() -> None:
    flat = flatten(_mixed_bucket())
    assert flat.packed
    # bf16 [0, 6), fp32 aligned up to 8, bf16 after 8 + 140, int64 aligned up to 200.
    assert [(e.start, e.end) for e in flat.entries] == [(0, 6), (8, 148), (148, 196), (200, 240)]
    assert flat.buffer.numel() == 240


def test_an_empty_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="empty bucket"):
        flatten([])


@pytest.fixture(params=SUPPORTED_SGLANG_VERSIONS)
def tensor_bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The release's own sglang.srt.weight_sync.tensor_bucket module (it imports only torch),
    importable under its own name so that its metadata pickles as the schedulers see it."""
    path = sglang_source(request.param) / "sglang" / "srt" / "weight_sync" / "tensor_bucket.py"
    spec = importlib.util.spec_from_file_location(BUCKET_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, BUCKET_MODULE, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("make", [_mixed_bucket, _one_buffer_bucket])
def test_sglangs_own_bucket_rebuilds_what_the_adapter_flattened(
    tensor_bucket: Any, make: Callable[[], list[tuple[str, torch.Tensor]]]
) -> None:
    """The payload crosses a pickle (as to a scheduler) and the release's FlattenedTensorBucket
    rebuilds it, as weight_updater._update_weights_from_flattened_bucket does."""
    sent = make()
    payload = sglang_flattened_bucket(flatten(sent), tensor_bucket.FlattenedTensorMetadata)
    received = deserialize(serialize(payload))
    assert all(type(m) is tensor_bucket.FlattenedTensorMetadata for m in received["metadata"])
    bucket = tensor_bucket.FlattenedTensorBucket(
        flattened_tensor=received["flattened_tensor"], metadata=received["metadata"]
    )
    _assert_same(bucket.reconstruct_tensors(), sent)


def _adapter(handoff: TensorHandoff | None, release: str) -> tuple[SGLangEngine, Any]:
    held: list[SGLangEngineStandIn] = []

    def engine_class(**kwargs: Any) -> SGLangEngineStandIn:
        held.append(SGLangEngineStandIn(contract=CONTRACTS[release], **kwargs))
        return held[0]

    engine = SGLangEngine(
        model_path="/models/qwen",
        dtype="bfloat16",
        mem_fraction_static=0.9,
        engine_class=engine_class,
        contract=CONTRACTS[release],
        handoff=handoff,
    )
    engine.resume([TAG_WEIGHTS])
    return engine, held[0]


@pytest.mark.parametrize("release", SUPPORTED_SGLANG_VERSIONS)
def test_with_the_flattened_path_each_bucket_is_one_payload_and_loads_the_same(
    release: str,
) -> None:
    engine, sgl = _adapter(HANDOFF_FLAT_STAND_IN, release)
    buckets = [_mixed_bucket(), _one_buffer_bucket()]
    for bucket in buckets:
        engine.update_weights(bucket)
    engine.flush_cache()
    updates = [kw for name, kw in sgl.calls if name == "update_weights_from_tensor"]
    assert [kw["load_format"] for kw in updates] == ["flattened_bucket"] * 2
    assert all(len(kw["named_tensors"]) == 1 for kw in updates)  # one payload (tp_size 1)
    assert sgl.flattened_loads == 2
    for bucket in buckets:
        for name, tensor in bucket:
            (loaded,) = sgl.loaded[name]
            assert _bytes(loaded) == _bytes(tensor) and loaded.dtype == tensor.dtype


@pytest.mark.parametrize("release", SUPPORTED_SGLANG_VERSIONS)
def test_without_the_flattened_path_the_adapter_hands_over_one_tensor_per_parameter(
    release: str,
) -> None:
    engine, sgl = _adapter(HANDOFF_STAND_IN, release)  # flattened_metadata None
    engine.update_weights(_mixed_bucket())
    (update,) = [kw for name, kw in sgl.calls if name == "update_weights_from_tensor"]
    assert update["load_format"] is None
    assert [n for n, _ in update["named_tensors"]] == [n for n, _ in _mixed_bucket()]
    assert sgl.flattened_loads == 0


def test_the_flattened_path_is_found_by_import_and_missing_means_the_fallback(
    tensor_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    contract = CONTRACTS[SUPPORTED_SGLANG_VERSIONS[-1]]
    monkeypatch.delenv(WEIGHT_SYNC_ENV, raising=False)  # the default: the direct path
    assert flattened_bucket_metadata(contract) is None
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "auto")
    assert flattened_bucket_metadata(contract) is tensor_bucket.FlattenedTensorMetadata
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "tensors")
    assert flattened_bucket_metadata(contract) is None
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "sideways")
    with pytest.raises(ValueError, match="must be one of"):
        flattened_bucket_metadata(contract)


def test_an_sglang_without_the_bucket_module_falls_back_unless_it_is_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    contract = CONTRACTS[SUPPORTED_SGLANG_VERSIONS[-1]]
    # None in sys.modules makes the import fail, as on a release without the module.
    monkeypatch.setitem(sys.modules, BUCKET_MODULE, None)
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "auto")
    assert flattened_bucket_metadata(contract) is None
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "flattened_bucket")
    with pytest.raises(SGLangVersionError, match="no flattened-bucket weight update"):
        flattened_bucket_metadata(contract)
    # A contract that declares no such path falls back without looking.
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "auto")
    assert (
        flattened_bucket_metadata(
            sglang_engine.dataclasses.replace(contract, flattened_bucket=None)
        )
        is None
    )


def test_prefetch_issues_the_next_gather_before_handing_on_and_holds_two_at_most() -> None:
    log: list[str] = []
    alive: set[int] = set()
    most_alive = 0

    class Bucket:
        def __init__(self, index: int) -> None:
            self.index = index
            alive.add(index)

        def __del__(self) -> None:
            alive.discard(self.index)

    def gather(index: int) -> Callable[[], Bucket]:
        def run() -> Bucket:
            nonlocal most_alive
            log.append(f"gather {index}")
            bucket = Bucket(index)
            most_alive = max(most_alive, len(alive))
            return bucket

        return run

    got = []
    for bucket in prefetched(gather(i) for i in range(4)):
        log.append(f"hand {bucket.index}")
        got.append(bucket.index)
        del bucket  # as the weight-sync stage does before asking for the next
    assert got == [0, 1, 2, 3]
    assert log == ["gather 0", "gather 1", "hand 0", "gather 2", "hand 1", "gather 3", "hand 2",
                   "hand 3"]  # fmt: skip
    assert most_alive == 2
    assert alive == set()


def test_without_overlap_each_gather_waits_for_the_previous_hand_off() -> None:
    log: list[str] = []

    def gather(index: int) -> Callable[[], int]:
        return lambda: log.append(f"gather {index}") or index  # type: ignore[func-returns-value]

    for index in prefetched((gather(i) for i in range(3)), ahead=False):
        log.append(f"hand {index}")
    assert log == ["gather 0", "hand 0", "gather 1", "hand 1", "gather 2", "hand 2"]


def test_the_overlapped_gather_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from rljob_worker.weight_sync import OVERLAP_ENV, overlap_enabled

    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert overlap_enabled()
    for value, expected in (("", True), (" ", True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv(OVERLAP_ENV, value)
        assert overlap_enabled() is expected, repr(value)


def test_copies_at_or_above_the_threshold_go_one_by_one_and_every_pair_is_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Destination sizes in bytes: the split is by the destination's (here bf16) size.
    monkeypatch.delenv(weight_sync.LARGE_COPY_ENV, raising=False)
    monkeypatch.setattr(weight_sync, "LARGE_COPY_BYTES", 8)
    assert split_copies([2, 8, 7, 16, 0]) == ((1, 3), (0, 2, 4))
    assert split_copies([2, 6]) == ((), (0, 1))
    assert split_copies([9, 8]) == ((0, 1), ())
    monkeypatch.setenv(weight_sync.LARGE_COPY_ENV, "9")  # the engine's schedulers inherit it
    assert split_copies([2, 8, 7, 16, 0]) == ((3,), (0, 1, 2, 4))
    monkeypatch.setenv(weight_sync.LARGE_COPY_ENV, "0")  # every copy one by one
    assert split_copies([2, 0]) == ((0, 1), ())
    for bad in ("lots", "-1"):
        monkeypatch.setenv(weight_sync.LARGE_COPY_ENV, bad)
        with pytest.raises(ValueError, match=f"RLJOB_LARGE_COPY_BYTES='{bad}' is not a number"):
            split_copies([1])
    monkeypatch.delenv(weight_sync.LARGE_COPY_ENV)
    torch.manual_seed(0)
    sources = [torch.randn(n) for n in (1, 4, 3, 8, 0)]  # fp32, cast on the way
    expected = [s.to(torch.bfloat16) for s in sources]
    for split in (((1, 3), (0, 2, 4)), ((), (0, 1, 2, 3, 4)), ((0, 1, 2, 3, 4), ())):
        dests = [torch.full((s.numel(),), 9.0, dtype=torch.bfloat16) for s in sources]
        copy_pairs(dests, sources, split)
        assert all(torch.equal(d, e) for d, e in zip(dests, expected, strict=True)), split
    # A split that leaves a pair out is refused rather than skipping its copy.
    with pytest.raises(ValueError, match="a copy split of 1 \\+ 3 for 5 destinations"):
        copy_pairs(dests, sources, ((1,), (0, 2, 3)))
