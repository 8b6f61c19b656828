"""FSDP2 training of the policy: sharding, AdamW, offload and the weight sync's buckets.

The Trainer owns the sharded policy (and frozen reference), runs the policy update of each train
stage (policy_update.py; its math in rl_math.py), moves optimizer state and params between device
and CPU on the stage machine's request (host_copies.py), and hands the engine full tensors bucket
by bucket (sync_send.py gathers each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import AdamW

from rljob.api import AlgorithmSpec, RLJobSpec

# The weight sync's buckets are planned where the memory plan sizes them (one function).
from rljob.plan import plan_buckets as plan_buckets
from rljob_worker import tp_shards
from rljob_worker.engines.sglang_weights import DenseLayout
from rljob_worker.host_copies import _HostCopies
from rljob_worker.model import torch_dtype

# The rollout's record and the update's sums, used by the stage machine through this module.
from rljob_worker.policy_update import Experience as Experience
from rljob_worker.policy_update import PolicyUpdate
from rljob_worker.policy_update import TrainStats as TrainStats
from rljob_worker.sharded_load import load_sharded
from rljob_worker.staging import (
    OPTIMIZER_TO_DEVICE,
    OPTIMIZER_TO_HOST,
    PARAMS_TO_DEVICE,
    PARAMS_TO_HOST,
    Staging,
)
from rljob_worker.sync_send import (
    Bucket,
    SendPlan,
    flat_shards_enabled,
    gather_full,
    gather_planned,
    shard_bucket,
)
from rljob_worker.weight_sync import overlap_enabled, prefetched

NamedTensors = list[tuple[str, torch.Tensor]]
T = TypeVar("T")


def _shard(model: torch.nn.Module, mesh: DeviceMesh, dtype: torch.dtype) -> None:
    # One FSDP unit per decoder layer (transformers names them in _no_split_modules), then the
    # root for embeddings, final norm and head: the layer-by-layer all-gather FSDP is built for.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _enable_checkpointing(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable()  # type: ignore[operator]


def _reshard(module: torch.nn.Module) -> None:
    """Free FSDP2's unsharded params and register the shards again, in every FSDP unit.

    FSDP2 keeps a root's params unsharded after a forward that no backward follows (the
    reference model's): until resharded, parameters() are the full compute-dtype copies.
    """
    for child in module.modules():
        if isinstance(child, FSDPModule):
            child.reshard()


def _storages(tensors: Sequence[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storage behind each tensor (a DTensor's local shard), each once, in order."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.data
        storages.setdefault(local.untyped_storage().data_ptr(), local.untyped_storage())
    return list(storages.values())


class ParamPaths:
    """A module's named parameters as named_parameters() gives them now, read through each
    one's owning module and attribute, found by one named_parameters() walk and kept: a dict
    lookup a parameter instead of the walk over every module (0.83-0.97 ms at 3B on an H200's
    host, most of the one-card sync's host time before its bucket: docs/weight-sync-figures.md).
    What is read is the object registered now (FSDP2 swaps a module's parameter between its
    sharded and unsharded forms, and a parameter may be replaced); an attribute that no longer
    holds a parameter makes a new walk. Tied parameters appear once, under the walk's name."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._paths: list[tuple[str, dict[str, Any], str]] | None = None

    def read(self) -> dict[str, torch.Tensor]:
        if self._paths is not None:
            found = {name: owner.get(attr) for name, owner, attr in self._paths}
            if all(p is not None for p in found.values()):
                return found  # type: ignore[return-value]
        return self._walk()

    def _walk(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        modules = dict(self.module.named_modules())
        paths = []
        for name in named:
            prefix, _, attr = name.rpartition(".")
            paths.append((name, modules[prefix]._parameters, attr))
        self._paths = paths
        return named


def make_optimizer(parameters: Iterable[torch.nn.Parameter], algorithm: AlgorithmSpec) -> AdamW:
    """AdamW at the schedule's peak rate with the spec's decoupled weight decay."""
    return AdamW(parameters, lr=algorithm.learning_rate, weight_decay=algorithm.weight_decay)


def set_learning_rate(optimizer: torch.optim.Optimizer, rate: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = rate


class Trainer:
    """The sharded policy of one rank; every method is collective (all ranks call it together)."""

    def __init__(
        self,
        spec: RLJobSpec,
        model_path: Path | str,
        device: torch.device,
        pad_id: int,
        staging: Staging | None = None,
    ):
        self.spec = spec
        self.device = device
        self.pad_id = pad_id
        self.compute_dtype = torch_dtype(spec.model.dtype)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.mesh = init_device_mesh(device.type, (world,))
        # Built on the meta device, sharded, then each rank reads only its rows from the
        # files (sharded_load.py): no rank holds a whole model. Master weights in float32;
        # FSDP casts to the spec's dtype for compute.
        shard = lambda model: _shard(model, self.mesh, self.compute_dtype)  # noqa: E731
        prepare = _enable_checkpointing if spec.training.gradient_checkpointing else None
        # The policy's shards in one buffer (sharded_load.to_empty_flat): the weight sync casts a
        # bucket in one copy, and on one rank hands the buffer itself to an engine that casts.
        self.model, slice_bytes = load_sharded(
            model_path, torch.float32, device, shard, prepare, flat=flat_shards_enabled()
        )
        self.reference: torch.nn.Module | None = None
        if spec.algorithm.kl_coef > 0:
            # Frozen, so in the engine's dtype: what its forward computed in anyway (the
            # MixedPrecisionPolicy casts to it), at half an fp32 copy's bytes.
            self.reference, ref_slice_bytes = load_sharded(
                model_path, self.compute_dtype, device, shard
            )
            self.reference.requires_grad_(False).eval()
            slice_bytes = max(slice_bytes, ref_slice_bytes)
        # The largest tensor slice one read held (host, then device): the loading's transient.
        self.load_slice_bytes = slice_bytes
        self.optimizer = make_optimizer(self.model.parameters(), spec.algorithm)
        # The copies of the training state, and (overlapStaging) their side stream.
        self.staging = staging if staging is not None else Staging(device, overlap=False)
        self._optimizer_copies = _HostCopies(
            device, self.staging, OPTIMIZER_TO_HOST, OPTIMIZER_TO_DEVICE
        )
        self._param_copies = _HostCopies(device, self.staging, PARAMS_TO_HOST, PARAMS_TO_DEVICE)
        # Moments whose load was started arrive behind forward/backward: the step reads them.
        self.optimizer.register_step_pre_hook(
            lambda *_: self.staging.wait(OPTIMIZER_TO_DEVICE, before="optimizer.step()")
        )
        # Micro-batches packed by length (PolicyUpdate.micro_batches); False only for a bench's
        # before/after (bench/train_alone.py).
        self.pack_micro_batches = True
        self.optimizer_on_device = True
        self.params_on_device = True
        self._optimizer_leaving = False  # start_offload_optimizer's copies, not yet freed
        # Each weight-sync bucket's gather, worked out on the first sync (gather_full), and its
        # shard-to-shard send (shard_bucket).
        self._send_plans: dict[tuple[str, ...], SendPlan] = {}
        self._shard_plans: dict[tuple[tuple[str, ...], bool], tp_shards.ShardPlan] = {}
        self._param_paths = ParamPaths(self.model)

    # -- training ----------------------------------------------------------------------------

    def train_step(self, experience: Experience, iteration: int | None = None) -> TrainStats:
        """PPO epochs over mini-batches of the rank's experience (policy_update.PolicyUpdate),
        at the rate spec.algorithm's schedule gives `iteration` (None: as the optimizer has it,
        for benches that train alone)."""
        if iteration is not None:
            set_learning_rate(self.optimizer, self.spec.algorithm.learning_rate_at(iteration))
        update = PolicyUpdate(
            self.spec,
            self.model,
            self.reference,
            self.optimizer,
            self.pad_id,
            self.device,
            pack=self.pack_micro_batches,
        )
        stats = update.run(experience)
        # Without an optimizer step (no tokens), the moments' later users still come after.
        self.staging.wait(OPTIMIZER_TO_DEVICE)
        if self.reference is not None:
            _reshard(self.reference)  # forward only: its root would stay unsharded (see _reshard)
        return stats

    # -- offload -----------------------------------------------------------------------------

    def _optimizer_storages(self) -> list[torch.UntypedStorage]:
        tensors = [
            value
            for group in self.optimizer.param_groups
            for param in group["params"]
            for key, value in self.optimizer.state.get(param, {}).items()
            if isinstance(value, torch.Tensor) and key != "step"  # AdamW keeps `step` on CPU
        ]
        return _storages(tensors)

    def _param_storages(self) -> list[torch.UntypedStorage]:
        for module in self._modules():
            _reshard(module)
        return _storages([p for module in self._modules() for p in module.parameters()])

    def copy_to_host(self) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """Copy the policy's params (and the reference's) and the AdamW moments into the host
        buffers the offloads use, freeing nothing; the offloads after it then only free the
        device memory, so the copy is made once per iteration either way. Returns the lookup
        from a local tensor (a shard) to a view of its host copy (None: not copied). Valid until
        the next train step: the stage machine's checkpoint stage, right after train."""
        if not (self.optimizer_on_device and self.params_on_device):
            raise RuntimeError("copy_to_host needs the training state on the device")
        self._optimizer_copies.copy_out(self._optimizer_storages())
        self._param_copies.copy_out(self._param_storages())

        def lookup(tensor: torch.Tensor) -> torch.Tensor | None:
            found = self._optimizer_copies.host_copy(tensor)
            return found if found is not None else self._param_copies.host_copy(tensor)

        return lookup

    def hold_host_copies(self, wait: Callable[[], None]) -> None:
        """A reader of copy_to_host's copies (the checkpoint writer) is done once `wait()`
        returns: the next write into those buffers calls it first."""
        self._optimizer_copies.hold(wait)
        self._param_copies.hold(wait)

    def offload_optimizer(self) -> None:
        """AdamW moments to (pinned) CPU memory; their device memory is freed."""
        self._optimizer_copies.offload(self._optimizer_storages())
        self.optimizer_on_device, self._optimizer_leaving = False, False

    def start_offload_optimizer(self) -> None:
        """The moments' copies to the host start (behind what follows, where the staging
        overlaps); finish_offloads frees them."""
        self._optimizer_copies.start_offload(self._optimizer_storages())
        self._optimizer_leaving = True

    def finish_offloads(self) -> None:
        """Free what start_offload_optimizer began to copy, once copied (else nothing)."""
        if self._optimizer_leaving:
            self.offload_optimizer()

    def load_optimizer(self) -> None:
        """The moments back. Where the staging overlaps, their copies run behind what follows
        and the next optimizer step (or the train step's end) waits for them."""
        self._optimizer_copies.load(wait=not self.staging.overlap)
        self.optimizer_on_device = True

    def _modules(self) -> list[torch.nn.Module]:
        return [self.model] + ([self.reference] if self.reference is not None else [])

    def offload_params(self) -> None:
        """Sharded params (policy and reference) to (pinned) CPU memory; device memory freed."""
        self._param_copies.offload(self._param_storages())
        self.params_on_device = False

    def load_params(self) -> None:
        """The params back: where the staging overlaps, the host goes on at once (the
        device's later work waits for the copies)."""
        self._param_copies.load()
        self.params_on_device = True

    # -- weight sync -------------------------------------------------------------------------

    def _shard_layout(self, shard_world: int | None) -> DenseLayout | None:
        """The engine's TP layout where buckets may go shard to shard (tp_shards): an engine
        over every rank of this trainer's mesh, a dense decoder's config; else None."""
        world = self.mesh.size()
        if shard_world is None or shard_world < 2 or shard_world != world:
            return None
        try:
            return DenseLayout.from_config(getattr(self.model, "config", None) or {}, world)
        except (KeyError, TypeError, ValueError):
            return None

    def weight_buckets(
        self, bucket_bytes: int, dtype: torch.dtype, *, engine_casts: bool = False
    ) -> Iterator[Bucket]:
        """Full (unsharded) tensors in the engine's dtype (or, `engine_casts`, the master
        dtype where that needs no copy), one bucket at a time.

        `engine_casts`: the engine casts what it loads into its own dtype (casts_weights). On one
        rank with the shards in one buffer (sharded_load.to_empty_flat) the whole model is then
        one bucket of that buffer as it is, in the master dtype: no cast here, no send buffer,
        the engine's load the one copy (docs/weight-sync.md). Otherwise, as below.

        Bucket N+1's gather is issued before bucket N is yielded (weight_sync.prefetched), so
        its kernels run while the caller hands bucket N to the engine. At most two buckets of
        full tensors exist at once, the one yielded and the one being gathered (on more than one
        rank the latter also has its send buffer and the received [world, chunk] buffer): that
        bound is what the bucket size buys, and what the memory plan's gather term counts. The
        caller drops each bucket before asking for the next. Collective: every rank gathers the
        same bucket in the same order.
        """
        params = self._param_paths.read()
        plans = self._send_plans
        if engine_casts and self.mesh.size() == 1:
            with torch.no_grad():
                whole = gather_planned(list(params.items()), dtype, plans, as_stored=True)
            if whole is not None:
                yield from prefetched([lambda: whole], overlap_enabled())
                return
        # No detach: gather_full runs without autograd (a DTensor's detach is ~30 us each).
        yield from self._in_buckets(
            params, bucket_bytes, dtype, lambda bucket: gather_full(bucket, dtype, plans)
        )

    def shard_buckets(
        self,
        bucket_bytes: int,
        dtype: torch.dtype,
        shard_world: int,
        *,
        own_as_stored: bool = True,
    ) -> Iterator[Bucket | tp_shards.ShardedBucket]:
        """weight_buckets for one tensor-parallel engine over all of this trainer's ranks,
        `shard_world` of them (TensorParallelEngine.shard_world): each bucket that can goes
        shard to shard (shard_bucket: a tp_shards.ShardedBucket, only what TP cuts across
        FSDP's rows crossing between ranks; `own_as_stored`, the engine's
        shard_own_as_stored, the own blocks read where the shards lie), the others by the
        full gather; all of them full where the engine or the model does not allow it
        (_shard_layout). Collective, as weight_buckets."""
        layout = self._shard_layout(shard_world)
        if layout is None:
            yield from self.weight_buckets(bucket_bytes, dtype)
            return
        plans, full_plans = self._shard_plans, self._send_plans

        def send(bucket: list[tuple[str, torch.Tensor]]) -> Bucket | tp_shards.ShardedBucket:
            sent = shard_bucket(bucket, dtype, plans, layout, own_as_stored)
            return sent if sent is not None else gather_full(bucket, dtype, full_plans)

        params = self._param_paths.read()
        yield from self._in_buckets(params, bucket_bytes, dtype, send)

    def _in_buckets(
        self,
        params: Mapping[str, torch.Tensor],
        bucket_bytes: int,
        dtype: torch.dtype,
        send: Callable[[list[tuple[str, torch.Tensor]]], T],
    ) -> Iterator[T]:
        """`send` of each bucket of `params` (plan_buckets in the engine's dtype), the next
        one's issued before the last is yielded (weight_sync.prefetched)."""
        sizes = [(name, p.numel() * dtype.itemsize) for name, p in params.items()]

        def gather(names: list[str]) -> Callable[[], T]:
            return lambda: send([(name, params[name]) for name in names])

        yield from prefetched(
            (gather(names) for names in plan_buckets(sizes, bucket_bytes)), overlap_enabled()
        )
