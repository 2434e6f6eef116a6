"""The example scripts run and reach sensible results."""

from __future__ import annotations

import importlib.util
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
