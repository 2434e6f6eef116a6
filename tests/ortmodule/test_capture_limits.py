"""What a captured graph can and cannot reproduce of a forward, and how ORTModule handles each:
None among the outputs and numbers derived from static shapes come back as in eager; a forward
that branches on grad mode gets a graph per mode; what a graph cannot give (numbers computed
from the tensors, tensors stored on modules, tensors hidden in plain objects, a second
backward) runs in PyTorch or raises, instead of returning stale or traced values."""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import OnnxTrainError  # noqa: E402
from onnxtrain.torch import ORTModule, ORTModuleFallbackWarning  # noqa: E402

from ._parity import FunctionModule, assert_steps_match, eager_and_wrapped, step  # noqa: E402


class WithNone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.linear = torch.nn.Linear(8, 3)

    def forward(self, x):
        out, weights = self.attention(x, x, x, need_weights=False)
        return {"logits": self.linear(out), "aux": None, "weights": weights}


def test_none_among_the_outputs():
    eager, wrapped = eager_and_wrapped(WithNone)
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        out = wrapped(x)
    expected = eager(x)
    assert out["aux"] is None and out["weights"] is None
    torch.testing.assert_close(out["logits"], expected["logits"], rtol=1e-5, atol=1e-5)
    out["logits"].sum().backward()


class ShapeNumbers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        y = self.linear(x)
        return x.shape[0], y * float(x.size(0)) / math.sqrt(x.shape[-1] * x.shape[0])


def test_numbers_from_shapes_follow_the_call():
    # a dynamic export would return (and bake in) the traced symbols: each shape gets a graph
    eager, wrapped = eager_and_wrapped(ShapeNumbers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for batch in (4, 6, 3, 8):
            x = torch.randn(batch, 5)
            size, out = wrapped(x)
            expected_size, expected = eager(x)
            assert size == expected_size == batch and isinstance(size, int)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert wrapped.fallback_reason is None


class ReturnsItem(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        y = self.linear(x)
        return y, y.mean().item()


def test_a_number_computed_from_values_runs_in_pytorch():
    eager, wrapped = eager_and_wrapped(ReturnsItem)
    x = torch.randn(4, 5)
    with pytest.warns(ORTModuleFallbackWarning, match="returns Python numbers computed from its tensors"):
        _, mean = wrapped(x)
    assert isinstance(mean, float) and mean == pytest.approx(eager(x)[1])


class Batch:
    """A plain object holding the inputs (not a pytree node)."""

    def __init__(self, x):
        self.x = x


class TakesBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 3)

    def forward(self, batch):
        return self.linear(batch.x)


def test_tensors_inside_plain_objects_run_in_pytorch():
    eager, wrapped = eager_and_wrapped(TakesBatch)
    batch = Batch(torch.randn(4, 5))
    with pytest.warns(ORTModuleFallbackWarning, match="tensors inside Batch objects"):
        wrapped(batch)
    batch.x = torch.randn(4, 5)  # a graph would have kept the first tensor as a constant
    torch.testing.assert_close(wrapped(batch), eager(batch))


class StoresAuxLoss(torch.nn.Module):
    """Keeps a tensor on itself for the training loop (a mixture-of-experts auxiliary loss)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 3)
        self.aux_loss = None

    def forward(self, x):
        y = self.linear(x)
        self.aux_loss = y.square().mean()
        return y


def test_tensors_stored_on_modules_run_in_pytorch():
    eager, wrapped = eager_and_wrapped(StoresAuxLoss)
    for call in range(2):
        x = torch.randn(4, 5)
        if call == 0:
            with pytest.warns(ORTModuleFallbackWarning, match=r"stores tensors on modules \(aux_loss\)"):
                wrapped(x)
        else:
            wrapped(x)
        eager(x)
        torch.testing.assert_close(wrapped.module.aux_loss, eager.aux_loss)


class GradModeBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        return self.linear(x) * (2.0 if torch.is_grad_enabled() else 3.0)


def test_a_forward_that_branches_on_grad_mode_gets_a_graph_per_mode():
    eager, wrapped = eager_and_wrapped(GradModeBranch)
    x = torch.randn(4, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for grad in (True, False, True, False):
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(wrapped(x), eager(x))
    assert wrapped.export_count == 2


def test_a_second_backward_is_a_clear_error():
    # a gradient penalty differentiates the gradient; ORT's backward cannot be differentiated
    _, wrapped = eager_and_wrapped(GradModeBranch)
    x = torch.randn(4, 5, requires_grad=True)
    out = wrapped(x).square().sum()
    with pytest.raises(OnnxTrainError, match="cannot be differentiated again"):
        torch.autograd.grad(out, x, create_graph=True)
    # a plain gradient still works
    (grad,) = torch.autograd.grad(wrapped(x).square().sum(), x)
    assert grad.shape == x.shape and not grad.requires_grad


class _ForcesFromEnergy(torch.nn.Module):
    """An interatomic potential: forces are the negative gradient of the energy."""

    def __init__(self):
        super().__init__()
        self.energy = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, positions):
        with torch.enable_grad():
            positions = positions.detach().requires_grad_(True)
            energy = self.energy(positions).sum()
            (gradient,) = torch.autograd.grad(energy, positions, create_graph=True)
        return energy, -gradient


def test_gradients_computed_in_the_forward_run_in_pytorch_and_are_named():
    from onnxtrain.errors import ExportError
    from onnxtrain.torch import DebugOptions

    eager, wrapped = eager_and_wrapped(_ForcesFromEnergy)
    x = torch.randn(6, 3)
    with pytest.warns(ORTModuleFallbackWarning, match=r"computes gradients \(torch\.autograd\.grad\)"):
        _, forces = wrapped(x)
    _, expected = eager(x)
    torch.testing.assert_close(forces, expected)
    forces.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(wrapped.module.energy[0].weight.grad, eager.energy[0].weight.grad)
    with pytest.raises(ExportError, match=r"_ForcesFromEnergy's forward computes gradients"):
        ORTModule(_ForcesFromEnergy(), DebugOptions(fallback=False))(x)


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.a(x), torch.tanh(self.b(x))


def test_the_outputs_of_one_call_share_one_backward():
    """Two outputs from independent layers: eager backpropagates each on its own; one ORTModule
    call has one backward for all of them, and a second backward after the first freed its
    tensors said only "Trying to backward through the graph a second time". It names the way:
    backpropagate them together, or retain_graph=True."""
    eager, wrapped = eager_and_wrapped(_TwoHeads)
    x = torch.randn(4, 5)
    first, second = wrapped(x)
    first.sum().backward()
    with pytest.raises(OnnxTrainError, match=r"outputs of one call share one backward .*\(loss_a \+ loss_b\)"):
        second.square().sum().backward()
    for model in (eager, wrapped):
        model.zero_grad()
        first, second = model(x)
        first.sum().backward(retain_graph=True)
        second.square().sum().backward()
    for p, q in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    # an output the backward reads (tanh's), changed in place: autograd's own error, as eager's
    _, second = wrapped(x)
    second.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        second.sum().backward()


def test_an_ortmodule_inside_an_eager_module():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = ORTModule(torch.nn.Linear(5, 5))

        def forward(self, x):
            return torch.relu(self.inner(x)).sum()

    model = Outer()
    model(torch.randn(3, 5)).backward()
    assert model.inner.module.weight.grad is not None


class ShapeBranches(torch.nn.Module):
    """Python code on the batch size: a parity branch and a float from a product of dims."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        y = self.linear(x) / math.sqrt(x.shape[-1] * x.shape[0])
        return y * 2.0 if x.shape[0] % 2 == 0 else y * 3.0


def test_a_dynamic_graph_serves_only_calls_its_shape_guards_admit():
    # after the dynamic re-export (second shape), a batch size for which the traced Python
    # would have gone another way gets a graph of its own, as torch.compile's guards do
    eager, wrapped = eager_and_wrapped(ShapeBranches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for batch in (4, 6, 7, 9, 6, 7):
            x = torch.randn(batch, 5)
            torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-5, atol=1e-5)
    assert wrapped.export_count == 4  # 4 static, 6 dynamic (guards pin it), 7 and 9 static


class FlattenedRowsAndTheirSum(torch.nn.Module):
    """Returns ``[batch * seq, 4]`` rows and their sum over the rows (a Mixture-of-Experts router's
    logits and its load-balancing statistics)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        rows = self.linear(x).reshape(-1, 4)
        return rows, torch.softmax(rows, dim=-1).sum(0)


def test_a_sum_over_flattened_dynamic_rows_beside_them():
    # the dynamic export's sum read its row count off the rows' output-gradient input, which
    # tied the forward to the backward (AssertionError, not even a fallback)
    eager, wrapped = eager_and_wrapped(FlattenedRowsAndTheirSum)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for length in (7, 5, 9):
            x = torch.randn(3, length, 8)
            results = []
            for model in (wrapped, eager):
                model.zero_grad()
                rows, statistics = model(x)
                (rows.square().sum() + statistics.square().sum()).backward()
                results.append([rows.detach(), statistics.detach(), *(p.grad.clone() for p in model.parameters())])
            for ours, theirs in zip(*results, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert wrapped.export_count == 2  # one static, then one dynamic export


class ParityOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        y = self.linear(x)
        return y * 2.0 if x.shape[0] % 2 == 0 else y * 3.0


def test_a_guard_is_checked_once_per_shape():
    eager, wrapped = eager_and_wrapped(ParityOnly, dynamic=True)
    for batch in (4, 8, 10, 4):
        x = torch.randn(batch, 5)
        torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-5, atol=1e-5)
    assert wrapped.export_count == 1  # every even batch passes the guard
    graph = next(iter(wrapped._variants.values()))[0].graph
    assert graph.shape_guards and len(graph._guard_results) == 3
    x = torch.randn(5, 5)
    torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-5, atol=1e-5)
    assert wrapped.export_count == 2


@pytest.mark.parametrize("tracked", [False, True], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_instance_norm(tracked, dims):
    # with running statistics, training updates them in place (the capture writes the update,
    # which the op's translation cannot give back); without, ONNX Runtime's
    # InstanceNormalization normalizes by each sample's statistics
    conv = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dims]
    norm = {1: torch.nn.InstanceNorm1d, 2: torch.nn.InstanceNorm2d, 3: torch.nn.InstanceNorm3d}[dims]

    def factory():
        # (a layer after the norm: the norm's output alone has a square sum its weights decide)
        return torch.nn.Sequential(conv(3, 4, 3), norm(4, affine=True, track_running_stats=tracked, momentum=0.3),
                                   torch.nn.Tanh(), conv(4, 2, 1))

    eager, wrapped = eager_and_wrapped(factory)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for _ in range(2):
            x = torch.randn(2, 3, *[7] * dims)
            (out, grads), (expected, expected_grads) = step(wrapped, x), step(eager, x)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            for ours, theirs in zip(grads, expected_grads, strict=True):
                # (the first conv's bias gets a zero gradient: the norm removes it; atol for the
                # rounding of sums over a 5x5x5 volume)
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(wrapped.module.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs)
    wrapped.eval()
    eager.eval()
    torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-4, atol=1e-5)


class Scatters(torch.nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.linear = torch.nn.Linear(5, 6)
        self.reduce = reduce

    def forward(self, x, index):
        y = self.linear(x)
        return y.scatter_reduce(1, index, y[:, 3:], self.reduce)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_scatter_reduce(reduce):
    # the exporter's "mean" does not average: ours does (it fell back to PyTorch before)
    eager, wrapped = eager_and_wrapped(lambda: Scatters(reduce))
    x = torch.randn(4, 5)
    index = torch.tensor([[0, 2, 1], [1, 3, 5], [3, 0, 4], [5, 2, 1]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wrapped(x, index)
    assert not any(issubclass(w.category, ORTModuleFallbackWarning) for w in caught)
    torch.testing.assert_close(out, eager(x, index), rtol=1e-5, atol=1e-5)


class AtTheKinks(torch.nn.Module):
    """An activation evaluated exactly at its kinks (weights times ones)."""

    def __init__(self, activation):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0, 6.0]))
        self.activation = activation

    def forward(self, x):
        return self.activation(self.weight * x)


@pytest.mark.parametrize("activation", [
    torch.nn.functional.hardtanh, torch.nn.functional.relu6, torch.nn.functional.hardswish,
    lambda t: t.clamp(-1, 1), lambda t: t.clamp(min=0), lambda t: torch.clamp(t, max=1.0),
], ids=["hardtanh", "relu6", "hardswish", "clamp", "clamp-min", "clamp-max"])
def test_gradients_at_the_kinks_are_torchs(activation):
    eager, wrapped = eager_and_wrapped(lambda: AtTheKinks(activation))
    x = torch.ones(6)
    for model in (eager, wrapped):
        model(x).sum().backward()
    torch.testing.assert_close(wrapped.module.weight.grad, eager.weight.grad)


@pytest.mark.parametrize("activation", [
    torch.nn.functional.hardtanh, torch.nn.functional.relu6, lambda t: t.clamp(-1, 1),
], ids=["hardtanh", "relu6", "clamp"])
def test_gradients_at_nan_and_infinite_inputs_are_torchs(activation):
    """hardtanh and relu6 pass the gradient where the input is not at or beyond a bound (NaN
    too), clamp where it is within them (not NaN), as PyTorch's kernels."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.5, -2.0, 1.0, 7.0])
    wrapped = ORTModule(FunctionModule(activation))
    expected_input, got_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    activation(expected_input).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        wrapped(got_input).sum().backward()
    torch.testing.assert_close(got_input.grad, expected_input.grad)


class TensorBounds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.low = torch.nn.Parameter(torch.full((4,), -0.2))
        self.high = torch.nn.Parameter(torch.full((4,), 0.3))

    def forward(self, x):
        y = self.linear(x)
        return torch.clamp(y, self.low, self.high) + torch.clamp(y.round().int(), -1, 1).float()


def test_clamp_with_tensor_bounds_and_integers():
    eager, wrapped = eager_and_wrapped(TensorBounds)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        assert_steps_match(eager, wrapped, torch.randn(5, 4) * 2)


class MaskedByNumbers(torch.nn.Module):
    """A number minus (and floor-divided by) an integer mask: XLNet's ``1.0 - attention_mask``."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, mask):
        kept = (1.0 - mask).unsqueeze(-1) * torch.rsub(mask, 0.5).unsqueeze(-1)
        return self.linear(x) * kept + 3.0 // (mask + 1).unsqueeze(-1) + 2.0 // x.abs().add(1.0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_number_minus_an_integer_tensor(dtype):
    """The exporter's decomposition failed on it (a ``sub`` with the number first): the module ran in PyTorch."""
    eager, wrapped = eager_and_wrapped(MaskedByNumbers)
    x, mask = torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        out = wrapped(x, mask)
    expected = eager(x, mask)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for ours, theirs in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)


class _BranchesOnADraw(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        if torch.rand(1) > 0.5:  # a Python branch on a tensor's value: not capturable
            return self.linear(x)
        return 2 * self.linear(x)


def test_a_data_dependent_branch_is_located_in_the_reason():
    # torch names the line that branched; the fallback reason keeps it (PEFT's LoHa, VBLoRA, ...)
    from onnxtrain.errors import ExportError
    from onnxtrain.torch import DebugOptions

    with pytest.raises(ExportError, match=r"at .*test_capture_limits\.py:\d+: if torch\.rand\(1\) > 0\.5:"):
        ORTModule(_BranchesOnADraw(), DebugOptions(fallback=False))(torch.randn(2, 4))


@pytest.mark.parametrize("how", ["static", "dynamic"])
def test_a_converted_quantized_model_falls_back_naming_its_quantized_modules(how):
    """torch.ao.quantization.convert / quantize_dynamic pack the weights in TorchScript objects:
    the reason read "LinearPackedParamsBase does not have a field with name '__obj_flatten__'".
    It now names the quantized modules and the way to train (the prepared model)."""
    from onnxtrain.errors import ExportError
    from onnxtrain.torch import DebugOptions

    quantization = pytest.importorskip("torch.ao.quantization")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        if how == "dynamic":
            converted = quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        else:
            stubbed = torch.nn.Sequential(quantization.QuantStub(), model, quantization.DeQuantStub())
            stubbed.qconfig = quantization.get_default_qconfig("fbgemm")
            prepared = quantization.prepare(stubbed)
            prepared(torch.randn(16, 8))
            converted = quantization.convert(prepared)
    x = torch.randn(4, 8)
    expected = converted(x)
    with pytest.warns(ORTModuleFallbackWarning, match=r"quantized modules whose weights are packed \(\S*0 "
                                                      r"\(torch\.ao\.nn\.quantized\.\S*Linear\), .*Train the prepared"):
        assert torch.equal(ORTModule(converted)(x), expected)
    with pytest.raises(ExportError, match="quantized modules whose weights are packed"):
        ORTModule(converted, DebugOptions(fallback=False))(x)


class _HoldsScripted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_torchscript_modules_are_named():
    """A scripted submodule was reported as a quantized one (its TorchScript object); wrapping a
    scripted module itself failed in ORTModule's constructor (KeyError 0)."""
    from onnxtrain.errors import ExportError, OnnxTrainError
    from onnxtrain.torch import DebugOptions

    eager, wrapped = eager_and_wrapped(_HoldsScripted)
    with pytest.warns(ORTModuleFallbackWarning, match=r"holds TorchScript modules \(encoder \(RecursiveScriptModule\)\)"):
        assert_steps_match(eager, wrapped, torch.randn(3, 4))
    with pytest.raises(ExportError, match="TorchScript modules"):
        ORTModule(_HoldsScripted(), DebugOptions(fallback=False))(torch.randn(3, 4))
    for scripted in (torch.jit.script(torch.nn.Linear(4, 2)), torch.jit.trace(torch.nn.Linear(4, 2), torch.randn(1, 4))):
        with pytest.raises(OnnxTrainError, match="it is a TorchScript module"):
            ORTModule(scripted)


def test_forward_mode_ad_runs_in_pytorch_and_a_vmapped_backward_is_named():
    """Forward-mode AD's dual tensors failed ("You must implement the jvp function"): such a call
    now runs in PyTorch, that call only. A vmapped backward (is_grads_batched=True, jacobian with
    vectorize=True) said "Batching rule not implemented for aten::detach"; it names ORTModule."""
    from torch.autograd import forward_ad

    eager, wrapped = eager_and_wrapped(GradModeBranch)
    x, tangent = torch.randn(4, 5), torch.randn(4, 5)
    wrapped(x)
    with forward_ad.dual_level():
        eager_tangent = forward_ad.unpack_dual(eager(forward_ad.make_dual(x, tangent))).tangent
        with pytest.warns(ORTModuleFallbackWarning, match="forward-mode AD's dual tensors.*calls with plain tensors"):
            ours = forward_ad.unpack_dual(wrapped(forward_ad.make_dual(x, tangent))).tangent
        plain = wrapped(x)  # no tangents: ONNX Runtime
    torch.testing.assert_close(ours, eager_tangent)
    torch.testing.assert_close(plain, eager(x))
    assert wrapped.fallback_reason is None
    with pytest.raises(OnnxTrainError, match="cannot be vmapped .*vectorize=False"):
        torch.autograd.functional.jacobian(wrapped, x, vectorize=True)
    jacobian = torch.autograd.functional.jacobian(wrapped, x)
    torch.testing.assert_close(jacobian, torch.autograd.functional.jacobian(eager, x))


class _PointProduct(torch.nn.Module):
    def forward(self, point):
        return point.x * point.y


class _BatchCount(torch.nn.Module):
    def forward(self, t):
        return t.shape[0] * 2


def test_calls_without_tensors_in_or_out_say_so():
    # upstream's test_ortmodule_fallback_forward: the reasons were the exporter's "Cannot detect
    # fake_mode" and onnxruntime's "OrtValue indexes should have been populated"
    import dataclasses

    from onnxtrain.errors import ExportError
    from onnxtrain.torch import DebugOptions

    point = dataclasses.make_dataclass("Point", ["x", "y"])(2, 3)
    with pytest.raises(ExportError, match="_PointProduct is called without tensors and holds no parameters"):
        ORTModule(_PointProduct(), DebugOptions(fallback=False))(point)
    with pytest.raises(ExportError, match=r"_BatchCount returns no tensor \(int\) and changes no buffer"):
        ORTModule(_BatchCount(), DebugOptions(fallback=False))(torch.randn(4, 2))
    with pytest.warns(ORTModuleFallbackWarning, match="returns no tensor"):
        assert ORTModule(_BatchCount())(torch.randn(4, 2)) == 8
