"""One rank of the ZeRO test (tests/ortmodule/test_zero.py), run as a script.

    python _zero_worker.py RANK WORLD_SIZE WORKDIR

Reads ``WORKDIR/setup.pt`` (initial state dict, global batch, steps, and a 1-rank ZeRO
checkpoint folder written by the test), joins a gloo group through a file store in
``WORKDIR``, and trains ``DDP(ORTModule(model))`` on its share of the global batch with:

- ``ZeroOptimizer(FusedAdam)``: ``STEPS`` steps, save shards to ``WORKDIR/ckpt2``, one more
  step; resume from the consolidated 2-rank and 1-rank checkpoints and take that step again;
- ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=FusedAdam)``;
- ``ZeroOptimizer(reduce_gradients=True)`` under ``ddp.no_sync()`` (raw local gradients);
- DeepSpeed ZeRO stage 1 around ``ORTModule`` and around the eager module, when installed.

Writes ``WORKDIR/rank<RANK>.pt``. Kept free of pytest and of the ``tests`` package.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from pathlib import Path

_STARTED = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

LR, BIAS_LR, WEIGHT_DECAY = 1e-2, 2e-2, 0.1


class ZeroMLP(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear -> Tanh -> Linear. With the groups of
    :func:`param_groups` its parameters split into two halves of exactly equal bytes."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 12), nn.Tanh(),
                                 nn.Linear(12, 4))

    def forward(self, x):
        return self.net(x)


def param_groups(net: nn.Module) -> list[dict]:
    """Matrices with weight decay; vectors (biases, LayerNorm) without, at another lr."""
    params = list(net.parameters())
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim <= 1], "lr": BIAS_LR, "weight_decay": 0.0}]


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)


def snapshot(net: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def train(model, optimizer, x, y, steps: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


def state_bytes(optimizer) -> int:
    """Bytes of the per-element state (Adam's moments; not the scalar step counts)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def run_zero(ddp, net, x, y, setup, workdir: Path) -> dict:
    from onnxtrain.torch.optim import FusedAdam, ZeroOptimizer, consolidate_state_dict

    def fresh():
        return ZeroOptimizer(param_groups(net), FusedAdam, lr=LR)

    optimizer = fresh()
    train(ddp, optimizer, x, y, setup["steps"])
    at_save = snapshot(net)
    result = {"params": at_save, "state_bytes": state_bytes(optimizer.optim),
              "owned": optimizer.partition.owned(optimizer.rank),
              "buckets": len(optimizer._buckets)}
    optimizer.save_shard(workdir / "ckpt2")
    dist.barrier()  # every shard is on disk
    train(ddp, optimizer, x, y, 1)
    result["continued"] = snapshot(net)

    for label, folder in (("resumed_from_2", workdir / "ckpt2"), ("resumed_from_1", setup["ckpt1"])):
        start = at_save if label == "resumed_from_2" else setup["ckpt1_params"]
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(start[name])
        optimizer = fresh()
        optimizer.load_state_dict(consolidate_state_dict(folder))
        train(ddp, optimizer, x, y, 1)
        result[label] = snapshot(net)
    return result


def run_torch_zero(ddp, net, x, y, setup) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from onnxtrain.torch.optim import FusedAdam

    net.load_state_dict(setup["state"])
    optimizer = ZeroRedundancyOptimizer(param_groups(net), optimizer_class=FusedAdam, lr=LR)
    train(ddp, optimizer, x, y, setup["steps"])
    return {"params": snapshot(net), "state_bytes": state_bytes(optimizer.optim)}


def run_reduce_gradients(ddp, net, x, y, setup) -> dict:
    from onnxtrain.torch.optim import FusedAdam, ZeroOptimizer

    net.load_state_dict(setup["state"])
    optimizer = ZeroOptimizer(param_groups(net), FusedAdam, lr=LR, reduce_gradients=True)
    with ddp.no_sync():  # DDP does not average: the optimizer reduces onto the owners
        train(ddp, optimizer, x, y, setup["steps"])
    return {"params": snapshot(net)}


def run_loss_scaled_overflow(rank: int) -> dict:
    """GradScaler around ZeroOptimizer(reduce_gradients=True) with an overflow in rank 1's loss
    at step 1 only: every rank must skip that step (the inf check of local gradients combined
    over the ranks); a rank stepping alone paired its collectives with the other's next step."""
    import datetime

    from onnxtrain.torch.amp import GradScaler
    from onnxtrain.torch.optim import ZeroOptimizer

    group = dist.new_group(timeout=datetime.timedelta(seconds=20))  # a desync fails, not hangs
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    optimizer = ZeroOptimizer(layer.parameters(), torch.optim.SGD, process_group=group, lr=0.1,
                              reduce_gradients=True)
    scaler = GradScaler("cpu", init_scale=2.0 ** 8)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    scales = []
    try:
        for step in range(4):
            optimizer.zero_grad()
            loss = layer(x).square().mean() * (float("inf") if (rank, step) == (1, 1) else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
    except Exception:  # noqa: BLE001 -- reported by the test
        return {"error": traceback.format_exc(limit=2)}
    return {"scales": scales, "params": snapshot(layer)}


def run_failures(rank: int) -> dict:
    """Mismatched parameters at construction, and a step refused on rank 1 only: every rank
    must raise (none may wait forever in a collective)."""
    from onnxtrain.torch.optim import FusedAdam, OptimizerConfigError, ZeroOptimizer

    result = {}
    try:
        ZeroOptimizer([torch.zeros(rank + 1, requires_grad=True)], FusedAdam)
    except OptimizerConfigError as exc:
        result["mismatch"] = str(exc)
    params = [torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)]  # one per rank
    optimizer = ZeroOptimizer(params, FusedAdam, lr=0.1)
    for p in params:
        p.grad = torch.ones(4)
    if rank == 1:
        optimizer.param_groups[0]["lr"] = -1.0
    try:
        optimizer.step()
    except Exception as exc:  # noqa: BLE001 -- the test checks the type
        result["step_error"] = (type(exc).__name__, str(exc))
    result["params"] = [p.detach().clone() for p in params]
    result["owned"] = optimizer.partition.owned(rank)
    # reduce_gradients with a gradient on rank 0 only: every rank raises (none waits in a reduce)
    reducing = ZeroOptimizer([torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)], FusedAdam,
                             lr=0.1, reduce_gradients=True)
    for k, p in enumerate(reducing.param_groups[0]["params"]):
        p.grad = torch.ones(4) if k == 0 or rank == 0 else None
    try:
        reducing.step()
    except Exception as exc:  # noqa: BLE001 -- the test checks the type
        result["uneven_error"] = (type(exc).__name__, str(exc))
    return result


def run_deepspeed(models: dict, setup, x, y) -> dict:
    """For each ``label: (model, net)``: ``deepspeed.initialize`` with ZeRO stage 1 around
    ``model`` and a FusedAdam on ``net``'s groups, ``STEPS`` steps; ``{"skipped": reason}``
    where deepspeed is not installed."""
    began = time.perf_counter()
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        return {"skipped": f"deepspeed is not installed ({exc})"}
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (for inference) on first
    # use: 3 min wall, 94 s CPU here. Training collectives go through torch.distributed (gloo)
    # either way; marking the op unavailable (a dict DeepSpeed keeps for edits) skips the build.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from onnxtrain.torch.optim import FusedAdam

    results = {"seconds": {"import": time.perf_counter() - began}}
    for label, (model, net) in models.items():
        began = time.perf_counter()
        config = {"train_micro_batch_size_per_gpu": x.shape[0], "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=FusedAdam(param_groups(net), lr=LR),
                                                       config=config)
        results["seconds"][f"{label} initialize"] = time.perf_counter() - began
        began = time.perf_counter()
        for _ in range(setup["steps"]):
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
        results[label] = {"params": snapshot(net), "optimizer": type(optimizer).__name__,
                          "fallback_reason": getattr(model, "fallback_reason", None),
                          "export_count": getattr(model, "export_count", None)}
        results["seconds"][f"{label} steps"] = time.perf_counter() - began
    return results


def main(rank: int, world_size: int, workdir: Path) -> None:
    torch.set_num_threads(1)
    import onnxruntime as ort

    from onnxtrain.torch import DebugOptions, ORTModule

    setup = torch.load(workdir / "setup.pt")
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'store'}", rank=rank, world_size=world_size)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1

    def make_model(wrap: bool):
        torch.manual_seed(1234 + rank)
        net = ZeroMLP()
        if rank == 0:  # other ranks keep their own init: DDP / DeepSpeed broadcast rank 0's
            net.load_state_dict(setup["state"])
        model = ORTModule(net, DebugOptions(fallback=False, session_options=options)) if wrap else net
        return model, net

    try:
        model, net = make_model(True)
        ddp = nn.parallel.DistributedDataParallel(model)
        share = setup["x"].shape[0] // world_size
        rows = slice(rank * share, (rank + 1) * share)
        x, y = setup["x"][rows], setup["y"][rows]
        start = time.perf_counter()
        seconds = {"to_main": start - _STARTED}
        results = {"zero": run_zero(ddp, net, x, y, setup, workdir)}
        seconds["zero"] = time.perf_counter() - start
        results["torch_zero"] = run_torch_zero(ddp, net, x, y, setup)
        results["reduce_gradients"] = run_reduce_gradients(ddp, net, x, y, setup)
        results["failures"] = run_failures(rank)
        results["loss_scaled_overflow"] = run_loss_scaled_overflow(rank)
        seconds["torch_zero+reduce_gradients"] = time.perf_counter() - start - seconds["zero"]
        results.update(export_count=model.export_count, fallback_reason=model.fallback_reason)
        del ddp  # its reducer's gradient hooks go with it
        gc.collect()
        net.zero_grad(set_to_none=True)  # DeepSpeed adds to leftover .grad in its first step
        if rank == 0:  # rank 1 keeps its trained weights: DeepSpeed must broadcast rank 0's
            net.load_state_dict(setup["state"])  # the ORTModule keeps its export: weights are inputs
        began = time.perf_counter()
        try:
            results["deepspeed"] = run_deepspeed({"eager": make_model(False), "ORTModule": (model, net)}, setup, x, y)
            results["export_count_after_deepspeed"] = model.export_count
            seconds["deepspeed"] = time.perf_counter() - began
        except Exception:  # noqa: BLE001 -- reported by the test with the traceback
            results["deepspeed"] = {"error": traceback.format_exc()}
        results["seconds"] = seconds
        torch.save(results, workdir / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
