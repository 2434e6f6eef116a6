"""A training run's record: metrics per step in a JSON-lines file, a summary and a plot.

A :class:`RunLog` appends one JSON object per line to ``<directory>/run.jsonl``: a ``run``
header (name, settings), one ``step`` record per logged step (loss, samples, seconds and any
other numbers), ``eval`` records, and an ``end`` record. :func:`summarize` reads the file back
(``onnxtrain report DIR`` prints it) and :func:`plot` draws loss and throughput per step as a
PNG (matplotlib). The file is appended and flushed record by record, so a run that crashes
or is stopped still leaves everything it logged.

Example:
    >>> import tempfile
    >>> from onnxtrain.runlog import RunLog, summarize
    >>> folder = tempfile.mkdtemp()
    >>> with RunLog(folder, name="demo", settings={"lr": 0.01}) as log:
    ...     log.step(loss=2.0, samples=32, seconds=0.5)
    ...     log.step(loss=1.0, samples=32, seconds=0.5)
    ...     log.evaluate(accuracy=0.9)
    >>> s = summarize(folder)
    >>> (s.steps, s.first_loss, s.last_loss, s.samples_per_second, s.evaluations[-1]["accuracy"])
    (2, 2.0, 1.0, 64.0, 0.9)
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from onnxtrain.errors import OnnxTrainError

RUN_FILE = "run.jsonl"
PLOT_FILE = "training.png"
# Steps averaged into one point of the plot's smoothed loss curve (raw points are drawn too).
SMOOTHING_WINDOW = 20


class RunLogError(OnnxTrainError, ValueError):
    """A run log is missing, malformed, or was given something that is not a number."""


# Keys every record of a kind has; metrics may not take these names.
_RESERVED = {"step": ("kind", "step", "loss", "samples", "seconds"), "eval": ("kind", "step")}


def _number(key: str, value) -> float | int:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if not isinstance(value, (bool, str, bytes)):
        try:
            return float(value)  # numpy scalars, 0-d arrays, torch scalars
        except (TypeError, ValueError):
            pass
    raise RunLogError(f"run log metric {key!r} must be a number, got {type(value).__name__} {value!r}")


def _metrics(kind: str, metrics: dict) -> dict:
    clashing = sorted(set(metrics) & set(_RESERVED[kind]))
    if clashing:
        raise RunLogError(f"run log {kind} metrics {clashing} would overwrite the record's own fields "
                          f"{list(_RESERVED[kind])}; name them otherwise")
    return {k: _number(k, v) for k, v in metrics.items()}


class RunLog:
    """Append a run's metrics to ``<directory>/run.jsonl`` (see the module docstring).

    Args:
        directory: created if missing. An existing ``run.jsonl`` is appended to (a resumed run
            continues its record, its steps numbered on); ``fresh=True`` starts it over.
        name: what ran, shown by :func:`summarize`.
        settings: numbers and strings describing the run (learning rate, batch size, ...).
    """

    def __init__(self, directory: str | os.PathLike, name: str = "run", settings: dict | None = None,
                 fresh: bool = False):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / RUN_FILE
        if fresh and self.path.exists():
            self.path.unlink()
        _drop_torn_record(self.path)
        # a resumed run numbers its steps (and evaluations) on from the steps already logged
        self._steps = sum(r["kind"] == "step" for r in _records(self.path)) \
            if self.path.exists() and self.path.stat().st_size else 0
        self._file = self.path.open("a", encoding="utf-8")
        self._started = time.perf_counter()
        self._write({"kind": "run", "name": name, "settings": dict(settings or {}), "time": time.time()})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def step(self, loss, samples: int | None = None, seconds: float | None = None, **metrics) -> None:
        """Record one training step: its loss, how many samples it saw and how long it took.
        Values that are not numbers raise :class:`RunLogError` and the step is not counted."""
        record = {"kind": "step", "step": self._steps + 1, "loss": _number("loss", loss)}
        if samples is not None:
            record["samples"] = int(_number("samples", samples))
        if seconds is not None:
            record["seconds"] = _number("seconds", seconds)
        record.update(_metrics("step", metrics))
        self._write(record)
        self._steps += 1

    def evaluate(self, **metrics) -> None:
        """Record an evaluation (accuracy, eval loss, ...) after the steps logged so far."""
        self._write({"kind": "eval", "step": self._steps, **_metrics("eval", metrics)})

    def close(self) -> None:
        """Write the ``end`` record (wall time since the log was opened) and close the file."""
        if not self._file.closed:
            self._write({"kind": "end", "steps": self._steps, "wall_seconds": time.perf_counter() - self._started})
            self._file.close()

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class RunSummary:
    """What :func:`summarize` finds in a run log. Losses are ``nan`` for a run with no steps."""

    name: str
    settings: dict
    steps: int
    first_loss: float
    last_loss: float
    min_loss: float
    samples: int
    samples_per_second: float | None
    wall_seconds: float | None
    finished: bool
    evaluations: list[dict] = field(default_factory=list)
    step_records: list[dict] = field(default_factory=list, repr=False)
    timed_samples: int = 0  # the samples of the steps that have a duration (samples_per_second's)

    @property
    def losses(self) -> list[float]:
        """The loss of every step, in order."""
        return [float(r["loss"]) for r in self.step_records]

    def text(self) -> str:
        """The summary as a few lines for a terminal."""
        lines = [f"run: {self.name}" + ("" if self.finished else " (no end record: stopped or still running)")]
        if self.settings:
            lines.append("settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()))
        lines.append(f"steps: {self.steps}")
        if self.steps:
            lines.append(f"loss: first {self.first_loss:.4f}, last {self.last_loss:.4f}, min {self.min_loss:.4f}")
        if self.samples_per_second is not None:
            lines.append(f"throughput: {self.samples_per_second:.1f} samples/s over {self.timed_samples} samples")
        if self.wall_seconds is not None:
            lines.append(f"wall time: {self.wall_seconds:.1f} s")
        for evaluation in self.evaluations:
            figures = ", ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}"
                                for k, v in evaluation.items() if k not in ("kind", "step"))
            lines.append(f"eval after step {evaluation['step']}: {figures}")
        return "\n".join(lines)


def _run_file(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    return path / RUN_FILE if path.is_dir() else path


def _drop_torn_record(path: Path) -> None:
    """Cut a last record that a killed run left without its newline, so appending goes on
    from whole records."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("r+b") as file:
        file.seek(-1, os.SEEK_END)
        if file.read(1) != b"\n":  # rare: only then read it all to find the last whole record
            file.seek(0)
            file.truncate(file.read().rfind(b"\n") + 1)


# Fields each kind of record must hold (all fields of steps, evals and ends are numbers).
_FIELDS = {"step": ("loss",), "eval": ("step",), "end": ("wall_seconds",)}


def _check_record(record: dict, where: str) -> None:
    for key in _FIELDS.get(record["kind"], ()):
        if key not in record:
            raise RunLogError(f"{where}: {record['kind']} record without {key!r}")
    if record["kind"] == "run" and not isinstance(record.get("settings", {}), dict):
        raise RunLogError(f"{where}: the run's 'settings' is not an object")
    if record["kind"] in ("step", "eval", "end"):
        for key, value in record.items():
            if key != "kind" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise RunLogError(f"{where}: {record['kind']} field {key!r} is {value!r}, not a number")


def _records(directory: str | os.PathLike) -> list[dict]:
    path = _run_file(directory)
    if not path.exists():
        raise RunLogError(f"no run log at {path}: expected a {RUN_FILE} written by onnxtrain.runlog.RunLog")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise RunLogError(f"{path}: not a readable run log ({exc})") from None
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # the record a killed run was writing: everything before it stands
            raise RunLogError(f"{path}, line {number}: not a JSON record ({exc})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise RunLogError(f"{path}, line {number}: expected an object with a 'kind', got {line[:80]!r}")
        _check_record(record, f"{path}, line {number}")
        records.append(record)
    return records


def summarize(directory: str | os.PathLike) -> RunSummary:
    """Read ``<directory>/run.jsonl`` (or that file itself) into a :class:`RunSummary`.

    A resumed run (several ``run`` headers in one file) is summarized as one run whose steps
    continue; the header of the first part names it. A last record cut short (a run killed
    while writing it) is left out. ``min_loss`` is over the losses that are not NaN.
    """
    records = _records(directory)
    header = next((r for r in records if r["kind"] == "run"), {})
    steps = [r for r in records if r["kind"] == "step"]
    losses = [float(r["loss"]) for r in steps]
    compared = [loss for loss in losses if not math.isnan(loss)]
    timed = [r for r in steps if "samples" in r and r.get("seconds")]
    samples = sum(r.get("samples", 0) for r in steps)
    timed_samples = sum(r["samples"] for r in timed)
    seconds = sum(r["seconds"] for r in timed)
    ends = [r for r in records if r["kind"] == "end"]
    nan = math.nan
    return RunSummary(
        name=header.get("name", "run"), settings=header.get("settings", {}), steps=len(steps),
        first_loss=losses[0] if losses else nan, last_loss=losses[-1] if losses else nan,
        min_loss=min(compared) if compared else nan, samples=samples,
        samples_per_second=timed_samples / seconds if seconds else None,
        wall_seconds=sum(r["wall_seconds"] for r in ends) if ends else None,
        finished=bool(ends) and records[-1]["kind"] == "end",
        evaluations=[{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "eval"],
        step_records=steps, timed_samples=timed_samples)


def _trailing_means(values: list[float], weights: list[float], window: int) -> list[float]:
    """Per position, sum(values) / sum(weights) over the last ``window`` positions."""
    means = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        means.append(sum(values[start:i + 1]) / sum(weights[start:i + 1]))
    return means


def plot(directory: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Draw loss (raw and smoothed) and throughput per step as a PNG; returns its path
    (default ``<directory>/training.png``). Needs matplotlib (``pip install matplotlib``)."""
    summary = summarize(directory)
    if not summary.steps:
        raise RunLogError(f"the run log in {directory} has no steps to plot")
    try:  # a Figure with its own Agg canvas: the caller's pyplot backend stays as it is
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RunLogError(f"plotting a run needs matplotlib ({exc}); pip install matplotlib") from None
    path = Path(path) if path is not None else _run_file(directory).parent / PLOT_FILE
    timed = [(i + 1, r["samples"], r["seconds"]) for i, r in enumerate(summary.step_records)
             if "samples" in r and r.get("seconds")]
    fig = Figure(figsize=(11 if timed else 6, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if timed else 1, squeeze=False)
    steps = range(1, summary.steps + 1)
    window = min(SMOOTHING_WINDOW, summary.steps)
    loss_axis = axes[0][0]
    loss_axis.plot(steps, summary.losses, color="tab:blue", alpha=0.35, linewidth=0.8, label="loss")
    if window > 1:
        loss_axis.plot(steps, _trailing_means(summary.losses, [1.0] * summary.steps, window), color="tab:blue",
                       linewidth=1.8, label=f"mean of the last {window} steps")
    loss_axis.set(xlabel="step", ylabel="loss", title=f"{summary.name}: training loss")
    finite = [loss for loss in summary.losses if math.isfinite(loss)]
    if finite and min(finite) > 0:
        loss_axis.set_yscale("log")
    loss_axis.legend()
    if timed:  # samples over seconds of the last steps: single steps are too short to read alone
        speed_axis = axes[0][1]
        speed = _trailing_means([n for _, n, _ in timed], [t for _, _, t in timed], min(SMOOTHING_WINDOW, len(timed)))
        speed_axis.plot([step for step, _, _ in timed], speed, color="tab:green", linewidth=1.5)
        speed_axis.set(xlabel="step", ylabel="samples / s", title=f"throughput (last {min(SMOOTHING_WINDOW, len(timed))} steps)")
        speed_axis.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
