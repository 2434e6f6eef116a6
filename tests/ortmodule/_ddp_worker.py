"""One rank of the DistributedDataParallel test (tests/ortmodule/test_ddp.py), run as a script.

    python _ddp_worker.py RANK WORLD_SIZE WORKDIR

Reads ``WORKDIR/setup.pt`` (initial state dict, global batch, training settings), joins a
gloo process group through a file store in ``WORKDIR``, trains ``DDP(ORTModule(model))`` on
its contiguous share of the global batch, and writes ``WORKDIR/rank<RANK>.pt``: final
parameters, per-step losses and gradients (after DDP's all-reduce), and ORTModule facts.

Kept free of pytest and of the ``tests`` package so that a bare interpreter can run it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


class LayerNormMLP(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear -> Tanh -> Linear; no batch statistics."""

    def __init__(self, d_in: int = 12, hidden: int = 32, d_out: int = 5):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(),
            nn.Linear(hidden, 16), nn.Tanh(), nn.Linear(16, d_out),
        )

    def forward(self, x):
        return self.net(x)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the (local) batch: with equal shares, DDP's gradient average is the
    gradient of the mean over the global batch."""
    return nn.functional.cross_entropy(output, target)


def make_optimizer(params, name: str):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    raise ValueError(name)


def train(model: nn.Module, net: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
          optimizer_name: str):
    """The unchanged training loop, shared by every rank and by the single-process references.

    ``model`` is what the script calls (``net`` itself, ``ORTModule(net)`` or
    ``DDP(ORTModule(net))``). Returns the per-step losses and the per-step gradients of
    ``net``'s parameters after ``backward()`` (i.e. after DDP's all-reduce), by their names
    in ``net``."""
    optimizer = make_optimizer(model.parameters(), optimizer_name)
    losses, grads = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
        optimizer.step()
    return losses, grads


def train_each_optimizer(model: nn.Module, net: nn.Module, x, y, setup: dict) -> dict:
    """For every optimizer of the setup, train from the setup's initial weights; then one
    forward under ``torch.no_grad()`` (the inference graph). Before the first run ``net``
    must already hold those weights; later runs reload them with ``net.load_state_dict``
    (the wrapper keeps its export and sessions: weights are graph inputs)."""
    results = {}
    for i, optimizer in enumerate(setup["optimizers"]):
        if i:
            net.load_state_dict(setup["state"])
        losses, grads = train(model, net, x, y, setup["steps"], optimizer)
        with torch.no_grad():
            eval_output = model(x)
        results[optimizer] = {
            "params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "losses": losses,
            "grads": grads,
            "eval_output": eval_output.detach().clone(),
        }
    return results


def main(rank: int, world_size: int, workdir: Path) -> None:
    torch.set_num_threads(1)
    import onnxruntime as ort

    from onnxtrain.torch import DebugOptions, ORTModule

    setup = torch.load(workdir / "setup.pt")
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'store'}",
                            rank=rank, world_size=world_size)
    try:
        torch.manual_seed(1234 + rank)
        net = LayerNormMLP()
        if rank == 0:
            net.load_state_dict(setup["state"])
        # other ranks keep their own random init: DDP must broadcast rank 0's weights
        # (through ORTModule.named_parameters / named_buffers) when it wraps the model

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        model = ORTModule(net, DebugOptions(fallback=False, session_options=options))
        ddp = nn.parallel.DistributedDataParallel(model)
        after_broadcast = {n: p.detach().clone() for n, p in net.named_parameters()}

        share = setup["x"].shape[0] // world_size
        rows = slice(rank * share, (rank + 1) * share)
        runs = train_each_optimizer(ddp, net, setup["x"][rows], setup["y"][rows], setup)

        torch.save({
            "after_broadcast": after_broadcast,
            "runs": runs,
            "export_count": model.export_count,
            "fallback_reason": model.fallback_reason,
        }, workdir / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
