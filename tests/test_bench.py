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


def test_quick_preset_and_options():
    from bench import run

    args = run.parse_args(["--quick", "--upstream-venv", ""])
    assert args.models == ["mlp", "gpt"] and {"eager", "ortmodule", "ondevice"} <= set(args.systems)
    assert args.rounds <= 2 and args.memory_cap_mb == 0  # no memory-cap search in a quick run
    args = run.parse_args(["--models", "tiny,tiny-gpt", "--systems", "eager,compile", "--rounds", "3"])
    assert args.models == ["tiny", "tiny-gpt"] and args.systems == ["eager", "compile"] and args.rounds == 3
    assert args.memory_cap_mb == run.FULL["memory_cap_mb"] and args.capacity_systems == ["eager", "ortmodule"]
    with pytest.raises(SystemExit):
        run.parse_args(["--capacity-systems", "upstream"])


@pytest.mark.slow
def test_suite_end_to_end(tmp_path):
    """``python -m bench`` on the tiny model: results.json, RESULTS.md and the plot."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--models", "tiny", "--systems", "eager,ortmodule,ondevice",
                           "--rounds", "2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path),
                           "--memory-cap-mb", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["cells"]) == 6 and results["meta"]["flops_per_step"]["tiny"] > 0
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
    assert runs == [4, 8, 16, 32, 64, 48, 56]  # doubling until 64 is over the cap, then two bisection steps
    assert found["largest_batch"] == 56 and found["peak_rss_mb"] == need(56)
    below = capacity.largest_batch(lambda b: {"status": "ok", "peak_rss_mb": need(b)}, start=64, cap_mb=300)
    assert below["largest_batch"] == 20  # 64, 32 over the cap; 16 fits; bisection: 24 over, 20 fits (300 MB)
    errored = capacity.largest_batch(lambda b: {"status": "error", "error": "boom"}, start=8, cap_mb=1e9)
    assert errored["largest_batch"] is None and errored["tried"][0]["error"] == "boom"
    roomy = capacity.largest_batch(lambda b: {"status": "ok", "peak_rss_mb": 1.0}, start=2, cap_mb=10)
    assert roomy["largest_batch"] == 2 * 2 ** capacity.MAX_DOUBLINGS and roomy["capped_by_search"]


def test_capacity_section_in_the_report():
    capacity = {"model": "gpt", "cap_mb": 2048, "systems": {
        "eager": {"largest_batch": 96, "peak_rss_mb": 1900.0, "capped_by_search": False,
                  "tried": [{"batch": 64, "peak_rss_mb": 1500.0, "status": "ok", "fits": True}]}}}
    text = "\n".join(report._capacity_section(capacity))
    assert "Largest gpt batch within 2048 MB" in text and "| eager (PyTorch) | 96 | 1900 |" in text
