"""bf16 against fp32 training step time: eager PyTorch and ORTModule, side by side in one run.

    python -m bench.precision [--quick] [--model gpt] [--steps 20] [--warmup 3] [--threads 2]

Each configuration trains a fresh copy of the benchmark model (bench/models.py: same initial
weights, same batches) with ``torch.optim.AdamW``; the bf16 ones run the forward under
``torch.autocast("cpu", dtype=torch.bfloat16)`` (the loss in fp32 from fp32 logits, as
usual with autocast). Writes ``bench/results/precision.json``; :func:`markdown_table`
formats it. ``--quick`` runs the tiny GPT for a few steps (a smoke test, not a measurement).

On a CPU, onnxruntime has no bf16 arithmetic kernels (passes/precision.py): ORTModule's
bf16 graph computes in fp32 between casts, so bf16 is not expected to be faster there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import models

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "precision.json"
CONFIGS = [("eager", "fp32"), ("eager", "bf16"), ("ortmodule", "fp32"), ("ortmodule", "bf16")]


def _loss(spec, model, batch, precision):
    import torch

    context = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with context:
        logits = model(batch["idx"])
    return models.cross_entropy(logits.float(), batch["labels"])


def run_config(spec: models.Spec, system: str, precision: str, steps: int, warmup: int) -> dict:
    """Train ``steps`` steps (after ``warmup`` untimed ones) of one configuration; its timings."""
    import torch

    model = spec.build()
    if system == "ortmodule":
        from onnxtrain.torch import DebugOptions, ORTModule

        model = ORTModule(model, DebugOptions(fallback=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    data = [{k: torch.from_numpy(v) for k, v in b.items()} for b in spec.batches()]
    times, cpu_times, losses = [], [], []
    for i in range(warmup + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(spec, model, data[i % len(data)], precision)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    timed = times[warmup:]
    # CPU time of the process (all its threads): unlike wall time, not inflated when other
    # processes share the cores, but it counts threads' busy-waiting too
    return {"system": system, "precision": precision, "first_step_s": times[0],
            "median_step_s": statistics.median(timed), "step_times_s": timed,
            "median_cpu_s": statistics.median(cpu_times[warmup:]), "losses": losses,
            "exports": getattr(model, "export_count", None)}


def run(model: str = "gpt", steps: int = 20, warmup: int = 3, threads: int = 2) -> dict:
    import torch

    torch.set_num_threads(threads)
    spec = models.SPECS[model]
    load_start = os.getloadavg()[0]  # other processes on the cores inflate wall times
    results = [run_config(spec, system, precision, steps, warmup) for system, precision in CONFIGS]
    return {"model": model, "description": spec.description, "steps": steps, "warmup": warmup,
            "threads": threads, "cpus": os.cpu_count(), "loadavg_start": load_start,
            "loadavg_end": os.getloadavg()[0], "torch": torch.__version__, "onnxruntime": _ort_version(),
            "results": results}


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def markdown_table(report: dict) -> str:
    """The results as a markdown table: median step wall and CPU time per configuration, bf16 /
    fp32 ratio (of wall times), and the last loss (bf16 and fp32 runs of one system should agree to ~1e-2)."""
    by_key = {(r["system"], r["precision"]): r for r in report["results"]}
    lines = [f"{report['model']}: {report['description']} ({report['steps']} timed steps, "
             f"{report['threads']} threads; load average {report.get('loadavg_start', '?')} before, "
             f"{report.get('loadavg_end', '?')} after)", "",
             "| system | precision | median step (ms) | median CPU time (ms) | first step (s) | bf16 / fp32 "
             "| last loss |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for system, precision in CONFIGS:
        r = by_key.get((system, precision))
        if r is None:
            continue
        ratio = r["median_step_s"] / by_key[(system, "fp32")]["median_step_s"] if precision != "fp32" else 1.0
        cpu = f"{r['median_cpu_s'] * 1e3:.1f}" if "median_cpu_s" in r else "-"
        lines.append(f"| {system} | {precision} | {r['median_step_s'] * 1e3:.1f} | {cpu} | "
                     f"{r['first_step_s']:.2f} | {ratio:.2f} | {r['losses'][-1]:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny GPT, 3 steps: a smoke run")
    parser.add_argument("--model", default="gpt", choices=["gpt", "tiny-gpt"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.warmup = "tiny-gpt", 3, 1
    report = run(args.model, args.steps, args.warmup, args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
