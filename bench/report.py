"""RESULTS.md and the speedup plot from a results dict (see :mod:`bench.run`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench import analysis

ANALYSIS = Path(__file__).resolve().parent / "ANALYSIS.md"
SYSTEM_LABELS = {"eager": "eager (PyTorch)", "eager_fused": "eager + fused AdamW (reference)", "compile": "torch.compile", "ortmodule": "ORTModule",
                 "ortmodule_recompute": "ORTModule + recompute (memory_opt_level=2)",
                 "ondevice": "on-device (onnxtrain)", "upstream": "upstream ORT-training 1.19.2"}


def capacity_section(capacity: dict | None) -> list[str]:
    """Markdown for the memory-cap search (bench/capacity.py), or nothing if it did not run."""
    if not capacity:
        return []
    lines = [f"## Largest {capacity['model']} batch within {capacity['cap_mb']:.0f} MB", "",
             "Each batch size ran in its own process (one warm-up and one timed step); a batch fits when its "
             "peak RSS (the whole process) stays within the cap. Doubling from the model's batch, then "
             f"{capacity.get('bisect_steps', 2)} bisection steps. "
             + ("Every PyTorch system trains the model and its loss as one module (`bench.models.with_loss`): "
                "ORTModule runs the loss inside its graph." if capacity.get("loss_in_module")
                else "The loss is computed by PyTorch outside the module."), "",
             "| system | largest batch | peak RSS MB at it | tried (batch: peak MB) |", "|---|---:|---:|---|"]
    for system, found in capacity["systems"].items():
        tried = ", ".join(f"{t['batch']}: {_f(t['peak_rss_mb'], '{:.0f}')}" + ("" if t["status"] == "ok" else " error")
                          for t in found["tried"])
        largest = found["largest_batch"]
        shown = "none" if largest is None else (f"≥ {largest}" if found.get("capped_by_search") else str(largest))
        lines.append(f"| {SYSTEM_LABELS.get(system, system)} | {shown} | {_f(found['peak_rss_mb'], '{:.0f}')} | "
                     f"{tried} |")
    return lines + [""]


def _matmul_line(matmul: dict, threads: int) -> str:
    """The peak matmul rate line: the faster library's rate, and each library's."""
    libraries = matmul.get("by_library", {})
    each = ", ".join(f"{name} {_f(r.get('gflops'), '{:.0f}')}" if "gflops" in r
                     else f"{name} failed: {r.get('error')}" for name, r in libraries.items())
    how = f"the faster of {' and '.join(libraries)}" if libraries else "torch.mm"  # results.json of older runs
    n = matmul.get("n", 2048)
    return (f"- peak float32 matmul rate ({how}, {n}x{n}, {threads} threads, best of "
            f"{matmul.get('reps', '?')}): **{_f(matmul.get('gflops'), '{:.0f}')} GFLOP/s**"
            + (f" ({each} GFLOP/s)" if each else ""))


def _warmup(settings: dict) -> str:
    seconds = settings.get("warmup_s")
    return (f"warm-up steps until at least {settings['warmup']} have run and {seconds:g} s have passed" if seconds
            else f"{settings['warmup']} warm-up steps")


def _more_rounds(settings: dict) -> str:
    """`` (5 for mlp, cnn: steps of a few ms)`` for models that run more rounds than the suite's."""
    more = settings.get("more_rounds") or {}
    by_count: dict[int, list[str]] = {}
    for model, extra in more.items():
        by_count.setdefault(settings["rounds"] + extra, []).append(model)
    if not by_count:
        return ""
    parts = "; ".join(f"{n} for {', '.join(ms)}" for n, ms in sorted(by_count.items()))
    return f" ({parts}: steps of a few ms, where one slow spell of the host moves a cell's median)"


def _load_probe_lines(probe: dict | None) -> list[str]:
    """The settings line on the load probe and the rounds it left out or added."""
    if not probe:
        return []
    extra = probe.get("extra_rounds") or []
    added = "; ".join(f"extra round {i}: {', '.join(models)}" for i, models in enumerate(extra, start=1))
    return [f"- load probe: every cell measures a short torch.mm burst (1024x1024, median of 8) before (in a child "
            f"process, so as not to warm the cell's PyTorch) and after its steps; "
            f"{probe['disturbed_cells']} of {probe['cells']} cells ran it below "
            f"{probe['steady_fraction']:.0%} of the run's calm rate (the upper quartile of the cells' slower probes, "
            f"{probe['reference_gflops']:.0f} GFLOP/s): outside "
            f"work had taken part of the machine, so they are left out of the medians wherever the same system "
            f"has undisturbed rounds (marked * below)"
            + (f"; models short of undisturbed rounds got more rounds of all their systems ({added})" if extra
               else "; no extra rounds")]


def _f(value, fmt="{:.1f}", none="—"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return fmt.format(value)


def _status(entry: dict) -> str:
    status = entry["status"]
    if status == analysis.REFERENCE:
        return "reference"
    if status == analysis.ERROR:
        error = (entry.get("error") or "").replace("|", "\\|").replace("\n", " ")
        return f"ERROR: {error[:160]}"
    rel = entry.get("max_loss_rel")
    rel_text = "" if rel is None else f" (rel. diff {rel:.1e})"
    if entry.get("trajectory_reference"):
        rel_text += f"; steps 1+ vs {entry['trajectory_reference']} {entry['max_trajectory_rel']:.1e}"
    if status == analysis.FAILED:
        return f"**FAILED**{rel_text}"
    return f"{status}{rel_text}"


def _read_json(folder: Path | None, name: str) -> dict | None:
    path = folder and Path(folder) / name
    if not path or not path.exists():
        return None
    return json.loads(path.read_text())


def side_sections(results_dir: Path | None) -> list[str]:
    """Sections of the benchmarks that run on their own (bench/optim_step.py, bench/precision.py,
    bench/hf_trainer.py), from their JSON beside results.json; nothing for those that have not run."""
    from bench import hf_trainer, optim_step, precision

    lines = []
    optim = _read_json(results_dir, "optim_step.json")
    if optim:
        lines += ["## Optimizer step: FusedAdam and LAMB vs torch.optim.AdamW", "",
                  "`python -m bench.optim_step`:", "", optim_step.markdown(optim), ""]
    mixed = _read_json(results_dir, "precision.json")
    if mixed:
        lines += ["## bf16 autocast vs fp32", "", "`python -m bench.precision`:", "",
                  precision.markdown_table(mixed), ""]
    trainers = _read_json(results_dir, "hf_trainer.json")
    if trainers:
        lines += ["## Hugging Face Trainer vs ORTTrainer", "", "`python -m bench.hf_trainer`:", "",
                  hf_trainer.markdown(trainers), ""]
    return lines


def markdown(results: dict, results_dir: Path | None = None) -> str:
    """RESULTS.md for ``results``; ``results_dir`` holds the side benchmarks' JSON (capacity,
    optimizer step, precision) that are shown when present."""
    meta, summary = results["meta"], results["summary"]
    settings = meta["settings"]
    lines = ["# onnxtrain benchmark results", ""]
    lines += [f"- date: {meta['date']}",
              f"- command: `{meta['command']}`",
              f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
              f"{meta['machine']['memory_gb']:.0f} GB, {meta['machine']['platform']}",
              f"- load average before / after the run: {meta['machine']['loadavg_start']} / "
              f"{meta['machine'].get('loadavg_end')}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
              f"- onnxtrain measured: `{meta.get('onnxtrain_path')}` (last commit {meta.get('onnxtrain_commit')})"
              + ("; every cell imports a copy taken at the start of the run" if meta.get("onnxtrain_snapshot")
                 else ""),
              f"- upstream: {meta.get('upstream') or 'not run'}",
              *([f"- **partial results: {settings['rounds_done']} of {settings['rounds']} rounds completed**"]
                if settings.get("rounds_done", settings["rounds"]) < settings["rounds"] else []),
              f"- settings: {settings['rounds']} rounds{_more_rounds(settings)}, {settings['steps']} timed steps "
              f"after step 0 and {_warmup(settings)}, {settings['threads']} threads, systems interleaved "
              f"(round r runs every system once per model, order reversed on odd rounds)",
              *_load_probe_lines(meta.get("load_probe")),
              f"- wall time of the run: {meta.get('wall_s', 0) / 60:.1f} min",
              _matmul_line(meta["matmul"], settings["threads"]),
              ""]
    lines += ["How to read: *step ms* is the median over rounds (the undisturbed ones, see the load probe) of "
              "each cell's median full training step "
              "(forward, loss, backward, AdamW update). *vs eager* is eager's step time / the system's, "
              "both from this run (> 1 = faster than eager). *first step s* runs from \"model and data "
              "ready\" to the end of step 0: export, artifacts, sessions and compilation included. "
              "*peak RSS MB* is the cell process's peak resident set size (`VmHWM`; the worker's for the on-device systems); *Δ MB* is that "
              "peak minus the RSS measured right before the system was prepared (what training added). "
              "Every cell runs in its own process. *x bound* is the step time / the matmul-bound time "
              "(the step's FLOPs, counted with `torch.utils.flop_counter.FlopCounterMode` on an eager "
              "forward + backward, divided by the peak matmul rate). *loss check*: the first-step loss "
              f"equals eager's within {analysis.LOSS_RTOL:g} relative in every round (same weights, same "
              f"data, dropout 0), and the losses of steps 1-{analysis.TRAJECTORY_STEPS - 1} follow those of the system that "
              f"applies the same update (ORTModule, torch.compile: eager's; on-device: upstream's) within "
              f"{analysis.TRAJECTORY_RTOL:g} (\"steps 1+\": a wrong gradient shows there), else **FAILED**.", "",
              "The machine is shared with other work (another engineer's test runs), so timings are "
              "noisy; the interleaved rounds spread the drift over all systems alike, and the load probe "
              "keeps cells that ran while outside work held a core out of the medians.", "",
              "Systems: *eager* and *torch.compile* (default inductor backend, a fresh inductor cache per "
              "cell, so the first step is a cold compile) train with `torch.optim.AdamW` (its default, "
              "single-tensor CPU update); *eager + fused AdamW* is eager with `AdamW(fused=True)`, a "
              "reference that shows how much of a gain is the optimizer's; *ORTModule* trains with "
              "`onnxtrain.torch.optim.FusedAdam` in `torch.optim.AdamW`'s mode and defaults; "
              "*on-device* exports with `torch.onnx.export(dynamo=True, optimize=False)` (dynamic batch; "
              "onnxtrain's artifacts translations for training-mode batch norm and padded embeddings), "
              "then generates artifacts with `OptimType.AdamW` and trains with `onnxtrain.api` in a worker "
              "process that does not import torch (`bench/ondevice_worker.py`); *upstream* exports with the "
              "TorchScript exporter (opset 14, training mode), then generates onnxruntime-training 1.19.2's "
              "artifacts and trains with `onnxruntime.training.api` in a worker in its own virtualenv. For "
              "both on-device systems the memory figures are the worker's (artifacts, sessions and steps, "
              "as on a device) and the first step includes the export. `OptimType.AdamW` is upstream's "
              "(Hugging Face-style) AdamW, so the losses of the two on-device systems drift slightly from "
              "torch's after step 0 (step 0 is checked).", ""]
    for model, systems in summary.items():
        spec = results["models"].get(model, {})
        first = next(iter(systems.values()))
        bound = first.get("bound_ms")
        flops = first.get("flops_per_step")
        lines += [f"## {model}", "", spec.get("description", ""), "",
                  f"FLOPs per training step: {_f(flops and flops / 1e9, '{:.2f}')} GFLOP; matmul-bound step: "
                  f"{_f(bound, '{:.2f}')} ms", "",
                  "| system | step ms | vs eager | x bound | first step s | peak RSS MB | Δ MB | loss check |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for system, e in systems.items():
            lines.append(f"| {SYSTEM_LABELS.get(system, system)} | {_f(e.get('median_step_ms'), '{:.2f}')} | "
                         f"{_f(e.get('ratio_vs_eager'), '{:.2f}x')} | {_f(e.get('x_bound'), '{:.2f}')} | "
                         f"{_f(e.get('first_step_s'), '{:.2f}')} | {_f(e.get('peak_rss_mb'), '{:.0f}')} | "
                         f"{_f(e.get('peak_increase_mb'), '{:.0f}')} | {_status(e)} |")
        lines += ["", "Step ms by round (the spread shows the machine's noise; * disturbed, left out of the "
                  "medians): " + "; ".join(
                      f"{system} " + " / ".join(_f(v, "{:.1f}") + ("*" if disturbed else "") for v, disturbed in
                                                zip(e.get("step_ms_by_round", []),
                                                    e.get("disturbed_by_round") or [False] * len(e.get("step_ms_by_round", []))))
                      for system, e in systems.items())]
        k = settings.get("k_losses", 5)
        lines += ["", f"First {k} losses:", ""]
        for system, e in systems.items():
            losses = e.get("losses") or []
            lines.append(f"- {system}: " + (", ".join(f"{v:.5f}" for v in losses[:k]) or "—"))
        notes = [f"{system}: {n}" for system, e in systems.items() for n in e.get("notes", [])]
        if notes:
            lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
        lines.append("")
    # the standalone search (python -m bench.capacity) when it ran after the suite's own
    capacity_file = _read_json(results_dir, "capacity.json")
    if capacity_file and results.get("capacity") and capacity_file.get("date", "") < meta["date"]:
        capacity_file = None
    lines += capacity_section(capacity_file or results.get("capacity"))
    lines += side_sections(results_dir)
    lines += ["## Targets", "", "Ratios measured in this run.", "",
              "| target | measured | status | detail |", "|---|---|---|---|"]
    extra_targets = [capacity_file["target"]] if capacity_file and capacity_file.get("target") else []
    for t in results["targets"] + extra_targets:
        lines.append(f"| {t['target']} | {t['measured'] or '—'} | **{t['status']}** | {t['detail']} |")
    lines += ["", "N/A: not measured in this run (model or system not selected, or the reference system "
              "errored). A target whose onnxtrain cell errored or failed its loss check is MISSED.", ""]
    if meta.get("plot"):
        lines += [f"![speedup vs eager]({meta['plot']})", ""]
    if meta.get("loss_plot"):
        lines += [f"![training loss per step]({meta['loss_plot']})", ""]
    if ANALYSIS.exists():
        lines += ["## Why targets are missed, and what would close them", "",
                  f"From `{ANALYSIS.name}` (written by hand from profiles; not regenerated by this run).", "",
                  ANALYSIS.read_text().strip(), ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Bar chart of the speedup vs eager per model and system; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    summary = results["summary"]
    models = list(summary)
    systems = [s for s in SYSTEM_LABELS if s != "eager" and any(s in summary[m] for m in models)]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(models) + 2), 4.5))
    width = 0.8 / max(len(systems), 1)
    colors = {"compile": "#7f7f7f", "ortmodule": "#1f77b4", "ondevice": "#2ca02c", "upstream": "#ff7f0e"}
    for i, system in enumerate(systems):
        xs, heights, hatches = [], [], []
        for j, model in enumerate(models):
            e = summary[model].get(system)
            if not e or e.get("ratio_vs_eager") is None:
                continue
            xs.append(j + (i - (len(systems) - 1) / 2) * width)
            heights.append(e["ratio_vs_eager"])
            hatches.append("//" if e["status"] == analysis.FAILED else "")
        # bars start at 1 (as fast as eager): up for speedups, down for slowdowns
        bars = ax.bar(xs, [h - 1 for h in heights], width, bottom=1, label=SYSTEM_LABELS[system],
                      color=colors.get(system))
        for bar, hatch, h in zip(bars, hatches, heights):
            bar.set_hatch(hatch)
            ax.annotate(f"{h:.2f}", (bar.get_x() + bar.get_width() / 2, h), ha="center",
                        va="bottom" if h >= 1 else "top", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # speedups and slowdowns alike: 2x and 0.5x are the same distance from 1
    low, high = ax.get_ylim()
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10, 20, 50, 100) if low <= t <= high]
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("speedup vs eager PyTorch (> 1 = faster, log scale)")
    ax.set_title(f"Training step speedup vs eager ({results['meta']['settings']['threads']} CPU threads; "
                 f"hatched = loss check FAILED)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_losses(results: dict, path: Path) -> bool:
    """Loss per training step, one panel per model, one line per system (the cells of one
    round: every system trains the same batches from the same weights); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summary = results["summary"]
    models = [m for m in summary if any(e.get("losses") for e in summary[m].values())]
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for system, entry in summary[model].items():
            losses = entry.get("losses") or []
            if losses:
                ax.plot(range(len(losses)), losses, label=SYSTEM_LABELS.get(system, system), linewidth=1.2,
                        linestyle="--" if system == "eager" else "-")
        ax.set(title=model, xlabel="step")
    axes[0][0].set_ylabel("training loss")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Training loss per step (the same batches and initial weights for every system)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    """``python -m bench.report [results.json] [RESULTS.md]``: render the report and plot again."""
    import argparse
    import os

    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    parser.add_argument("results", nargs="?", default=str(here / "results" / "results.json"))
    parser.add_argument("report", nargs="?", default=str(here / "RESULTS.md"))
    args = parser.parse_args(argv)
    results_path, report_path = Path(args.results), Path(args.report)
    results = json.loads(results_path.read_text())
    plot_path = results_path.parent / "speedup.png"
    if plot(results, plot_path):
        results["meta"]["plot"] = os.path.relpath(plot_path, report_path.parent)
    if plot_losses(results, results_path.parent / "losses.png"):
        results["meta"]["loss_plot"] = os.path.relpath(results_path.parent / "losses.png", report_path.parent)
    report_path.write_text(markdown(results, results_path.parent))
    print(f"wrote {report_path}, {plot_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
