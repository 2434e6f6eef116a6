"""ZeRO stage 1 (ZeroOptimizer), its sharded checkpoints, torch's ZeroRedundancyOptimizer and
DeepSpeed around ORTModule and FusedAdam.

One launch of 2 gloo ranks (``tests/ortmodule/_zero_worker.py``, as in test_ddp.py) runs
every distributed check; the references are single-process eager PyTorch runs with
FusedAdam on the whole global batch, computed here. The rest are one-process tests.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from onnxtrain.errors import CheckpointError  # noqa: E402
from onnxtrain.torch.optim import (  # noqa: E402
    FusedAdam,
    OptimizerConfigError,
    ZeroOptimizer,
    consolidate_state_dict,
    partition_parameters,
)
from tests._launch import launch_ranks, load_worker  # noqa: E402

WORLD_SIZE = 2
GLOBAL_BATCH = 8
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 300

_WORKER = Path(__file__).with_name("_zero_worker.py")


worker = load_worker(_WORKER)
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")


def _assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _assert_params_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        _assert_close(actual[name], expected[name], f"{what}: {name}")


def _net(state) -> torch.nn.Module:
    net = worker.ZeroMLP()
    net.load_state_dict(state)
    return net


def _eager_step(net, optimizer, x, y) -> None:
    optimizer.zero_grad()
    worker.loss_fn(net(x), y).backward()
    optimizer.step()


# -- the 2-rank run and its single-process references ------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("zero")
    torch.manual_seed(0)
    state = copy.deepcopy(worker.ZeroMLP().state_dict())
    x, y = torch.randn(GLOBAL_BATCH, 12), torch.randint(0, 4, (GLOBAL_BATCH,))
    # a 1-rank ZeRO checkpoint after STEPS steps on the global batch, for the 1 -> 2 resume
    net = _net(state)
    optimizer = ZeroOptimizer(worker.param_groups(net), FusedAdam, lr=worker.LR)
    for _ in range(STEPS):
        _eager_step(net, optimizer, x, y)
    optimizer.save_shard(workdir / "ckpt1")
    data = {"state": state, "x": x, "y": y, "steps": STEPS, "ckpt1": str(workdir / "ckpt1"),
            "ckpt1_params": worker.snapshot(net)}
    torch.save(data, workdir / "setup.pt")
    return workdir, data


@pytest.fixture(scope="module")
def reference(setup) -> dict:
    """Plain FusedAdam, one process, global batch: parameters after STEPS and STEPS + 1 steps."""
    _, data = setup
    net = _net(data["state"])
    optimizer = FusedAdam(worker.param_groups(net), lr=worker.LR)
    for _ in range(STEPS):
        _eager_step(net, optimizer, data["x"], data["y"])
    at_save, state_bytes = worker.snapshot(net), worker.state_bytes(optimizer)
    _eager_step(net, optimizer, data["x"], data["y"])
    return {"params": at_save, "next": worker.snapshot(net), "state_bytes": state_bytes,
            "largest_state_bytes": max(sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t))
                                       for s in optimizer.state.values())}


@pytest.fixture(scope="module")
def ranks(setup) -> list[dict]:
    workdir, _ = setup
    return launch_ranks(_WORKER, workdir, WORLD_SIZE, timeout_s=TIMEOUT_S, env={"DS_ACCELERATOR": "cpu"})


@needs_gloo
def test_zero_ranks_run_in_onnxruntime(ranks):
    for result in ranks:
        assert result["fallback_reason"] is None, result["fallback_reason"]
        assert result["export_count"] == 1


@needs_gloo
def test_zero_two_ranks_match_single_process_on_the_global_batch(setup, ranks, reference):
    _, data = setup
    first, second = (r["zero"] for r in ranks)
    assert any(not torch.equal(first["params"][n], v) for n, v in data["state"].items()), "nothing trained"
    for name in first["params"]:
        assert torch.equal(first["params"][name], second["params"][name]), name  # exchanged, not recomputed
    _assert_params_close(first["params"], reference["params"], "ZeroOptimizer on 2 ranks vs FusedAdam")
    # one flat buffer per owner (all float32 on CPU, far below the bucket size), not one per tensor
    assert first["buckets"] == WORLD_SIZE


@needs_gloo
def test_zero_each_rank_holds_half_the_optimizer_state(ranks, reference):
    owned = [r["zero"]["owned"] for r in ranks]
    assert all(owned) and not set(owned[0]) & set(owned[1])
    assert sorted(owned[0] + owned[1]) == list(range(8))
    total = reference["state_bytes"]  # two moments of every parameter, one process
    for result in ranks:
        held = result["zero"]["state_bytes"]
        assert abs(held - total / WORLD_SIZE) <= reference["largest_state_bytes"]  # the general bound
        assert held == total // WORLD_SIZE  # this model splits into two equal halves


@needs_gloo
def test_zero_checkpoint_saved_on_two_ranks_resumes_on_one(setup, ranks, reference):
    workdir, data = setup
    continued = ranks[0]["zero"]["continued"]
    for rank_result in ranks:
        _assert_params_close(rank_result["zero"]["continued"], reference["next"], "2 ranks, one more step")
    for label, make in (("ZeroOptimizer (1 rank)", lambda p: ZeroOptimizer(p, FusedAdam, lr=worker.LR)),
                        ("FusedAdam", lambda p: FusedAdam(p, lr=worker.LR))):
        net = _net(ranks[0]["zero"]["params"])
        optimizer = make(worker.param_groups(net))
        optimizer.load_state_dict(consolidate_state_dict(workdir / "ckpt2"))  # loading aliases its tensors
        assert [g["step"] for g in optimizer.param_groups] == [STEPS, STEPS]
        _eager_step(net, optimizer, data["x"], data["y"])
        _assert_params_close(worker.snapshot(net), continued, f"resumed on {label} vs continued on 2 ranks")


@needs_gloo
def test_zero_checkpoint_resumes_on_two_ranks_from_two_and_from_one(ranks, reference):
    for result in ranks:
        _assert_params_close(result["zero"]["resumed_from_2"], result["zero"]["continued"], "2 -> 2 ranks")
        _assert_params_close(result["zero"]["resumed_from_1"], reference["next"], "1 -> 2 ranks")


@needs_gloo
def test_torch_zero_redundancy_optimizer_around_fused_adam(ranks, reference):
    first, second = (r["torch_zero"] for r in ranks)
    for name in first["params"]:
        assert torch.equal(first["params"][name], second["params"][name]), name
    _assert_params_close(first["params"], reference["params"], "ZeroRedundancyOptimizer(FusedAdam) vs FusedAdam")
    assert first["state_bytes"] + second["state_bytes"] == reference["state_bytes"]
    assert first["state_bytes"] and second["state_bytes"]


@needs_gloo
def test_zero_reduce_gradients_replaces_ddp_averaging(ranks, reference):
    for result in ranks:
        _assert_params_close(result["reduce_gradients"]["params"], reference["params"], "reduce_gradients=True")


@needs_gloo
def test_zero_reduce_gradients_ranks_skip_an_overflow_together(ranks):
    first, second = (result["loss_scaled_overflow"] for result in ranks)
    assert "error" not in first and "error" not in second, (first, second)
    assert first["scales"] == second["scales"] == [256.0, 128.0, 128.0, 128.0]  # step 1 skipped everywhere
    _assert_params_close(first["params"], second["params"], "the ranks' parameters")


@needs_gloo
def test_zero_failures_are_reported_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        failures = result["failures"]
        assert "same parameters" in failures["mismatch"] and "rank 1: 1 parameters, 2 elements" in failures["mismatch"]
        assert failures["owned"] == [rank]
        kind, message = failures["step_error"]
        if rank == 1:  # where the step was refused: FusedAdam's own error, its parameter untouched
            assert kind == "OptimizerConfigError" and "lr must be" in message
            assert all(torch.equal(p, torch.ones(4)) for p in failures["params"])
        else:  # the other rank updated its own parameter and exchanged nothing
            assert kind == "ZeroStepError" and "rank(s) [1] of 2" in message
            assert not torch.equal(failures["params"][0], torch.ones(4))
            assert torch.equal(failures["params"][1], torch.ones(4))
        kind, message = failures["uneven_error"]
        assert kind == "ZeroStepError" and "positions [1] have a gradient on some ranks only" in message


@needs_gloo
def test_deepspeed_zero_stage1_around_ortmodule_matches_eager_deepspeed(ranks, reference):
    for result in ranks:
        ds = result["deepspeed"]
        if "skipped" in ds:
            pytest.skip(ds["skipped"])
        assert "error" not in ds, ds.get("error")
        assert ds["ORTModule"]["optimizer"] == ds["eager"]["optimizer"] == "DeepSpeedZeroOptimizer"
        assert ds["ORTModule"]["fallback_reason"] is None
        assert result["export_count_after_deepspeed"] == 1  # DeepSpeed's flat buffers: no re-export
        _assert_params_close(ds["ORTModule"]["params"], ds["eager"]["params"], "DeepSpeed: ORTModule vs eager")
        _assert_params_close(ds["ORTModule"]["params"], reference["params"], "DeepSpeed + ORTModule vs FusedAdam")


# -- checkpoint errors, using the shards of the 2-rank run ---------------------------------
@needs_gloo
def test_consolidate_names_missing_and_mismatched_shards(setup, ranks, tmp_path):
    workdir, _ = setup
    shards = sorted((workdir / "ckpt2").iterdir())
    assert [p.name for p in shards] == ["optimizer_shard_0_of_2.pt", "optimizer_shard_1_of_2.pt"]
    with pytest.raises(CheckpointError, match=r"missing ranks \[1\]"):
        consolidate_state_dict(shards[:1])
    with pytest.raises(CheckpointError, match=r"duplicate ranks \[0\]"):
        consolidate_state_dict([shards[0], shards[0], shards[1]])
    with pytest.raises(CheckpointError, match=r"world sizes \[1, 2\]"):
        consolidate_state_dict([*shards, next((workdir / "ckpt1").iterdir())])
    with pytest.raises(CheckpointError, match="does not exist"):
        consolidate_state_dict([shards[0], tmp_path / "optimizer_shard_1_of_2.pt"])
    with pytest.raises(CheckpointError, match="no ZeRO optimizer shards"):
        consolidate_state_dict(tmp_path)
    torch.save({"state": {}, "param_groups": []}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not a ZeRO optimizer shard"):
        consolidate_state_dict([tmp_path / "plain.pt"])
    (tmp_path / "optimizer_shard_0_of_1.pt").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match="cannot read"):
        consolidate_state_dict(tmp_path)

    # in-memory shards (each rank's state_dict()) merge like the files
    in_memory = consolidate_state_dict([torch.load(p, weights_only=True) for p in reversed(shards)])
    from_files = consolidate_state_dict(workdir / "ckpt2")
    assert in_memory["param_groups"] == from_files["param_groups"]
    assert sorted(in_memory["state"]) == sorted(from_files["state"]) == list(range(8))
    for index, state in from_files["state"].items():
        for key, value in state.items():
            expected = in_memory["state"][index][key]
            assert torch.equal(expected, value) if torch.is_tensor(value) else expected == value, (index, key)


@needs_gloo
def test_loading_another_ranks_shard_asks_for_consolidation(setup, ranks):
    workdir, _ = setup
    shard = torch.load(workdir / "ckpt2" / "optimizer_shard_1_of_2.pt", weights_only=True)
    net = _net(ranks[0]["zero"]["params"])
    optimizer = ZeroOptimizer(worker.param_groups(net), FusedAdam, lr=worker.LR)
    with pytest.raises(CheckpointError, match="rank 1's shard of a 2-rank save.*consolidate_state_dict"):
        optimizer.load_state_dict(shard)


# -- one process -----------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_partition_is_balanced_by_bytes(world_size):
    generator = torch.Generator().manual_seed(world_size)
    sizes = torch.randint(1, 300, (23,), generator=generator).tolist()
    params = [torch.zeros(n, dtype=torch.float64 if i % 3 == 0 else torch.float32) for i, n in enumerate(sizes)]
    partition = partition_parameters(params, world_size)
    nbytes = [p.numel() * p.element_size() for p in params]
    for rank in range(world_size):  # recomputed from the owners, independently of bytes_per_rank
        held = sum(nbytes[i] for i in partition.owned(rank))
        assert held == partition.bytes_per_rank[rank]
        assert abs(held - sum(nbytes) / world_size) <= max(nbytes)
    assert sorted(i for r in range(world_size) for i in partition.owned(r)) == list(range(len(params)))
    assert partition_parameters(params, world_size) == partition  # every rank computes the same


@pytest.mark.parametrize("schedule", [
    lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)),
    # cycles beta1 too: it looks for "betas" in the optimizer's defaults (ZeroOptimizer's held
    # only the arguments given, and the scheduler refused it)
    lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=10 * worker.LR, total_steps=STEPS)],
    ids=["lambda", "one-cycle"])
def test_one_rank_zero_optimizer_is_fused_adam_and_follows_lr_schedules(schedule):
    torch.manual_seed(0)
    state = worker.ZeroMLP().state_dict()
    x, y = torch.randn(GLOBAL_BATCH, 12), torch.randint(0, 4, (GLOBAL_BATCH,))
    results = []
    for make in (lambda p: ZeroOptimizer(p, FusedAdam, lr=worker.LR), lambda p: FusedAdam(p, lr=worker.LR)):
        net = _net(state)
        optimizer = make(worker.param_groups(net))
        scheduler = schedule(optimizer)
        for _ in range(STEPS):
            _eager_step(net, optimizer, x, y)
            scheduler.step()
        results.append(worker.snapshot(net))
    for name in results[1]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_refused_step_leaves_parameters_untouched_and_add_param_group_is_refused():
    net = torch.nn.Linear(3, 2)
    optimizer = ZeroOptimizer(net.parameters(), FusedAdam, lr=0.1)
    net(torch.ones(1, 3)).sum().backward()
    before = worker.snapshot(net)
    optimizer.param_groups[0]["lr"] = -1.0
    with pytest.raises(OptimizerConfigError, match="lr must be"):
        optimizer.step()
    for name, value in worker.snapshot(net).items():
        assert torch.equal(value, before[name]), name
    with pytest.raises(OptimizerConfigError, match="add_param_group"):
        optimizer.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    with pytest.raises(OptimizerConfigError, match="optimizer_class"):
        ZeroOptimizer(net.parameters(), "adam")


def test_shard_write_is_atomic_and_shapes_are_checked(tmp_path, monkeypatch):
    net = torch.nn.Linear(3, 2)
    optimizer = ZeroOptimizer(net.parameters(), FusedAdam, lr=0.1)
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = optimizer.save_shard(tmp_path)
    saved = path.read_bytes()

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    optimizer.step()
    with pytest.raises(CheckpointError, match="disk full"):
        optimizer.save_shard(tmp_path)
    monkeypatch.undo()
    assert path.read_bytes() == saved and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp left

    other = torch.nn.Linear(2, 3)  # same parameter count, other shapes
    with pytest.raises(CheckpointError, match=r"parameter 0: saved \[2, 3\], now \[3, 2\]"):
        ZeroOptimizer(other.parameters(), FusedAdam).load_state_dict(torch.load(path, weights_only=True))
    shutil.rmtree(tmp_path)


def test_a_shard_of_fused_adam_with_an_adamw_mode_enum_consolidates(tmp_path):
    # the documented form, adam_w_mode=AdamWMode.ADAMW_TORCH, lands in every parameter group:
    # shards hold plain values (a weights-only load reads them)
    from onnxtrain.torch.optim import AdamWMode

    p = torch.nn.Parameter(torch.randn(4))
    optimizer = ZeroOptimizer([p], optimizer_class=FusedAdam, lr=1e-3, adam_w_mode=AdamWMode.ADAMW_TORCH)
    p.grad = torch.randn(4)
    optimizer.step()
    optimizer.save_shard(tmp_path)
    full = consolidate_state_dict(tmp_path)
    assert full["param_groups"][0]["adam_w_mode"] == AdamWMode.ADAMW_TORCH
    resumed = FusedAdam([torch.nn.Parameter(p.detach().clone())], adam_w_mode=AdamWMode.ADAMW_TORCH)
    resumed.load_state_dict(full)
    assert torch.equal(resumed.state[resumed.param_groups[0]["params"][0]]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])
    # the state dict itself too (torch.save, then torch.load's default weights-only read)
    torch.save(optimizer.state_dict(), tmp_path / "state.pt")
    copy_of_p = torch.nn.Parameter(p.detach().clone())
    again = ZeroOptimizer([copy_of_p], optimizer_class=FusedAdam, lr=1e-3, adam_w_mode=AdamWMode.ADAMW_TORCH)
    again.load_state_dict(torch.load(tmp_path / "state.pt"))
    p.grad = copy_of_p.grad = torch.randn(4)
    optimizer.step()
    again.step()
    assert torch.equal(copy_of_p, p)
