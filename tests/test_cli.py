"""The command line: the demo (the README's main job), `onnxtrain report` and `onnxtrain artifacts`."""

from __future__ import annotations

import re
import subprocess
import sys

import onnx
import pytest

from tests.test_artifacts import regression_model


def _onnxtrain(*args, cwd):
    return subprocess.run([sys.executable, "-m", "onnxtrain.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_demo_reaches_the_required_accuracy(tmp_path):
    result = _onnxtrain("demo", "--out", str(tmp_path / "demo"), "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(re.search(r"test accuracy \(eval model\): ([0-9.]+)", result.stdout).group(1))
    exported = float(re.search(r"inference model, plain InferenceSession\): ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95 and exported == accuracy
    assert (tmp_path / "demo" / "inference_model.onnx").exists()
    assert (tmp_path / "demo" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the loss plot
    # the run's record: `onnxtrain report` summarizes it, its last evaluation is the demo's accuracy
    report = _onnxtrain("report", str(tmp_path / "demo"), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "steps: 900" in report.stdout  # 20 epochs of ceil(1437 / 32) = 45 steps
    last_eval = report.stdout.strip().splitlines()[-1]
    assert last_eval.startswith("eval after step 900: ") and f"accuracy {accuracy:.4f}" in last_eval


def test_artifacts_command_defaults_to_all_float_initializers(tmp_path):
    onnx.save(regression_model(), tmp_path / "model.onnx")
    result = _onnxtrain("artifacts", "model.onnx", "--loss", "mse", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    training = onnx.load(tmp_path / "out" / "training_model.onnx")
    grads = sorted(o.name for o in training.graph.output if o.name.endswith("_grad.accumulation.out"))
    assert grads == [f"{n}_grad.accumulation.out" for n in ("b1", "b2", "w1", "w2")]
    assert (tmp_path / "out" / "optimizer_model.onnx").exists()


def test_artifacts_command_reports_bad_parameter_names(tmp_path):
    onnx.save(regression_model(), tmp_path / "model.onnx")
    result = _onnxtrain("artifacts", "model.onnx", "--requires-grad", "w9", "-o", "out", cwd=tmp_path)
    assert result.returncode != 0
    assert "no initializer named ['w9']" in result.stderr

def test_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """No names at all, an output folder that is a file, no epochs: exit 2 and a message, no traceback."""
    from onnxtrain import cli

    monkeypatch.chdir(tmp_path)
    onnx.save(regression_model(), tmp_path / "model.onnx")
    (tmp_path / "a_file").write_text("")
    for args, message in [(["artifacts", "model.onnx", "--requires-grad"], "requires_grad is empty"),
                          (["artifacts", "model.onnx", "-o", "a_file"], "'a_file' is a file, not a folder"),
                          (["artifacts", "model.onnx", "-o", "a_file/out"], "cannot write the artifacts to")]:
        assert cli.main(args) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        cli.main(["demo", "--epochs", "0"])
    assert exit_info.value.code == 2 and "--epochs: expected an integer >= 1, got '0'" in capsys.readouterr().err


def test_artifacts_command_with_ort_format(tmp_path):
    from onnxruntime.tools.reduced_build_config_parser import parse_config

    onnx.save(regression_model(), tmp_path / "model.onnx")
    result = _onnxtrain("artifacts", "model.onnx", "--loss", "mse", "-o", "out", "--ort-format", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # onnxruntime's config writer logs nothing through the root logger
    out = tmp_path / "out"
    for name in ("training_model", "eval_model", "optimizer_model"):
        assert (out / f"{name}.onnx").exists() and (out / f"{name}.ort").read_bytes()[4:8] == b"ORTM"
    assert "required operators for a minimal onnxruntime build: out/required_operators.config" in result.stdout
    required, _ = parse_config(str(out / "required_operators.config"))
    assert {"Gemm", "Sigmoid"} <= set().union(*required["ai.onnx"].values())


def test_ort_format_command_converts_a_folder_and_reports_errors(tmp_path):
    onnx.save(regression_model(), tmp_path / "model.onnx")
    assert _onnxtrain("artifacts", "model.onnx", "--loss", "mse", "-o", "out", "--prefix", "reg_",
                      cwd=tmp_path).returncode == 0
    result = _onnxtrain("ort-format", "out", "--prefix", "reg_", "--enable-type-reduction",
                        "--optimization-level", "basic", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "reg_training_model.ort").exists()
    config = (tmp_path / "out" / "reg_required_operators_and_types.config").read_text()
    assert 'Sigmoid{"inputs": {"0": ["float"]}}' in config and "com.microsoft" not in config

    missing = _onnxtrain("ort-format", "nowhere", cwd=tmp_path)
    assert missing.returncode == 2
    assert "onnxtrain: error: artifact directory 'nowhere' does not exist" in missing.stderr
    no_prefix = _onnxtrain("ort-format", "out", cwd=tmp_path)  # the files have the prefix reg_
    assert no_prefix.returncode == 2 and "holds no training model 'training_model.onnx'" in no_prefix.stderr
    bad_level = _onnxtrain("ort-format", "out", "--optimization-level", "max", cwd=tmp_path)
    assert bad_level.returncode == 2 and "invalid choice: 'max'" in bad_level.stderr
    types_alone = _onnxtrain("artifacts", "model.onnx", "-o", "out2", "--enable-type-reduction", cwd=tmp_path)
    assert types_alone.returncode == 2 and "--enable-type-reduction applies to --ort-format only" in types_alone.stderr
    assert not (tmp_path / "out2").exists()
