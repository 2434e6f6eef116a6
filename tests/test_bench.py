"""The benchmark suite (bench/): one tiny cell per system, the JSON it reports, the loss check.

The cells run in this process (``bench.cell.run_cell``; the suite runs each in its own
process) on the ``tiny`` model (MLP 32-16-4, batch 8) for a few steps. The upstream system
runs only where its virtualenv exists (bench/setup_upstream.sh).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bench import analysis, cell, report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ["eager", "eager_fused", "compile", "ortmodule", "ondevice"] + (["upstream"] if cell.upstream_venv(None) else [])
STEPS, WARMUP = 3, 1
FIELDS = {"model", "system", "status", "error", "steps", "warmup", "threads", "first_step_s", "median_step_s",
          "step_times_s", "losses", "first_loss", "rss_before_mb", "peak_rss_mb", "peak_increase_mb", "phases_s",
          "notes"}


@pytest.fixture(scope="module")
def tiny_cells():
    threads = torch.get_num_threads()
    cells = []
    try:
        for system in SYSTEMS:
            args = cell.parse_args(["--model", "tiny", "--system", system, "--steps", str(STEPS),
                                    "--warmup", str(WARMUP), "--threads", "2", "--timeout", "120"])
            result = cell.run_cell(args)
            result["round"] = 0
            cells.append(json.loads(json.dumps(result, default=str)))  # what the suite reads back
    finally:
        torch.set_num_threads(threads)
    return cells


def test_every_system_runs_a_tiny_cell_and_reports_its_figures(tiny_cells):
    for c in tiny_cells:
        assert c["status"] == "ok", (c["system"], c["error"], c.get("traceback"))
        assert FIELDS <= set(c), (c["system"], sorted(FIELDS - set(c)))
        assert len(c["step_times_s"]) == STEPS and len(c["losses"]) == 1 + WARMUP + STEPS
        assert c["median_step_s"] > 0 and c["first_step_s"] > 0
        assert c["peak_rss_mb"] >= c["rss_before_mb"] > 0
        assert abs(c["peak_increase_mb"] - (c["peak_rss_mb"] - c["rss_before_mb"])) < 1e-6
    eager = tiny_cells[0]["losses"]
    for c in tiny_cells[1:]:  # same weights, same data: the first loss is eager's
        assert c["first_loss"] == pytest.approx(eager[0], rel=1e-5), c["system"]
    summary = analysis.aggregate(tiny_cells)
    assert {e["status"] for e in summary["tiny"].values()} == {analysis.REFERENCE, analysis.OK}


def test_worker_systems_report_their_worker_process_without_torch(tiny_cells):
    """The on-device systems train in a worker process (bench/*_worker.py) whose memory figures
    are its own: no torch, and not the cell's resident set carried over by exec."""
    for c in tiny_cells:
        if c["system"] in cell.WORKER_SYSTEMS:
            assert c["pid"] != tiny_cells[0]["pid"] and "export" in c["phases_s"], c["system"]
            assert c["rss_before_mb"] < 200 and c["peak_increase_mb"] < 150, (c["system"], c["rss_before_mb"])


def test_warm_up_runs_for_its_count_and_its_seconds():
    import time

    from bench.worker_loop import run_steps

    seen = []

    def step(i):
        seen.append(i)
        time.sleep(0.01)
        return float(i)

    losses, times, warmup = run_steps(step, warmup=2, warmup_s=0.08, steps=3)
    assert warmup >= 8 and seen == list(range(1, warmup + 4)) and losses == [float(i) for i in seen]
    assert len(times) == 3 and all(t >= 0.01 for t in times)
    seen.clear()
    assert run_steps(step, warmup=2, warmup_s=0.0, steps=1)[2] == 2 and seen == [1, 2, 3]


def test_peak_rss_of_a_child_process_is_its_own():
    """``ru_maxrss`` of a process started from a big parent starts at the parent's size; the
    suite's peak (VmHWM) does not."""
    import numpy as np

    ballast = np.ones(400 * 2**20 // 8)  # 400 MB resident in this process
    code = "import sys; sys.path.insert(0, sys.argv[1]); import memory; print(memory.peak_rss_mb())"
    child = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench")], capture_output=True, text=True,
                           check=True)
    assert float(child.stdout) < 100 < ballast.nbytes / 2**20


def test_loss_check_follows_the_losses_after_the_first_step(tiny_cells):
    """A wrong gradient leaves the first loss alone: the losses of the following steps must follow
    those of the system that applies the same update (ORTModule: eager's)."""
    tiny = analysis.aggregate(tiny_cells)["tiny"]
    assert tiny["ortmodule"]["trajectory_reference"] == "eager"
    assert tiny["ortmodule"]["max_trajectory_rel"] < analysis.TRAJECTORY_RTOL
    cells = copy.deepcopy(tiny_cells)
    off = next(c for c in cells if c["system"] == "ortmodule")
    off["losses"][2] *= 1.005
    tiny = analysis.aggregate(cells)["tiny"]
    assert tiny["ortmodule"]["status"] == analysis.FAILED
    assert tiny["ortmodule"]["max_loss_rel"] < analysis.LOSS_RTOL  # the first loss still agrees
    assert "steps 1+ vs eager 5.0e-03" in report._status(tiny["ortmodule"])
    assert analysis.trajectory_agreement([1.0], [1.0]) is None
    assert analysis.trajectory_agreement([1.0, 2.0, float("nan")], [1.0, 2.0, 3.0])[0] is False


def test_loss_check_flags_a_mismatched_first_loss(tiny_cells):
    cells = copy.deepcopy(tiny_cells)
    bad = next(c for c in cells if c["system"] == "ondevice")
    bad["first_loss"] *= 1.01  # 1% off eager's
    bad["losses"][0] = bad["first_loss"]
    errored = {**copy.deepcopy(cells[0]), "system": "ortmodule", "round": 1, "status": "error",
               "error": "RuntimeError: boom"}
    summary = analysis.aggregate(cells + [errored])
    tiny = summary["tiny"]
    assert tiny["ondevice"]["status"] == analysis.FAILED
    assert tiny["ondevice"]["max_loss_rel"] == pytest.approx(0.01, rel=1e-3)
    assert tiny["ortmodule"]["status"] == analysis.OK  # one good round of two: figures from that round
    assert tiny["ortmodule"]["ok_rounds"] == 1 and tiny["ortmodule"]["errors"] == ["RuntimeError: boom"]
    assert tiny["eager"]["ratio_vs_eager"] == pytest.approx(1.0)
    # just inside and just outside the tolerance
    assert analysis.loss_agreement(1.0 + 0.9e-3, 1.0)[0] and not analysis.loss_agreement(1.0 + 1.1e-3, 1.0)[0]
    assert not analysis.loss_agreement(float("nan"), 1.0)[0]

    only_error = analysis.aggregate([{**errored, "round": 0}])
    assert only_error["tiny"]["ortmodule"]["status"] == analysis.ERROR

    results = {"meta": {"date": "today", "command": "python -m bench --test",
                        "machine": {"cpu": "cpu", "cores": 2, "memory_gb": 24.0, "platform": "linux",
                                    "loadavg_start": [0.0]},
                        "versions": {"torch": torch.__version__}, "settings": {
                            "rounds": 1, "steps": STEPS, "warmup": WARMUP, "threads": 2, "k_losses": 3},
                        "matmul": {"gflops": 100.0, "reps": 3}},
               "models": {"tiny": {"description": "tiny MLP"}}, "summary": summary,
               "targets": analysis.targets(summary)}
    text = report.markdown(results)
    assert "**FAILED**" in text and "## tiny" in text and "## Targets" in text


def test_disturbed_cells_are_left_out_of_the_medians_and_earn_extra_rounds(tiny_cells):
    template = next(c for c in tiny_cells if c["system"] == "eager")
    cells = []
    # (eager ms, ortmodule ms, ortmodule's slower probe) by round; eager's probes read 100 GFLOP/s
    for r, (eager_ms, ort_ms, ort_probe) in enumerate([(10.0, 5.0, 100.0), (10.0, 9.0, 60.0), (12.0, 6.0, 95.0)]):
        for system, ms, probe in (("eager", eager_ms, 100.0), ("ortmodule", ort_ms, ort_probe)):
            cells.append({**copy.deepcopy(template), "system": system, "round": r, "median_step_s": ms / 1e3,
                          "load_probe_gflops": [100.0, probe]})
    assert analysis.mark_disturbed(cells) == 100.0
    assert [c["disturbed"] for c in cells] == [False, False, False, True, False, False]  # 60 < 0.7 * 100 (the upper quartile)
    tiny = analysis.aggregate(cells)["tiny"]
    assert tiny["ortmodule"]["median_step_ms"] == pytest.approx(5.5)  # rounds 0 and 2 only
    assert tiny["ortmodule"]["steady_rounds"] == 2 and tiny["ortmodule"]["disturbed_by_round"] == [False, True, False]
    assert tiny["eager"]["median_step_ms"] == pytest.approx(10.0)
    assert tiny["ortmodule"]["ratio_vs_eager"] == pytest.approx(10.0 / 5.5)
    assert analysis.unsteady_models(cells, 3) == ["tiny"] and analysis.unsteady_models(cells, 2) == []

    results = {"meta": {"date": "today", "command": "python -m bench --test",
                        "machine": {"cpu": "cpu", "cores": 2, "memory_gb": 24.0, "platform": "linux",
                                    "loadavg_start": [0.0]},
                        "versions": {"torch": torch.__version__}, "settings": {
                            "rounds": 3, "steps": STEPS, "warmup": WARMUP, "threads": 2, "k_losses": 3},
                        "matmul": {"gflops": 100.0, "reps": 3},
                        "load_probe": {"reference_gflops": 100.0, "steady_fraction": analysis.STEADY_FRACTION,
                                       "cells": 6, "disturbed_cells": 1, "extra_rounds": [["tiny"]]}},
               "models": {"tiny": {"description": "tiny MLP"}}, "summary": analysis.aggregate(cells)}
    results["targets"] = analysis.targets(results["summary"])
    text = report.markdown(results)
    assert "ortmodule 5.0 / 9.0* / 6.0" in text and "1 of 6 cells" in text and "extra round 1: tiny" in text

    # every round of a system disturbed: its figures fall back to all of them
    for c in cells:
        c["load_probe_gflops"] = [50.0, 100.0] if c["system"] == "ortmodule" else [100.0, 100.0]
    analysis.mark_disturbed(cells)
    tiny = analysis.aggregate(cells)["tiny"]
    assert tiny["ortmodule"]["steady_rounds"] == 0 and tiny["ortmodule"]["median_step_ms"] == pytest.approx(6.0)
    # cells without probes (--no-load-probe) are never disturbed
    assert analysis.mark_disturbed([{**template, "round": 0}]) is None


def test_targets_are_met_missed_or_not_applicable():
    def entry(ms, status=analysis.OK, first=1.0, rss=100.0):
        return {"median_step_ms": ms, "status": status, "first_step_s": first, "peak_rss_mb": rss,
                "peak_increase_mb": rss / 2, "ratio_vs_eager": None}

    summary = {"mlp": {"eager": entry(10.0, analysis.REFERENCE), "ortmodule": entry(4.0, rss=90.0),
                       "compile": entry(5.0, first=30.0), "ondevice": entry(3.0), "upstream": entry(9.0)},
               "gpt": {"eager": entry(100.0, analysis.REFERENCE), "ortmodule": entry(90.0, analysis.FAILED)}}
    for model in summary.values():
        for e in model.values():
            e["ratio_vs_eager"] = model["eager"]["median_step_ms"] / e["median_step_ms"]
    analysis.add_matmul_bound(summary, {"mlp": 1e9, "gpt": 8e9}, 100.0)
    by_name = {t["target"]: t["status"] for t in analysis.targets(summary)}
    assert by_name["ORTModule vs eager on mlp >= 2x"] == "MET"
    assert by_name["ORTModule vs eager on gpt >= 1.2x"] == "MISSED"  # its loss check failed
    assert by_name["ORTModule vs eager on cnn >= 1.3x"] == "N/A"
    assert by_name["ORTModule not slower than torch.compile on mlp"] == "MET"
    assert by_name["on-device vs upstream on mlp >= 2x"] == "MET"
    assert by_name["ORTModule first-step latency <= 1/5 of torch.compile's on mlp"] == "MET"
    assert by_name["ORTModule peak memory <= eager's on mlp"] == "MET"
    assert by_name["GPT step within 1.2x of the matmul bound (ORTModule)"] == "MISSED"


def test_peak_matmul_rate_is_the_faster_library(monkeypatch):
    """The bound's peak rate is the best of torch.mm and onnxruntime's MatMul (each measured for
    real, here on small matrices); a library that fails is reported and left out."""
    from bench import probe

    peak = probe.matmul_peak(n=128, reps=3, threads=1)
    rates = {name: r["gflops"] for name, r in peak["by_library"].items()}
    assert set(rates) == {"torch.mm", "onnxruntime MatMul"} and min(rates.values()) > 0
    assert peak["gflops"] == max(rates.values()) and rates[peak["library"]] == peak["gflops"]
    line = report._matmul_line(peak, 1)
    assert f"**{peak['gflops']:.0f} GFLOP/s**" in line and "torch.mm" in line and "onnxruntime MatMul" in line

    def broken(a, b, reps, threads):
        raise RuntimeError("no such library here")

    monkeypatch.setitem(probe.LIBRARIES, "onnxruntime MatMul", broken)
    peak = probe.matmul_peak(n=64, reps=2, threads=1)
    assert peak["library"] == "torch.mm" and peak["gflops"] == peak["by_library"]["torch.mm"]["gflops"]
    assert "no such library here" in peak["by_library"]["onnxruntime MatMul"]["error"]


def test_a_quick_run_does_not_replace_the_committed_table():
    from bench import run

    out = run.DEFAULT_OUT.resolve()
    assert run.default_report_path(run.parse_args(["--upstream-venv", ""]), out) == run.HERE / "RESULTS.md"
    assert run.default_report_path(run.parse_args(["--quick", "--upstream-venv", ""]), out) == out / "RESULTS.md"
    assert run.default_report_path(run.parse_args(["--quick", "--report", "r.md", "--upstream-venv", ""]), out) \
        == Path("r.md")


def test_quick_preset_and_options():
    from bench import run

    args = run.parse_args(["--quick", "--upstream-venv", ""])
    assert args.models == ["mlp", "gpt"] and {"eager", "ortmodule", "ondevice"} <= set(args.systems)
    assert args.rounds <= 2 and args.memory_cap_mb == 0  # no memory-cap search in a quick run
    args = run.parse_args(["--models", "tiny,tiny-gpt", "--systems", "eager,compile", "--rounds", "3"])
    assert args.models == ["tiny", "tiny-gpt"] and args.systems == ["eager", "compile"] and args.rounds == 3
    assert args.memory_cap_mb == run.FULL["memory_cap_mb"] and args.capacity_systems == ["eager", "ortmodule", "ortmodule_recompute"]
    assert "ortmodule_recompute" not in run.FULL["systems"]  # compared in the memory-cap search only
    with pytest.raises(SystemExit):
        run.parse_args(["--capacity-systems", "upstream"])


@pytest.mark.slow
def test_suite_end_to_end(tmp_path):
    """``python -m bench`` on the tiny model: results.json, RESULTS.md and the plot."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--models", "tiny", "--systems", "eager,ortmodule,ondevice",
                           "--rounds", "2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path),
                           "--memory-cap-mb", "0", "--extra-rounds", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["cells"]) == 6 and results["meta"]["flops_per_step"]["tiny"] > 0
    assert all(len(c["load_probe_gflops"]) == 2 and min(c["load_probe_gflops"]) > 0 for c in results["cells"])
    assert results["meta"]["load_probe"]["cells"] == 6
    assert {e["status"] for e in results["summary"]["tiny"].values()} == {"reference", "OK"}
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## tiny" in text and "## Targets" in text
    pytest.importorskip("matplotlib")
    assert (tmp_path / "speedup.png").stat().st_size > 1000


def test_capacity_search_finds_the_largest_fitting_batch():
    from bench import capacity

    need = lambda batch: 100 + 10 * batch  # MB a batch needs
    runs = []

    def run(batch):
        runs.append(batch)
        return {"status": "ok", "peak_rss_mb": need(batch)}

    found = capacity.largest_batch(run, start=4, cap_mb=700)  # batches up to 60 fit
    assert runs == [4, 8, 16, 32, 64, 48, 56, 60]  # doubling until 64 is over the cap, then bisection
    assert capacity.BISECT_STEPS == 3 and found["largest_batch"] == 60 and found["peak_rss_mb"] == need(60)
    below = capacity.largest_batch(lambda b: {"status": "ok", "peak_rss_mb": need(b)}, start=64, cap_mb=300)
    assert below["largest_batch"] == 20  # 64, 32 over the cap; 16 fits; bisection: 24 over, 20 fits, 22 over
    errored = capacity.largest_batch(lambda b: {"status": "error", "error": "boom"}, start=8, cap_mb=1e9)
    assert errored["largest_batch"] is None and errored["tried"][0]["error"] == "boom"
    roomy = capacity.largest_batch(lambda b: {"status": "ok", "peak_rss_mb": 1.0}, start=2, cap_mb=10)
    assert roomy["largest_batch"] == 2 * 2 ** capacity.MAX_DOUBLINGS and roomy["capped_by_search"]


# the language model's flattened loss: ~6 s more (pytest -m slow)
@pytest.mark.parametrize("model", ["tiny", pytest.param("tiny-gpt", marks=pytest.mark.slow)])
def test_loss_in_module_trains_the_same_model(model):
    """--loss-in-module (the memory-cap search's default) wraps the model and its loss in one
    module: eager's losses are those of the loss computed outside, ORTModule's match them."""
    threads = torch.get_num_threads()
    try:
        def losses(system, *flags):
            args = cell.parse_args(["--model", model, "--system", system, "--steps", "1", "--warmup", "1",
                                    "--threads", "2", *flags])
            result = cell.run_cell(args)
            assert result["status"] == "ok", (system, flags, result["error"], result.get("traceback"))
            return result["losses"]

        outside = losses("eager")
        assert losses("eager", "--loss-in-module") == outside
        assert losses("ortmodule_recompute", "--loss-in-module") == pytest.approx(outside, rel=1e-4)
        refused = cell.run_cell(cell.parse_args(["--model", model, "--system", "ondevice", "--loss-in-module"]))
        assert refused["status"] == "error" and "PyTorch systems" in refused["error"]
    finally:
        torch.set_num_threads(threads)


def test_capacity_section_in_the_report():
    capacity = {"model": "gpt", "cap_mb": 2048, "systems": {
        "eager": {"largest_batch": 96, "peak_rss_mb": 1900.0, "capped_by_search": False,
                  "tried": [{"batch": 64, "peak_rss_mb": 1500.0, "status": "ok", "fits": True}]}}}
    text = "\n".join(report.capacity_section(capacity))
    assert "Largest gpt batch within 2048 MB" in text and "| eager (PyTorch) | 96 | 1900 |" in text
    assert "outside the module" in text
    assert "loss inside its graph" in "\n".join(report.capacity_section({**capacity, "loss_in_module": True}))


def _found(largest, capped=False):
    return {"largest_batch": largest, "peak_rss_mb": 1.0, "capped_by_search": capped, "tried": []}


def test_capacity_target_compares_the_memory_optimizer_with_eager():
    from bench import capacity

    result = {"model": "gpt", "cap_mb": 2048, "systems": {"eager": _found(200), "ortmodule_recompute": _found(320)}}
    met = capacity.target(result)
    assert met["status"] == "MET" and met["measured"].startswith("1.60x")
    result["systems"]["ortmodule_recompute"] = _found(280)
    assert capacity.target(result)["status"] == "MISSED"
    result["systems"]["ortmodule_recompute"] = _found(None)  # not even the smallest batch fits
    assert capacity.target(result)["status"] == "N/A"
    del result["systems"]["ortmodule_recompute"]
    assert capacity.target(result) is None


def test_standalone_capacity_results_and_side_benchmarks_join_the_report(tmp_path):
    """RESULTS.md shows capacity.json when it is newer than the suite's own search, with its
    target, and the optimizer-step and precision tables when their JSON is present."""
    from bench import capacity, hf_trainer, optim_step, precision

    results = json.loads((ROOT / "bench" / "results" / "results.json").read_text())
    # the suite's own search (whether or not the committed run had one): the newer of the two is shown
    results["capacity"] = {"model": "gpt", "cap_mb": 2048, "bisect_steps": 3, "systems": {"eager": _found(200)}}
    standalone = {"model": "gpt", "cap_mb": 1000, "date": "2999-01-01 00:00 UTC",
                  "systems": {"eager": _found(100), "ortmodule_recompute": _found(150)}}
    standalone["target"] = capacity.target(standalone)
    (tmp_path / "capacity.json").write_text(json.dumps(standalone))
    text = report.markdown(results, tmp_path)
    assert "Largest gpt batch within 1000 MB" in text and "| ORTModule + recompute" in text
    assert "1.50x (150 vs 100) | **MET**" in text
    # no side section without its JSON (ANALYSIS.md's prose, also in the report, may name them)
    assert "## Optimizer step" not in text and "## bf16 autocast" not in text
    assert "## Hugging Face Trainer vs ORTTrainer" not in text
    standalone["date"] = "2000-01-01 00:00 UTC"  # older than the suite's run: the suite's search wins
    (tmp_path / "capacity.json").write_text(json.dumps(standalone))
    assert "within 1000 MB" not in report.markdown(results, tmp_path)
    del results["capacity"]  # a suite run without a search: the standalone one is shown, whatever its date
    assert "within 1000 MB" in report.markdown(results, tmp_path)
    for name in ("optim_step.json", "precision.json", "hf_trainer.json"):
        (tmp_path / name).write_text((ROOT / "bench" / "results" / name).read_text())
    text = report.markdown(results, tmp_path)
    optim = json.loads((tmp_path / "optim_step.json").read_text())
    mixed = json.loads((tmp_path / "precision.json").read_text())
    trainers = json.loads((tmp_path / "hf_trainer.json").read_text())
    assert optim_step.markdown(optim) in text and precision.markdown_table(mixed) in text
    assert "## Hugging Face Trainer vs ORTTrainer" in text and hf_trainer.markdown(trainers) in text


def test_loss_plot_from_the_results(tmp_path):
    pytest.importorskip("matplotlib")
    results = json.loads((ROOT / "bench" / "results" / "results.json").read_text())
    assert report.plot_losses(results, tmp_path / "losses.png")
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not report.plot_losses({"summary": {}}, tmp_path / "none.png")  # nothing to draw
