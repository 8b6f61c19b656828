"""The asynchronous checkpoint's own behaviour, one process on the CPU: the stage returns while
the writer still writes, the seconds blocked are reported apart from the seconds to durable, a
process killed while its writer runs leaves nothing that looks complete, a full disk in the
writer is CheckpointFailed, and the host copies the writer reads are shared with the offload
(copied once, not rewritten while read). The 2-rank runs: test_checkpoint_resume.py (bit for
bit with asynchronous saves) and test_checkpoint_failure.py (ENOSPC on both ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rljob.api import RLJobSpec, parse_manifest
from rljob_worker.checkpoint import (
    MARKER,
    CheckpointFailed,
    Keeper,
    SavedCheckpoint,
    checkpoint_bytes,
    checkpoint_dir,
    complete_checkpoints,
    load,
    space_problem,
)
from rljob_worker.checkpoint_writer import host_state_dict
from rljob_worker.host_copies import _HostCopies
from rljob_worker.staging import Staging

pytestmark = pytest.mark.worker

REPO = Path(__file__).resolve().parents[2]


def _spec(root: Path, mode: str = "Async", keep: int = 5) -> RLJobSpec:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "ckpt-async"},
        "spec": {
            "model": {"path": "builtin:tiny-qwen2"},
            "data": {"source": "builtin:digit"},
            "rollout": {"engine": "torch"},
            "resources": {"workers": 1, "gpusPerWorker": 0},
            "checkpoint": {"path": str(root), "keep": keep, "mode": mode},
        },
    }
    return parse_manifest(doc)[1]


def _first_weight(model: torch.nn.Module) -> torch.Tensor:
    layer = next(iter(model.children()))
    assert isinstance(layer, torch.nn.Linear)
    return layer.weight


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step (so the optimizer has moments to save)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


@pytest.fixture(autouse=True)
def writer_starts_in_the_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the writer once it runs: they start it in the checkpoint stage
    (RLJOB_CHECKPOINT_WRITER_START=stage). The default, held back to after the weight sync,
    has its own test (which sets the variable itself); without this, a writer here would start
    only when its 3 s hold lapsed, and "the loop went on while the writer wrote" would hold
    with no writer running."""
    from rljob_worker.checkpoint import WRITER_START_ENV

    monkeypatch.setenv(WRITER_START_ENV, "stage")


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> float:
    """dcp.save takes at least this long (the writer's files, then a wait)."""
    import torch.distributed.checkpoint as dcp

    real, delay = dcp.save, 1.0

    def slow(*args: object, **kwargs: object) -> object:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        time.sleep(delay)
        return result

    monkeypatch.setattr(dcp, "save", slow)
    return delay


def test_the_stage_returns_before_the_write_and_reports_blocked_apart_from_durable(
    tmp_path: Path, slow_writes: float
) -> None:
    model, optimizer = _trained()
    keeper = Keeper(_spec(tmp_path / "ckpt"), model, optimizer, "builtin:tiny-qwen2")
    started = time.perf_counter()
    keeper.save(1)
    returned = time.perf_counter() - started
    assert returned < slow_writes / 2  # the loop went on while the writer wrote
    keeper.poll()  # a stage boundary: the writer is still running, nothing is complete
    assert keeper.take() == ((), None)
    assert complete_checkpoints(tmp_path / "ckpt") == []
    # The training goes on meanwhile: the checkpoint holds the state as it was at the save.
    saved_weight = _first_weight(model).detach().clone()
    with torch.no_grad():
        _first_weight(model).add_(1.0)
    taken: tuple[SavedCheckpoint, ...] = ()
    deadline = time.monotonic() + 60
    while not taken and time.monotonic() < deadline:  # the next stage boundaries
        time.sleep(0.05)
        keeper.poll()
        taken, _ = keeper.take()
    (saved,) = taken
    assert saved.iteration == 1
    assert saved.blocked_seconds is not None and saved.blocked_seconds < slow_writes / 2
    assert saved.seconds >= slow_writes  # to durable: the whole write
    assert saved.completed_at is not None and saved.bytes > 0
    assert [i for i, _ in complete_checkpoints(tmp_path / "ckpt")] == [1]
    fresh, fresh_optimizer = _trained(seed=1)
    load(fresh, fresh_optimizer, keeper.spec, checkpoint_dir(tmp_path / "ckpt", 1))
    assert torch.equal(_first_weight(fresh), saved_weight)


def test_two_checkpoints_completed_before_one_take_are_both_reported(
    tmp_path: Path, slow_writes: float
) -> None:
    """The next save settles the previous writer (iteration 1 complete), and the job's end
    completes its own (iteration 2) before the loop takes them: both come out, oldest first
    (the last iteration's report sends the older alone; status counts each)."""
    model, optimizer = _trained()
    keeper = Keeper(_spec(tmp_path / "ckpt"), model, optimizer, "builtin:tiny-qwen2")
    keeper.save(1)
    keeper.save(2)  # waits for iteration 1's writer first
    keeper.finish()  # the last writer
    taken, _ = keeper.take()
    assert [c.iteration for c in taken] == [1, 2]
    assert all(c.completed_at and c.bytes > 0 for c in taken)
    assert keeper.take() == ((), None)


def test_after_sync_the_writer_waits_for_the_weight_sync_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RLJOB_CHECKPOINT_WRITER_START=after_sync: nothing is written until the boundary after
    wake_weights (the boundaries before it agree the writer is still running), then the
    checkpoint completes as before. It is the default; "stage" starts the writer in the
    checkpoint stage."""
    from rljob.report import Stage
    from rljob_worker.checkpoint import WRITER_START_ENV, writer_start

    monkeypatch.delenv(WRITER_START_ENV, raising=False)
    assert writer_start() == "after_sync"
    monkeypatch.setenv(WRITER_START_ENV, "stage")
    assert writer_start() == "stage"
    monkeypatch.setenv(WRITER_START_ENV, "after_sync")
    model, optimizer = _trained()
    keeper = Keeper(_spec(tmp_path / "ckpt"), model, optimizer, "builtin:tiny-qwen2")
    keeper.save(1)
    for stage in (Stage.CHECKPOINT, Stage.OFFLOAD_OPTIMIZER):
        keeper.poll(stage)
        time.sleep(0.3)  # a writer started here would have written by now
        assert keeper.take() == ((), None)
        assert not list((tmp_path / "ckpt").rglob("*.distcp"))
    keeper.poll(Stage.WAKE_WEIGHTS)
    taken: tuple[SavedCheckpoint, ...] = ()
    deadline = time.monotonic() + 60
    while not taken and time.monotonic() < deadline:
        time.sleep(0.05)
        keeper.poll(Stage.OFFLOAD_TRAIN)
        taken, _ = keeper.take()
    assert [c.iteration for c in taken] == [1]
    assert [i for i, _ in complete_checkpoints(tmp_path / "ckpt")] == [1]
    # A writer still held back when the job ends (no weight sync after the save) is started by
    # the wait for it; a bad value is refused when the keeper is made.
    keeper.save(2)
    keeper.finish()
    assert [c.iteration for c in keeper.take()[0]] == [2]
    monkeypatch.setenv(WRITER_START_ENV, "later")
    with pytest.raises(ValueError, match="must be one of"):
        Keeper(_spec(tmp_path / "other"), model, optimizer, "builtin:tiny-qwen2")


def test_sync_mode_ends_the_stage_with_the_checkpoint_complete(
    tmp_path: Path, slow_writes: float
) -> None:
    model, optimizer = _trained()
    keeper = Keeper(_spec(tmp_path / "ckpt", mode="Sync"), model, optimizer, "m")
    keeper.save(1)
    (saved,), _ = keeper.take()
    assert saved.blocked_seconds is not None
    assert saved.blocked_seconds >= slow_writes
    assert [i for i, _ in complete_checkpoints(tmp_path / "ckpt")] == [1]


# The child saves iteration 1 whole, then iteration 2 with a writer that stops after writing
# the shards (before the marker) and says so; the test kills it there.
_CHILD = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    import torch.distributed.checkpoint as dcp
    sys.path[:0] = [{tests!r}]
    from test_checkpoint_async import _spec, _trained
    from rljob_worker.checkpoint import Keeper

    root, flag = Path(sys.argv[1]), Path(sys.argv[2])
    model, optimizer = _trained()
    keeper = Keeper(_spec(root), model, optimizer, "builtin:tiny-qwen2")
    keeper.save(1)
    keeper.finish()
    real = dcp.save

    def stuck(*args, **kwargs):
        real(*args, **kwargs)
        flag.write_text("shards written")
        threading.Event().wait()

    dcp.save = stuck
    keeper.save(2)
    print("save returned", flush=True)
    threading.Event().wait()
    """
)


def test_a_process_killed_while_its_writer_runs_leaves_no_complete_checkpoint(
    tmp_path: Path,
) -> None:
    root, flag = tmp_path / "ckpt", tmp_path / "flag"
    script = _CHILD.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(root), str(flag)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists(), child.communicate(timeout=5)
    finally:
        child.send_signal(signal.SIGKILL)
    out, _ = child.communicate(timeout=30)
    assert "save returned" in out  # the loop had gone on: the kill hit the writer
    partial = checkpoint_dir(root, 2)
    assert list((partial / "state").glob("__0_*.distcp"))  # its shards are there ...
    assert not (partial / MARKER).exists()  # ... and no marker
    assert [i for i, _ in complete_checkpoints(root)] == [1]


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (root needed, as in test_checkpoint_failure.py): the model's ~0.8 MB of
    params and moments do not fit."""
    mount = tmp_path / "tiny-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {mount} ({done.stderr.strip()}): needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_in_the_writer_is_checkpoint_failed_at_a_boundary(tiny_disk: Path) -> None:
    model, optimizer = _trained()
    keeper = Keeper(_spec(tiny_disk / "ckpt"), model, optimizer, "m")
    keeper.save(1)  # returns: the write fails behind it
    deadline = time.monotonic() + 60
    with pytest.raises(CheckpointFailed) as failed:
        while time.monotonic() < deadline:
            keeper.poll()
            time.sleep(0.05)
    failure = failed.value.failure
    assert failure.iteration == 1 and failure.rank == 0
    assert "[Errno 28] No space left on device" in failure.error
    assert complete_checkpoints(tiny_disk / "ckpt") == []
    assert not checkpoint_dir(tiny_disk / "ckpt", 1).exists()  # its space given back


def test_offload_after_copy_out_only_frees_and_a_reader_is_waited_for() -> None:
    cpu = torch.device("cpu")
    copies = _HostCopies(cpu, Staging(cpu, overlap=False), "out", "in")
    first = torch.full((5,), -1.0)  # its host copy comes first: the second's starts further on
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)[:, 1:]  # a strided view
    storages = [first.untyped_storage(), tensor.untyped_storage()]
    copies.copy_out(storages)
    view = copies.host_copy(tensor)
    assert view is not None and torch.equal(view, tensor)
    assert torch.equal(copies.host_copy(first), first)  # type: ignore[arg-type]
    assert copies.host_copy(torch.zeros(3)) is None  # not one of the copied storages
    # What the offload writes to the host now is not a second copy: the copy_out's stays.
    snapshot = view.clone()
    tensor.add_(100.0)
    copies.offload(storages)
    assert torch.equal(view, snapshot)
    assert storages[0].nbytes() == 0  # freed
    copies.load()
    assert torch.equal(tensor, snapshot)
    waited: list[str] = []
    copies.hold(lambda: waited.append("writer done"))
    copies.copy_out(storages)  # rewrites the buffers: waits for their reader first
    assert waited == ["writer done"]


def test_host_state_dict_views_what_has_a_host_copy_and_copies_the_rest() -> None:
    kept = torch.ones(4)
    moved = torch.zeros(2)
    state = {"a": moved, "nested": {"b": [moved]}, "lr": 0.1}
    host = host_state_dict(state, lambda t: kept if t is moved else None)
    assert host.state["a"] is kept and host.state["nested"]["b"][0] is kept
    assert host.viewed_bytes == 2 * moved.nbytes and host.copied_bytes == 0
    copied = host_state_dict(state, None)
    assert copied.state["a"] is not moved and torch.equal(copied.state["a"], moved)
    assert copied.copied_bytes == 2 * moved.nbytes and copied.state["lr"] == 0.1


def test_the_writer_writes_the_host_copies_in_place_without_crc_and_they_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dcp's writer clones a tensor whose storage is larger than itself, and the host copies
    are views of one allocation: host_state_dict hands it views over storages of their own
    bytes instead (the same memory), and FileWriter skips torch.save's CRC32; the files load."""
    import zipfile

    import torch.distributed.checkpoint as dcp

    from rljob_worker.checkpoint_writer import FileWriter

    cpu = torch.device("cpu")
    copies = _HostCopies(cpu, Staging(cpu, overlap=False), "out", "in")
    weight, moment = torch.randn(4, 8), torch.randn(16)
    copies.copy_out([weight.untyped_storage(), moment.untyped_storage()])
    host = host_state_dict({"weight": weight, "moment": moment}, copies.host_copy)
    assert host.copied_bytes == 0
    for name, tensor in host.state.items():
        view = copies.host_copy({"weight": weight, "moment": moment}[name])
        assert view is not None and view.untyped_storage().nbytes() > view.nbytes  # one buffer
        assert tensor.data_ptr() == view.data_ptr()  # the same memory, not a copy
        assert tensor.untyped_storage().nbytes() == tensor.nbytes
    clones: list[int] = []
    real_clone = torch.Tensor.clone

    def counted_clone(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        clones.append(self.nbytes)
        return real_clone(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "clone", counted_clone)
    dcp.save(host.state, storage_writer=FileWriter(tmp_path / "state"), no_dist=True)
    monkeypatch.undo()
    assert clones == []
    assert torch.serialization.get_crc32_options()  # the process-wide switch is restored
    (shard,) = (tmp_path / "state").glob("*.distcp")
    # A .distcp file is torch.save records back to back; the first one's zip entries.
    with zipfile.ZipFile(shard) as records:
        assert {info.CRC for info in records.infolist()} == {0}
    loaded = {"weight": torch.zeros(4, 8), "moment": torch.zeros(16)}
    dcp.load(loaded, checkpoint_id=tmp_path / "state", no_dist=True)
    assert torch.equal(loaded["weight"], weight) and torch.equal(loaded["moment"], moment)


def test_an_empty_shard_goes_to_the_writer_as_it_is() -> None:
    """FSDP2 gives a rank an empty shard where a parameter's first dimension has fewer chunks
    than ranks (_chunk_with_empty: 128 rows on 24 ranks leave ranks 22 and 23 none); its host
    copy is an empty view into the one host allocation, and host_state_dict still hands it on
    (the writer's clone of 0 bytes costs nothing) instead of failing the checkpoint stage."""
    cpu = torch.device("cpu")
    copies = _HostCopies(cpu, Staging(cpu, overlap=False), "out", "in")
    full, padded = torch.randn(6), torch.zeros(4)
    empty = padded[:0].view(0, 2)  # a shard with no rows, over FSDP2's padded storage
    copies.copy_out([full.untyped_storage(), padded.untyped_storage()])
    host = host_state_dict({"full": full, "empty": empty}, copies.host_copy)
    assert host.copied_bytes == 0
    assert host.state["empty"].shape == (0, 2) and host.state["empty"].dtype == torch.float32
    assert torch.equal(host.state["full"], full)


def test_overlapping_writers_leave_torch_saves_crc_as_it_was() -> None:
    """The CRC switch is process-wide: with two writers overlapping (A starts, B starts, A ends,
    B ends) it stays off until the last one ends and is then back on. Saving and restoring it
    per writer would leave it off: B saved 'off' while A wrote."""
    from rljob_worker.checkpoint_writer import _CrcOff

    crc = _CrcOff()
    assert torch.serialization.get_crc32_options()
    crc.__enter__()  # A
    crc.__enter__()  # B
    crc.__exit__()  # A ends: B still writes
    assert not torch.serialization.get_crc32_options()
    crc.__exit__()  # B ends
    assert torch.serialization.get_crc32_options()


def test_the_size_estimate_is_what_a_save_writes(tmp_path: Path) -> None:
    # The params (66,112 fp32: 264,448 bytes) and AdamW's two moments of the same size; the
    # files add the RNG states, the metadata and the step counters, a few KiB.
    model, optimizer = _trained()
    estimate = checkpoint_bytes(model, optimizer)
    assert estimate == 3 * 4 * (64 * 512 + 512 + 512 * 64 + 64)
    keeper = Keeper(_spec(tmp_path / "ckpt"), model, optimizer, "builtin:tiny-qwen2")
    keeper.save(1)
    keeper.finish()
    (saved,), _ = keeper.take()
    assert estimate <= saved.bytes <= estimate + (64 << 10), (estimate, saved.bytes)


class _Tied(torch.nn.Module):
    """Embeddings tied to the head, as Qwen2.5's small models have them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(2048, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 2048, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.embed(ids)))


def test_a_tied_weight_counts_twice_in_the_size_estimate_as_the_save_writes_it(
    tmp_path: Path,
) -> None:
    # The state dict names the tied matrix twice and the files hold it twice; its moments once.
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 2048, (4, 8))).sum().backward()
    optimizer.step()
    tied, mid = 2048 * 64 * 4, (64 * 64 + 64) * 4
    estimate = checkpoint_bytes(model, optimizer)
    assert estimate == 2 * tied + mid + 2 * (tied + mid)
    keeper = Keeper(_spec(tmp_path / "ckpt"), model, optimizer, "m")
    keeper.save(1)
    keeper.finish()
    (saved,), _ = keeper.take()
    assert estimate <= saved.bytes <= estimate + (64 << 10), (estimate, saved.bytes)


def test_keep_plus_one_checkpoints_must_fit_less_those_already_there(tiny_disk: Path) -> None:
    root = tiny_disk / "ckpt"
    root.mkdir()
    each = 100 << 10  # three (keep 2, and the next before the oldest goes) > the 256 KiB disk
    problem = space_problem(root, 2, each)
    assert problem is not None
    assert problem.startswith(f"spec.checkpoint.path {root}: ")
    assert "keep 2 needs about 0.3 MiB more (3 checkpoints of about 0.1 MiB at once" in problem
    assert space_problem(root, 1, each) is None  # two fit
    for iteration in (1, 2):  # two complete already: only the next one's space is needed
        checkpoint_dir(root, iteration).mkdir()
        (checkpoint_dir(root, iteration) / MARKER).write_text("")
    assert space_problem(root, 2, each) is None


def test_rank_0_warns_at_the_start_when_the_checkpoints_will_not_fit(
    tiny_disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = _trained()  # ~0.8 MB a checkpoint: none fits the 256 KiB disk
    keeper = Keeper(_spec(tiny_disk / "ckpt", keep=2), model, optimizer, "m")
    assert keeper.resume() is None  # nothing to resume; the run goes on (a warning, no error)
    assert "keep 2 needs about 2.3 MiB more (3 checkpoints of about 0.8 MiB" in caplog.text
    roomy = Keeper(_spec(tmp_path / "ckpt", keep=2), model, optimizer, "m")
    assert roomy.check_space() is None
