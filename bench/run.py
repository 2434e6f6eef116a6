"""The benchmark suite: every model x system cell in its own process, interleaved in rounds.

    python -m bench --quick                  # < 5 minutes: mlp + gpt; eager, ortmodule, ondevice (+ upstream)
    python -m bench                          # everything (long)
    python -m bench --models gpt,cnn --systems eager,ortmodule --rounds 3 --out /tmp/b

Writes ``<out>/results.json`` (every cell, the aggregates, the targets), ``<out>/speedup.png``
and the report ``RESULTS.md`` (``bench/RESULTS.md`` when ``--out`` is the default
``bench/results``, else ``<out>/RESULTS.md``; ``--report`` overrides).

Round ``r`` runs every selected system once per model (in the systems' order on even rounds,
reversed on odd ones), so slow drift of a shared machine hits all systems alike; each figure is
the median over rounds. Models with steps of a few milliseconds (``Spec.more_rounds``: the MLP
and the CNN) run that many rounds more than ``--rounds``. Before the rounds it measures the peak
matmul rate and, per model, the FLOPs of one eager training step, each in its own process.

The machine is shared, and outside work sometimes takes a core for minutes. Every cell measures
a short matmul burst before and after its steps (``bench.probe.load_probe``); a cell whose probe
ran below 70% of the run's calm rate counts as *disturbed* and is left out of the medians where
its system has undisturbed rounds (``bench.analysis.mark_disturbed``). After the planned rounds, a
model with a system short of undisturbed rounds gets another round of all its systems, up to
``--extra-rounds`` times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from bench import analysis, capacity, models, report
from bench.cell import SYSTEMS, TORCH_SYSTEMS, upstream_venv

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results"

QUICK = {"models": ["mlp", "gpt"], "systems": ["eager", "ortmodule", "ondevice", "upstream"], "rounds": 2,
         "steps": 10, "warmup": 2, "warmup_s": 0.5, "memory_cap_mb": 0, "extra_rounds": 0}
# every system but the memory-optimized ORTModule, which the memory-cap search compares
FULL = {"models": models.MAIN_MODELS, "systems": [s for s in SYSTEMS if s != "ortmodule_recompute"], "rounds": 3, "steps": 15, "warmup": 3, "warmup_s": 1.0,
        "memory_cap_mb": 2048, "extra_rounds": 3}
CAPACITY_SYSTEMS = capacity.DEFAULT_SYSTEMS


def bench_env(threads: int) -> dict:
    """The environment of every cell process: this checkout importable, nothing downloaded."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def run_subprocess_json(cmd: list[str], out_file: Path, timeout: float, env: dict) -> dict:
    """Run ``cmd`` (which writes JSON to ``out_file``); an error dict if it crashes or times out."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
    if out_file.exists():
        return json.loads(out_file.read_text())
    tail = (proc.stderr or proc.stdout or "")[-3000:]
    return {"status": "error", "error": f"cell process exited {proc.returncode} without a result: {tail}"}


def run_cell(model: str, system: str, args, workdir: Path, env: dict, round_index: int | str = 0,
             count_flops: bool = False, batch: int | None = None, steps: int | None = None,
             warmup: int | None = None, loss_in_module: bool = False, load_probe: bool = False) -> dict:
    """One cell in its own process. ``warmup`` given (the memory-cap search, the FLOP count): that
    many warm-up steps and no more; else ``args.warmup`` steps and ``args.warmup_s`` seconds."""
    out_file = workdir / f"{model}-{system}-r{round_index}{'-flops' if count_flops else ''}.json"
    steps = 0 if count_flops else (args.steps if steps is None else steps)
    warmup_s = args.warmup_s if warmup is None and not count_flops else 0.0
    warmup = 0 if count_flops else (args.warmup if warmup is None else warmup)
    cmd = [sys.executable, "-m", "bench.cell", "--model", model, "--system", system, "--steps", str(steps),
           "--warmup", str(warmup), "--warmup-s", str(warmup_s), "--threads", str(args.threads), "--out", str(out_file),
           "--timeout", str(args.timeout)]
    if count_flops:
        cmd.append("--count-flops")
    if batch:
        cmd += ["--batch", str(batch)]
    if loss_in_module:
        cmd.append("--loss-in-module")
    if load_probe:
        cmd.append("--load-probe")
    if args.upstream_venv:
        cmd += ["--upstream-venv", str(args.upstream_venv)]
    if system == "compile":  # a cold compile every time: the first-step latency of a fresh script
        env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(workdir / f"inductor-{model}-r{round_index}")}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    cell = run_subprocess_json(cmd, out_file, args.timeout, env)
    cell.setdefault("model", model)
    cell.setdefault("system", system)
    cell.update(round=round_index, wall_s=time.perf_counter() - t0, loadavg_before=round(load, 2))
    return cell


def capacity_search(args, workdir: Path, env: dict) -> dict:
    """The largest batch of ``args.capacity_model`` within ``args.memory_cap_mb`` for each capacity system."""
    model = args.capacity_model
    loss_in_module = not getattr(args, "capacity_loss_outside", False)
    result = {"model": model, "cap_mb": args.memory_cap_mb, "systems": {}, "bisect_steps": capacity.BISECT_STEPS,
              "loss_in_module": loss_in_module,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    for system in args.capacity_systems:
        def run(batch: int, system=system) -> dict:
            # the on-device system has its loss in its training graph anyway
            cell = run_cell(model, system, args, workdir, env, round_index=f"cap{batch}", batch=batch, steps=1,
                            warmup=1, loss_in_module=loss_in_module and system in TORCH_SYSTEMS)
            figure = f"peak RSS {cell.get('peak_rss_mb', float('nan')):.0f} MB" if cell["status"] == "ok" else \
                f"ERROR {str(cell.get('error'))[:200]}"
            print(f"  memory cap {args.memory_cap_mb:.0f} MB: {model} {system:10s} batch {batch:5d} {figure}",
                  flush=True)
            return cell

        result["systems"][system] = capacity.largest_batch(run, models.get(model).batch, args.memory_cap_mb)
    return result


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip() \
            or None
    except (OSError, subprocess.SubprocessError):
        return None


def _short_path(path: str) -> str:
    """``path`` relative to the repository when it lies inside it."""
    full = Path(path).resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(full)


def _onnxtrain_location(env: dict) -> tuple[str | None, str | None]:
    code = "import onnxtrain, pathlib; print(pathlib.Path(onnxtrain.__file__).resolve().parent)"
    try:
        path = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None, None
    if not path:
        return None, None
    commit = _git(["log", "-1", "--format=%h", "--", "."], Path(path))  # the last commit that changed it
    dirty = _git(["status", "--porcelain", "--", "."], Path(path))
    return path, (f"{commit}{' + uncommitted changes' if dirty else ''}" if commit else None)


def snapshot_onnxtrain(env: dict, folder: Path) -> tuple[str | None, str | None]:
    """Copy the onnxtrain package that ``env`` imports into ``folder`` and put it first on the cells'
    PYTHONPATH, so every cell of the run measures the same code even if the source tree changes
    meanwhile. Returns (the original location, its last commit)."""
    path, commit = _onnxtrain_location(env)
    if path is None:
        return None, None
    shutil.copytree(path, folder / "onnxtrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    return path, commit


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"quick run (< 5 min): models {','.join(QUICK['models'])}, systems "
                             f"{','.join(QUICK['systems'])} (upstream only if its venv exists), "
                             f"{QUICK['rounds']} rounds of {QUICK['steps']} steps")
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(models.SPECS)}")
    parser.add_argument("--systems", help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, help="untimed steps after step 0 (at least)")
    parser.add_argument("--warmup-s", type=float,
                        help=f"and at least this many seconds of them (default {FULL['warmup_s']}, "
                             f"{QUICK['warmup_s']} with --quick)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k-losses", type=int, default=5, help="losses of the first K steps in the report")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="folder for results.json and speedup.png")
    parser.add_argument("--report", default=None, help="RESULTS.md path (default: see above)")
    parser.add_argument("--upstream-venv", default=None,
                        help="virtualenv with onnxruntime-training 1.19.2 (default: bench/.venv-upstream if it "
                             "exists; create it with bench/setup_upstream.sh)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    parser.add_argument("--no-flops", action="store_true", help="skip the FLOP count and the matmul probe")
    parser.add_argument("--extra-rounds", type=int,
                        help="at most this many more rounds for models whose systems have fewer undisturbed "
                             f"rounds than --rounds (default {FULL['extra_rounds']}, {QUICK['extra_rounds']} with "
                             "--quick)")
    parser.add_argument("--no-load-probe", action="store_true",
                        help="no load probe in the cells: every round counts, no extra rounds")
    parser.add_argument("--memory-cap-mb", type=float, default=None,
                        help="after the rounds, search the largest batch of --capacity-model whose cell's peak RSS "
                             f"stays within this many MB (0: skip; default {FULL['memory_cap_mb']}, "
                             "0 with --quick)")
    parser.add_argument("--capacity-model", default="gpt", help="model of the memory-cap search")
    parser.add_argument("--capacity-systems", default=",".join(CAPACITY_SYSTEMS),
                        help="systems of the memory-cap search")
    parser.add_argument("--capacity-loss-outside", action="store_true",
                        help="memory-cap search: compute the loss in PyTorch outside the module (default: the "
                             "module returns its loss, bench.models.with_loss, for every PyTorch system)")
    parser.add_argument("--no-snapshot", action="store_true",
                        help="import onnxtrain from where it is installed in every cell (default: a copy taken "
                             "at the start, so edits to the source during the run do not mix versions)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.models = args.models.split(",") if args.models else list(preset["models"])
    args.systems = args.systems.split(",") if args.systems else list(preset["systems"])
    for m in args.models:
        models.get(m)
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {SYSTEMS}")
    args.capacity_systems = args.capacity_systems.split(",")
    models.get(args.capacity_model)
    unknown = [s for s in args.capacity_systems if s not in SYSTEMS or s == "upstream"]
    if unknown:
        parser.error(f"--capacity-systems: unknown or unsupported {unknown}")
    for key in ("rounds", "steps", "warmup", "warmup_s", "memory_cap_mb", "extra_rounds"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    venv = upstream_venv(args.upstream_venv)
    if "upstream" in args.systems and venv is None:
        if args.upstream_venv:
            parser.error(f"--upstream-venv {args.upstream_venv}: no bin/python there")
        args.systems.remove("upstream")  # optional: only with its virtualenv
    args.upstream_venv = str(venv) if venv and "upstream" in args.systems else None
    return args


def default_report_path(args, out: Path) -> Path:
    """Where the markdown report goes: ``--report``, else ``bench/RESULTS.md`` for a full run into
    the default results folder (the committed table is a full run's), else next to the results
    (a ``--quick`` run does not replace the committed table)."""
    if args.report:
        return Path(args.report)
    return HERE / "RESULTS.md" if out == DEFAULT_OUT.resolve() and not args.quick else out / "RESULTS.md"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path = default_report_path(args, out)
    env = bench_env(args.threads)
    start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc)
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    print(f"bench: models {args.models}, systems {args.systems}, {args.rounds} rounds x {args.steps} steps",
          flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        workdir = Path(tmp)
        if args.no_snapshot:
            onnxtrain_at = _onnxtrain_location(env)
        else:
            (workdir / "snapshot").mkdir()
            onnxtrain_at = snapshot_onnxtrain(env, workdir / "snapshot")
        matmul, flops = {}, {}
        if not args.no_flops:
            probe = [sys.executable, "-m", "bench.probe", "--threads", str(args.threads)]
            try:
                matmul = json.loads(subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True,
                                                   timeout=300).stdout)
            except (ValueError, subprocess.SubprocessError) as exc:
                matmul = {"error": str(exc)}
            print(f"  peak matmul: {matmul.get('gflops', float('nan')):.0f} GFLOP/s ({matmul.get('library')})",
                  flush=True)
            for model in args.models:
                cell = run_cell(model, "eager", args, workdir, env, count_flops=True)
                flops[model] = cell.get("flops_per_step")
                print(f"  {model}: {flops[model] and flops[model] / 1e9:.2f} GFLOP per step", flush=True)

        cells = []
        planned = {model: args.rounds + models.get(model).more_rounds for model in args.models}
        bar = tqdm(total=sum(planned.values()) * len(args.systems), desc="cells", unit="cell")

        def run_round(r: int, round_models: list[str]) -> None:
            for model in round_models:
                order = args.systems if r % 2 == 0 else list(reversed(args.systems))
                for system in order:
                    bar.set_postfix_str(f"round {r} {model} {system}")
                    cell = run_cell(model, system, args, workdir, env, round_index=r,
                                    load_probe=not args.no_load_probe)
                    cell.pop("traceback", None)  # keep results.json small (the error stays)
                    cells.append(cell)
                    figure = (f"{cell['median_step_s'] * 1e3:.2f} ms/step, first step {cell['first_step_s']:.1f} s"
                              if cell["status"] == "ok" else f"ERROR {cell['error'][:200]}")
                    probes = " ".join(f"{p:.0f}" for p in cell.get("load_probe_gflops") or [])
                    bar.write(f"  round {r} {model:10s} {system:10s} {figure}  ({cell['wall_s']:.0f} s"
                              + (f", probe {probes} GFLOP/s)" if probes else ")"))
                    bar.update()

        for r in range(max(planned.values(), default=0)):
            run_round(r, [model for model in args.models if r < planned[model]])
            if r + 1 < args.rounds:  # a run stopped later still leaves the rounds it completed
                write_outputs(args, argv, cells, r + 1, matmul, flops, onnxtrain_at, started, start, loadavg_start,
                              out, report_path, quiet=True)
        extra = []  # the models of each extra round
        while not args.no_load_probe and len(extra) < args.extra_rounds:
            analysis.mark_disturbed(cells)
            pending = analysis.unsteady_models(cells, args.rounds)
            if not pending:
                break
            bar.total += len(pending) * len(args.systems)
            index = max(planned.values()) + len(extra)  # past every model's planned rounds: unique
            bar.write(f"  extra round {index} for {', '.join(pending)}: disturbed cells")
            run_round(index, pending)
            extra.append(pending)
        bar.close()
        capacity_result = capacity_search(args, workdir, env) if args.memory_cap_mb else None
        if not args.no_flops:  # again at the end: the machine's state may have changed
            try:
                again = json.loads(subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True,
                                                  timeout=300).stdout)
                matmul["gflops_end"] = again.get("gflops")
                if again.get("gflops", 0) > matmul.get("gflops", 0):
                    matmul.update({k: again[k] for k in ("best_s", "gflops")})
            except (ValueError, subprocess.SubprocessError):
                pass

    results = write_outputs(args, argv, cells, args.rounds, matmul, flops, onnxtrain_at, started, start,
                            loadavg_start, out, report_path, capacity_result=capacity_result, extra_rounds=extra)
    summary = results["summary"]
    failed = [f"{m}/{s}" for m, ss in summary.items() for s, e in ss.items() if e["status"] == analysis.FAILED]
    if failed:
        print(f"loss check FAILED for {', '.join(failed)}", file=sys.stderr)
    print(f"done in {results['meta']['wall_s'] / 60:.1f} min")
    return 1 if failed else 0


def write_outputs(args, argv, cells, rounds_done, matmul, flops, onnxtrain_at, started, start, loadavg_start,
                  out: Path, report_path: Path, quiet: bool = False, capacity_result: dict | None = None,
                  extra_rounds: list[list[str]] | None = None) -> dict:
    """Aggregate ``cells`` and write results.json, the plot and RESULTS.md; return the results.
    ``extra_rounds``: the models of each extra round run for disturbed cells."""
    probe_reference = analysis.mark_disturbed(cells)
    summary = analysis.aggregate(cells)
    analysis.add_matmul_bound(summary, flops, matmul.get("gflops"))
    onnxtrain_path, onnxtrain_commit = onnxtrain_at
    eager_versions = next((c.get("versions") for c in cells if c.get("versions") and c["system"] != "upstream"), {})
    upstream_versions = next((c.get("versions") for c in cells if c["system"] == "upstream" and c.get("versions")),
                             None)
    results = {
        "meta": {
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python -m bench", *(shlex.quote(a) for a in argv)]),
            "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "memory_gb": _memory_gb(),
                        "platform": platform.platform(), "loadavg_start": loadavg_start,
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "versions": eager_versions,
            "upstream": (f"onnxruntime-training {upstream_versions.get('onnxruntime')} (onnx "
                         f"{upstream_versions.get('onnx')}, numpy {upstream_versions.get('numpy')}) in "
                         f"{_short_path(args.upstream_venv)}") if upstream_versions else None,
            "onnxtrain_path": onnxtrain_path, "onnxtrain_commit": onnxtrain_commit,
            "onnxtrain_snapshot": not args.no_snapshot,
            "settings": {"models": args.models, "systems": args.systems, "rounds": args.rounds,
                         "more_rounds": {m: models.get(m).more_rounds for m in args.models
                                         if models.get(m).more_rounds},
                         "rounds_done": rounds_done, "steps": args.steps, "warmup": args.warmup, "warmup_s": args.warmup_s,
                         "threads": args.threads, "k_losses": args.k_losses, "loss_rtol": analysis.LOSS_RTOL,
                         "memory_cap_mb": args.memory_cap_mb},
            "matmul": matmul, "flops_per_step": flops,
            "load_probe": None if probe_reference is None else {
                "reference_gflops": probe_reference, "steady_fraction": analysis.STEADY_FRACTION,
                "cells": sum(1 for c in cells if c.get("load_probe_gflops")),
                "disturbed_cells": sum(1 for c in cells if c.get("disturbed")),
                "extra_rounds": extra_rounds or []},
            "wall_s": time.perf_counter() - start,
        },
        "models": {m: {"description": models.get(m).description, "batch": models.get(m).batch}
                   for m in args.models},
        "summary": summary,
        "capacity": capacity_result,
        "cells": cells,
    }
    results["targets"] = analysis.targets(summary)
    capacity_target = capacity.target(capacity_result) if capacity_result else None
    if capacity_target:
        results["targets"].append(capacity_target)
    plot_path = out / "speedup.png"
    if report.plot(results, plot_path):
        results["meta"]["plot"] = os.path.relpath(plot_path, report_path.parent)
    if report.plot_losses(results, out / "losses.png"):
        results["meta"]["loss_plot"] = os.path.relpath(out / "losses.png", report_path.parent)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    report_path.write_text(report.markdown(results, out))
    if not quiet:
        print(f"wrote {out / 'results.json'}, {report_path}" + (f", {plot_path}" if results["meta"].get("plot") else ""))
    return results


if __name__ == "__main__":
    sys.exit(main())
