"""Load-balancing distributed samplers (upstream's onnxruntime.training.utils.data)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.torch_models import torch

from onnxtrain.torch.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


class _Sequences(torch.utils.data.Dataset):
    """Variable-length token sequences, as in speech and NLP: a sample's cost is its length."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(1, 200, n)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, index):
        return torch.zeros(int(self.lengths[index]), dtype=torch.long)


def _samplers(dataset, world_size, **options):
    return [LoadBalancingDistributedSampler(dataset, len, world_size=world_size, rank=r, **options)
            for r in range(world_size)]


@pytest.mark.parametrize("size,world_size", [(103, 4), (100, 4), (5, 8), (1, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_split_the_dataset_evenly(size, world_size, drop_last):
    samplers = _samplers(_Sequences(size), world_size, drop_last=drop_last)
    per_rank = [list(s) for s in samplers]
    expected = size // world_size if drop_last else -(-size // world_size)
    assert all(len(indices) == expected == len(s) for indices, s in zip(per_rank, samplers))
    seen = [i for indices in per_rank for i in indices]
    if drop_last:
        assert len(set(seen)) == len(seen) == size - size % world_size  # no sample twice
    else:
        assert set(seen) == set(range(size))  # every sample, the cheapest repeated to fill the last step


def test_each_step_deals_samples_of_similar_cost():
    """The point of the sampler: at each step the ranks' samples cost about the same, where a
    DistributedSampler pairs long and short ones."""
    dataset = _Sequences(400)
    per_rank = [list(s) for s in _samplers(dataset, 4, seed=3)]
    spread = [np.ptp([dataset.lengths[indices[step]] for indices in per_rank]) for step in range(100)]
    plain = [list(torch.utils.data.DistributedSampler(dataset, num_replicas=4, rank=r, seed=3)) for r in range(4)]
    plain_spread = [np.ptp([dataset.lengths[indices[step]] for indices in plain]) for step in range(100)]
    assert np.mean(spread) < 2 and max(spread) <= 10 and np.mean(plain_spread) > 50


def test_the_order_is_shared_by_the_ranks_and_changes_with_the_epoch():
    dataset = _Sequences(64)
    first = [list(s) for s in _samplers(dataset, 2, seed=7)]
    again = [list(s) for s in _samplers(dataset, 2, seed=7)]
    assert first == again  # every rank computes the same deal
    sampler = LoadBalancingDistributedSampler(dataset, len, world_size=2, rank=0, seed=7)
    assert list(sampler) == list(sampler) == first[0]  # iterating again in the same epoch
    sampler.set_epoch(1)
    assert list(sampler) != first[0] and sorted(sampler) == sorted(first[0])  # the same samples, a new order
    unshuffled = LoadBalancingDistributedSampler(dataset, len, world_size=2, rank=0, shuffle=False)
    costs = [dataset.lengths[i] for i in unshuffled]
    assert costs == sorted(costs)  # cheapest first


def test_groups_sort_within_and_shuffle_between():
    dataset = _Sequences(60)
    sampler = LoadBalancingDistributedSampler(dataset, len, world_size=1, rank=0, group_size=20, seed=1)
    order = list(sampler)
    groups = [order[i:i + 20] for i in range(0, 60, 20)]
    assert sorted(tuple(sorted(g)) for g in groups) == [tuple(range(s, s + 20)) for s in (0, 20, 40)]
    assert all([dataset.lengths[i] for i in g] == sorted(dataset.lengths[i] for i in g) for g in groups)

    def group_order():
        return [min(list(sampler)[i:i + 20]) for i in range(0, 60, 20)]

    orders = set()
    for epoch in range(6):  # the groups' order is drawn per epoch
        sampler.set_epoch(epoch)
        orders.add(tuple(group_order()))
    assert len(orders) > 1


def test_random_level_trades_balance_for_variety():
    dataset = _Sequences(400)

    def mean_spread(level):
        per_rank = [list(s) for s in _samplers(dataset, 4, random_level=level)]
        return np.mean([np.ptp([dataset.lengths[ix[s]] for ix in per_rank]) for s in range(100)])

    assert mean_spread(0.0) < mean_spread(0.2) < mean_spread(1.0)


def test_batches_are_as_many_on_every_rank_and_train_through_a_data_loader():
    dataset = _Sequences(101)

    def token_budget(indices, budget=400):
        batches, current, tokens = [], [], 0
        for i in indices:
            if current and tokens + dataset.lengths[i] > budget:
                batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += dataset.lengths[i]
        return batches + [current] if current else batches

    for drop_last in (False, True):
        batch_samplers = [LoadBalancingDistributedBatchSampler(s, token_budget, drop_last=drop_last)
                          for s in _samplers(dataset, 3, seed=2)]
        counts = [len(b) for b in batch_samplers]
        assert len(set(counts)) == 1 and all(len(list(b)) == counts[0] for b in batch_samplers)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_samplers[0],
                                         collate_fn=lambda samples: torch.nn.utils.rnn.pad_sequence(samples))
    shapes = [batch.shape for batch in loader]
    assert len(shapes) == counts[0] and all(s[0] * s[1] <= 2 * 400 for s in shapes)
    batch_samplers[0].set_epoch(1)
    assert list(batch_samplers[0]) != [list(map(int, b)) for b in token_budget(list(_samplers(dataset, 3, seed=2)[0]))]


def test_bad_arguments_are_named():
    dataset = _Sequences(10)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got 2"):
        LoadBalancingDistributedSampler(dataset, len, world_size=2, rank=2)
    with pytest.raises(ValueError, match="random_level must be between 0 and 1"):
        LoadBalancingDistributedSampler(dataset, len, world_size=1, rank=0, random_level=1.5)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        LoadBalancingDistributedSampler(dataset, len)
    with pytest.raises(TypeError, match="complexity_fn must return an integer, got float for sample 0"):
        list(LoadBalancingDistributedSampler(dataset, lambda s: 1.5, world_size=1, rank=0))
    with pytest.raises(TypeError, match="sampler must be a LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(torch.utils.data.SequentialSampler(dataset), lambda i: [i])
