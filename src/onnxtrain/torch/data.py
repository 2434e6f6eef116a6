"""Load-balancing samplers for distributed training (upstream's ``onnxruntime.training.utils.data``).

In data-parallel training every rank waits for the slowest at each step. With samples of very
different cost (sequence lengths in speech and NLP) a plain ``DistributedSampler`` hands one
rank a long sample and another a short one at the same step. These samplers sort the samples
by a cost the caller defines (``complexity_fn``, e.g. the sequence length) and deal samples of
similar cost to the ranks at the same step, then shuffle the order of the steps.

:class:`LoadBalancingDistributedSampler` yields this rank's sample indices;
:class:`LoadBalancingDistributedBatchSampler` groups them into batches with a ``batch_fn`` (a
token budget, say) and gives every rank the same number of batches, as DDP needs.

Example:
    >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len, world_size=2, rank=0)
    >>> loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=8)
    >>> for epoch in range(3):
    ...     sampler.set_epoch(epoch)      # a new order every epoch, the same on every rank
    ...     for batch in loader: ...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler


class LoadBalancingDistributedSampler(Sampler[int]):
    """Deal samples of similar cost to the ranks at each step (``DistributedSampler``'s role).

    Args:
        dataset: a map-style dataset (``len`` and indexing).
        complexity_fn: a sample's cost as an integer (e.g. its length); called once per sample,
            on the first iteration.
        world_size, rank: default: the initialized ``torch.distributed`` group's.
        shuffle: shuffle the order of the steps each epoch (seeded by ``seed + epoch``, the same
            on every rank); without ``group_size`` the steps run from cheapest to costliest
            when ``False``.
        group_size: sort within consecutive groups of this many samples only (the dataset's
            own order between groups, e.g. to keep some locality), and shuffle the groups'
            order when ``shuffle``.
        seed: the shuffling seed; identical on every rank.
        drop_last: leave out ``len(dataset) % world_size`` samples (chosen at random each epoch
            when ``shuffle``, else the costliest) so that the ranks split the rest evenly;
            ``False`` repeats the cheapest samples to fill the last step instead.
        random_level: 0 (best balance) to 1: random noise of up to that fraction of the cost
            range is added to the costs before sorting, trading balance for variety in which
            samples share a step.
    """

    def __init__(self, dataset, complexity_fn: Callable[..., int], world_size: int | None = None,
                 rank: int | None = None, shuffle: bool = True, group_size: int | None = None, seed: int = 0,
                 drop_last: bool = False, random_level: float = 0.0) -> None:
        world_size, rank = _world(world_size, rank)
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size must be a positive integer or None, got {group_size!r}")
        if not 0.0 <= float(random_level) <= 1.0:
            raise ValueError(f"random_level must be between 0 and 1, got {random_level!r}")
        self.dataset = dataset
        self.complexity_fn = complexity_fn
        self.world_size, self.rank = world_size, rank
        self.shuffle, self.group_size, self.seed = shuffle, group_size, seed
        self.drop_last, self.random_level = drop_last, float(random_level)
        self.epoch = 0
        size = len(dataset)
        self.num_samples = size // world_size if drop_last else math.ceil(size / world_size)
        self.total_size = self.num_samples * world_size
        self._complexities: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (call it on every rank)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_indices()[self.rank])

    def rank_indices(self) -> list[list[int]]:
        """Every rank's sample indices for the current epoch, step by step (the same lists on
        every rank: what :class:`LoadBalancingDistributedBatchSampler` balances)."""
        steps = self._steps()
        return [[int(step[r]) for step in steps] for r in range(self.world_size)]

    def complexities(self) -> np.ndarray:
        """Each sample's cost (computed once)."""
        if self._complexities is None:
            values = []
            for index in range(len(self.dataset)):
                value = self.complexity_fn(self.dataset[index])
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise TypeError(f"complexity_fn must return an integer, got {type(value).__name__} "
                                    f"for sample {index}")
                values.append(int(value))
            self._complexities = np.asarray(values, dtype=np.int64)
        return self._complexities

    def _steps(self) -> np.ndarray:
        """``[num_samples, world_size]`` sample indices: one row per step, samples of similar cost."""
        costs = self.complexities()
        size = len(costs)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.random_level > 0 and size:
            spread = int((int(costs.max()) - int(costs.min())) * self.random_level) + 1
            costs = costs + torch.randint(spread, (size,), generator=generator).numpy()
        group = self.group_size or max(size, 1)
        groups = [np.arange(start, min(start + group, size)) for start in range(0, size, group)]
        groups = [members[np.argsort(costs[members], kind="stable")] for members in groups]
        if self.shuffle and self.group_size is not None:
            groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
        order = np.concatenate(groups) if groups else np.zeros(0, np.int64)
        if self.drop_last:
            extra = size - self.total_size
            if extra:
                dropped = torch.randperm(size, generator=generator)[:extra].numpy() if self.shuffle else \
                    np.arange(size - extra, size)
                order = np.delete(order, dropped)
        elif size:
            order = np.resize(order, self.total_size)  # wraps around: the cheapest samples fill the last step
        steps = order.reshape(self.num_samples, self.world_size)
        if self.shuffle and self.group_size is None:
            steps = steps[torch.randperm(len(steps), generator=generator).numpy()]
        return steps


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Batches of a :class:`LoadBalancingDistributedSampler`'s indices, as many on every rank.

    Args:
        sampler: the load-balancing sampler (its ``rank`` is this process's).
        batch_fn: this rank's indices for the epoch (cost-balanced step by step) -> its
            batches (lists of indices), e.g. consecutive indices up to a token budget.
        drop_last: every rank stops at the fewest batches any rank has (``False``: ranks with
            fewer repeat their first batches up to the most any rank has).

    Example:
        >>> batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn=lambda idx: [idx[i:i + 8]
        ...                                                for i in range(0, len(idx), 8)])
        >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches)
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler,
                 batch_fn: Callable[[list[int]], Sequence[Sequence[int]]], drop_last: bool = False) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(f"sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}")
        self.sampler, self.batch_fn, self.drop_last = sampler, batch_fn, drop_last
        self._cache: tuple[int, list[list[int]]] | None = None

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    @property
    def rank(self) -> int:
        return self.sampler.rank

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (call it on every rank)."""
        self.sampler.set_epoch(epoch)

    def _batches(self) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == self.sampler.epoch:
            return self._cache[1]
        per_rank = []
        for rank, indices in enumerate(self.sampler.rank_indices()):
            batches = [list(map(int, batch)) for batch in self.batch_fn(indices)]
            if not batches and indices:
                raise ValueError(f"batch_fn returned no batches for rank {rank}'s {len(indices)} samples")
            per_rank.append(batches)
        counts = [len(b) for b in per_rank]
        total = min(counts) if self.drop_last else max(counts)
        mine = per_rank[self.rank]
        batches = mine[:total] if len(mine) >= total else (mine * math.ceil(total / len(mine)))[:total]
        self._cache = (self.sampler.epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def _world(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("world_size and rank are needed when torch.distributed is not initialized")
        world_size = dist.get_world_size() if world_size is None else world_size
        rank = dist.get_rank() if rank is None else rank
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}], got {rank!r}")
    return world_size, rank
