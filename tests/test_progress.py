"""Progress bars and phase timings of long operations (onnxtrain.progress, generate_artifacts)."""

from __future__ import annotations

import doctest
import logging

from onnxtrain import artifacts, progress
from tests.test_artifacts import regression_model

PHASES = ["training and eval graphs", "writing the models", "writing the checkpoint", "optimizer graph"]


def test_tqdm_disable_follows_the_choice_and_the_model_size():
    assert progress.tqdm_disable(True, 0) is False  # tqdm's `disable`
    assert progress.tqdm_disable(False, 10**12) is True
    assert progress.tqdm_disable(None, progress.BIG_MODEL_BYTES - 1) is True  # small: never
    assert progress.tqdm_disable(None, progress.BIG_MODEL_BYTES) is None  # big: on a terminal


def test_generate_artifacts_shows_its_phases_and_logs_their_times(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="onnxtrain.artifacts")
    artifacts.generate_artifacts(regression_model(), loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "a",
                                 progress=True)
    bar = capsys.readouterr().err
    assert "generate_artifacts: 4/4" in bar and all(phase in bar for phase in PHASES)
    timed = [r.getMessage() for r in caplog.records if " took " in r.getMessage()]
    assert [m.split(": ", 1)[1].split(" took ")[0] for m in timed] == PHASES
    caplog.clear()
    artifacts.generate_artifacts(regression_model(), loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path / "b")  # default: a small model shows no bar
    assert capsys.readouterr().err == ""
    assert len([r for r in caplog.records if " took " in r.getMessage()]) == 3  # no optimizer phase


def test_docstring_example():
    result = doctest.testmod(progress)
    assert result.attempted > 0 and result.failed == 0
