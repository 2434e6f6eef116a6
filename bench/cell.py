"""One benchmark cell: one model trained by one system, in this process, reported as JSON.

Run by the suite as ``python -m bench.cell --model gpt --system ortmodule --out cell.json``
(one fresh process per cell, so its memory figures are its own). The cell builds the model
(fixed seed) and its batches, measures the resident set size, then *prepares* the system
(wrap / compile / export + artifacts + sessions) and runs step 0, then warm-up steps (at
least ``--warmup`` of them and ``--warmup-s`` seconds), then ``--steps`` timed steps. A step
is a full training step: forward, loss, backward and the AdamW update.

Figures (all in the JSON):
- ``step_times_s``: each timed step; ``median_step_s`` their median;
- ``first_step_s``: from "model and data ready" to the end of step 0 (export, artifacts,
  session creation, compilation included);
- ``rss_before_mb``: resident set size right before the system is prepared;
  ``peak_rss_mb``: the process's peak resident set size (``VmHWM``, bench.memory) at the end;
  ``peak_increase_mb``: their difference (what training added at its peak);
- ``losses``: the loss of every step, ``first_loss`` that of step 0;
- with ``--load-probe``: ``load_probe_gflops``, :func:`bench.probe.load_probe` right before the
  system is prepared (in a child process, :func:`bench.probe.load_probe_in_child`, so that it does
  not warm this process's PyTorch) and right after the timed steps (how much of the shared machine
  the cell got).

A cell that fails reports ``status: "error"`` and the error instead of raising, so the suite
records it and goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

import numpy as np

from bench import memory, models, package_versions, probe
from bench.worker_loop import run_steps

SYSTEMS = ["eager", "eager_fused", "compile", "ortmodule", "ortmodule_recompute", "ondevice", "upstream"]
TORCH_SYSTEMS = ["eager", "eager_fused", "compile", "ortmodule", "ortmodule_recompute"]
# ORTModule with its memory optimizer at its most aggressive level: every deterministic op the
# backward reads is recomputed where that saves bytes (the memory-cap search compares it).
RECOMPUTE_LEVEL = 2
HERE = Path(__file__).resolve().parent
DEFAULT_UPSTREAM_VENV = HERE / ".venv-upstream"
UPSTREAM_WORKER = HERE / "upstream_worker.py"
ONDEVICE_WORKER = HERE / "ondevice_worker.py"


# -- PyTorch systems ---------------------------------------------------------------------------

def _torch_batches(spec: models.Spec, batches):
    import torch

    return [{k: torch.from_numpy(v) for k, v in b.items()} for b in batches]


def _torch_loss(spec: models.Spec, model, batch):
    if spec.kind != "hf":  # classifier, lm
        inputs = batch[spec.input_names[0]]
        if spec.extra.get("loss_in_module"):  # models.with_loss: the module returns the loss
            return model(inputs, batch["labels"])
        return models.cross_entropy(model(inputs), batch["labels"])
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


def _torch_stepper(spec, run_model, params, batches, optimizer=None):
    """A training step of ``run_model`` (eager, compiled or ORTModule); ``torch.optim.AdamW``
    (its default single-tensor CPU update) unless another optimizer is given."""
    import torch

    optimizer = optimizer or torch.optim.AdamW(params, lr=spec.lr)
    data = _torch_batches(spec, batches)

    def step(i: int) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = _torch_loss(spec, run_model, data[i % len(data)])
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def prepare_eager(spec, model, batches, workdir, info):
    return _torch_stepper(spec, model, model.parameters(), batches)


def prepare_eager_fused(spec, model, batches, workdir, info):
    import torch

    info["notes"].append("eager PyTorch with torch.optim.AdamW(fused=True): the same update as eager's in one "
                         "kernel per parameter; shows how much of a system's gain is the optimizer's")
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, fused=True)
    return _torch_stepper(spec, model, None, batches, optimizer)


def prepare_compile(spec, model, batches, workdir, info):
    import torch

    compiled = torch.compile(model)  # default backend: inductor
    info["notes"].append("torch.compile(model), default backend (inductor); the optimizer runs eagerly")
    return _torch_stepper(spec, compiled, model.parameters(), batches)


def prepare_ortmodule(spec, model, batches, workdir, info, **ortmodule_options):
    from onnxtrain.torch import ORTModule
    from onnxtrain.torch.optim import AdamWMode, FusedAdam

    wrapped = ORTModule(model, **ortmodule_options)  # the user's script is otherwise unchanged, but for the optimizer:
    # onnxtrain's FusedAdam in torch.optim.AdamW's mode and defaults (same update as eager's)
    optimizer = FusedAdam(wrapped.parameters(), lr=spec.lr, adam_w_mode=AdamWMode.ADAMW_TORCH, eps=1e-8,
                          weight_decay=0.01)
    info["notes"].append("ORTModule + onnxtrain.torch.optim.FusedAdam(adam_w_mode=ADAMW_TORCH, eps=1e-8, "
                         "weight_decay=0.01): torch.optim.AdamW's update and defaults, multi-tensor")
    step = _torch_stepper(spec, wrapped, None, batches, optimizer)

    def checked(i: int) -> float:
        loss = step(i)
        if wrapped.fallback_reason is not None:  # it ran in PyTorch: not an ORTModule measurement
            raise RuntimeError(f"ORTModule fell back to PyTorch: {wrapped.fallback_reason}")
        return loss

    return checked


def prepare_ortmodule_recompute(spec, model, batches, workdir, info):
    info["notes"].append(f"ORTModule(memory_opt_level={RECOMPUTE_LEVEL}): aggressive recompute")
    return prepare_ortmodule(spec, model, batches, workdir, info, memory_opt_level=RECOMPUTE_LEVEL)


# -- onnxtrain on-device training ----------------------------------------------------------------

def _export_dynamo(spec, model, batches):
    """``torch.onnx.export(dynamo=True, optimize=False)`` of the logits, with a dynamic batch.

    The model is in training mode. onnxtrain's artifacts translations
    (``onnxtrain.torch.onnx_translation_table()``) are used for aten ops that the exporter
    translates for inference only: training-mode batch norm (a ``BatchNormalization`` in
    training mode, batch statistics as in PyTorch; the exporter would normalize with the running
    statistics) and ``embedding`` with a padding index (the padding row gets no gradient).
    """
    import logging
    import warnings

    import torch

    from onnxtrain.torch import onnx_translation_table as translation_table

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    sample = spec.export_sample(batches[0])
    batch = torch.export.Dim("batch", min=2, max=4096)
    dynamic = tuple({0: batch} for _ in spec.input_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(spec.export_model(model), sample, dynamo=True, input_names=spec.input_names,
                                    output_names=["output"], dynamic_shapes=dynamic, optimize=False,
                                    custom_translation_table=translation_table(), verbose=False)
    return program.model_proto


def flat_cross_entropy_block():
    """onnxblock loss: cross entropy of logits [N, T, V] flattened to [N*T, V] against labels [N, T]
    (V is read from the logits' static shape)."""
    import onnx_ir

    from onnxtrain import onnxblock

    class FlatCrossEntropy(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.ce = onnxblock.loss.CrossEntropyLoss()

        def build(self, logits_name):
            b = self.context.builder
            logits = self.context.value(logits_name)
            flat = b.op.Reshape(logits, b.ints([-1, logits.shape[-1]]))
            labels = b.input("labels", onnx_ir.DataType.INT32, ["batch", "seq"])
            flat_labels = b.op.Reshape(labels, b.ints([-1]))
            return self.ce(flat.name, flat_labels.name)

    return FlatCrossEntropy()


def _trainable_names(spec, model, onnx_model) -> list[str]:
    names = [n for n, _ in spec.export_model(model).named_parameters()]
    initializers = {i.name for i in onnx_model.graph.initializer}
    missing = [n for n in names if n not in initializers]
    if missing:
        raise RuntimeError(f"parameters missing from the exported model's initializers: {missing[:8]}")
    return names


def run_ondevice(spec, model, batches, workdir, args, info) -> dict:
    """Export here (``torch.onnx.export``, dynamo), then generate the artifacts and train with
    ``onnxtrain.api`` in a worker process without torch (``bench/ondevice_worker.py``), as the
    upstream cell does; the figures are the worker's, ``first_step_s`` includes the export."""
    import onnx

    workdir = Path(workdir)
    t0 = time.perf_counter()
    onnx_model = _export_dynamo(spec, model, batches)
    requires_grad = _trainable_names(spec, model, onnx_model)
    model_path = workdir / "model.onnx"
    onnx.save(onnx_model, str(model_path))
    del onnx_model
    export_s = time.perf_counter() - t0
    job = _worker_job(spec, batches, workdir, args, model_path, requires_grad, frozen=[],
                      artifact_dir=workdir / "artifacts")
    return _run_worker([sys.executable, str(ONDEVICE_WORKER)], job, workdir, dict(os.environ), args, export_s,
                       "exported here (torch.onnx.export, dynamo); onnxtrain artifacts (OptimType.AdamW: upstream's "
                       "AdamW) generated and trained with onnxtrain.api in a worker process without torch, as "
                       "upstream's; memory figures are the worker's; first_step_s includes the export")


def _worker_job(spec, batches, workdir: Path, args, model_path: Path, requires_grad: list[str], frozen: list[str],
                artifact_dir: Path) -> dict:
    """What an on-device worker (``worker_loop``) needs: the model, the batches (written to
    ``data.npz``), the parameters to train and the step counts."""
    data_path = workdir / "data.npz"
    np.savez(data_path, **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()})
    return {"model_path": str(model_path), "data_path": str(data_path), "n_batches": len(batches),
            "input_names": spec.input_names, "kind": spec.kind, "vocab": spec.vocab, "lr": spec.lr,
            "requires_grad": requires_grad, "frozen_params": frozen, "steps": args.steps, "warmup": args.warmup,
            "warmup_s": args.warmup_s,
            "artifact_dir": str(artifact_dir)}


def _run_worker(command: list[str], job: dict, workdir: Path, env: dict, args, export_s: float, note: str) -> dict:
    """Run an on-device worker on ``job`` with ``args.threads`` OpenMP threads; its result, with
    the cell's export (``export_s``) added to the first step and ``note`` to the notes."""
    what = Path(command[-1]).stem
    job_path, result_path = workdir / "job.json", workdir / "worker_result.json"
    job_path.write_text(json.dumps(job))
    env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run([*command, str(job_path), str(result_path)], capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    if not result_path.exists():
        raise RuntimeError(f"{what} exited {proc.returncode} without a result: {proc.stderr[-3000:]}")
    result = json.loads(result_path.read_text())
    if result.get("status") != "ok":
        raise RuntimeError(f"{what}: {result.get('error')}")
    result["phases_s"] = {"export": export_s, **result.get("phases_s", {})}
    result["first_step_s"] = export_s + result["first_step_s"]
    result["notes"] = [note, *result.get("notes", [])]
    return result


# -- upstream onnxruntime-training 1.19.2, in its own virtualenv ----------------------------------

def export_legacy(spec, model, batches, path: Path) -> None:
    """The TorchScript exporter at opset 14, in training mode, with a dynamic batch."""
    import warnings

    import torch

    sample = spec.export_sample(batches[0])
    dynamic_axes = {n: {0: "batch"} for n in spec.input_names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(spec.export_model(model), sample, str(path), dynamo=False, opset_version=14,
                          input_names=spec.input_names, output_names=["output"], dynamic_axes=dynamic_axes,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)


def upstream_venv(path: str | os.PathLike | None) -> Path | None:
    """The upstream virtualenv to use: ``path`` if given, else bench/.venv-upstream if it exists."""
    venv = Path(path) if path else DEFAULT_UPSTREAM_VENV
    return venv if (venv / "bin" / "python").exists() else None


def run_upstream(spec, model, batches, workdir, args, info) -> dict:
    """Export here, then train in the upstream venv's worker; the figures are the worker's."""
    import onnx

    venv = upstream_venv(args.upstream_venv)
    if venv is None:
        raise RuntimeError("no upstream virtualenv: run bench/setup_upstream.sh or pass --upstream-venv")
    workdir = Path(workdir)
    t0 = time.perf_counter()
    model_path = workdir / "model.onnx"
    export_legacy(spec, model, batches, model_path)
    export_s = time.perf_counter() - t0
    initializers = {i.name for i in onnx.load(str(model_path), load_external_data=False).graph.initializer}
    params = [n for n, _ in spec.export_model(model).named_parameters()]
    missing = [n for n in params if n not in initializers]
    if missing:
        raise RuntimeError(f"parameters missing from the legacy export's initializers: {missing[:8]}")
    running = [n for n, _ in spec.export_model(model).named_buffers() if n in initializers and "running_" in n]
    job = _worker_job(spec, batches, workdir, args, model_path, params, frozen=running,
                      artifact_dir=workdir / "upstream_artifacts")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return _run_worker([str(venv / "bin" / "python"), str(UPSTREAM_WORKER)], job, workdir, env, args, export_s,
                       "exported in the main environment (TorchScript exporter, opset 14, training mode); "
                       "trained in the upstream virtualenv; memory figures are the worker process's "
                       "(no torch in it); first_step_s includes the export")


PREPARE = {"eager": prepare_eager, "eager_fused": prepare_eager_fused, "compile": prepare_compile, "ortmodule": prepare_ortmodule,
           "ortmodule_recompute": prepare_ortmodule_recompute}
# systems trained by a worker process (their figures are the worker's)
WORKER_SYSTEMS = {"ondevice": run_ondevice, "upstream": run_upstream}


# -- the cell ------------------------------------------------------------------------------------

def versions() -> dict:
    """The versions of the packages a cell's figures depend on."""
    return package_versions(("torch", "onnxruntime", "onnx", "transformers", "onnxtrain", "numpy"))


def count_flops(spec, model, batches) -> int:
    """FLOPs of one eager forward + backward (FlopCounterMode: matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    data = _torch_batches(spec, batches)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = _torch_loss(spec, model, data[0])
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def run_cell(args) -> dict:
    spec = models.get(args.model)
    if args.batch:
        spec = dataclasses.replace(spec, batch=args.batch)
    if args.loss_in_module:
        spec = dataclasses.replace(spec, extra={**spec.extra, "loss_in_module": True})
    result: dict = {"model": spec.name, "system": args.system, "status": "ok", "error": None,
                    "steps": args.steps, "warmup": args.warmup, "threads": args.threads, "pid": os.getpid(),
                    "notes": [], "phases_s": {}}
    try:
        import torch

        torch.set_num_threads(args.threads)
        result["versions"] = versions()
        if args.loss_in_module and args.system not in TORCH_SYSTEMS:
            raise ValueError(f"--loss-in-module is for the PyTorch systems {TORCH_SYSTEMS}, not {args.system!r}")
        def build():
            built = spec.build()
            return models.with_loss(spec, built) if args.loss_in_module else built

        model = build()
        batches = spec.batches()
        if args.count_flops:
            result["flops_per_step"] = count_flops(spec, model, batches)
            model = build()  # fresh weights (and BatchNorm statistics) for the measurement
        probes = result["load_probe_gflops"] = [] if args.load_probe else None

        def take_probe(before: bool = False) -> None:
            if probes is not None:  # before the system: in a child process (see load_probe_in_child)
                probes.append(probe.load_probe_in_child(args.threads) if before else probe.load_probe(args.threads))

        take_probe(before=True)
        with tempfile.TemporaryDirectory(prefix=f"bench-{spec.name}-{args.system}-") as workdir:
            if args.system in WORKER_SYSTEMS:
                result.update(WORKER_SYSTEMS[args.system](spec, model, batches, workdir, args, result))
                take_probe()
                return result
            memory.trim()
            result["rss_before_mb"] = memory.rss_mb()
            ready = time.perf_counter()
            step = PREPARE[args.system](spec, model, batches, workdir, result)
            result["phases_s"]["prepare"] = time.perf_counter() - ready
            losses = [step(0)]
            result["first_step_s"] = time.perf_counter() - ready
            more, times, result["warmup_steps_run"] = run_steps(step, args.warmup, args.warmup_s, args.steps)
            losses += more
            result.update(memory.peaks(result["rss_before_mb"]))
            take_probe()
        if "onnxtrain" in sys.modules:
            result["onnxtrain_file"] = sys.modules["onnxtrain"].__file__
        result["step_times_s"] = times
        result["median_step_s"] = float(np.median(times)) if times else None
        result["losses"] = losses
        result["first_loss"] = losses[0]
    except Exception as exc:  # noqa: BLE001 - a failed cell is a result, not a crash
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        result["traceback"] = traceback.format_exc()[-6000:]
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.cell", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help=f"one of {', '.join(models.SPECS)}")
    parser.add_argument("--system", required=True, choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after step 0 (at least)")
    parser.add_argument("--warmup-s", type=float, default=0.0,
                        help="warm up for at least this many seconds too (bench.worker_loop.run_steps)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--count-flops", action="store_true", help="also count one eager step's FLOPs")
    parser.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    parser.add_argument("--loss-in-module", action="store_true",
                        help="PyTorch systems: the module computes its own loss from the labels (bench.models."
                             "with_loss), so ORTModule runs the loss inside its graph")
    parser.add_argument("--upstream-venv", default=None)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the upstream worker")
    parser.add_argument("--load-probe", action="store_true",
                        help="measure bench.probe.load_probe before and after the steps (load_probe_gflops)")
    parser.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run_cell(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
