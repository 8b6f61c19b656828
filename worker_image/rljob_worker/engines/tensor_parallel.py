"""One sglang engine per tensor-parallel group of ranks: the group's layout on nodes and GPUs,
and the engine every rank of the group drives as if it were its own.

Layout (the same as verl's colocated SGLang rollout): ranks are numbered so that a node's ranks
are consecutive (both drivers do this), and each run of `tp_size` consecutive ranks is one group,
which must lie on one node. The group's first rank, the leader, starts `sglang.Engine` with
CUDA_VISIBLE_DEVICES set to the group's GPUs in rank order and base_gpu_id=0, so sglang's TP
rank i runs on the GPU of the group's i-th rank, next to that rank's FSDP shard. Each rank may
see only its own GPU (a Ray actor does), which is why the leader gathers the GPU ids first.

Every rank of a group makes the same calls in the same order (the stage machine is the same on
every rank); the leader runs them on the engine and the others wait for its answer over a gloo
group, so each rank measures its GPU after the engine changed it. A resume, which takes memory
on every GPU of the group, first waits until every rank has arrived (has freed what the stage
before gave back). Weights travel per GPU: every rank serializes its own full tensors (IPC
handles) and the leader passes one handle per TP rank to sglang, so TP rank i loads from its
own GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from rljob_worker.engines.base import ColocatedEngine, Completion, SamplingParams
from rljob_worker.weight_sync import ipc_alias, record_span

if TYPE_CHECKING:
    import torch

    from rljob_worker.engines.sglang_engine import TensorHandoff
    from rljob_worker.engines.sglang_weights import WeightShards
    from rljob_worker.tp_shards import ShardedBucket

log = logging.getLogger(__name__)


class GroupEngine(Protocol):
    """What the leader's engine offers beyond RolloutEngine: several ranks' batches at once."""

    @property
    def released_tags(self) -> frozenset[str]: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    def generate_many(
        self, batches: Sequence[tuple[Sequence[Sequence[int]], SamplingParams]]
    ) -> list[list[Completion]]: ...

    def release(self, tags: Sequence[str]) -> None: ...

    def resume(self, tags: Sequence[str]) -> None: ...

    def update_weights(self, bucket: Iterable[tuple[str, Any]]) -> None: ...

    def update_weights_flattened(self, payloads: Sequence[bytes]) -> None: ...

    def update_weights_direct(self, name: str, buffer: Any, stored: Any = None) -> None: ...

    def flush_cache(self) -> None: ...

    def shutdown(self) -> None: ...

    def prompt_logprobs_many(
        self, batches: Sequence[Sequence[Sequence[int]]]
    ) -> list[list[list[float]]]: ...

    def dump_weights(self, directory: str) -> WeightShards: ...


class TensorParallelPeerError(RuntimeError):
    """The group's engine failed on the leader; raised on the other ranks of the group."""


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where one rank sits among the tensor-parallel groups of the job."""

    rank: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def group(self) -> tuple[int, ...]:
        """This rank's group: global ranks in TP-rank order (the leader first)."""
        return next(g for g in self.groups if self.rank in g)

    @property
    def tp_rank(self) -> int:
        return self.group.index(self.rank)

    @property
    def leader(self) -> int:
        return self.group[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def tensor_parallel_layout(rank: int, nodes: Sequence[str], tp_size: int) -> TensorParallelLayout:
    """Groups of `tp_size` consecutive ranks; `nodes[r]` is rank r's node.

    A group that spans nodes is refused: the colocated engine shares each GPU with its rank's
    training, and sglang's multi-node TP would put NCCL traffic for every token across nodes.
    """
    world = len(nodes)
    if tp_size < 1 or world % tp_size:
        raise ValueError(
            f"spec.rollout.tensorParallelSize={tp_size} must divide the job's {world} ranks"
        )
    groups = tuple(tuple(range(start, start + tp_size)) for start in range(0, world, tp_size))
    for group in groups:
        spread = sorted({nodes[r] for r in group})
        if len(spread) > 1:
            raise ValueError(
                f"tensor-parallel group of ranks {list(group)} spans nodes {spread}: "
                "spec.rollout.tensorParallelSize must divide the GPUs of one worker "
                "(spec.resources.gpusPerWorker), and a node's ranks must be consecutive"
            )
    return TensorParallelLayout(rank=rank, groups=groups)


def physical_gpu_id(device: str) -> str:
    """The id (index or UUID) of this process's `device` that CUDA_VISIBLE_DEVICES would name.

    `cuda:1` in a process that sees CUDA_VISIBLE_DEVICES=4,6 is GPU 6; with nothing set, the
    process sees every GPU and the index is the id.
    """
    from rljob_worker.engines import cuda_index

    index = cuda_index(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    if index >= len(ids):
        raise ValueError(f"{device} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[index]


@contextlib.contextmanager
def visible_gpus(gpu_ids: Sequence[str]) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to `gpu_ids` for processes started inside; restored after.

    This process's own CUDA context is already made and keeps its devices: only the engine's
    scheduler processes, spawned inside, see the group's GPUs.
    """
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class TensorParallelEngine(ColocatedEngine):
    """The rollout engine of one rank in a tensor-parallel group (a RolloutEngine).

    Built collectively by make_tensor_parallel_engine on every rank of the job.
    """

    def __init__(
        self,
        layout: TensorParallelLayout,
        group: Any,
        engine: GroupEngine | None,
        handoff: TensorHandoff,
        kv_capacity_tokens: int,
        released_tags: frozenset[str],
        shard_to_shard: bool = False,
        own_as_stored: bool = False,
    ) -> None:
        self.layout = layout
        # Every rank of the job allows the shard-to-shard sync, and reading the own blocks as
        # stored (make_tensor_parallel_engine asked them all): one rank's environment alone
        # never decides a collective's kind or a payload's layout.
        self._shard_to_shard = shard_to_shard
        self._own_as_stored = shard_to_shard and own_as_stored
        self._group = group
        self._engine = engine
        self._handoff = handoff
        self._kv_capacity_tokens = kv_capacity_tokens
        self._released = released_tags

    @property
    def flattened_buckets(self) -> bool:
        """Whether buckets go to sglang flattened (one payload per rank and bucket)."""
        return self._handoff.flattened_metadata is not None

    @property
    def direct_buckets(self) -> bool:
        """Whether buckets go to rljob's loader in the schedulers (one buffer per rank)."""
        return self._handoff.direct

    @property
    def shard_world(self) -> int | None:
        """The job's ranks where this engine spans them all and takes buckets shard to shard
        (rljob_worker.tp_shards: rljob's loader, one group, RLJOB_TP_SHARDED_SYNC not 0 on any
        rank); TP rank r is then rank r, next to FSDP's shard r. Else None (full tensors)."""
        layout = self.layout
        if not self.direct_buckets or len(layout.groups) != 1 or not self._shard_to_shard:
            return None
        return len(layout.group)

    @property
    def shard_own_as_stored(self) -> bool:
        """Whether the trainer may hand its own blocks where its shards lie (tp_shards' own
        blocks as stored): every rank's RLJOB_TP_SHARDED_SYNC allows it."""
        return self._own_as_stored

    def update_weights_sharded(self, bucket: ShardedBucket) -> None:
        """Every rank hands over its own buffer of the bucket (its own blocks and those it
        received, or the received ones and, as stored, the storage of its own shards); the
        leader gives TP rank i rank i's, under the payload name, which must be every rank's (the
        layout's byte offsets are rank-independent)."""
        serializing = time.time()  # the spans are for bench/sync_trip.py (TIMINGS_ENV)
        mine = self._handoff.serialize(bucket.buffer)
        if bucket.stored is None:
            record_span("serialize", serializing, time.time())
            self._load_direct(bucket.name, mine, bucket)
            return
        # The trainer's own storage goes as an alias (weight_sync.ipc_alias): the loader is done
        # with it when the leader reports the bucket loaded, and the alias is kept till then.
        alias = ipc_alias(bucket.stored)
        stored = self._handoff.serialize(alias)
        record_span("serialize", serializing, time.time())
        self._load_direct(bucket.name, mine, (bucket, alias), stored)

    def generate_with_logprobs(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Completion]:
        """The group's batches go to the engine as one; each rank gets its own answers."""
        mine = ([list(p) for p in prompts], sampling)
        return list(self._as_one_batch("generate", mine, lambda e, b: e.generate_many(b)))

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of this rank's sequences (SGLangEngine.prompt_logprobs),
        scored with the other ranks' in one batch."""
        mine = [list(ids) for ids in sequences]
        return list(
            self._as_one_batch("prompt_logprobs", mine, lambda e, b: e.prompt_logprobs_many(b))
        )

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The group engine's weights, full, under the trainer's names, on every rank.

        The leader has every TP rank's scheduler write its shards into a directory of this node
        (the group lies on one node); each rank reads and joins them itself, and the leader
        removes them once all have (a gloo barrier).
        """
        from rljob_worker.engines.sglang_weights import read_weights

        shards = self._leader_answer(
            "named_weights",
            lambda engine: engine.dump_weights(tempfile.mkdtemp(prefix="rljob-sglang-weights-")),
        )
        try:
            weights = read_weights(shards)
        finally:
            with _peers(self.layout, "named_weights"):
                dist.barrier(group=self._group)
            if self.layout.is_leader:
                shutil.rmtree(shards.directory, ignore_errors=True)
        return iter(weights.items())

    def _as_one_batch(self, what: str, mine: Any, answer: Callable[[Any, list[Any]], Any]) -> Any:
        """Gather every rank's `mine` on the leader, which answers them in one engine call
        (`answer(engine, batches)`, one answer per rank); this rank's answer."""
        layout = self.layout
        batches: list[Any] | None = [None] * len(layout.group) if layout.is_leader else None
        with _peers(layout, what):
            dist.gather_object(mine, batches, dst=layout.leader, group=self._group)
        answers = self._leader_answer(what, lambda engine: answer(engine, batches or []))
        return answers[layout.tp_rank]

    def release(self, tags: Sequence[str]) -> None:
        if any(t not in self._released for t in tags):
            self._on_leader("release", lambda engine: engine.release(tags))

    def resume(self, tags: Sequence[str]) -> None:
        """Map the tags' memory again on every GPU of the group, once every rank is here.

        The leader's resume takes memory on the other ranks' GPUs too, so it waits (a gloo
        barrier) until each rank has finished the stage before, whose empty_cache() gave its
        training memory back: without it the leader, done first, mapped the KV pool on a GPU
        whose rank was still offloading its params (first seen on two H200s at 3B, TP 2,
        staged 0.95, where the first offload pins host memory for seconds; docs/two-gpu.md).
        """
        if any(t in self._released for t in tags):
            with _peers(self.layout, "resume"):
                dist.barrier(group=self._group)
            self._on_leader("resume", lambda engine: engine.resume(tags))

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every rank hands over its own full tensors; TP rank i's scheduler loads rank i's.

        On the direct path each rank sends its bucket's buffer (one handle) and the bucket's
        layout as its name, which must be every rank's; where sglang has the flattened-bucket
        path, each rank sends one payload for the whole bucket (its buffer's IPC handle and the
        tensors' places in it), else one handle per tensor. This rank's tensors stay referenced
        (`named`, `flat`) until the leader reports the bucket loaded: an IPC handle is only good
        while its tensor lives.
        """
        named = [(name, tensor.detach()) for name, tensor in bucket]
        names = [name for name, _ in named]
        metadata = self._handoff.flattened_metadata
        direct = self._handoff.direct
        if direct:
            from rljob_worker.engines.sglang_direct import payload_name
            from rljob_worker.weight_sync import flatten

            flat = flatten(named)
            # The layout travels as the bucket's one name: every rank's must be the same.
            names = [payload_name(flat)]
            mine: Any = self._handoff.serialize(flat.buffer)
        elif metadata is not None:
            from rljob_worker.weight_sync import flatten, sglang_flattened_bucket

            flat = flatten(named)
            mine = self._handoff.serialize(sglang_flattened_bucket(flat, metadata))
        else:
            mine = [self._handoff.serialize(tensor) for _, tensor in named]
        if direct:
            self._load_direct(names[0], mine, (named, flat))
            return
        gathered = self._gather_on_leader(names, mine)

        def load(engine: GroupEngine) -> None:
            assert gathered is not None
            self._check_same(gathered, names)
            if metadata is not None:
                engine.update_weights_flattened([payload for _, payload in gathered])
                return
            engine.update_weights(
                (name, self._handoff.local_tensor(values=[handles[i] for _, handles in gathered]))
                for i, name in enumerate(names)
            )

        self._on_leader("update_weights", load)

    def _gather_on_leader(self, names: list[str], mine: Any) -> list[Any] | None:
        """Every rank's (names, payload) on the leader (None elsewhere), where every rank
        must have sent the same names."""
        layout = self.layout
        gathered: list[Any] | None = [None] * len(layout.group) if layout.is_leader else None
        gathering = time.time()
        with _peers(layout, "update_weights"):
            dist.gather_object((names, mine), gathered, dst=layout.leader, group=self._group)
        record_span("tp_gather", gathering, time.time())
        return gathered

    def _check_same(self, gathered: list[Any], names: list[str]) -> None:
        """On the leader, inside its work: every rank sent the bucket it sent."""
        for tp_rank, (theirs, _) in enumerate(gathered):
            if theirs != names:
                raise RuntimeError(
                    f"rank {self.layout.group[tp_rank]} sent a different bucket than rank "
                    f"{self.layout.leader}: {str(theirs)[:300]} != {str(names)[:300]}"
                )

    def _load_direct(self, name: str, mine: Any, keep: Any, stored: Any = None) -> None:
        """One buffer a rank (`mine`, serialized) under payload `name` into rljob's loader: the
        leader hands TP rank i rank i's, and so each rank's `stored` (a sharded bucket's own
        shards as stored, serialized) where the bucket has them (its payload name says so, and
        every rank sent that name). `keep` (what the buffers belong to) is referenced by this
        call until the leader reports the bucket loaded: an IPC handle is only good while its
        tensor lives."""
        gathered = self._gather_on_leader([name], (mine, stored))

        def load(engine: GroupEngine) -> None:
            assert gathered is not None
            self._check_same(gathered, [name])
            payloads = [payload for _, payload in gathered]
            buffers = self._handoff.local_tensor(values=[p[0] for p in payloads])
            own = None
            if stored is not None:
                own = self._handoff.local_tensor(values=[p[1] for p in payloads])
            engine.update_weights_direct(name, buffers, stored=own)

        self._on_leader("update_weights", load)

    def flush_cache(self) -> None:
        self._on_leader("flush_cache", lambda engine: engine.flush_cache())

    def shutdown(self) -> None:
        """The leader stops sglang; no collective, so it is safe after another rank failed."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def _on_leader(self, what: str, call: Callable[[GroupEngine], None]) -> None:
        """Run `call` on the leader's engine; every rank returns once it is done (and raises if
        it failed), with the engine's released tags."""

        def run(engine: GroupEngine) -> frozenset[str]:
            call(engine)
            return engine.released_tags

        self._released = frozenset(self._leader_answer(what, run))

    def _leader_answer(self, what: str, work: Callable[[GroupEngine], Any]) -> Any:
        """`work(engine)` on the leader; its result on every rank (a leader's error raised)."""

        def run() -> Any:
            assert self._engine is not None, "the engine was shut down"
            return work(self._engine)

        answer, error = _lead(self._group, self.layout, run, what)
        if error is not None:
            raise self._peer_error(what, error)
        return answer

    def _peer_error(self, what: str, error: str) -> TensorParallelPeerError:
        return TensorParallelPeerError(
            f"{what} failed on rank {self.layout.leader}, which runs the sglang engine of "
            f"tensor-parallel group {list(self.layout.group)}: {error}"
        )


@contextlib.contextmanager
def _peers(layout: TensorParallelLayout, what: str) -> Iterator[None]:
    """A collective of the group whose failure names who is gone.

    A rank killed outright (SIGKILL, its node lost) sends no error: gloo's connection to it
    closes, and the collective raises a RuntimeError at once on the ranks that wait on it. That
    error names a socket, not a rank; this one names the leader, or on the leader the group.
    """
    try:
        yield
    except RuntimeError as exc:
        first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        cause = f"{type(exc).__name__}: {first_line}"
        group = list(layout.group)
        if layout.is_leader:
            who = f"a rank of tensor-parallel group {group} (this rank, {layout.rank}, leads it)"
        else:
            who = (
                f"rank {layout.leader}, which runs the sglang engine of tensor-parallel "
                f"group {group},"
            )
        raise TensorParallelPeerError(f"{who} stopped answering during {what} ({cause})") from exc


def _lead(
    group: Any, layout: TensorParallelLayout, work: Callable[[], Any], what: str
) -> tuple[Any, str | None]:
    """Run `work` on the group's leader and give every rank of the group its outcome:
    (result, None), or (None, the leader's error). The leader raises its own error itself,
    after the others have it, so none of them waits for an answer that never comes."""
    message: list[Any] = [None, None]
    if layout.is_leader:
        try:
            message = [work(), None]
        except Exception as exc:
            message = [None, f"{type(exc).__name__}: {exc}"]
            with _peers(layout, what):
                dist.broadcast_object_list(message, src=layout.leader, group=group)
            raise
    answering = time.time()
    with _peers(layout, what):
        dist.broadcast_object_list(message, src=layout.leader, group=group)
    record_span("tp_answer", answering, time.time())
    return message[0], message[1]


def make_tensor_parallel_engine(
    *,
    tp_size: int,
    device: str,
    node: str,
    build: Callable[[int], GroupEngine],
    handoff: TensorHandoff,
) -> TensorParallelEngine:
    """Collective over the job's process group: every rank calls it, in the same order.

    `build(tp_size)` starts the group's engine on the leader (inside visible_gpus of the group,
    base GPU 0); the other ranks wait for its KV capacity, or its error.
    """
    from rljob_worker.tp_shards import OFF, STORED, agreed_mode, sharded_sync_mode

    world, rank = dist.get_world_size(), dist.get_rank()
    placed: list[Any] = [None] * world
    dist.all_gather_object(placed, (node, physical_gpu_id(device), sharded_sync_mode()))
    layout = tensor_parallel_layout(rank, [n for n, _, _ in placed], tp_size)
    # Every rank creates every group, in the same order (new_group is collective).
    groups = [dist.new_group(list(g), backend="gloo") for g in layout.groups]
    group = groups[layout.groups.index(layout.group)]
    assert isinstance(group, dist.ProcessGroup), "this rank is in its own group"
    gpu_ids = [placed[r][1] for r in layout.group]
    mode = agreed_mode([m for _, _, m in placed])
    built: list[GroupEngine] = []

    def start() -> tuple[int, frozenset[str]]:
        log.info(
            "rank %d starts the sglang engine of ranks %s on GPUs %s",
            rank,
            list(layout.group),
            gpu_ids,
        )
        with visible_gpus(gpu_ids):
            built.append(build(tp_size))
        return built[0].kv_capacity_tokens, built[0].released_tags

    started, error = _lead(group, layout, start, "engine start")
    if error is not None:
        raise TensorParallelPeerError(
            f"rank {layout.leader} could not start the sglang engine of tensor-parallel group "
            f"{list(layout.group)} on GPUs {gpu_ids}: {error}"
        )
    kv_capacity_tokens, released = started
    return TensorParallelEngine(
        layout,
        group,
        built[0] if built else None,
        handoff,
        int(kv_capacity_tokens),
        frozenset(released),
        shard_to_shard=mode != OFF,
        own_as_stored=mode == STORED,
    )
