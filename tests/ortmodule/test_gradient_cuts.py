"""Where PyTorch stops gradients in a forward, ORTModule's gradient graph stops them too:
``detach()`` (a straight-through estimator, a target network's output) and the outputs of a
``torch.no_grad()`` region. Parameters that only a stopped path reaches keep ``.grad`` None, as
in eager, so optimizers leave them alone. The exported graph keeps the mark through our passes,
artifacts exported with ``onnx_translation_table()`` honor ``detach()`` too, and an export whose
gradient paths miss a parameter that autograd reaches is refused rather than trained."""

import warnings

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")

from onnxtrain import names  # noqa: E402
from onnxtrain.autodiff.builder import build_gradients, inputs_with_gradient  # noqa: E402
from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.passes.fold import FoldConstantsPass  # noqa: E402
from onnxtrain.torch import DebugOptions, ORTModuleFallbackWarning  # noqa: E402

from ._parity import assert_steps_match, eager_and_wrapped  # noqa: E402


class StraightThrough(torch.nn.Module):
    """Vector quantization with the straight-through trick: ``z + (q - z).detach()``."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(6, 4)
        self.decoder = torch.nn.Linear(4, 3)

    def forward(self, x):
        z = self.encoder(x)
        q = torch.round(z * 2.0) / 2.0
        return self.decoder(z + (q - z).detach())


class NoGradBranch(torch.nn.Module):
    """A gate computed by a submodule under torch.no_grad(): that submodule gets no gradient."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(6, 6)
        self.body = torch.nn.Linear(6, 3)

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.gate(x))
        return self.body(x * g)


class TargetNetwork(torch.nn.Module):
    """The same layer in a gradient branch and, detached, as its own target (BYOL-style)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(6, 6)

    def forward(self, x):
        online = torch.tanh(self.layer(x))
        target = torch.tanh(self.layer(x * 0.5)).detach()
        return (online - target).square().mean(dim=1, keepdim=True)


def _assert_same_training(eager, wrapped, x):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        grads = assert_steps_match(eager, wrapped, x)
    assert wrapped.fallback_reason is None
    return grads


def test_detach_stops_the_gradient_of_a_straight_through_estimator():
    eager, wrapped = eager_and_wrapped(StraightThrough)
    grads = _assert_same_training(eager, wrapped, torch.randn(8, 6))
    assert torch.count_nonzero(grads[0]) > 0  # the encoder learns through the identity path


def test_detach_of_a_target_branch():
    eager, wrapped = eager_and_wrapped(TargetNetwork)
    x = torch.randn(8, 6)
    _assert_same_training(eager, wrapped, x)
    _assert_same_training(eager, wrapped, x.requires_grad_())


def test_a_no_grad_region_gives_its_parameters_no_gradient():
    eager, wrapped = eager_and_wrapped(NoGradBranch)
    grads = _assert_same_training(eager, wrapped, torch.randn(8, 6))
    assert grads[0] is None and grads[1] is None  # the gate's weight and bias, as in eager


class ReadsData(torch.nn.Module):
    """Older code's ``.data``: a mask of an activation, a weight's statistic, an input's scale."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.layer(x)
        return h * h.data.gt(0).float() * x.data.abs().mean() + self.layer.weight.data.square().sum()


def test_data_reads_carry_no_gradient():
    # the capture failed on .data ("a fake tensor in the exported program constant's list")
    eager, wrapped = eager_and_wrapped(ReadsData)
    x = torch.randn(8, 6)
    _assert_same_training(eager, wrapped, x)
    _assert_same_training(eager, wrapped, x.requires_grad_())


class ScaledByItsOwnMean(torch.nn.Module):
    """``y * y.abs().mean().item()``: a Python number, which carries no gradient in eager."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = self.layer(x)
        return y * y.abs().mean().item()


def test_a_number_read_with_item_carries_no_gradient():
    eager, wrapped = eager_and_wrapped(ScaledByItsOwnMean)
    for _ in range(2):  # the second call feeds the exported graph other values of the number
        _assert_same_training(eager, wrapped, torch.randn(5, 4))
    assert wrapped.export_count == 1


def test_an_optimizer_leaves_parameters_without_gradient_alone():
    eager, wrapped = eager_and_wrapped(NoGradBranch)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (eager, wrapped)]
    x = torch.randn(8, 6)
    gate_before = wrapped.module.gate.weight.detach().clone()
    for _ in range(3):
        for model, optimizer in zip((eager, wrapped), optimizers):
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
    torch.testing.assert_close(wrapped.module.gate.weight, gate_before)  # no update, no weight decay
    for ours, theirs in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_no_grad_region_in_an_inference_first_module():
    eager, wrapped = eager_and_wrapped(NoGradBranch)
    x = torch.randn(8, 6)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), eager(x))
    _assert_same_training(eager, wrapped, x)


class CheckpointedThenNoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 6)
        self.second = torch.nn.Linear(6, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.tanh(self.first(t)), x, use_reentrant=True)
        return self.second(h)


def test_a_misplaced_cut_is_refused_not_trained(monkeypatch):
    # the reentrant checkpoint sets grad mode inside its forward, so the capture believes grad
    # is off after it: cutting those "regions" anyway would take the second layer's gradient
    from onnxtrain.torch import _export

    real = _export.mark_gradient_cuts
    monkeypatch.setattr(_export, "mark_gradient_cuts", lambda program, regions=True: real(program, regions=True))
    _, wrapped = eager_and_wrapped(CheckpointedThenNoGrad, debug_options=DebugOptions(fallback=False))
    with pytest.raises(ExportError, match="gives no gradient to input 0, second.weight, second.bias"):
        wrapped(torch.randn(8, 6, requires_grad=True))


def test_the_reentrant_checkpoint_is_not_cut():
    eager, wrapped = eager_and_wrapped(CheckpointedThenNoGrad)
    _assert_same_training(eager, wrapped, torch.randn(8, 6, requires_grad=True))


def _marked_graph():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    xw = ir.node("Mul", [x, w])
    stop = ir.node("Identity", [xw.outputs[0]], metadata_props={names.STOP_GRADIENT_METADATA: "1"})
    out = ir.node("Add", [stop.outputs[0], w])
    graph = ir.Graph([x, w], [out.outputs[0]], nodes=[xw, stop, out], opset_imports={"": 20})
    for node in graph:
        node.outputs[0].type, node.outputs[0].shape = x.type, x.shape
    return graph


def test_the_autodiff_does_not_differentiate_through_a_stop_gradient():
    graph = _marked_graph()
    x, w = graph.inputs
    assert inputs_with_gradient(list(graph), [x, w], graph.outputs) == [w]
    grads = build_gradients(graph, graph.outputs[0], [x, w])
    model = ir.Model(graph, ir_version=10)
    import onnxruntime as ort
    graph.outputs.extend([grads[x], grads[w]])
    for i, g in enumerate(graph.outputs[1:]):
        g.name = f"g{i}"
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString())
    xs, ws = np.ones((2, 3), np.float32) * 2, np.ones((2, 3), np.float32)
    _, dx, dw = session.run(None, {"x": xs, "w": ws})
    np.testing.assert_array_equal(dx, np.zeros((2, 3)))  # x only reaches the output through the stop
    np.testing.assert_array_equal(dw, np.ones((2, 3)))  # d(stop + w)/dw, the product's path stopped


def test_constant_folding_keeps_the_stop_gradient():
    graph = _marked_graph()
    model = ir.Model(graph, ir_version=10)
    FoldConstantsPass()(model)
    ops = [(n.op_type, n.domain, names.STOP_GRADIENT_METADATA in n.metadata_props) for n in model.graph]
    assert ("Identity", "", True) in ops
    assert graph.outputs[0].producer().inputs[0].producer().op_type == "Identity"  # still read


def test_artifacts_exported_with_the_translation_table_honor_detach(tmp_path):
    import onnx

    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module
    from onnxtrain.torch import onnx_translation_table

    torch.manual_seed(0)
    model = TargetNetwork()
    x = torch.randn(8, 6)
    program = torch.onnx.export(model, (x,), dynamo=True, optimize=False, input_names=["x"],
                                output_names=["output"], custom_translation_table=onnx_translation_table())
    trainable = [n for n, _ in model.named_parameters()]
    artifacts.generate_artifacts(program.model_proto, requires_grad=trainable, loss=artifacts.LossType.L1Loss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path,
                                 loss_input_names=["output"])
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    target = np.zeros((8, 1), np.float32)
    module(x.numpy(), target)
    expected = torch.nn.functional.l1_loss(model(x), torch.from_numpy(target))
    expected.backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert onnx.load(tmp_path / "training_model.onnx")  # a standard model on disk


class DetachesInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(6, 6)
        self.body = torch.nn.Linear(6, 3)

    def forward(self, x):
        g = torch.sigmoid(self.gate(x))
        g.detach_()  # every later read of g is detached too
        return self.body(x * g) + g[:, :3]


def test_an_in_place_detach_stops_the_gradient():
    eager, wrapped = eager_and_wrapped(DetachesInPlace)
    grads = _assert_same_training(eager, wrapped, torch.randn(8, 6))
    assert grads[0] is None and grads[1] is None


class Centered(torch.autograd.Function):
    """x - mean(x), the mean taken under torch.no_grad() inside the forward."""

    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            mean = x.mean()
        return x - mean

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean()


class CenteredInputThenTwoPaths(torch.nn.Module):
    """A grad-switching Function on the raw input (no autograd node records it), then a path
    without grad mode changes and one under enable_grad."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x):
        z = self.layer(Centered.apply(x))
        w = self.layer(x) * 2.0
        with torch.enable_grad():
            return z + self.layer(x) + w


def test_a_grad_switching_function_on_tensors_without_grad_cuts_nothing_after_it():
    # the capture believed grad was off from the Function's no_grad on: its ops were cut as a
    # no-grad region, and the layer's gradient lost two of its three paths, silently
    eager, wrapped = eager_and_wrapped(CenteredInputThenTwoPaths)
    _assert_same_training(eager, wrapped, torch.randn(3, 4))


class CheckpointOfInputWithoutGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.outer = torch.nn.Linear(2, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.outer(checkpoint(self.inner, x, use_reentrant=True))


def test_a_reentrant_checkpoint_of_inputs_without_grad():
    # its function's parameters get no gradient in eager (PyTorch warns), which a graph that
    # cannot cut the checkpoint's region alone would give them: refused by name, not trained
    _, wrapped = eager_and_wrapped(CheckpointOfInputWithoutGrad, debug_options=DebugOptions(fallback=False))
    with pytest.raises(ExportError, match="reentrant torch.utils.checkpoint on tensors none of which requires grad"):
        wrapped(torch.rand(2, 2))
    eager, wrapped = eager_and_wrapped(CheckpointOfInputWithoutGrad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = assert_steps_match(eager, wrapped, torch.rand(2, 2))
    assert grads[0] is None and wrapped.fallback_reason is not None
    _, wrapped = eager_and_wrapped(CheckpointOfInputWithoutGrad, debug_options=DebugOptions(fallback=False))
    _assert_same_training(eager, wrapped, torch.rand(2, 2, requires_grad=True))


class TeacherAndCenteredStudent(torch.nn.Module):
    """A custom Function that does not switch grad mode, beside a teacher under torch.no_grad()."""

    def __init__(self):
        super().__init__()
        self.teacher = torch.nn.Linear(4, 4)
        self.student = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return self.student(Shifted.apply(x)) * target


class Shifted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_function_that_keeps_grad_mode_leaves_the_no_grad_regions_cut():
    # a forward with any custom Function kept its no_grad regions whole: the teacher trained
    eager, wrapped = eager_and_wrapped(TeacherAndCenteredStudent, inline_autograd_functions=[Shifted])
    grads = _assert_same_training(eager, wrapped, torch.randn(3, 4, requires_grad=True))
    assert grads[0] is None and grads[1] is None


class StatisticsAndNoise(torch.nn.Module):
    """Outputs PyTorch computes from a parameter but gives no gradient: the statistics of
    ``aten.native_layer_norm`` (its mean and reciprocal deviation) and ``rand_like`` of a layer's
    output, beside the layer's own output."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x):
        h = self.layer(x)
        out, mean, rstd = torch.ops.aten.native_layer_norm(h, [6], self.norm.weight, self.norm.bias, 1e-5)
        return out, mean, rstd, torch.rand_like(h)


def test_outputs_pytorch_gives_no_gradient_require_none():
    # they required grad, and a loss that read them trained the layer through them
    eager, wrapped = eager_and_wrapped(StatisticsAndNoise, debug_options=DebugOptions(fallback=False))
    x = torch.randn(5, 4)
    outputs, eager_outputs = wrapped(x), eager(x)
    assert [o.requires_grad for o in outputs] == [o.requires_grad for o in eager_outputs] == [True, False, False,
                                                                                               False]
    for ours, theirs in zip(outputs[:3], eager_outputs[:3]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the statistics in a loss beside the output: only the output's path trains, as in eager
    for model, (out, mean, rstd, _) in ((wrapped, outputs), (eager, eager_outputs)):
        (out.square().sum() + (mean * out[:, :1]).sum() + rstd.sum()).backward()
    for ours, theirs in zip(wrapped.module.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)
    assert wrapped.fallback_reason is None


def test_a_shape_only_op_is_on_no_gradient_path():
    # RandomUniformLike reads its input's shape only: the weight it is drawn "like" gets no
    # gradient (an artifacts graph built from an ONNX model has no trace to say so)
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 20})
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    graph.inputs.extend([w, x])
    noise = ir.node("RandomUniformLike", [w], num_outputs=1)
    product = ir.node("Mul", [noise.outputs[0], x], num_outputs=1)
    graph.extend([noise, product])
    loss = product.outputs[0]
    loss.dtype = noise.outputs[0].dtype = ir.DataType.FLOAT
    graph.outputs.append(loss)
    assert inputs_with_gradient(list(graph), [w, x], [loss]) == [x]
    unreached = []
    build_gradients(graph, loss, [w, x], unreached=unreached)
    assert unreached == [w]


class ValueAndMarker(torch.autograd.Function):
    """Doubles ``x`` and returns a marker it declares non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        marker = x.sum(-1, keepdim=True) + 1.0
        ctx.mark_non_differentiable(marker)
        return x * 2.0, marker

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 2.0


class WithMarker(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    def forward(self, x):
        return ValueAndMarker.apply(self.layer(x))


def test_an_output_a_function_marks_non_differentiable_requires_no_grad():
    eager, wrapped = eager_and_wrapped(WithMarker, debug_options=DebugOptions(fallback=False),
                                       inline_autograd_functions=[ValueAndMarker])
    x = torch.randn(2, 3)
    (value, marker), (eager_value, eager_marker) = wrapped(x), eager(x)
    assert (value.requires_grad, marker.requires_grad) == (eager_value.requires_grad, eager_marker.requires_grad)
    assert not marker.requires_grad
    torch.testing.assert_close(marker, eager_marker)
