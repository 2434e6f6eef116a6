"""ORTModule inside torch.nn.parallel.DistributedDataParallel (gloo, 2 processes on CPU).

Each rank trains ``DDP(ORTModule(model))`` for a few optimizer steps on its half of a fixed
global batch; the result must be what one process gets training the same initial model on
the whole batch: eager PyTorch, and ORTModule without DDP. Ranks run as separate
interpreters (``tests/ortmodule/_ddp_worker.py``) joined through a file store in a tmp
folder. One launch of the ranks trains with every optimizer (SGD with momentum, then Adam,
restarting from the initial weights), so the export is paid once per rank.

The last two tests check that a parent (DDP) sees ORTModule's parameters under the names
state_dict() writes, for loading and for DDP's ignore list.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402
from tests._launch import launch_ranks, load_worker  # noqa: E402

WORLD_SIZE = 2
GLOBAL_BATCH = 8
STEPS = 3
OPTIMIZERS = ("sgd", "adam")
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 240

_WORKER = Path(__file__).with_name("_ddp_worker.py")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")


worker = load_worker(_WORKER)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ddp")
    torch.manual_seed(0)
    net = worker.LayerNormMLP()
    data = {
        "state": copy.deepcopy(net.state_dict()),
        "x": torch.randn(GLOBAL_BATCH, 12),
        "y": torch.randint(0, 5, (GLOBAL_BATCH,)),
        "steps": STEPS,
        "optimizers": list(OPTIMIZERS),
    }
    torch.save(data, workdir / "setup.pt")
    return workdir, data


@pytest.fixture(scope="module")
def ranks(setup) -> list[dict]:
    """Run the ranks once; each returns what ``_ddp_worker.main`` saved."""
    workdir, _ = setup
    return launch_ranks(_WORKER, workdir, WORLD_SIZE, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def references(setup) -> dict:
    """Single process, whole global batch, same initial weights and optimizers."""
    _, data = setup
    result = {}
    for label, wrap in (("eager", False), ("ORTModule", True)):
        net = worker.LayerNormMLP()
        net.load_state_dict(data["state"])
        model = ORTModule(net, DebugOptions(fallback=False)) if wrap else net
        result[label] = worker.train_each_optimizer(model, net, data["x"], data["y"], data)
    return result


def _assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def test_ddp_ranks_run_in_onnxruntime_from_rank0_weights(setup, ranks):
    _, data = setup
    for rank, result in enumerate(ranks):
        # really ran in ONNX Runtime: one export for training with both optimizers, one for the
        # no-grad calls (grad mode is part of ORTModule's key)
        assert result["fallback_reason"] is None, result["fallback_reason"]
        assert result["export_count"] == 2
        # DDP broadcast rank 0's weights to rank 1 (which started from another init)
        for name, value in data["state"].items():
            assert torch.equal(result["after_broadcast"][name], value), (rank, name)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_ddp_two_ranks_match_single_process_on_the_global_batch(setup, ranks, references, optimizer):
    _, data = setup
    first, second = (r["runs"][optimizer] for r in ranks)
    names = list(data["state"])
    share = GLOBAL_BATCH // WORLD_SIZE

    assert any(not torch.equal(first["params"][n], data["state"][n]) for n in names), "nothing trained"

    # both ranks hold bit-identical all-reduced gradients at every step, and final parameters
    for step in range(STEPS):
        for name in names:
            assert torch.equal(first["grads"][step][name], second["grads"][step][name]), (step, name)
    for name in names:
        assert torch.equal(first["params"][name], second["params"][name]), name

    for label, runs in references.items():
        ref = runs[optimizer]
        for step in range(STEPS):
            # the mean of the per-rank losses (equal shares) is the global-batch loss
            mean_loss = (first["losses"][step] + second["losses"][step]) / WORLD_SIZE
            _assert_close(mean_loss, ref["losses"][step], f"{label}: loss at step {step}")
            for name in names:
                _assert_close(first["grads"][step][name], ref["grads"][step][name],
                              f"{label}: all-reduced gradient of {name} at step {step}")
        for name in names:
            _assert_close(first["params"][name], ref["params"][name], f"{label}: final {name}")
        for rank, result in enumerate((first, second)):
            _assert_close(result["eval_output"], ref["eval_output"][rank * share:(rank + 1) * share],
                          f"{label}: no-grad output of rank {rank} after training")


# -- DDP's view of the wrapped module's names (one process, no export needed) ----------------
@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp_of_ortmodule():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    return torch.nn.parallel.DistributedDataParallel(ORTModule(net, DebugOptions(fallback=False)))


def test_ddp_state_dict_round_trip(single_rank_group):
    ddp = _ddp_of_ortmodule()
    state = {k: v + 1 for k, v in ddp.state_dict().items()}  # "module.0.weight", ...
    ddp.load_state_dict(state)
    for key, value in ddp.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_ddp_parameter_names_are_the_state_dict_keys(single_rank_group):
    ddp = _ddp_of_ortmodule()
    assert [name for name, _ in ddp.named_parameters()] == list(ddp.state_dict())
