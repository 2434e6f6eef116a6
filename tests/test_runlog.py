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
    # the summary is one run whose steps continue: so are the step numbers (each part counted
    # its own, and the second part's evaluation read "step 1" after three steps)
    assert [e["step"] for e in summary.evaluations] == [2, 3]
    assert [r["step"] for r in summary.step_records] == [1, 2, 3]
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


def test_a_rejected_step_is_not_counted_and_reserved_names_are_refused(tmp_path):
    with runlog.RunLog(tmp_path) as log:
        for bad in ("high", "1.5", True, b"1"):
            with pytest.raises(runlog.RunLogError, match="'loss' must be a number"):
                log.step(bad)
        log.step(1.0)
        with pytest.raises(runlog.RunLogError, match=r"metrics \['kind', 'step'\] would overwrite"):
            log.step(0.5, kind=1, step=100)
        with pytest.raises(runlog.RunLogError, match=r"eval metrics \['kind'\] would overwrite"):
            log.evaluate(kind=3, accuracy=0.5)
        log.evaluate(accuracy=0.5)
    records = [json.loads(line) for line in (tmp_path / runlog.RUN_FILE).read_text().splitlines()]
    assert [(r["kind"], r.get("step", r.get("steps"))) for r in records[1:]] == [("step", 1), ("eval", 1), ("end", 1)]
    assert runlog.summarize(tmp_path).steps == 1


def test_a_record_cut_short_is_left_out_and_resuming_goes_on(tmp_path):
    """A run killed while writing leaves a last line without its newline: the report reads
    everything before it, and a resumed RunLog appends after the last whole record."""
    log = runlog.RunLog(tmp_path)
    log.step(2.0)
    log.step(1.5)
    log._file.close()  # killed: no end record, and half of the next one
    with (tmp_path / runlog.RUN_FILE).open("a") as file:
        file.write('{"kind": "step", "step": 3, "lo')
    assert runlog.summarize(tmp_path).losses == [2.0, 1.5]
    _log_run(tmp_path, [1.0])
    summary = runlog.summarize(tmp_path)
    assert summary.losses == [2.0, 1.5, 1.0] and summary.finished


def test_nan_losses_and_the_timed_samples(tmp_path):
    for order in ([math.nan, 2.0, 1.0], [2.0, math.nan, 1.0]):
        _log_run(tmp_path, order, fresh=True)
        assert runlog.summarize(tmp_path).min_loss == 1.0  # NaN is not a minimum, wherever it is
    with runlog.RunLog(tmp_path, fresh=True) as log:
        log.step(1.0, samples=1000)  # no duration: not part of the throughput
        log.step(1.0, samples=10, seconds=1.0)
    summary = runlog.summarize(tmp_path)
    assert (summary.samples, summary.timed_samples, summary.samples_per_second) == (1010, 10, 10.0)
    assert "throughput: 10.0 samples/s over 10 samples" in summary.text()


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe binary", "not a readable run log"),
    (b'{"kind": "step", "step": 1}\n', "step record without 'loss'"),
    (b'{"kind": "step", "step": 1, "loss": "abc"}\n', "step field 'loss' is 'abc', not a number"),
    (b'{"kind": "eval", "accuracy": 0.5}\n', "eval record without 'step'"),
    (b'{"kind": "end", "steps": 1}\n', "end record without 'wall_seconds'"),
    (b'{"kind": "run", "settings": [1]}\n', "'settings' is not an object"),
    (b'{"kind": "step", "step": 1, "loss": 1.0, "samples": "8"}\n', "step field 'samples' is '8'"),
])
def test_malformed_records_are_named(tmp_path, capsys, content, message):
    from onnxtrain import cli

    (tmp_path / runlog.RUN_FILE).write_bytes(content)
    with pytest.raises(runlog.RunLogError, match=message):
        runlog.summarize(tmp_path)
    assert cli.main(["report", str(tmp_path)]) == 2  # one line, no traceback
    assert capsys.readouterr().err.startswith("onnxtrain report: ")


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    _log_run(tmp_path, [1.0 / (i + 1) for i in range(50)])
    path = runlog.plot(tmp_path)
    assert path == tmp_path / runlog.PLOT_FILE and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = runlog.plot(tmp_path, tmp_path / "sub" / "loss.png")
    assert other.stat().st_size > 1000
    # given the run.jsonl itself, the default plot goes next to it
    (tmp_path / runlog.PLOT_FILE).unlink()
    assert runlog.plot(tmp_path / runlog.RUN_FILE) == tmp_path / runlog.PLOT_FILE


def test_plot_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    pytest.importorskip("matplotlib")
    code = ("import matplotlib; matplotlib.use('svg'); from onnxtrain import runlog; "
            f"runlog.plot({str(tmp_path)!r}); print(matplotlib.get_backend())")
    _log_run(tmp_path, [2.0, math.nan, 1.0])  # a NaN loss plots too
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "svg"


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
