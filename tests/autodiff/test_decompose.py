"""Ops without a rule but with an ONNX function body are differentiated through the body."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import DEFAULT_REGISTRY
from onnxtrain.autodiff.check import check_gradients
from onnxtrain.autodiff.decompose import DecomposePass
from onnxtrain.errors import UnsupportedOpError
from onnxtrain.ir import io

CASES = [
    ("GroupNormalization", {"num_groups": 2, "epsilon": 1e-5}, 21, [("N", 4, 3), (4,), (4,)]),
    ("MeanVarianceNormalization", {"axes": [0, 2, 3]}, 13, [(2, 3, 4, 5)]),
    # attributes left at their defaults: the body reads them by reference (the schema's default)
    ("MeanVarianceNormalization", {}, 18, [(2, 3, 4, 5)]),
    ("RMSNormalization", {"axis": -1, "epsilon": 1e-5}, 23, [("N", 3, 4), (4,)]),
    # bodies written for an older opset whose ops mean the same at the model's (Reshape, Shape,
    # Cast ... were bumped at 23 for new element types only)
    ("GroupNormalization", {"num_groups": 2, "epsilon": 1e-5}, 23, [("N", 4, 3), (4,), (4,)]),
    ("MeanVarianceNormalization", {"axes": [0, 2, 3]}, 21, [(2, 3, 4, 5)]),
    # context-dependent bodies that need the inputs' ranks (they were built without shapes: none)
    ("RotaryEmbedding", {}, 23, [("N", 2, 3, 4), ("N", 3, 2), ("N", 3, 2)]),
    ("RotaryEmbedding", {"num_heads": 2, "interleaved": 1}, 23, [(1, 3, 8), (1, 3, 2), (1, 3, 2)]),
]


def _model(op, attrs, opset, shapes):
    names = [f"in{k}" for k in range(len(shapes))]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], op,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(names, shapes)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shapes[0]))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(("op", "attrs", "opset", "shapes"), CASES,
                         ids=[f"{c[0]}-{'-'.join(c[1]) or 'defaults'}-opset{c[2]}" for c in CASES])
def test_decomposed_op_matches_finite_differences(op, attrs, opset, shapes):
    assert DEFAULT_REGISTRY.lookup("", op, opset) is None  # else this test checks a rule, not decomposition
    rng = np.random.default_rng(0)
    feeds = {f"in{k}": rng.uniform(-2, 2, [3 if isinstance(d, str) else d for d in s]).astype(np.float32)
             for k, s in enumerate(shapes)}
    check_gradients(_model(op, attrs, opset, shapes), feeds)


@pytest.mark.parametrize("attrs", [{}, {"align_corners": 1}])
def test_affine_grid_with_and_without_its_default_attribute(attrs):
    from onnx import numpy_helper

    graph = helper.make_graph([helper.make_node("AffineGrid", ["theta", "size"], ["grid"], **attrs)], "affine",
                              [helper.make_tensor_value_info("theta", TensorProto.FLOAT, [2, 2, 3])],
                              [helper.make_tensor_value_info("grid", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array([2, 1, 3, 4], np.int64), "size")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    check_gradients(model, {"theta": np.random.default_rng(0).standard_normal((2, 2, 3)).astype(np.float32)})


def test_affine_grid_of_a_constant_size_trains_from_artifacts(tmp_path):
    """onnx's AffineGrid body feeds Range the one-element vectors of a Split: with the size a
    constant, onnxruntime refused the training and eval models ("Input to 'Range' op should be
    scalars"). The decomposition gives Range scalars."""
    from onnx import numpy_helper

    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module

    rng = np.random.default_rng(0)
    theta = rng.standard_normal((2, 2, 3)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("AffineGrid", ["theta", "size"], ["grid"])], "affine", [],
                              [helper.make_tensor_value_info("grid", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(theta, "theta"),
                               numpy_helper.from_array(np.array([2, 1, 3, 4], np.int64), "size")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    artifacts.generate_artifacts(model, requires_grad=["theta"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    target = rng.standard_normal((2, 3, 4, 2)).astype(np.float32)
    module(target)
    grid = _reference_grid(theta, (2, 1, 3, 4))
    expected = 2 * np.einsum("nhwk,hwj->nkj", grid - target, np.concatenate(
        [_base_grid(3, 4), np.ones((3, 4, 1), np.float32)], axis=-1)) / grid.size
    np.testing.assert_allclose(state.parameters["theta"].grad, expected, rtol=1e-4, atol=1e-5)
    module.eval()
    np.testing.assert_allclose(float(module(target)), np.mean((grid - target) ** 2), rtol=1e-5)


def _base_grid(height, width):
    """The normalized (x, y) pixel centres of an [height, width] grid, align_corners=0."""
    ys, xs = (np.arange(height) * 2 + 1) / height - 1, (np.arange(width) * 2 + 1) / width - 1
    return np.stack(np.meshgrid(xs, ys), axis=-1).astype(np.float32)


def _reference_grid(theta, size):
    """AffineGrid's output for a 2-D ``size`` [N, C, H, W], align_corners=0."""
    base = np.concatenate([_base_grid(size[2], size[3]), np.ones((size[2], size[3], 1), np.float32)], axis=-1)
    return np.einsum("hwj,nkj->nhwk", base, theta)


def test_group_norm_gradient_matches_torch():
    torch = pytest.importorskip("torch")
    from onnxtrain.ir.builder import GraphBuilder
    from onnxtrain.autodiff import build_gradients
    import onnxruntime as ort

    model = io.load_model(_model("GroupNormalization", {"num_groups": 2, "epsilon": 1e-5}, 21,
                                 [(2, 4, 3), (4,), (4,)]))
    DecomposePass()(model)
    graph = model.graph
    b = GraphBuilder(graph)
    weight = np.random.default_rng(1).standard_normal((2, 4, 3)).astype(np.float32)
    loss = b.op.ReduceSum(b.op.Mul(graph.outputs[0], b.const(weight)), keepdims=0)
    grads = build_gradients(graph, loss, list(graph.inputs))
    graph.outputs.clear()
    graph.outputs.extend(grads[v] for v in graph.inputs)
    for k, g in enumerate(graph.outputs):
        g.name = f"grad{k}"
    rng = np.random.default_rng(2)
    x, scale, bias = (rng.standard_normal(s).astype(np.float32) for s in [(2, 4, 3), (4,), (4,)])
    ours = ort.InferenceSession(io.serialize(model)).run(None, {"in0": x, "in1": scale, "in2": bias})
    tx, ts, tb = (torch.tensor(a, requires_grad=True) for a in (x, scale, bias))
    (torch.nn.functional.group_norm(tx, 2, ts, tb, eps=1e-5) * torch.tensor(weight)).sum().backward()
    for got, want in zip(ours, (tx.grad, ts.grad, tb.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_older_body_is_refused_where_one_of_its_ops_changed_meaning():
    """ReduceMean took its axes as an attribute before opset 18 and as an input from 18 on."""
    import onnx_ir as ir

    from onnxtrain.ir.schema import _same_schemas

    def function(op):
        x = ir.Value(name="x")
        node = ir.node(op, [x, x])
        return ir.Function("test", "f", graph=ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17}),
                           attributes=[])

    assert not _same_schemas(function("ReduceMean"), 17, 18)
    assert _same_schemas(function("Reshape"), 21, 23)


def test_op_without_rule_or_body_is_still_unsupported():
    model = _model("Unique", {"sorted": 1}, 18, [(3, 3)])  # its values are a float output
    with pytest.raises(UnsupportedOpError, match="Unique"):
        check_gradients(model, {"in0": np.arange(9, dtype=np.float32).reshape(3, 3)})


def test_op_whose_body_cannot_be_read_is_unsupported_not_a_crash(monkeypatch):
    """A body onnx_ir cannot read (as Attention-23's was, before its unmade outputs were trimmed):
    the node is reported."""
    import onnx_ir

    def unreadable(proto):
        raise onnx_ir.serde.SerdeError("unreadable body")

    monkeypatch.setattr(onnx_ir.serde, "deserialize_function", unreadable)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = _model("MeanVarianceNormalization", {}, 18, [(2, 3, 4, 5)])
    with pytest.raises(UnsupportedOpError, match="MeanVarianceNormalization"):
        check_gradients(model, {"in0": x})


def test_attention_23_matches_finite_differences():
    q = np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)
    check_gradients(_model("Attention", {}, 23, [(1, 2, 3, 4)] * 3), {"in0": q, "in1": q, "in2": q})


@pytest.mark.parametrize("attrs", [{"is_causal": 1}, {"scale": 0.3}])
def test_attention_23_trains_through_its_body_as_pytorchs_attention(tmp_path, attrs):
    """Attention-23's context-dependent body lists outputs the node does not ask for (present_key,
    ...) and leaves them undefined; trimmed, it decomposes (SDPA exported at opset 23 was refused)."""
    torch = pytest.importorskip("torch")
    from onnx import numpy_helper

    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["q", "w"], ["qw"]), helper.make_node("Attention", ["qw", "k", "v"], ["y"], **attrs)]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4, 5, 8])
                                                   for n in "qkv"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 5, 8])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    q, k, v, target = (rng.standard_normal((2, 4, 5, 8)).astype(np.float32) for _ in range(4))
    loss = Module(tmp_path / "training_model.onnx", state)(q, k, v, target)
    w = torch.tensor(weight, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(torch.tensor(q) @ w, torch.tensor(k), torch.tensor(v),
                                                           is_causal=bool(attrs.get("is_causal")),
                                                           scale=attrs.get("scale"))
    expected = torch.nn.functional.mse_loss(out, torch.tensor(target))
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    np.testing.assert_allclose(state.parameters["w"].grad, w.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_an_op_inside_an_if_branch_is_decomposed_too():
    """y = If(c, then: MVN(x * w), else: x * w): the branch's MeanVarianceNormalization has no
    rule, and is differentiated through its body as at the top level (it was refused there)."""
    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    then = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["xw"]),
                              helper.make_node("MeanVarianceNormalization", ["xw"], ["t"], axes=[0, 2])],
                             "then", [], [info("t", TensorProto.FLOAT, [2, 3, 4])])
    other = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["e"])], "else", [],
                              [info("e", TensorProto.FLOAT, [2, 3, 4])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                              [info("x", TensorProto.FLOAT, [2, 3, 4]), info("w", TensorProto.FLOAT, [1, 3, 4]),
                               info("c", TensorProto.BOOL, [])],
                              [info("y", TensorProto.FLOAT, [2, 3, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32),
              "w": rng.uniform(0.5, 1.5, (1, 3, 4)).astype(np.float32), "c": np.array(True)}
    check_gradients(model, inputs, wrt=["x", "w"])


def test_an_op_whose_body_takes_a_graph_is_left_alone(tmp_path):
    """SequenceMap's body is a graph attribute, which the inliner cannot pass to a function: the
    node stays (artifacts of a model that computes a side output with it were refused with the
    inliner's ValueError), and on the path to the loss it is reported as unsupported."""
    from onnx import numpy_helper

    from onnxtrain import artifacts

    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    def model(side_reads_w: bool):
        body = helper.make_graph([helper.make_node("Tanh", ["e"], ["e2"])], "m", [info("e", [None, 3])],
                                 [info("e2", [None, 3])])
        nodes = [helper.make_node("Mul", ["x", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
                 helper.make_node("SplitToSequence", ["y" if side_reads_w else "x"], ["s"], axis=0),
                 helper.make_node("SequenceMap", ["s"], ["s2"], body=body),
                 helper.make_node("ConcatFromSequence", ["s2"], ["side"], axis=0)]
        if side_reads_w:
            nodes.append(helper.make_node("ReduceSum", ["side"], ["side_loss"], keepdims=0))
        graph = helper.make_graph(nodes, "g", [info("x", [2, 3])], [info("side_loss" if side_reads_w else "loss", []),
                                                                   info("side", [2, 3])],
                                  [numpy_helper.from_array(np.ones((2, 3), np.float32), "W")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    model_ir = io.load_model(model(side_reads_w=False))
    DecomposePass()(model_ir)
    assert "SequenceMap" in [n.op_type for n in model_ir.graph]
    artifacts.generate_artifacts(model(side_reads_w=False), requires_grad=["W"], loss=None,
                                 artifact_directory=tmp_path / "off_the_path")
    with pytest.raises(UnsupportedOpError, match="SequenceMap"):
        artifacts.generate_artifacts(model(side_reads_w=True), requires_grad=["W"], loss=None,
                                     artifact_directory=tmp_path / "on_the_path")


def test_a_body_written_for_float_only_is_not_used_for_double():
    """MeanVarianceNormalization's body holds float constants: for a double input it is ill typed
    (generate_artifacts failed with a TypeError deep in a rule). The node stays, reported as
    unsupported."""
    model = _model("MeanVarianceNormalization", {"axes": [0, 2]}, 17, [(2, 3, 4)])
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    model_ir = io.load_model(model)
    DecomposePass()(model_ir)
    assert [n.op_type for n in model_ir.graph] == ["MeanVarianceNormalization"]
