"""The on-device runtime's CPU runs flush denormals to zero; the calling thread's own arithmetic never does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.checkpoint import write_checkpoint
from onnxtrain.runtime.denormals import can_flush_denormals, denormals_flushed, thread_flushes_denormals
from tests.api.conftest import IN, OUT, make_artifacts

pytestmark = pytest.mark.skipif(not can_flush_denormals(), reason="cannot set FTZ/DAZ on this platform")

TINY = 1e-20  # TINY * TINY = 1e-40: a float32 denormal


@pytest.fixture
def tiny_artifacts(tmp_path):
    """The conftest model, pred = (x @ W + b) * scale, with W = TINY: x = TINY gives denormal products."""
    artifacts = make_artifacts(tmp_path / "tiny", "adamw")
    params = {"W": np.full((IN, OUT), TINY, np.float32), "b": np.zeros(OUT, np.float32),
              "scale": np.ones(OUT, np.float32)}
    write_checkpoint(artifacts.checkpoint, params, requires_grad={"W", "b"})
    return artifacts


def _train_step(artifacts, session_options=None):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    module = Module(artifacts.training, state, artifacts.eval, session_options=session_options)
    optimizer = Optimizer(artifacts.optimizer, module)
    x = np.full((2, IN), TINY, np.float32)
    target = np.ones((2, OUT), np.float32)
    _, pred = module(x, target)
    module.eval()
    _, eval_pred = module(x, target)
    module.train()
    optimizer.step()
    return pred, eval_pred, state.parameters["W"].data


def test_default_options_flush_denormals_in_the_runs(tiny_artifacts):
    pred, eval_pred, weight = _train_step(tiny_artifacts)
    assert np.all(pred == 0) and np.all(eval_pred == 0)  # 3 * 1e-40 flushed in training and eval runs
    assert np.all(np.isfinite(weight)) and not np.all(weight == TINY)  # the step itself went through
    assert not thread_flushes_denormals()


def test_given_options_without_the_entry_keep_denormals(tiny_artifacts):
    pred, eval_pred, _ = _train_step(tiny_artifacts, ort.SessionOptions())
    expected = np.full((2, OUT), IN * TINY * TINY, np.float32)
    assert np.all(expected > 0)
    np.testing.assert_allclose(pred, expected, rtol=1e-4, atol=0)  # denormals: fewer bits
    np.testing.assert_allclose(eval_pred, expected, rtol=1e-4, atol=0)


def test_given_options_asking_for_it_flush_on_the_calling_thread_too(tiny_artifacts):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    pred, eval_pred, _ = _train_step(tiny_artifacts, options)
    assert np.all(pred == 0) and np.all(eval_pred == 0)
    assert not thread_flushes_denormals()


def test_denormals_flushed_sets_the_flags_for_the_block_only():
    assert not thread_flushes_denormals()
    with denormals_flushed():
        assert thread_flushes_denormals()
        with denormals_flushed():  # already set: left set on leaving the inner block
            pass
        assert thread_flushes_denormals()
    assert not thread_flushes_denormals()
    with denormals_flushed(enabled=False):
        assert not thread_flushes_denormals()


def test_denormals_flushed_restores_the_flags_when_the_block_raises_and_can_be_reused():
    flushing = denormals_flushed()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="run failed"):
            with flushing:
                assert thread_flushes_denormals()
                raise RuntimeError("run failed")
        assert not thread_flushes_denormals()


def test_flags_set_natively_without_torch_on_linux():
    """On x86-64 and arm64 Linux the C library sets the flags, so the runtime needs no PyTorch."""
    if sys.platform != "linux":
        pytest.skip("the C library's fesetmode is used on Linux only")
    code = ("import sys; from onnxtrain.runtime.denormals import can_flush_denormals; "
            "print(can_flush_denormals(), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


# onnxruntime sets the flags on the thread that creates the first session asking for them in a
# process (not again later): a fresh process shows whether the runtime puts them back.
_FRESH_PROCESS_CHECK = """
import contextlib, sys
import numpy as np
from pathlib import Path
from onnxtrain.runtime.denormals import denormals_flushed, thread_flushes_denormals
from tests.api.conftest import make_artifacts
from tests.api.test_denormals import _train_step
user_setting = sys.argv[1] == "on"
with contextlib.ExitStack() as stack:
    if user_setting:
        stack.enter_context(denormals_flushed())
    pred, _, _ = _train_step(make_artifacts(Path(sys.argv[2]), "adamw"))
    mine = np.full(2, 1e-20, np.float32) * np.float32(1e-20)
    print(thread_flushes_denormals(), bool(np.all(mine == 0)), bool(np.all(np.isfinite(pred))))
"""


@pytest.mark.parametrize("user_setting", ["off", "on"])
def test_the_calling_threads_flags_stay_as_the_user_set_them(user_setting, tmp_path):
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_CHECK, user_setting, str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    flushes, own_flushed, ran = done.stdout.split()[-3:]
    expected = str(user_setting == "on")
    assert flushes == expected      # the thread's flags after sessions were created and run
    assert own_flushed == expected  # the user's own numpy arithmetic, as the user set it
    assert ran == "True"


_FIRST_SESSION_CHECK = """
import sys
from onnxtrain.runtime.denormals import denormals_flushed, thread_flushes_denormals
from onnxtrain.runtime.session import create_session, quiet_session_options
from tests.api.test_denormals import _tiny_model_bytes
with denormals_flushed():
    create_session(_tiny_model_bytes(), ["CPUExecutionProvider"], quiet_session_options())
    print(thread_flushes_denormals())
"""


def _tiny_model_bytes() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_a_first_session_not_asking_leaves_the_users_flushing_on():
    """The process's first session sets the creating thread's flags as its options say, off
    included: creating it must not take the user's flushing away."""
    done = subprocess.run([sys.executable, "-c", _FIRST_SESSION_CHECK], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "True"
