"""ORTModule's CPU runs flush denormals to zero; PyTorch's arithmetic in the calling thread never does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.torch_models import torch

from onnxtrain.torch import DebugOptions, ORTModule
from onnxtrain.runtime.denormals import can_flush_denormals, thread_flushes_denormals

pytestmark = pytest.mark.skipif(not can_flush_denormals(), reason="PyTorch cannot set FTZ/DAZ on this CPU")

TINY = 1e-20  # TINY * TINY = 1e-40: a float32 denormal


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), TINY))

    def forward(self, x):
        return x * self.weight


def _train_and_infer(options: DebugOptions):
    model = ORTModule(Scale(), options)
    x = torch.full((3, 4), TINY, requires_grad=True)
    out = model(x)
    out.sum().backward()
    with torch.no_grad():
        inferred = model(x)
    return out, x.grad, inferred


def test_onnxruntime_runs_flush_denormals_by_default():
    out, grad, inferred = _train_and_infer(DebugOptions(fallback=False))
    assert torch.all(out == 0) and torch.all(inferred == 0)  # 1e-40 flushed in the forward runs
    assert torch.all(grad == TINY)                            # the gradient is a normal float


def test_flush_denormals_false_keeps_them():
    out, _, inferred = _train_and_infer(DebugOptions(fallback=False, flush_denormals=False))
    expected = torch.full((3, 4), TINY) * torch.full((4,), TINY)
    assert torch.all(expected > 0)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(inferred, expected, rtol=1e-6, atol=0)


# onnxruntime sets the flags on the thread that creates the first session asking for them in a
# process (not again later): a fresh process shows whether ORTModule puts them back.
_FRESH_PROCESS_CHECK = """
import sys, torch
from onnxtrain.torch import DebugOptions, ORTModule
from onnxtrain.runtime.denormals import thread_flushes_denormals
user_setting = sys.argv[1] == "on"
torch.set_flush_denormal(user_setting)
model = ORTModule(torch.nn.Linear(4, 4), DebugOptions(fallback=False))
model(torch.randn(3, 4)).sum().backward()
with torch.no_grad():
    model(torch.randn(3, 4))
eager = torch.full((2,), 1e-20) * torch.full((2,), 1e-20)
print(thread_flushes_denormals(), bool(torch.all(eager == 0)))
"""


@pytest.mark.parametrize("user_setting", ["off", "on"])
def test_the_calling_threads_flags_stay_as_the_user_set_them(user_setting):
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_CHECK, user_setting], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    flushes, eager_flushed = done.stdout.split()[-2:]
    expected = str(user_setting == "on")
    assert flushes == expected          # the thread's flags after sessions were created and run
    assert eager_flushed == expected    # PyTorch's own arithmetic, as the user set it
