"""bench/hf_trainer.py on the tiny BERT: every system trains, the JSON and the markdown table."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from bench import hf_trainer  # noqa: E402


@pytest.mark.slow  # ~21 s, a benchmark's run; ORTTrainer against Trainer: tests/integrations/test_huggingface.py
def test_smoke_run_on_the_tiny_bert_writes_json_and_a_table(tmp_path):
    out = tmp_path / "hf_trainer.json"
    threads = torch.get_num_threads()
    try:
        assert hf_trainer.main(["--models", "tiny-bert", "--rounds", "2", "--steps", "1", "--warmup", "1",
                                "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads(out.read_text())
    (model,) = results["models"]
    assert model["model"] == "tiny-bert" and list(model["systems"]) == list(hf_trainer.SYSTEMS)
    for name, entry in model["systems"].items():
        assert len(entry["round_step_ms"]) == 2 and entry["median_step_ms"] > 0, name
        assert entry["first_loss_agrees"], (name, entry["first_loss"], model["systems"]["trainer"]["first_loss"])
        if name != "trainer":  # the ORTTrainers ran in ONNX Runtime, one export each
            assert entry["export_count"] == 1 and entry["fallback_reason"] is None, name
    assert model["systems"]["trainer"]["ratio_vs_trainer"] == 1.0
    table = hf_trainer.markdown(results)
    assert "| tiny-bert |" in table and table.count("\n| ") == 2  # header + one row
    assert "| yes |" in table


def test_rejects_models_that_are_not_hugging_face_models():
    with pytest.raises(SystemExit):
        hf_trainer.main(["--models", "tiny", "--rounds", "1"])
