"""Branches and step loops train through both front doors, ORTModule and export_for_training's
artifacts, with eager PyTorch's gradients.

``torch.cond`` exports as an ONNX ``If`` whose branches read the enclosing graph's values
(onnxtrain's If rule differentiates the branch taken), torch's ``scan`` as a ``Scan`` (its rule
runs the differentiated body over the steps in reverse). torch's own autograd Functions for these
ops (their backward differentiates the subgraphs too) are not refused as custom Functions.
torch's ``while_loop`` exports as a ``Loop`` (the capture's runtime asserts on the loop's
counter concern values the graph computes, not the inputs' shapes). ``nn.LSTM(proj_size=...)``,
which ONNX's LSTM cannot express, is traced through torch's decomposition of the op (its steps
unrolled).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxtrain.torch import DebugOptions, ORTModule, export_for_training
from tests.torch_models import training_gradients


def _assert_ortmodule_trains_like_eager(make, x: torch.Tensor, reference=None):
    """The outputs and every gradient (parameters and input) of a random-direction VJP through
    ORTModule equal eager PyTorch's (of ``reference()``, the same weights, where given);
    returns the wrapped model."""
    torch.manual_seed(0)
    reference = (reference or make)()
    torch.manual_seed(0)
    model = make()
    wrapped = ORTModule(model, DebugOptions(fallback=False))
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = reference(xr), wrapped(xo)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (expected * weight).sum().backward()
    (got * weight).sum().backward()
    torch.testing.assert_close(got, expected)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-5, atol=1e-6)
    return model


def _assert_artifacts_train_like_eager(make, x: torch.Tensor, reference=None):
    """The parameters' gradients of a random-direction VJP through the training graph of
    export_for_training's model equal eager PyTorch's (of ``reference()``, the same weights,
    where given); returns the exported model."""
    torch.manual_seed(0)
    onnx_model = export_for_training(make(), (x,), input_names=["x"])
    torch.manual_seed(0)
    model = (reference or make)()
    out = model(x)
    weight = np.random.default_rng(1).standard_normal(tuple(out.shape)).astype(np.float32)
    params = dict(model.named_parameters())
    ours = training_gradients(onnx_model, list(params), {"x": x.numpy()}, weight)
    (out * torch.from_numpy(weight)).sum().backward()
    for name, p in params.items():
        np.testing.assert_allclose(ours[name], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    return onnx_model


class Gated(torch.nn.Module):
    """A residual branch taken when the batch's mean activation is positive, else a squared one;
    both branches read a parameter of their own."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.25]))
        self.shift = torch.nn.Parameter(torch.tensor([0.1, 0.2, -0.3, 0.4]))

    def forward(self, x):
        h = self.inner(x)
        return torch.cond(h.mean() > 0, lambda t: torch.tanh(t) * self.scale + t,
                          lambda t: t * t + self.shift, (h,))


def _input(positive: bool) -> torch.Tensor:
    """A batch for which the model takes the first branch (``positive``) or the second."""
    torch.manual_seed(0)
    model = Gated()
    for seed in range(100):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        if (model.inner(x).mean() > 0) == positive:
            return x
    raise AssertionError("no sample takes the branch")


@pytest.mark.parametrize("positive", [True, False], ids=["then", "else"])
def test_ortmodule_trains_torch_cond_like_eager(positive):
    model = _assert_ortmodule_trains_like_eager(Gated, _input(positive))
    untaken = "shift" if positive else "scale"
    assert torch.count_nonzero(getattr(model, untaken).grad) == 0  # the branch not taken


@pytest.mark.parametrize("positive", [True, False], ids=["then", "else"])
def test_artifacts_of_torch_cond_train_like_eager(positive):
    _assert_artifacts_train_like_eager(Gated, _input(positive))

class Recurrent(torch.nn.Module):
    """A tanh recurrence written with ``torch._higher_order_ops.scan`` (exported as an ONNX
    ``Scan`` whose body reads the layer's parameters from outside): the final state plus the
    sum of the per-step outputs."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.Linear(4, 4)

    def forward(self, x):  # [steps, batch, 4]
        from torch._higher_order_ops.scan import scan

        def step(h, xt):
            h = torch.tanh(self.cell(h) + xt)
            return h, h * h

        final, outputs = scan(step, torch.zeros_like(x[0]), x)
        return outputs.sum(0) + final


def _steps() -> torch.Tensor:
    return torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(0))


def test_ortmodule_trains_a_torch_scan_like_eager():
    _assert_ortmodule_trains_like_eager(Recurrent, _steps())


def test_artifacts_of_a_torch_scan_train_like_eager():
    onnx_model = _assert_artifacts_train_like_eager(Recurrent, _steps())
    assert any(node.op_type == "Scan" for node in onnx_model.graph.node)


class ProjectedLstm(torch.nn.Module):
    """nn.LSTM with an output projection (2 bidirectional layers): ONNX's LSTM has none, so the
    capture traces torch's decomposition of the op instead (one cell per step)."""

    def __init__(self, **options):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 6, proj_size=3, num_layers=2, **options)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return torch.cat([out.flatten(), h.flatten(), c.flatten()])


@pytest.mark.parametrize("options", [{"bidirectional": True}, {"batch_first": True}], ids=["bidirectional",
                                                                                          "batch-first"])
def test_an_lstm_with_a_projection_trains_like_eager(options):
    x = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(0))
    _assert_ortmodule_trains_like_eager(lambda: ProjectedLstm(**options), x)
    onnx_model = _assert_artifacts_train_like_eager(lambda: ProjectedLstm(**options), x)
    assert not any(node.op_type == "LSTM" for node in onnx_model.graph.node)


def test_an_lstm_with_a_projection_follows_the_sequence_length():
    """The decomposition unrolls the steps: a call with another length gets a graph of its own."""
    torch.manual_seed(0)
    reference = ProjectedLstm()
    torch.manual_seed(0)
    model = ProjectedLstm()
    wrapped = ORTModule(model, DebugOptions(fallback=False))
    for count, steps in enumerate((5, 7), start=1):
        x = torch.randn(steps, 2, 4, generator=torch.Generator().manual_seed(steps))
        torch.testing.assert_close(wrapped(x), reference(x))
        assert wrapped.export_count == count


class Looped(torch.nn.Module):
    """Three tanh layers sharing weights, written with torch's while_loop (exported as an ONNX
    ``Loop`` whose body reads the layer's parameters from outside)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        _, h = while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, torch.tanh(self.layer(h))), (torch.tensor(0), x))
        return h


class Unrolled(Looped):
    """The same three steps as a Python loop: the reference for Looped's gradients (in torch
    2.13 eager autograd through while_loop gives the parameters the body closes over another
    gradient than finite differences do; the unrolled loop's agrees with them)."""

    def forward(self, x):
        h = x
        for _ in range(3):
            h = torch.tanh(self.layer(h))
        return h


def test_a_torch_while_loop_trains_as_the_unrolled_loop():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    _assert_ortmodule_trains_like_eager(Looped, x, reference=Unrolled)
    onnx_model = _assert_artifacts_train_like_eager(Looped, x, reference=Unrolled)
    assert any(node.op_type == "Loop" for node in onnx_model.graph.node)
