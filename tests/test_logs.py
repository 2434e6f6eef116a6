"""onnxtrain.logs: upstream's log levels on the logging module, and set_verbosity."""

from __future__ import annotations

import logging

import pytest

import onnxtrain
from onnxtrain import logs


@pytest.fixture
def restore_onnxtrain_logger():
    logger = logging.getLogger(logs.ROOT_LOGGER)
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_levels_map_onto_logging():
    assert [logs.logging_level(level) for level in onnxtrain.LogLevel] == [
        logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]
    assert logs.logging_level("verbose") == logs.logging_level("DEBUG") == logging.DEBUG
    assert logs.logging_level("Fatal") == logging.CRITICAL and logs.logging_level(logging.INFO) == logging.INFO
    for bad in (3, True, "loud", None):  # 3 would be upstream's ERROR or nothing: ambiguous, refused
        with pytest.raises(onnxtrain.OnnxTrainError, match="log level must be"):
            logs.logging_level(bad)


def test_set_verbosity_shows_onnxtrain_messages(restore_onnxtrain_logger, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a script that configured nothing
    restore_onnxtrain_logger.handlers[:] = []
    onnxtrain.set_verbosity(onnxtrain.LogLevel.INFO)
    logging.getLogger("onnxtrain.artifacts").info("phase took 1 s")
    logging.getLogger("onnxtrain.artifacts").debug("hidden detail")
    onnxtrain.set_verbosity("warning")
    logging.getLogger("onnxtrain.torch.ortmodule").info("hidden too")
    err = capsys.readouterr().err
    assert "INFO onnxtrain.artifacts: phase took 1 s" in err
    assert "hidden" not in err
    assert len(restore_onnxtrain_logger.handlers) == 1  # set twice, one handler


def test_module_docstring_example(restore_onnxtrain_logger):
    import doctest

    result = doctest.testmod(logs)
    assert result.attempted > 0 and result.failed == 0


def test_upstreams_devinfo_is_info_and_levels_are_read_by_name_or_number():
    assert logs.LogLevel.DEVINFO is logs.LogLevel.INFO  # upstream's name imports (onnxruntime's INFO)
    assert logs.logging_level("devinfo") == logging.INFO
    assert logs.as_log_level("Warning", "x") is logs.LogLevel.WARNING
    for bad in ("some_string", 3, True, None):  # a number is ambiguous (upstream's 3 is WARNING)
        with pytest.raises(TypeError, match=r"the level must be an onnxtrain LogLevel \(VERBOSE, INFO, DEVINFO"):
            logs.as_log_level(bad, "the level")
