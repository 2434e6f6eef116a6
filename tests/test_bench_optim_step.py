"""bench/optim_step.py on a tiny model: every system steps, the JSON and the markdown table."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bench import optim_step  # noqa: E402

SYSTEMS = ["onnxtrain_fused_adam", "torch_adamw_fused", "torch_adamw_foreach", "onnxtrain_lamb"]


def test_quick_run_on_a_tiny_model_writes_json_and_a_table(tmp_path):
    out = tmp_path / "optim_step.json"
    threads = torch.get_num_threads()
    try:
        assert optim_step.main(["--model", "tiny-gpt", "--rounds", "2", "--steps", "2", "--warmup", "1",
                                "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads(out.read_text())
    assert list(results["systems"]) == SYSTEMS
    assert results["n_tensors"] == len(list(optim_step.models.get("tiny-gpt").build().parameters()))
    fastest = results["torch_fastest"]
    assert fastest in optim_step.TORCH_SYSTEMS
    assert results["systems"][fastest]["ratio_vs_torch_fastest"] == 1.0
    for name, entry in results["systems"].items():
        assert len(entry["round_step_ms"]) == 2 and entry["median_step_ms"] > 0, name
        assert entry["best_step_ms"] <= entry["median_step_ms"]
    for name in optim_step.ADAMW_SYSTEMS:  # the same update: like is compared with like
        assert results["systems"][name]["max_abs_diff_vs_torch_fastest"] < 1e-6, name
    table = optim_step.markdown(results)
    for entry in results["systems"].values():
        assert f"| {entry['label']} |" in table
    assert table.count("\n| ") == 1 + len(SYSTEMS)  # header + one row per system
