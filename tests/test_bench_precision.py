"""bench/precision.py on the tiny GPT: every configuration runs, the report is written and
tabulated, and bf16 runs train the same model as fp32 ones (losses agree)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench import precision  # noqa: E402


def test_quick_run_writes_json_and_a_markdown_table(tmp_path):
    output = tmp_path / "precision.json"
    assert precision.main(["--quick", "--threads", "1", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["model"] == "tiny-gpt" and report["steps"] == 3
    got = {(r["system"], r["precision"]) for r in report["results"]}
    assert got == set(precision.CONFIGS)
    for r in report["results"]:
        assert len(r["step_times_s"]) == 3 and r["median_step_s"] > 0
        assert len(r["losses"]) == 4
    by_key = {(r["system"], r["precision"]): r["losses"] for r in report["results"]}
    for system in ("eager", "ortmodule"):  # same data, same weights: bf16 tracks fp32
        for fp32, bf16 in zip(by_key[(system, "fp32")], by_key[(system, "bf16")]):
            assert abs(bf16 - fp32) / fp32 < 1e-2
    assert [r["exports"] for r in report["results"] if r["system"] == "ortmodule"] == [1, 1]
    table = precision.markdown_table(report)
    assert table.count("\n| ") == 5 and "| ortmodule | bf16 |" in table
