"""The Lightning model and runs of tests/integrations/test_lightning.py; as a script, one DDP rank.

    python _lightning_worker.py RANK WORLD_SIZE WORKDIR

With ``LOCAL_RANK`` etc. set by the launcher (tests/_launch.py), Lightning's ``strategy="ddp"``
joins the processes instead of starting its own. Each rank fits the eager model, then the
same model with :class:`ORTModuleCallback`, and writes ``WORKDIR/rank<RANK>.pt``.

Kept free of pytest and of the ``tests`` package so that a bare interpreter can run it.
"""

from __future__ import annotations

import csv
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

SAMPLES, D_IN, CLASSES = 8, 12, 5  # one process: 2 steps an epoch; 2 DDP ranks: 1
BATCH = 4  # per process
STEPS = 4
LR = 1e-2


class Net(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear -> Tanh -> Linear."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(),
                                 nn.Linear(16, CLASSES))

    def forward(self, x):
        return self.net(x)


class LitModel(pl.LightningModule):
    """Cross-entropy classifier; ``build_in_configure`` creates ``self.model`` in
    ``configure_model`` (after the callbacks' ``setup``) instead of ``__init__``."""

    def __init__(self, build_in_configure: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.loss_fn = nn.CrossEntropyLoss()  # a child without parameters: not wrapped
        self.model = None if build_in_configure else Net()
        self.output_dtypes: list[torch.dtype] = []

    def configure_model(self):
        if self.model is None:
            self.model = Net()

    def _loss(self, batch):
        x, y = batch
        logits = self.model(x)
        self.output_dtypes.append(logits.dtype)
        return self.loss_fn(logits.float(), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("loss", loss, sync_dist=True)  # the mean over ranks: the global batch's loss
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, D_IN, generator=generator)
    return torch.utils.data.TensorDataset(x, torch.randint(0, CLASSES, (SAMPLES,), generator=generator))


def loader(batch_size: int = BATCH, rank: int = 0, world_size: int = 1) -> torch.utils.data.DataLoader:
    """No shuffling. Under DDP our own unshuffled sampler (Lightning's would shuffle): rank r
    reads samples r, r + 2, ..., so each step of 2 ranks covers all 8 samples."""
    data = dataset()
    sampler = None if world_size == 1 else \
        torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False, sampler=sampler)


def trainer(root: Path, *, callbacks=(), **kwargs) -> pl.Trainer:
    """A quiet, deterministic CPU Trainer logging every step to ``root/metrics.csv``; ``kwargs``
    override the defaults."""
    options = dict(accelerator="cpu", max_steps=STEPS, deterministic=True, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                   logger=CSVLogger(root, name="", version=""), log_every_n_steps=1, default_root_dir=root)
    return pl.Trainer(callbacks=list(callbacks), **{**options, **kwargs})


def logged(root: Path, key: str) -> list[float]:
    """The values of ``key`` that Lightning's CSV logger wrote, in step order."""
    with open(root / "metrics.csv") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(root: Path, *, wrap: bool, model: LitModel | None = None, build_in_configure: bool = False,
        batch_size: int = BATCH, ckpt_path: Path | None = None, callbacks=(), **trainer_kwargs) -> dict:
    """Seeded fit of a fresh :class:`LitModel` (or ``model``), with ``ORTModuleCallback()``
    when ``wrap``; returns the logged losses, the final state dict, the model and trainer."""
    from onnxtrain.integrations.lightning import ORTModuleCallback
    from onnxtrain.torch import DebugOptions

    pl.seed_everything(0, verbose=False)
    if model is None:
        model = LitModel(build_in_configure)
    callback = ORTModuleCallback(debug_options=DebugOptions(fallback=False)) if wrap else None
    run = trainer(root, callbacks=[*callbacks, *([callback] if wrap else [])], **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")  # its CPU/worker/logging advice
        run.fit(model, loader(batch_size, run.global_rank, run.world_size), ckpt_path=ckpt_path)
    result = {"losses": logged(root, "loss") if run.global_rank == 0 else None, "state": snapshot(model),
              "model": model, "trainer": run, "wrapped": callback.wrapped if wrap else []}
    if wrap:
        result.update(export_count=model.model.export_count, fallback_reason=model.model.fallback_reason)
    return result


def main(rank: int, world_size: int, workdir: Path) -> None:
    torch.set_num_threads(1)
    results = {}
    for label, wrap in (("eager", False), ("ORTModule", True)):
        run = fit(workdir / f"{label}_rank{rank}", wrap=wrap, devices=world_size, strategy="ddp",
                  use_distributed_sampler=False)
        results[label] = {k: run[k] for k in ("losses", "state", "wrapped")}
        results[label]["world_size"] = run["trainer"].world_size
        if wrap:
            results[label].update(export_count=run["export_count"], fallback_reason=run["fallback_reason"])
    torch.save(results, workdir / f"rank{rank}.pt")
    # Lightning leaves its gloo process group to the interpreter's exit, where gloo's threads can
    # abort the process ("terminate called without an active exception", pytorch/pytorch#190489)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
