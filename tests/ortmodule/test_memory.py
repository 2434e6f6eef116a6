"""ORTModule's memory options: same gradients with recompute, less memory, a readable report."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import ORTModule  # noqa: E402
from onnxtrain.torch.ortmodule import MemoryOptionsError  # noqa: E402
from tests.torch_models import GPT  # noqa: E402

WORKER = Path(__file__).with_name("_memory_worker.py")
PEAK_BATCH = 64  # activations dominate the peak (the regime recompute is for)


def _gradients(**memory_options):
    torch.manual_seed(0)
    net = GPT(layers=3)
    model = ORTModule(net, **memory_options) if memory_options is not None else net
    idx = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(1))
    model(idx).square().mean().backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}, model


@pytest.fixture(scope="module")
def reference():
    return _gradients()[0]


@pytest.mark.parametrize("options", [{"memory_opt_level": 1}, {"memory_opt_level": 2}, {"memory_budget": 0}],
                         ids=["level1", "level2", "budget0"])
def test_recompute_leaves_gradients_unchanged(reference, options):
    grads, model = _gradients(**options)
    for name, expected in reference.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-7, msg=name)
    report = model.memory_report
    assert report.saved_bytes < report.unplanned_saved_bytes
    text = model.explain_memory()
    assert "saved activations" in text and "recomputed in the backward" in text


def test_explain_memory_before_training_and_bad_options():
    model = ORTModule(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="training"):
        model.explain_memory()
    # numbers that are not whole, bools and strings were truncated or taken as 1
    for budget in (-1, True, 0.5 * 2**30, "100"):
        with pytest.raises(MemoryOptionsError, match="memory_budget must be a whole number"):
            ORTModule(torch.nn.Linear(2, 2), memory_budget=budget)
    for level in (5, 1.7, True, "2"):
        with pytest.raises(MemoryOptionsError, match="memory_opt_level must be 0, 1 or 2"):
            ORTModule(torch.nn.Linear(2, 2), memory_opt_level=level)
    assert ORTModule(torch.nn.Linear(2, 2), memory_budget=np.int64(100))._memory_options.budget == 100


def test_the_level_from_the_environment_is_read_once_and_estimates_take_a_modules_options(monkeypatch):
    """$ORTMODULE_MEMORY_OPT_LEVEL is read when the module is made (it was read again at every
    export: a later value won silently), and estimate_memory of an ORTModule uses its options."""
    from onnxtrain.torch import estimate_memory

    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "2")
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)))
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "0")
    model(torch.randn(2, 4)).sum().backward()
    assert model.memory_report.level == 2
    monkeypatch.delenv("ORTMODULE_MEMORY_OPT_LEVEL")
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    x = torch.randn(32, 16)
    recomputing = estimate_memory(ORTModule(net, memory_opt_level=2), x).saved_activations
    assert recomputing == estimate_memory(net, x, memory_opt_level=2).saved_activations
    assert recomputing < estimate_memory(net, x).saved_activations
    with pytest.raises(ValueError, match="optimizer_states"):
        estimate_memory(net, x, optimizer_states=-1)


def _run(mode: str) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), mode, str(PEAK_BATCH)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak")
def test_half_budget_cuts_the_peak_by_what_it_stops_saving():
    """The benchmark GPT with a budget of half its no-recompute activation memory: the
    measured peak of a training run drops by at least 3/4 of the activation bytes the plan
    stops saving (130 of 132 MB here; 397 against 527 MB), and the loss is the same."""
    plain = _run("level0")
    budget = plain["unplanned_saved_bytes"] // 2
    planned = _run(str(budget))
    assert planned["saved_bytes"] <= budget
    assert planned["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    not_saved_mb = (plain["saved_bytes"] - planned["saved_bytes"]) / 2**20
    drop_mb = plain["peak_mb"] - planned["peak_mb"]
    assert drop_mb >= 0.75 * not_saved_mb, f"peak {plain['peak_mb']:.0f} MB -> {planned['peak_mb']:.0f} MB " \
                                           f"with {not_saved_mb:.0f} MB fewer activations saved"


ESTIMATE_WORKER = Path(__file__).with_name("_estimate_worker.py")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak")
@pytest.mark.parametrize("name, batch", [
    ("mlp", 2048), ("cnn", 64), ("gpt", 64),
    # BERT-mini (~19 s; GPT covers attention in the default run) and larger batches, where the
    # arena's growth and fragmentation matter most (pytest -m slow)
    pytest.param("bert-mini", 64, marks=pytest.mark.slow),
    pytest.param("mlp", 8192, marks=pytest.mark.slow),
    pytest.param("cnn", 256, marks=pytest.mark.slow),
])
def test_estimate_is_within_a_fifth_of_the_measured_step_peak(name, batch):
    done = subprocess.run([sys.executable, str(ESTIMATE_WORKER), name, str(batch)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = result["estimated"] / result["measured"]
    assert 0.8 <= ratio <= 1.2, f"{name}: estimated / measured = {ratio:.2f}\n{result['explain']}"


class _RunningMeanNormalizer(torch.nn.Module):
    """Normalizes with a running mean it then updates in place (an RL observation normalizer)."""

    def __init__(self, scaled):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        self.scaled = scaled
        self.register_buffer("mu", torch.full((8,), 0.3))

    def forward(self, x):
        h = self.l1(x)
        y = h * (self.mu * 2) if self.scaled else torch.tanh(h - self.mu)
        with torch.no_grad():
            self.mu.mul_(0.5).add_(0.5 * h.mean(0))
        return self.l2(y)


@pytest.mark.parametrize(("scaled", "options"), [(False, {"memory_opt_level": 2}), (False, {"memory_budget": 0}),
                                                 (True, {})])
def test_a_backward_that_reads_a_buffer_the_forward_updates(scaled, options):
    """The backward reads (recomputes from) the buffer's value from before the call, while the
    call writes the update back into the buffer: autograd refused the backward (the saved buffer
    was modified in place)."""
    from onnxtrain.torch import DebugOptions

    torch.manual_seed(0)
    eager = _RunningMeanNormalizer(scaled)
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False), **options)
    for seed in (1, 2):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
        for model in (eager, wrapped):
            model.zero_grad()
            model(x).square().mean().backward()
        torch.testing.assert_close(wrapped.module.l1.weight.grad, eager.l1.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wrapped.module.mu, eager.mu)
