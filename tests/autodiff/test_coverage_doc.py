"""docs/ops.md lists what the gradient registry and the installed onnx actually cover."""

from __future__ import annotations

import re
from pathlib import Path

from onnxtrain.autodiff.coverage import coverage_markdown

_PAGE = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def test_ops_page_is_current():
    assert _PAGE.read_text() == coverage_markdown(), (
        "docs/ops.md is out of date: run `python -m onnxtrain.autodiff.coverage > docs/ops.md`")


def test_every_registered_op_is_listed_once_among_the_rules():
    page = coverage_markdown()
    rules = page.split("## Ops with a gradient rule")[1].split("## Differentiated")[0]
    for op in ("LSTM", "Resize", "GridSample", "TopK", "Col2Im", "Softmax", "If", "Loop", "Scan", "DFT", "STFT",
               "Det"):
        assert len(re.findall(rf"\b{op} \(\d", rules)) == 1, op
    missing = page.split("## Not differentiated")[1].strip().splitlines()[-1].split(", ")  # the list
    assert "RoiAlign" in missing
    assert not {"Det", "DFT", "Loop", "If", "LSTM", "CumProd", "OneHot", "MaxUnpool", "TensorScatter"} & set(missing)
