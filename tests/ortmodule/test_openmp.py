"""Releasing PyTorch's OpenMP threads before ORT runs (onnxtrain.torch._openmp)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import ORTModule, _bridge, _openmp  # noqa: E402


@pytest.mark.skipif(sys.platform != "linux", reason="looks for libgomp in /proc/self/maps")
def test_released_threads_come_back_for_the_next_parallel_op():
    a, b = torch.randn(300, 200, dtype=torch.float64), torch.randn(200, 100, dtype=torch.float64)
    expected = a @ b
    if _openmp._pause_all() is None:
        pytest.skip("PyTorch does not run on GNU OpenMP (libgomp) here")
    threads = torch.get_num_threads()
    assert _openmp.release_torch_openmp_threads()
    assert torch.equal(a @ b, expected)          # the pool starts again
    assert torch.get_num_threads() == threads    # with the thread count it had


def test_long_cpu_runs_release_the_threads_and_short_ones_do_not(monkeypatch):
    calls = []
    monkeypatch.setattr(_bridge, "release_torch_openmp_threads", lambda: calls.append(1) or True)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    model = ORTModule(inner)
    x = torch.randn(5, 4)
    model(x).sum().backward()                    # first runs: no previous run, so release
    first = len(calls)
    assert first == 2                            # the forward and the backward session
    monkeypatch.setattr(_bridge, "RELEASE_OPENMP_FOR_RUNS_S", float("inf"))
    model(x).sum().backward()
    assert len(calls) == first                   # runs shorter than the threshold: left alone
    monkeypatch.setattr(_bridge, "RELEASE_OPENMP_FOR_RUNS_S", 0.0)
    out = model(x)
    out.sum().backward()
    assert len(calls) == first + 2
    assert torch.allclose(out, inner(x), atol=1e-6)  # same results either way


def test_a_runner_that_released_keeps_releasing_while_its_runs_stay_near_the_threshold():
    """A released run is the faster one: judged by the bare threshold it would stop the release
    that made it fast, and the runs would alternate between fast and slow."""
    runner = SimpleNamespace(_releasing=False, _last_run_s=0.0)
    threshold = _bridge.RELEASE_OPENMP_FOR_RUNS_S
    decisions = []
    for last in (0.8, 2.0, 0.8, 0.6, 0.3, 0.6, 1.0):  # in thresholds
        runner._last_run_s = last * threshold
        decisions.append(_bridge.SessionRunner._releases_openmp(runner))
    assert decisions == [False, True, True, True, False, False, True]
