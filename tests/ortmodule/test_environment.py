"""Upstream ORTModule's environment variables (ORTMODULE_FALLBACK_POLICY, ORTMODULE_LOG_LEVEL,
and the ones without effect here), as migrated training scripts set them."""

from __future__ import annotations

import copy
import warnings

import pytest

from tests.ortmodule._unsupported import without_dft_rule  # noqa: F401  (a fixture)
from tests.ortmodule.test_ortmodule import _WithoutRule
from tests.torch_models import MLP, torch

from onnxtrain.errors import OnnxTrainError
from onnxtrain.logs import LogLevel
from onnxtrain.torch import (DebugOptions, IgnoredSettingWarning, ORTModule, ORTModuleEnvironmentError,
                             ORTModuleFallbackWarning)
from onnxtrain.torch._environment import read_environment


@pytest.fixture(autouse=True)
def _no_upstream_variables(monkeypatch):
    for name in ("ORTMODULE_FALLBACK_POLICY", "ORTMODULE_LOG_LEVEL", "ORTMODULE_ONNX_OPSET_VERSION",
                 "ORTMODULE_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("without_dft_rule")
def test_fallback_disable_raises_where_the_default_falls_back(monkeypatch):
    x = torch.randn(3, 6)
    with pytest.warns(ORTModuleFallbackWarning):
        ORTModule(_WithoutRule())(x).sum().backward()
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    with pytest.raises(OnnxTrainError):
        ORTModule(_WithoutRule())(x).sum().backward()


@pytest.mark.usefixtures("without_dft_rule")
def test_the_variable_wins_over_debug_options(monkeypatch):
    """As upstream: a job's environment decides, whatever the script's DebugOptions say."""
    x = torch.randn(3, 6)
    options = DebugOptions(fallback=False, log_level=LogLevel.FATAL)
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_ONNX_MODEL|FALLBACK_UNSUPPORTED_TORCH_MODEL")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "warning")
    model = ORTModule(_WithoutRule(), options)
    with pytest.warns(ORTModuleFallbackWarning):
        model(x).sum().backward()
    assert model.fallback_reason is not None
    assert model._debug.log_level == LogLevel.WARNING
    assert model._debug.resolved_session_options().log_severity_level == int(LogLevel.WARNING)
    assert options.fallback is False and options.log_level == LogLevel.FATAL  # the caller's object is left as it was


def test_force_torch_forward_runs_in_pytorch_from_the_first_call(monkeypatch):
    torch.manual_seed(0)
    eager = MLP()
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_FORCE_TORCH_FORWARD")
    with pytest.warns(ORTModuleFallbackWarning, match="ORTMODULE_FALLBACK_POLICY='FALLBACK_FORCE_TORCH_FORWARD'"):
        model = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 12)
    out = model(x)
    out.sum().backward()
    reference = eager(x)
    reference.sum().backward()
    assert model.export_count == 0
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_disable_wins_over_force(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_FORCE_TORCH_FORWARD | FALLBACK_DISABLE")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = ORTModule(MLP())
        model(torch.randn(5, 12)).sum().backward()
    assert model.export_count == 1 and model.fallback_reason is None


def test_unknown_values_are_named(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLED")
    with pytest.raises(ORTModuleEnvironmentError, match="unknown policy FALLBACK_DISABLED.*FALLBACK_DISABLE"):
        ORTModule(MLP())
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "LOUD")
    with pytest.raises(ORTModuleEnvironmentError, match="ORTMODULE_LOG_LEVEL='LOUD'.*VERBOSE"):
        ORTModule(MLP())


def test_upstream_settings_without_effect_say_so_and_training_goes_on(monkeypatch):
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "14")
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", "/tmp/cache")
    with pytest.warns(IgnoredSettingWarning) as caught:
        model = ORTModule(MLP())
    messages = sorted(str(w.message) for w in caught)
    assert messages[0].startswith("ORTMODULE_CACHE_DIR is set") and "not cached" in messages[0]
    assert messages[1].startswith("ORTMODULE_ONNX_OPSET_VERSION is set") and "opset" in messages[1]
    model(torch.randn(5, 12)).sum().backward()
    assert model.export_count == 1


def test_read_environment_values():
    assert read_environment({}) == read_environment({"ORTMODULE_FALLBACK_POLICY": " ", "ORTMODULE_LOG_LEVEL": ""})
    settings = read_environment({"ORTMODULE_FALLBACK_POLICY": "fallback_force_torch_backward",
                                 "ORTMODULE_LOG_LEVEL": "DEVINFO", "ORTMODULE_USE_TRITON": "1",
                                 "ORTMODULE_SAVE_ONNX_PATH": "/x", "ORTMODULE_MEMORY_OPT_LEVEL": "1"})
    assert settings.fallback is True and settings.force_torch
    assert settings.log_level == LogLevel.INFO
    assert settings.save_path == "/x"
    assert list(settings.ignored) == ["ORTMODULE_USE_TRITON"]  # the others take effect
    assert read_environment({"ORTMODULE_FALLBACK_POLICY": "FALLBACK_UNSUPPORTED_DEVICE"}).force_torch is False


def test_debug_options_check_the_log_level_when_made():
    """As upstream's: a log level that is not one is refused by name when the options are made
    (it failed at the first call, with int()'s message)."""
    with pytest.raises(TypeError, match="DebugOptions log_level must be an onnxtrain LogLevel"):
        DebugOptions(log_level="some_string")
    assert DebugOptions(log_level=LogLevel.DEVINFO).log_level is LogLevel.INFO
    assert DebugOptions(log_level="warning").resolved_session_options().log_severity_level == 2
    # as upstream's: INFO asks for ORTModule's messages, not onnxruntime's thousands of INFO lines
    assert DebugOptions(log_level=LogLevel.INFO).resolved_session_options().log_severity_level == 2
    assert DebugOptions(log_level=LogLevel.VERBOSE).resolved_session_options().log_severity_level == 0
    # the saved files' prefix, as upstream's: a str, not empty when files are saved
    with pytest.raises(TypeError, match="onnx_prefix must be a str"):
        DebugOptions(onnx_prefix=3)
    with pytest.raises(ValueError, match="onnx_prefix must not be empty when save_onnx is set"):
        DebugOptions(save_onnx=True, onnx_prefix="")
    assert DebugOptions(onnx_prefix="").onnx_prefix == ""  # nothing is saved


@pytest.mark.parametrize("name", ["ORTMODULE_USE_FLASH_ATTENTION", "ORTMODULE_TRITON_DEBUG", "ORTMODULE_CONV_ALGO_SEARCH",
                                  "ORTMODULE_SKIPCHECK_POLICY", "ORTMODULE_MEMORY_OPT_PROBE_RECOMPUTE_LEVEL"])
def test_the_other_upstream_variables_are_named_when_set(name):
    # upstream's guide (and its code) read these too: set, they were ignored without a word
    assert name in read_environment({name: "1"}).ignored


def test_the_save_path_variable_is_read_when_made_and_wins_over_debug_options(monkeypatch, tmp_path):
    """As upstream's: $ORTMODULE_SAVE_ONNX_PATH, read when the ORTModule is made, wins over
    DebugOptions(save_path=...) (it lost to it, and was read at each export)."""
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path / "from_env"))
    model = ORTModule(MLP(), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(tmp_path / "given")))
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path / "later"))
    model(torch.randn(5, 12)).sum().backward()
    assert min(p.name for p in (tmp_path / "from_env").iterdir()) == "m_training_backward.onnx"
    assert not (tmp_path / "given").exists() and not (tmp_path / "later").exists()
