"""ORTModule and custom torch.autograd.Functions: the exporter traces through their forward, so a
module that runs one whose backward is its own (a straight-through estimator, a gradient
reversal) must not train with the gradient of that forward. It runs in PyTorch (or raises
without fallback) with a reason that names the Functions; Functions declared exact, and torch's
reentrant checkpoint, run in ONNX Runtime; Functions only on tensors that need no gradient do
not matter; a parameter unfrozen after the export is looked along at the next training call.
Backward hooks on submodules cannot run in ONNX Runtime's backward either: such a module runs in
PyTorch too."""

import copy
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.torch import DebugOptions, ForwardHookWarning, ORTModule, ORTModuleFallbackWarning  # noqa: E402
from onnxtrain.torch._export import autograd_functions  # noqa: E402

from ._parity import assert_steps_match, eager_and_wrapped, step  # noqa: E402


class RoundSTE(torch.autograd.Function):
    """Rounds; passes the gradient straight through (the forward's own gradient is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReverseGrad(torch.autograd.Function):
    """Identity forward; negated gradient (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Cube(torch.autograd.Function):
    """x^3 with its exact gradient written by hand."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3.0 * x * x * grad


class Net(torch.nn.Module):
    """Two linear layers with a custom Function (or none) between them."""

    def __init__(self, function=None):
        super().__init__()
        self.first = torch.nn.Linear(6, 5)
        self.second = torch.nn.Linear(5, 3)
        self.function = function

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if self.function is not None:
            h = self.function.apply(h)
        return self.second(h)


class InputNormalized(torch.nn.Module):
    """A custom Function applied to the input only (which needs no gradient)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.linear(ReverseGrad.apply(x * 0.5))


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.second = torch.nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.tanh(self.first(t)), x, use_reentrant=True)
        return self.second(h)


def test_the_autograd_graph_names_the_functions_a_forward_ran():
    x = torch.randn(4, 6, requires_grad=True)
    y = Cube.apply(RoundSTE.apply(ReverseGrad.apply(x)) + torch.tanh(x))
    assert autograd_functions([y, 3, None]) == [Cube, RoundSTE, ReverseGrad]
    assert autograd_functions([torch.tanh(x)]) == []
    with torch.no_grad():
        assert autograd_functions([Cube.apply(x)]) == []


@pytest.mark.parametrize("function", [RoundSTE, ReverseGrad], ids=["straight-through", "gradient-reversal"])
def test_a_function_with_its_own_backward_runs_in_pytorch(function):
    eager, wrapped = eager_and_wrapped(lambda: Net(function))
    x = torch.randn(8, 6) * 3
    with pytest.warns(ORTModuleFallbackWarning, match=f"custom torch.autograd.Function .*{function.__qualname__}"):
        assert_steps_match(eager, wrapped, x)
    assert function.__qualname__ in wrapped.fallback_reason
    assert_steps_match(eager, wrapped, x)  # and stays there, without warning again


def test_without_fallback_the_error_names_every_function_and_the_option():
    class Both(Net):
        def forward(self, x):
            return super().forward(ReverseGrad.apply(x))

    _, wrapped = eager_and_wrapped(lambda: Both(RoundSTE), debug_options=DebugOptions(fallback=False))
    with pytest.raises(ExportError, match="inline_autograd_functions") as raised:
        wrapped(torch.randn(8, 6, requires_grad=True))
    assert f"{__name__}.RoundSTE" in str(raised.value) and f"{__name__}.ReverseGrad" in str(raised.value)


def test_a_function_declared_exact_runs_in_onnx_runtime():
    eager, wrapped = eager_and_wrapped(lambda: Net(Cube), inline_autograd_functions=[Cube])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for seed in range(2):
            assert_steps_match(eager, wrapped, torch.randn(8, 6, generator=torch.Generator().manual_seed(seed)))
    assert wrapped.fallback_reason is None and wrapped.export_count == 1


def test_inline_all_trusts_every_function():
    # True inlines every Function: here RoundSTE's forward is differentiated (round passes no
    # gradient), which is what the user asked for and what PyTorch's own round would give
    torch.manual_seed(0)
    wrapped = ORTModule(Net(RoundSTE), inline_autograd_functions=True)
    x = torch.randn(8, 6) * 3
    _, grads = step(wrapped, x)
    assert wrapped.fallback_reason is None
    assert torch.count_nonzero(grads[0]) == 0 and torch.count_nonzero(grads[2]) > 0


def test_reentrant_checkpoint_runs_in_onnx_runtime():
    eager, wrapped = eager_and_wrapped(Checkpointed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        # with an input that requires grad, as the reentrant variant needs (without one, eager
        # gives the checkpointed layers no gradient at all)
        assert_steps_match(eager, wrapped, torch.randn(8, 6, requires_grad=True))
    assert wrapped.fallback_reason is None


def test_bloom_gelu_function_is_known_exact():
    """transformers' BLOOM runs its tanh GELU as a custom Function in training, whose backward is
    the forward's derivative: it trains in ONNX Runtime with eager's gradients."""
    transformers = pytest.importorskip("transformers")

    class Bloom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.BloomConfig(vocab_size=50, hidden_size=16, n_layer=2, n_head=2, hidden_dropout=0.0,
                                              attention_dropout=0.0)
            self.model = transformers.BloomForCausalLM(config)

        def forward(self, ids):
            return self.model(ids).logits

    eager, wrapped = eager_and_wrapped(Bloom)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        assert_steps_match(eager, wrapped, torch.randint(0, 50, (3, 7)))
    assert wrapped.fallback_reason is None


def test_a_function_on_tensors_without_gradient_does_not_matter():
    eager, wrapped = eager_and_wrapped(InputNormalized)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        assert_steps_match(eager, wrapped, torch.randn(8, 6))
    assert wrapped.fallback_reason is None


def test_an_inference_call_runs_in_onnx_runtime_and_a_training_call_finds_the_function():
    # without grad no backward runs: the forward's graph is exact; the first call with grad
    # exports again (grad mode is part of the key) and finds the Function
    eager, wrapped = eager_and_wrapped(lambda: Net(ReverseGrad))
    x = torch.randn(8, 6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        torch.testing.assert_close(wrapped(x), eager(x))
    assert wrapped.fallback_reason is None
    with pytest.warns(ORTModuleFallbackWarning, match="ReverseGrad"):
        assert_steps_match(eager, wrapped, x)


def test_a_parameter_unfrozen_after_the_export_is_looked_along():
    # the Function sits on the frozen first layer's path: at the export no gradient flows
    # through it, so it does not matter and the module runs in ONNX Runtime; once the first
    # layer trains, its gradient passes the Function, and the next training call finds it
    eager, wrapped = eager_and_wrapped(lambda: Net(ReverseGrad))
    eager.first.requires_grad_(False)
    wrapped.module.first.requires_grad_(False)
    x = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        assert_steps_match(eager, wrapped, x)
    assert wrapped.fallback_reason is None and wrapped.export_count == 1
    eager.first.requires_grad_(True)
    wrapped.module.first.requires_grad_(True)
    with pytest.warns(ORTModuleFallbackWarning, match="ReverseGrad"):
        assert_steps_match(eager, wrapped, x)


def test_unfreezing_without_functions_keeps_the_graph():
    eager, wrapped = eager_and_wrapped(Net)
    eager.first.requires_grad_(False)
    wrapped.module.first.requires_grad_(False)
    x = torch.randn(8, 6)
    assert_steps_match(eager, wrapped, x)
    eager.first.requires_grad_(True)
    wrapped.module.first.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        assert_steps_match(eager, wrapped, x)
        assert_steps_match(eager, wrapped, x)
    assert wrapped.fallback_reason is None
    assert wrapped.export_count == 2  # one look along the new paths, not one per call


@pytest.mark.parametrize("value", [[int], 5, [Cube, "Cube"]], ids=["class", "number", "string"])
def test_inline_autograd_functions_takes_function_classes(value):
    with pytest.raises(TypeError, match="inline_autograd_functions"):
        ORTModule(Net(), inline_autograd_functions=value)


def test_copies_keep_the_declared_functions():
    torch.manual_seed(0)
    wrapped = ORTModule(Net(Cube), inline_autograd_functions=[Cube])
    for clone in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        step(clone, torch.randn(8, 6))
        assert clone.fallback_reason is None


def _halve_input_gradient(module, grad_input, grad_output):
    return (grad_input[0] * 0.5,)


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")
@pytest.mark.parametrize("hook", [
    lambda net: net.second.register_full_backward_hook(_halve_input_gradient),
    lambda net: net.second.register_full_backward_pre_hook(lambda module, grad_output: (grad_output[0] * 0.5,)),
    lambda net: net.second.register_backward_hook(lambda module, grad_input, grad_output:
                                                  (grad_input[0] * 0.5, *grad_input[1:])),
], ids=["full", "pre", "legacy"])
def test_a_submodule_backward_hook_runs_in_pytorch(hook):
    eager, wrapped = eager_and_wrapped(Net)
    hook(eager)
    hook(wrapped.module)
    with pytest.warns(ORTModuleFallbackWarning, match=r"backward hooks \(second\)"):
        assert_steps_match(eager, wrapped, torch.randn(8, 6))


class HookedInside(Net):
    """Registers a gradient hook on an activation inside its forward."""

    def __init__(self, register):
        super().__init__()
        self.register = register

    def forward(self, x):
        h = torch.tanh(self.first(x))
        self.register(h)
        return self.second(h)


def _double(grad):
    return grad * 2.0


@pytest.mark.parametrize("register", [
    lambda h: h.register_hook(_double),
    lambda h: torch.autograd.graph.register_multi_grad_hook((h,), lambda grads: None),
], ids=["tensor", "multi"])
def test_a_gradient_hook_registered_in_forward_runs_in_pytorch(register):
    # the capture drops hooks registered on its (fake) tensors: the graph's backward would
    # compute the first layer's gradients without the doubling
    eager, wrapped = eager_and_wrapped(lambda: HookedInside(register))
    with pytest.warns(ORTModuleFallbackWarning, match=r"registers gradient hooks on its tensors"):
        assert_steps_match(eager, wrapped, torch.randn(8, 6))
    strict = ORTModule(HookedInside(register), DebugOptions(fallback=False))
    with pytest.raises(ExportError, match=r"HookedInside's forward registers gradient hooks"):
        strict(torch.randn(8, 6))


def test_forward_hooks_and_parameter_hooks_stay_in_onnx_runtime():
    # a forward hook is traced into the graph; a hook on a parameter fires on the gradient
    # ORTModule hands to autograd
    eager, wrapped = eager_and_wrapped(Net)
    for net in (eager, wrapped.module):
        net.second.register_forward_hook(lambda module, inputs, output: output * 2.0)
        net.first.weight.register_hook(lambda grad: grad * 0.25)
    with warnings.catch_warnings(), pytest.warns(ForwardHookWarning, match="forward hooks on second"):
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        assert_steps_match(eager, wrapped, torch.randn(8, 6))
    assert wrapped.fallback_reason is None
