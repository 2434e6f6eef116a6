"""onnxtrain.runlog: a run's metrics in run.jsonl, read back by summarize, drawn by plot, and
printed by `onnxtrain report`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from onnxtrain import runlog
from onnxtrain.errors import OnnxTrainError


def _log_run(folder, losses, name="run", samples=8, seconds=0.25, **kwargs):
    with runlog.RunLog(folder, name=name, **kwargs) as log:
        for loss in losses:
            log.step(loss, samples=samples, seconds=seconds)
        log.evaluate(accuracy=0.5)


def test_summary_of_a_run(tmp_path):
    losses = [2.5, np.float32(1.5), np.array(0.75), 1.0]  # numpy scalars and 0-d arrays are numbers too
    _log_run(tmp_path, losses, name="mlp", settings={"lr": 0.1, "optimizer": "adamw"})
    summary = runlog.summarize(tmp_path)
    assert (summary.name, summary.settings) == ("mlp", {"lr": 0.1, "optimizer": "adamw"})
    assert summary.steps == 4 and summary.losses == [2.5, 1.5, 0.75, 1.0]
    assert (summary.first_loss, summary.last_loss, summary.min_loss) == (2.5, 1.0, 0.75)
    assert summary.samples == 32 and summary.samples_per_second == pytest.approx(32.0)  # 32 samples in 1 s
    assert summary.finished and summary.wall_seconds >= 0
    assert summary.evaluations == [{"step": 4, "accuracy": 0.5}]
    text = summary.text()
    assert "loss: first 2.5000, last 1.0000, min 0.7500" in text and "eval after step 4: accuracy 0.5000" in text
    assert runlog.summarize(tmp_path / runlog.RUN_FILE).steps == 4  # the file itself works too


def test_a_resumed_run_continues_and_a_fresh_one_starts_over(tmp_path):
    _log_run(tmp_path, [3.0, 2.0], name="first part")
    _log_run(tmp_path, [1.0])
    summary = runlog.summarize(tmp_path)
    assert summary.name == "first part" and summary.losses == [3.0, 2.0, 1.0] and summary.finished
    assert [e["step"] for e in summary.evaluations] == [2, 1]  # each part counts its own steps
    _log_run(tmp_path, [9.0], fresh=True)
    assert runlog.summarize(tmp_path).losses == [9.0]


def test_a_stopped_run_keeps_what_it_logged(tmp_path):
    log = runlog.RunLog(tmp_path)
    log.step(1.25)  # no samples or seconds: no throughput, still a loss
    summary = runlog.summarize(tmp_path)  # read while the log is open: flushed record by record
    assert summary.losses == [1.25] and not summary.finished and summary.samples_per_second is None
    assert "no end record" in summary.text()
    log.close()
    log.close()  # closing twice is harmless
    assert runlog.summarize(tmp_path).finished


def test_bad_input_is_named(tmp_path):
    with runlog.RunLog(tmp_path / "a") as log:
        with pytest.raises(runlog.RunLogError, match="'loss' must be a number, got str 'high'"):
            log.step("high")
        with pytest.raises(OnnxTrainError, match="'accuracy' must be a number"):
            log.evaluate(accuracy=None)
    assert runlog.summarize(tmp_path / "a").steps == 0  # nothing half-written
    assert math.isnan(runlog.summarize(tmp_path / "a").first_loss)
    with pytest.raises(runlog.RunLogError, match="no run log at .*missing"):
        runlog.summarize(tmp_path / "missing")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / runlog.RUN_FILE).write_text(json.dumps({"kind": "run"}) + "\n{not json\n")
    with pytest.raises(runlog.RunLogError, match="line 2: not a JSON record"):
        runlog.summarize(tmp_path / "b")
    with pytest.raises(runlog.RunLogError, match="has no steps to plot"):
        runlog.plot(tmp_path / "a")


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    _log_run(tmp_path, [1.0 / (i + 1) for i in range(50)])
    path = runlog.plot(tmp_path)
    assert path == tmp_path / runlog.PLOT_FILE and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = runlog.plot(tmp_path, tmp_path / "sub" / "loss.png")
    assert other.stat().st_size > 1000


def _report(*args):
    return subprocess.run([sys.executable, "-m", "onnxtrain.cli", "report", *map(str, args)],
                          capture_output=True, text=True)


def test_report_command(tmp_path):
    _log_run(tmp_path, [2.0, 1.0], name="cli run")
    result = _report(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("run: cli run\n") and "steps: 2" in result.stdout
    missing = _report(tmp_path / "nothing")
    assert missing.returncode == 2 and "no run log at" in missing.stderr
    pytest.importorskip("matplotlib")
    plotted = _report(tmp_path, "--plot", tmp_path / "p.png")
    assert plotted.returncode == 0 and (tmp_path / "p.png").exists()


def test_docstring_example():
    import doctest

    assert doctest.testmod(runlog).failed == 0 and doctest.testmod(runlog).attempted > 0
