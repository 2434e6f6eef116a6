"""ZeRO stage 1: the optimizer state partitioned across the data-parallel ranks.

Every rank keeps the whole model (as with DistributedDataParallel) but optimizer state (Adam's
two moments: twice the parameters' size) only for the parameters it *owns*. Each rank updates
its own parameters, then the owners send the updated values to everyone: one broadcast per
bucket of parameters (a flat buffer of at most ``bucket_bytes``), not one per tensor.

Ownership is balanced by bytes: parameters are taken largest first and each goes to the rank
that owns the fewest bytes so far (ties: the lower rank). Then no rank owns more than the
average plus the size of the largest parameter.

Checkpoints are sharded: :meth:`ZeroOptimizer.state_dict` returns this rank's shard (no
collective), :meth:`ZeroOptimizer.save_shard` writes it atomically, and
:func:`~onnxtrain.torch.optim.zero_checkpoint.consolidate_state_dict` merges the shards into
an ordinary optimizer state dict that loads into a ZeroOptimizer on any number of ranks or
into the plain optimizer.
"""

from __future__ import annotations

import os
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from onnxtrain.errors import CheckpointError, OnnxTrainError
from onnxtrain.torch.optim import zero_checkpoint
from onnxtrain.torch.optim._common import evaluate_closure
from onnxtrain.torch.optim.errors import OptimizerConfigError
from onnxtrain.torch.optim.fused_adam import FusedAdam

# DistributedDataParallel's default bucket_cap_mb: big enough that a step costs a handful of
# collectives, small enough that the flat staging buffers stay a fraction of the model.
DEFAULT_BUCKET_BYTES = 25 * 2**20

# group keys that list parameters (torch >= 2.6 keeps "param_names" next to "params")
_PARAM_KEYS = ("params", "param_names")


class ZeroStepError(OnnxTrainError, RuntimeError):
    """The local optimizer step raised on one or more ranks; every rank raises this (or the
    original error, on the ranks where it happened) instead of waiting in a collective."""


@dataclass(frozen=True)
class Partition:
    """Which rank owns each parameter (by its position in the parameter groups, group after
    group), and the bytes that makes per rank."""

    owners: tuple[int, ...]
    bytes_per_rank: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.bytes_per_rank)

    def owned(self, rank: int) -> list[int]:
        """Positions of the parameters ``rank`` owns, in order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]


def partition_parameters(params: Sequence[torch.Tensor], world_size: int) -> Partition:
    """Balance ``params`` over ``world_size`` ranks by bytes: largest first, each to the least
    loaded rank. Deterministic (ties go to the lower position and the lower rank), so every
    rank computes the same partition without communicating.

    Example:
        >>> partition_parameters([torch.zeros(4), torch.zeros(4), torch.zeros(2)], 2).owners
        (0, 1, 0)
    """
    if world_size < 1:
        raise OptimizerConfigError(f"ZeRO needs a world size >= 1, got {world_size}")
    sizes = [p.numel() * p.element_size() for p in params]
    loads = [0] * world_size
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return Partition(tuple(owners), tuple(loads))


@dataclass(frozen=True)
class _Bucket:
    """Parameters of one owner, one device and one dtype, exchanged as one flat buffer."""

    owner: int  # rank in the process group
    source: int  # the same rank in the default group (what broadcast/reduce take)
    params: tuple[torch.Tensor, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _buckets(params: Sequence[torch.Tensor], partition: Partition, sources: Sequence[int],
             bucket_bytes: int) -> list[_Bucket]:
    buckets = []
    for rank in range(partition.world_size):
        by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for i in partition.owned(rank):
            by_kind[(params[i].device, params[i].dtype)].append(params[i])
        for group in by_kind.values():
            current, size = [], 0
            for p in group:
                nbytes = p.numel() * p.element_size()
                if current and size + nbytes > bucket_bytes:
                    buckets.append(_Bucket(rank, sources[rank], tuple(current)))
                    current, size = [], 0
                current.append(p)
                size += nbytes
            if current:
                buckets.append(_Bucket(rank, sources[rank], tuple(current)))
    return buckets


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _PARAM_KEYS}


def _copy_hyperparameters(sources: Sequence[dict], targets: Sequence[dict]) -> None:
    for source, target in zip(sources, targets):
        target.update(_hyperparameters(source))


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: wrap an optimizer so that each data-parallel rank keeps state only for
    the parameters it owns (like ``torch.distributed.optim.ZeroRedundancyOptimizer``).

    Args:
        params: parameters or parameter groups (dicts), as for any ``torch.optim`` optimizer;
            the same on every rank and in the same order.
        optimizer_class: the optimizer each rank runs on its own parameters
            (default :class:`FusedAdam`).
        process_group: the data-parallel group (default: the whole world). Without an
            initialized ``torch.distributed`` the optimizer runs as one rank.
        bucket_bytes: the most bytes exchanged in one collective after the step.
        reduce_gradients: ``False`` (default): gradients must already be averaged over the
            ranks (``DistributedDataParallel`` does it in ``backward()``). ``True``: each
            rank's raw local gradients are averaged onto the owner of each parameter before
            the step (one reduce per bucket, i.e. a reduce-scatter), so it replaces DDP's
            all-reduce; other ranks' ``.grad`` keep their local values, and every rank must
            produce gradients for the same parameters. A loss scaler's inf check is combined
            over the ranks (:meth:`agree_on_found_inf`), but gradient clipping before the step
            sees each rank's own gradients, not their average (clip with DDP's averaged ones).
        **defaults: the arguments of ``optimizer_class`` (``lr``, ``weight_decay``, ...).

    ``param_groups`` lists every parameter (learning-rate schedulers work as usual);
    ``optim`` is this rank's local optimizer and ``state`` its state. Each ``step()`` runs
    the local optimizer, then every owner broadcasts its updated parameters. If the local
    step raises on any rank, every rank raises (:class:`ZeroStepError` where it did not
    happen) and nothing is exchanged: parameters of ranks that failed are untouched, those
    the other ranks own are updated, so reload a checkpoint.

    ``state_dict()`` is this rank's shard; consolidate the shards of all ranks with
    :func:`consolidate_state_dict` to get a full state dict for any world size.

    Example:
        >>> model = DistributedDataParallel(ORTModule(net))
        >>> optimizer = ZeroOptimizer(model.parameters(), FusedAdam, lr=1e-3)
        >>> model(x).sum().backward(); optimizer.step()
        >>> optimizer.save_shard("ckpt")  # on every rank
        >>> full = consolidate_state_dict("ckpt")  # anywhere, later
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer] = FusedAdam, process_group=None,
                 *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_gradients: bool = False, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise OptimizerConfigError(
                f"ZeroOptimizer optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
            raise OptimizerConfigError(f"ZeroOptimizer bucket_bytes must be an int > 0, got {bucket_bytes!r}")
        super().__init__(params, defaults)
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
            if self.rank < 0:
                raise OptimizerConfigError("ZeroOptimizer: this process is not a member of process_group")
            group = process_group if process_group is not None else dist.group.WORLD
            sources = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        else:
            self.world_size, self.rank, sources = 1, 0, [0]
        self.reduce_gradients = reduce_gradients
        self._optimizer_class, self._defaults, self._sources, self._bucket_bytes = (
            optimizer_class, defaults, sources, bucket_bytes)
        self._partition_and_build()

    def _partition_and_build(self) -> None:
        """Partition the parameters of ``param_groups`` and build this rank's optimizer over its own."""
        self._params = [p for group in self.param_groups for p in group["params"]]
        if self.world_size > 1:
            self._check_same_parameters_everywhere()
        self.partition = partition_parameters(self._params, self.world_size)
        owned = set(self.partition.owned(self.rank))
        self._local_positions = sorted(owned)  # the local optimizer's parameter order
        self.optim = self._optimizer_class(self._local_groups(self.param_groups, owned), **self._defaults)
        self.state = self.optim.state
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)  # its filled-in defaults
        # and its defaults, which schedulers read (OneCycleLR and CyclicLR look for "betas" there)
        self.defaults = {**self.optim.defaults, **self._defaults}
        self._buckets = _buckets(self._params, self.partition, self._sources, self._bucket_bytes)

    def parameters_replaced(self) -> None:
        """Rebuild over the tensors ``param_groups`` now lists, after a wrapper put others in their
        places before the first step (``FP16_Optimizer``'s fp32 masters): the local optimizer and
        the exchange held the old ones, so the masters were never updated."""
        if any(self.optim.state.values()):
            raise OptimizerConfigError("ZeroOptimizer: parameters can be replaced before the first step only")
        self._partition_and_build()

    def _check_same_parameters_everywhere(self) -> None:
        """Every rank must partition the same list, or the exchange would mix tensors up."""
        shapes = ";".join(f"{tuple(p.shape)}{p.dtype}" for p in self._params)
        mine = torch.tensor([len(self._params), sum(p.numel() for p in self._params),
                             zlib.crc32(shapes.encode())], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.process_group)
        if any(not torch.equal(other, mine) for other in everyone):
            rows = ", ".join(f"rank {r}: {t[0].item()} parameters, {t[1].item()} elements"
                             for r, t in enumerate(everyone))
            raise OptimizerConfigError("ZeroOptimizer needs the same parameters (count, shapes, dtypes, order) on "
                                       f"every rank; got {rows}")

    def _local_groups(self, groups: Sequence[dict], owned: set[int]) -> list[dict]:
        """``groups`` (exposed or from a state dict) cut down to this rank's parameters."""
        local, position = [], 0
        for group in groups:
            keep = [k for k in range(len(group["params"])) if position + k in owned]
            entry = {**_hyperparameters(group), "params": [self._params[position + k] for k in keep]}
            if "param_names" in group:
                entry["param_names"] = [group["param_names"][k] for k in keep]
            local.append(entry)
            position += len(group["params"])
        return local

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "optim"):
            raise OptimizerConfigError("ZeroOptimizer partitions its parameters once: pass every parameter "
                                       "group to the constructor instead of add_param_group()")
        super().add_param_group(param_group)

    # -- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's parameters, then exchange them; returns ``closure()``'s loss."""
        loss = evaluate_closure(closure)
        if self.reduce_gradients and self.world_size > 1:
            self._reduce_gradients()
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)  # lr schedules, ...
        error = None
        try:
            self.optim.step()
        except Exception as exc:  # noqa: BLE001 -- every rank must learn of it before any collective
            error = exc
        failed = self._failed_ranks(error is not None)
        if failed:
            if error is not None:
                raise error
            raise ZeroStepError(f"the optimizer step raised on rank(s) {failed} of {self.world_size}; this rank "
                                "updated its own parameters, no parameters were exchanged")
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)  # e.g. FusedAdam's "step"
        if self.world_size > 1:
            self._broadcast_parameters()
        return loss

    def agree_on_found_inf(self, found: dict[torch.device, torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """For :class:`~onnxtrain.torch.amp.GradScaler` (and ``FP16_Optimizer``): with
        ``reduce_gradients`` each rank checks its own gradients before they are averaged, so a
        rank that found an inf would skip a step the others take (and the ranks' collectives
        would pair up across steps: a hang). The flags are combined over the ranks, as the
        check of averaged gradients would find them (an inf or NaN stays one in a sum)."""
        if not (self.reduce_gradients and self.world_size > 1) or not found:
            return found
        device, first = next(iter(found.items()))
        combined = sum(flag.to(device) for flag in found.values())
        dist.all_reduce(combined, group=self.process_group)
        return {device: (combined > 0).to(first.dtype)}

    def _failed_ranks(self, failed_here: bool) -> list[int]:
        if self.world_size == 1:
            return [0] if failed_here else []
        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[self.rank] = int(failed_here)
        dist.all_reduce(flags, group=self.process_group)
        return [r for r in range(self.world_size) if flags[r]]

    def _broadcast_parameters(self) -> None:
        pending = []
        for bucket in self._buckets:
            first = bucket.params[0]
            if bucket.owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])
            else:
                flat = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
            work = dist.broadcast(flat, src=bucket.source, group=self.process_group, async_op=True)
            pending.append((bucket, flat, work))
        for bucket, flat, work in pending:
            work.wait()
            if bucket.owner != self.rank:
                _unflatten_into([p.detach() for p in bucket.params], flat)

    def _reduce_gradients(self) -> None:
        # every rank must reduce the same buckets: a gradient some ranks lack would make them
        # reduce different sizes, or leave a rank waiting in a reduce the others never start
        present = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32)
        everywhere = present.clone()
        dist.all_reduce(everywhere, group=self.process_group)
        uneven = [i for i, count in enumerate(everywhere.tolist()) if count not in (0, self.world_size)]
        if uneven:
            here = [i for i in uneven if present[i]]
            raise ZeroStepError(f"ZeroOptimizer(reduce_gradients=True): parameters at positions {uneven[:8]} have a "
                                f"gradient on some ranks only (on this rank: {here[:8]}); every rank must produce "
                                "gradients for the same parameters. Nothing was reduced or updated")
        pending = []
        for bucket in self._buckets:
            grads = [p.grad for p in bucket.params if p.grad is not None]
            if not grads:
                continue
            if any(g.is_sparse for g in grads):
                raise OptimizerConfigError("ZeroOptimizer(reduce_gradients=True) cannot reduce sparse gradients")
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.reduce(flat, dst=bucket.source, group=self.process_group, async_op=True)
            pending.append((bucket, grads, flat, work))
        for bucket, grads, flat, work in pending:
            work.wait()
            if bucket.owner == self.rank:
                _unflatten_into(grads, flat.div_(self.world_size))

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: the state of its parameters, every group's hyperparameters
        (parameters as positions), and ``"zero"`` metadata (rank, world size, owned positions,
        every parameter's shape). No collective: call it on every rank and save each shard,
        or use :meth:`save_shard`."""
        local = self.optim.state_dict()  # ids 0, 1, ... in the local order, i.e. _local_positions
        state = {self._local_positions[i]: value for i, value in local["state"].items()}
        groups, position = [], 0
        for group in self.param_groups:
            count = len(group["params"])
            entry = {**zero_checkpoint.plain_values(_hyperparameters(group)),
                     "params": list(range(position, position + count))}
            if "param_names" in group:
                entry["param_names"] = list(group["param_names"])
            groups.append(entry)
            position += count
        meta = {"format": zero_checkpoint.FORMAT_VERSION, "rank": self.rank, "world_size": self.world_size,
                "owned": list(self._local_positions), "shapes": [list(p.shape) for p in self._params]}
        return {"state": dict(sorted(state.items())), "param_groups": groups, zero_checkpoint.META_KEY: meta}

    def save_shard(self, folder: str | os.PathLike) -> Path:
        """Write :meth:`state_dict` to ``folder/optimizer_shard_<rank>_of_<world size>.pt``
        (temporary file, then rename); returns the path. Call it on every rank."""
        path = zero_checkpoint.shard_path(folder, self.rank, self.world_size)
        zero_checkpoint.save_shard(self.state_dict(), path)
        return path

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full optimizer state dict (from :func:`consolidate_state_dict`, or from the
        plain optimizer's ``state_dict()``): each rank keeps the state of its own parameters.
        This rank's own shard (same rank, world size and partition) loads as well."""
        meta = state_dict.get(zero_checkpoint.META_KEY)
        if meta is not None and (meta["world_size"], meta["rank"], list(meta["owned"])) != \
                (self.world_size, self.rank, self._local_positions):
            raise CheckpointError(
                f"this is rank {meta['rank']}'s shard of a {meta['world_size']}-rank save; this optimizer is rank "
                f"{self.rank} of {self.world_size}: merge every rank's shard with consolidate_state_dict() first")
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        expected = [len(g["params"]) for g in self.param_groups]
        if sizes != expected:
            raise CheckpointError(f"optimizer state dict has parameter groups of sizes {sizes}; "
                                  f"this optimizer's groups have sizes {expected}")
        if meta is not None:
            zero_checkpoint.check_shapes(meta["shapes"], [list(p.shape) for p in self._params], "optimizer shard")
        ids = [i for g in groups for i in g["params"]]  # ids by position, group after group
        local_groups, local_id = self._local_groups(groups, set(self._local_positions)), 0
        for group in local_groups:  # the local optimizer numbers its parameters in this order
            count = len(group["params"])
            group["params"] = list(range(local_id, local_id + count))
            local_id += count
        state = {k: state_dict["state"][ids[position]] for k, position in enumerate(self._local_positions)
                 if ids[position] in state_dict["state"]}
        self.optim.load_state_dict({"state": state, "param_groups": local_groups})
        self.state = self.optim.state  # load_state_dict replaced the local optimizer's dict
        _copy_hyperparameters(groups, self.param_groups)
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)


def _unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    chunks = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(list(tensors), [c.view(t.shape) for c, t in zip(chunks, tensors)])
