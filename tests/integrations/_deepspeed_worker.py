"""One rank of tests/integrations/test_deepspeed.py, run as a script (tests/_launch.py).

    python _deepspeed_worker.py RANK WORLD_SIZE WORKDIR

Reads ``WORKDIR/setup.pt`` (initial weights, global batch, steps), joins a gloo group through a
file store, and trains on its share of the batch, ZeRO stage 1 with a WarmupLR schedule:

- eager DeepSpeed with the config's optimizer built by DeepSpeed as ``torch.optim.AdamW`` /
  ``torch.optim.Adam`` (``"torch_adam": true``: no C++ op to compile), the reference;
- ``onnxtrain.integrations.deepspeed.initialize`` on the plain model with the same config
  without ``torch_adam``: ORTModule and our FusedAdam.

for ``AdamW`` and for ``Adam`` with ``"adam_w_mode": false`` (L2). Writes ``WORKDIR/rank<RANK>.pt``.
Kept free of pytest and of the ``tests`` package.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

LR, WEIGHT_DECAY = 1e-2, 0.1
OPTIMIZERS = {  # label: DeepSpeed "optimizer" entry (without torch_adam)
    "AdamW": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
    "Adam-L2": {"type": "Adam", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "adam_w_mode": False}},
}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


def config(batch: int, optimizer: dict, torch_adam: bool) -> dict:
    entry = copy.deepcopy(optimizer)
    if torch_adam:
        entry["params"]["torch_adam"] = True
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1}, "optimizer": entry,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                         "warmup_num_steps": 2, "warmup_type": "linear"}}}


def train(engine, x, y, steps: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def main(rank: int, world_size: int, workdir: Path) -> None:
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    import onnxruntime as ort

    from onnxtrain.integrations.deepspeed import initialize
    from onnxtrain.torch import DebugOptions

    setup = torch.load(workdir / "setup.pt")
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'store'}", rank=rank, world_size=world_size)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    share = setup["x"].shape[0] // world_size
    x, y = setup["x"][rank * share:(rank + 1) * share], setup["y"][rank * share:(rank + 1) * share]

    def fresh_net():
        torch.manual_seed(1234 + rank)
        net = MLP()
        if rank == 0:  # other ranks keep their own init: DeepSpeed broadcasts rank 0's
            net.load_state_dict(setup["state"])
        return net

    # the eager runs do by hand what the helper does on CPU (skip the shm op's compilation)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    results = {"seconds": {}}
    try:
        for label, optimizer in OPTIMIZERS.items():
            for kind in ("eager", "helper"):
                net = fresh_net()
                began = time.perf_counter()
                if kind == "eager":
                    engine, opt, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                                             config=config(share, optimizer, torch_adam=True))
                else:
                    engine, opt, _, _ = initialize(net, debug_options=DebugOptions(fallback=False,
                                                                                  session_options=options),
                                                   config=config(share, optimizer, torch_adam=False))
                losses = train(engine, x, y, setup["steps"])
                results["seconds"][f"{label} {kind}"] = time.perf_counter() - began
                results[label, kind] = {
                    "losses": losses, "params": {n: p.detach().clone() for n, p in net.named_parameters()},
                    "optimizer": type(opt).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
                    "module": type(engine.module).__name__, "lr": engine.get_lr(),
                    "fallback_reason": getattr(engine.module, "fallback_reason", None),
                    "export_count": getattr(engine.module, "export_count", None)}
        torch.save(results, workdir / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
