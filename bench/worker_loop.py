"""The training loop that both on-device workers run (``upstream_worker.py``, ``ondevice_worker.py``).

A worker trains artifacts with an on-device training API, upstream's ``onnxruntime.training.api``
or ``onnxtrain.api`` (the same names and calls), in a process of its own that has not imported
torch, so its memory figures are those of on-device training alone. Standard library, numpy and
onnx only: the upstream virtualenv imports this file too.

``job.json`` (written by ``bench.cell``) names the exported ONNX model, the batches
(``data.npz``), the parameters to train, the loss kind and the step counts. The worker measures
its resident set size once the model is loaded, then generates the artifacts, creates the
sessions and trains (step = ``module(*inputs, labels)``, ``optimizer.step()``,
``module.lazy_reset_grad()``), and writes the same figures as a cell.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory  # noqa: E402  (bench/memory.py: standard library only)


def load_batches(job: dict) -> list[dict]:
    """The batches of ``job["data_path"]`` (``data.npz``, keys ``<batch>/<name>``)."""
    import numpy as np

    data = np.load(job["data_path"])
    return [{k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(f"{i}/")}
            for i in range(job["n_batches"])]


def train(job: dict, result: dict, generate: Callable[[str], None], open_module: Callable[[str], tuple]) -> dict:
    """Measure the baseline (the caller has loaded the model), ``generate(artifact_dir)`` the
    artifacts, ``open_module(artifact_dir)`` -> ``(module, optimizer, labels dtype)``, train;
    returns ``result`` filled."""
    import numpy as np

    batches = load_batches(job)
    memory.trim()
    result["rss_before_mb"] = memory.rss_mb()
    ready = time.perf_counter()
    out = job["artifact_dir"]
    os.makedirs(out, exist_ok=True)
    generate(out)
    result["phases_s"]["artifacts"] = time.perf_counter() - ready
    t0 = time.perf_counter()
    module, optimizer, labels_dtype = open_module(out)
    optimizer.set_learning_rate(job["lr"])
    feeds = [([b[n] for n in job["input_names"]], b["labels"].astype(labels_dtype)) for b in batches]
    result["phases_s"]["sessions"] = time.perf_counter() - t0

    def step(i: int) -> float:
        inputs, labels = feeds[i % len(feeds)]
        value = module(*inputs, labels)
        optimizer.step()
        module.lazy_reset_grad()
        return float(value)

    losses = [step(0)]
    result["first_step_s"] = time.perf_counter() - ready
    more, times, result["warmup_steps_run"] = run_steps(step, job["warmup"], job.get("warmup_s", 0.0), job["steps"])
    losses += more
    result.update(step_times_s=times, median_step_s=float(np.median(times)) if times else None, losses=losses,
                  first_loss=losses[0], **memory.peaks(result["rss_before_mb"]))
    return result


def run_steps(step: Callable[[int], float], warmup: int, warmup_s: float, steps: int
              ) -> tuple[list[float], list[float], int]:
    """After step 0: warm up with steps 1, 2, ... until at least ``warmup`` steps and ``warmup_s``
    seconds of them have run, then time ``steps`` steps. Returns the losses of all these steps,
    the timed steps' seconds and the number of warm-up steps.

    Warming up by time as well as by count gives every system its steady state whatever its step
    time: a runtime whose first runs fault in fresh buffers and grow its arena (onnxtrain's
    on-device MLP: ~1.7 ms steps for its first ~20 steps, ~1.0 ms after) is not timed in that
    start-up while a slower model still gets its few warm-up steps.
    """
    losses, start, i = [], time.perf_counter(), 1
    while i <= warmup or time.perf_counter() - start < warmup_s:
        losses.append(step(i))
        i += 1
    times = []
    for j in range(i, i + steps):
        t0 = time.perf_counter()
        losses.append(step(j))
        times.append(time.perf_counter() - t0)
    return losses, times, i - 1


def main(run: Callable[[dict], dict], argv: list[str]) -> int:
    """``worker.py job.json result.json``: ``run(job)``, or the error, written to result.json."""
    job_path, result_path = argv[:2]
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as exc:  # noqa: BLE001 - reported to the cell
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
                  "traceback": traceback.format_exc()[-6000:]}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0
