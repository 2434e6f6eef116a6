"""Hugging Face Trainer step time: ``transformers.Trainer`` beside onnxtrain's ``ORTTrainer``.

    python -m bench.hf_trainer                      # minilm and bert-mini (bench/models.py), 8 rounds of 3 steps
    python -m bench.hf_trainer --quick              # 3 rounds of 2 steps
    python -m bench.hf_trainer --models tiny-bert --rounds 1 --steps 1 --out /tmp/h.json   (smoke test)

Systems, each a trainer over its own copy of the model (same initial weights, same batches,
same seed, so the same data order):

- ``trainer``: ``transformers.Trainer`` with its default optimizer for this PyTorch
  (``adamw_torch_fused``), the reference;
- ``ort_trainer``: ``ORTTrainer`` with the same optimizer (the difference is ORTModule);
- ``ort_trainer_fused``: ``ORTTrainer`` with ``optim="adamw_ort_fused"`` (FusedAdam).

Each system first trains ``--warmup`` untimed steps (ORTTrainer's first step exports the
model). Then round ``r`` calls ``train()`` for ``--steps`` steps on every system, in order on
even rounds and reversed on odd ones, so slow drift of a shared machine hits all alike. A
callback times each optimizer step (``on_step_begin`` to ``on_step_end``: forward, backward,
optimizer step and scheduler, not logging); a system's figure is the median over rounds of
its mean step time in the round, and its ratio to ``trainer`` both as a ratio of medians and
as the median of per-round ratios (paired). The first logged loss of each system is checked
against ``trainer``'s (same weights, same batch).

Writes ``bench/results/hf_trainer.json`` (``--out``) and prints :func:`markdown`'s table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import models, package_versions, write_results

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "hf_trainer.json"
DEFAULT_MODELS = ("minilm", "bert-mini")
SYSTEMS = {  # name -> (label, ORTTrainer?, optim); the first is the reference
    "trainer": ("transformers.Trainer (adamw_torch_fused)", False, "adamw_torch_fused"),
    "ort_trainer": ("ORTTrainer (adamw_torch_fused)", True, "adamw_torch_fused"),
    "ort_trainer_fused": ("ORTTrainer (adamw_ort_fused)", True, "adamw_ort_fused"),
}
REFERENCE = "trainer"
# the same first loss within this relative tolerance (the check of tests/ortmodule/test_minilm.py)
LOSS_RTOL = 1e-4
QUICK = {"rounds": 3, "steps": 2, "warmup": 1}
FULL = {"rounds": 8, "steps": 3, "warmup": 2}


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Seconds of every optimizer step (forward, backward, optimizer, scheduler)."""

        def __init__(self):
            self.times: list[float] = []
            self._start = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    return StepTimer()


def _dataset(spec: models.Spec) -> list[dict]:
    """The spec's batches as one list of examples (every example has the spec's sequence length)."""
    import torch

    examples = []
    for batch in spec.batches():
        for i in range(spec.batch):
            examples.append({name: torch.as_tensor(batch[name][i]) for name in (*spec.input_names, "labels")})
    return examples


def _trainer(spec: models.Spec, system: str, workdir: Path, threads: int):
    import transformers

    from onnxtrain.integrations.huggingface import ORTTrainer, ORTTrainingArguments
    from onnxtrain.torch import DebugOptions

    _, ort, optim = SYSTEMS[system]
    args_cls, trainer_cls = (ORTTrainingArguments, ORTTrainer) if ort else (transformers.TrainingArguments,
                                                                             transformers.Trainer)
    args = args_cls(str(workdir / system), optim=optim, learning_rate=spec.lr, weight_decay=0.01,
                    per_device_train_batch_size=spec.batch, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=models.MODEL_SEED,
                    torch_compile=False)
    extra = {"debug_options": DebugOptions(fallback=False)} if ort else {}
    timer = _step_timer()
    trainer = trainer_cls(model=spec.build(), args=args, train_dataset=_dataset(spec), callbacks=[timer], **extra)
    return trainer, timer


def _train(trainer, steps: int) -> list[float]:
    """Run ``steps`` steps (a fresh ``train()``: same optimizer object, schedule restarted); their losses."""
    trainer.args.max_steps = steps
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def measure_model(name: str, rounds: int, steps: int, warmup: int, threads: int) -> dict:
    import torch

    spec = models.get(name)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as scratch:
        trainers = {s: _trainer(spec, s, Path(scratch), threads) for s in SYSTEMS}
        entries = {}
        for system, (trainer, timer) in trainers.items():
            start = time.perf_counter()
            losses = _train(trainer, max(warmup, 1))
            entries[system] = {"label": SYSTEMS[system][0], "first_loss": losses[0],
                               "warmup_s": time.perf_counter() - start, "round_step_ms": []}
            timer.times.clear()
        for r in range(rounds):
            order = list(SYSTEMS) if r % 2 == 0 else list(reversed(SYSTEMS))
            for system in order:
                trainer, timer = trainers[system]
                _train(trainer, steps)
                entries[system]["round_step_ms"].append(1e3 * statistics.fmean(timer.times))
                timer.times.clear()
        for system, (trainer, _) in trainers.items():
            module = getattr(trainer, "ort_module", None)
            entries[system]["export_count"] = None if module is None else module.export_count
            entries[system]["fallback_reason"] = None if module is None else module.fallback_reason
    reference = entries[REFERENCE]
    for entry in entries.values():
        entry["median_step_ms"] = statistics.median(entry["round_step_ms"])
        entry["ratio_vs_trainer"] = entry["median_step_ms"] / reference["median_step_ms"]
        entry["paired_ratio_vs_trainer"] = statistics.median(
            a / b for a, b in zip(entry["round_step_ms"], reference["round_step_ms"]))
        entry["first_loss_agrees"] = abs(entry["first_loss"] - reference["first_loss"]) <= \
            LOSS_RTOL * abs(reference["first_loss"])
    return {"model": name, "description": spec.description, "systems": entries}


def measure(names, rounds: int, steps: int, warmup: int, threads: int) -> dict:
    return {"models": [measure_model(n, rounds, steps, warmup, threads) for n in names],
            "rounds": rounds, "steps_per_round": steps, "warmup": warmup, "threads": threads,
            "versions": package_versions(("torch", "transformers", "onnxruntime", "onnxtrain"))}


def markdown(results: dict) -> str:
    """One row per model: each system's median step time and its ratio to ``transformers.Trainer``."""
    names = list(SYSTEMS)
    head = "| model | " + " | ".join(f"{SYSTEMS[s][0]} ms" for s in names) + " | " + \
        " | ".join(f"{SYSTEMS[s][0]} vs Trainer (paired)" for s in names[1:]) + " | first loss agrees |"
    lines = [f"Training step time (forward, backward, optimizer), median of {results['rounds']} rounds of "
             f"{results['steps_per_round']} steps, {results['threads']} threads; ratio < 1: faster than "
             "transformers.Trainer.", "", head, "|---|" + "---:|" * (2 * len(names) - 1) + "---|"]
    for model in results["models"]:
        entries = model["systems"]
        times = " | ".join(f"{entries[s]['median_step_ms']:.1f}" for s in names)
        ratios = " | ".join(f"{entries[s]['ratio_vs_trainer']:.2f}x ({entries[s]['paired_ratio_vs_trainer']:.2f}x)"
                            for s in names[1:])
        agrees = "yes" if all(entries[s]["first_loss_agrees"] for s in names) else "NO"
        lines.append(f"| {model['model']} | {times} | {ratios} | {agrees} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"fewer rounds: {QUICK}")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="models of bench/models.py (kind hf)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if models.get(n).kind != "hf"]
    if bad:
        parser.error(f"not Hugging Face models (kind 'hf' in bench/models.py): {bad}")
    preset = QUICK if args.quick else FULL
    results = measure(names, rounds=args.rounds or preset["rounds"], steps=args.steps or preset["steps"],
                      warmup=preset["warmup"] if args.warmup is None else args.warmup, threads=args.threads)
    write_results(results, args.out, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
