"""Eager PyTorch against ORTModule on the same module: one training step's outputs and gradients."""

import warnings

import torch

from onnxtrain.torch import ORTModule, onnx_translation_table


class FunctionModule(torch.nn.Module):
    """A module without parameters whose forward is ``function`` of its inputs (an op under test)."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *inputs):
        return self.function(*inputs)


def eager_and_wrapped(factory, **options):
    """Two modules from ``factory`` with the same weights: eager, and wrapped in ORTModule(**options)."""
    torch.manual_seed(0)
    eager = factory()
    wrapped = ORTModule(factory(), **options)
    wrapped.module.load_state_dict(eager.state_dict())
    return eager, wrapped


def step(model, x):
    """Output and parameter gradients (None where PyTorch leaves none) of ``sum(model(x)^2)``."""
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_steps_match(eager, wrapped, x) -> list:
    """The same outputs and gradients (and the same parameters without one); the wrapped ones."""
    out, grads = step(wrapped, x)
    eager_out, eager_grads = step(eager, x)
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    assert [g is None for g in grads] == [g is None for g in eager_grads]
    for ours, theirs in zip(grads, eager_grads):
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    return grads


def exported_ops(module, x) -> list[str]:
    """The op types of ``module(x)`` exported with onnxtrain's translations (``torch.onnx.export``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (x,), dynamo=True, optimize=False, verbose=False,
                                    custom_translation_table=onnx_translation_table())
    return [n.op_type for n in program.model_proto.graph.node]
