"""PatchConvPass: a Conv weight gradient's patches from one grouped Conv on CPU sessions, same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.ir import io
from onnxtrain.passes.conv_patches import PATCHES_METADATA, PatchConvPass
from onnxtrain.runtime import fusions
from tests.passes._graphs import run

# name: (input shape, weight shape, Conv attributes)
CASES = {
    "3x3_pads": ([2, 3, 9, 8], [4, 3, 3, 3], {"pads": [1, 1, 1, 1]}),
    "3x3_no_pads": ([2, 3, 7, 7], [5, 3, 3, 3], {}),
    "stride_2_uneven_pads": ([2, 2, 10, 9], [3, 2, 3, 2], {"strides": [2, 2], "pads": [1, 0, 2, 1]}),
    "dilated": ([1, 2, 11, 11], [2, 2, 3, 3], {"dilations": [2, 1], "pads": [2, 1, 2, 1]}),
    "stride_and_rows_no_window_reads": ([2, 3, 10, 10], [4, 3, 3, 3], {"strides": [3, 3]}),
    "same_upper": ([2, 2, 8, 8], [3, 2, 3, 3], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "1d": ([3, 4, 12], [2, 4, 5], {"pads": [2, 2], "strides": [2]}),
    "3d": ([1, 2, 5, 6, 5], [2, 2, 2, 2, 3], {"pads": [0, 1, 1, 0, 1, 1]}),
}


def _conv_loss_model(x_shape, w_shape, attrs) -> onnx.ModelProto:
    """loss = sum(Conv(x, w) * t); ``t``'s shape comes from a first shape inference."""
    conv = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    probe = helper.make_model(helper.make_graph(
        [conv], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                          helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 18)])
    y_shape = [d.dim_value for d in onnx.shape_inference.infer_shapes(probe).graph.output[0]
               .type.tensor_type.shape.dim]
    nodes = [conv, helper.make_node("Mul", ["y", "t"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                        helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape),
                        helper.make_tensor_value_info("t", TensorProto.FLOAT, y_shape)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _weight_gradient_model(case: str) -> tuple[ir.Model, dict]:
    x_shape, w_shape, attrs = CASES[case]
    model = io.load_model(_conv_loss_model(x_shape, w_shape, attrs))
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    grads = build_gradients(graph, graph.outputs[0], [inputs["w"]])
    dw = grads[inputs["w"]]
    dw.name = "dw"
    graph.outputs.clear()
    graph.outputs.append(dw)
    rng = np.random.default_rng(0)
    t_shape = list(inputs["t"].shape)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32), "w": rng.standard_normal(w_shape).astype(np.float32),
             "t": rng.standard_normal(t_shape).astype(np.float32)}
    return model, feeds


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _tap_slices(model: ir.Model) -> list[ir.Node]:
    """The strided Slices of a patch gather (the shape arithmetic's Slices have no steps)."""
    return [n for n in model.graph if n.op_type == "Slice" and len(n.inputs) == 5]


def _dead(model: ir.Model) -> set[str]:
    """Names of the nodes none of whose outputs is read or returned."""
    return {n.name for n in model.graph if not any(o.uses() or o.is_graph_output() for o in n.outputs)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_weight_gradient_from_one_grouped_conv(case):
    model, feeds = _weight_gradient_model(case)
    assert any(PATCHES_METADATA in n.metadata_props for n in model.graph)
    standard = run(io.to_proto(model), feeds)[0]
    dead_before = _dead(model)
    assert PatchConvPass()(model).modified
    assert _dead(model) <= dead_before  # the gather's nodes went with it
    assert not _tap_slices(model)  # the taps are gone (and their Pad where static: see below)
    patch_convs = [n for n in model.graph if n.op_type == "Conv" and n.attributes.get_int("group", 1) > 1]
    assert len(patch_convs) == 1
    np.testing.assert_array_equal(run(io.to_proto(model), feeds)[0], standard)


def test_static_pads_move_into_the_conv():
    model, _ = _weight_gradient_model("3x3_pads")
    assert "Pad" in _ops(model)
    PatchConvPass()(model)
    assert "Pad" not in _ops(model)
    conv = next(n for n in model.graph if n.op_type == "Conv" and n.attributes.get_int("group", 1) > 1)
    assert list(conv.attributes["pads"].value) == [1, 1, 1, 1]
    assert conv.inputs[0].name == "x"


def test_an_unmarked_gather_is_left_alone():
    model, _ = _weight_gradient_model("3x3_no_pads")
    for node in model.graph:
        node.metadata_props.pop(PATCHES_METADATA, None)
    assert not PatchConvPass()(model).modified


def test_a_gather_whose_taps_read_different_tensors_is_left_alone():
    """The metadata says what the value is; the pass still checks the graph gathers from one tensor."""
    model, _ = _weight_gradient_model("3x3_no_pads")
    graph = model.graph
    first_slice = _tap_slices(model)[0]
    other = ir.node("Neg", [first_slice.inputs[0]])
    graph.insert_before(first_slice, other)
    first_slice.replace_input_with(0, other.outputs[0])
    assert not PatchConvPass()(model).modified


def test_for_session_rewrites_for_cpu_alone():
    model, _ = _weight_gradient_model("3x3_pads")
    assert not fusions.for_session(model, ["CUDAExecutionProvider", "CPUExecutionProvider"], gated_add=False)
    assert _tap_slices(model)
    assert fusions.has_patches(model)
    assert fusions.for_session(model, ["CPUExecutionProvider"], gated_add=False)
    assert not _tap_slices(model)


def test_session_model_of_a_training_file(tmp_path):
    """The file keeps its slices (standard ops for every runtime); the CPU session's bytes have the Conv."""
    model, feeds = _weight_gradient_model("stride_2_uneven_pads")
    path = tmp_path / "training_model.onnx"
    io.save_model(model, path)
    rewritten = fusions.session_model(path, ["CPUExecutionProvider"], gated_add=False)
    assert isinstance(rewritten, bytes)
    assert _tap_slices(io.load_model(path))
    assert not _tap_slices(io.load_model(onnx.load_from_string(rewritten)))
    np.testing.assert_array_equal(run(onnx.load_from_string(rewritten), feeds)[0],
                                  run(io.to_proto(io.load_model(path)), feeds)[0])
    assert fusions.session_model(path, ["CUDAExecutionProvider"], gated_add=False) == str(path)


@pytest.mark.parametrize("dims", [["N", 3, 9, 8], ["N", 3, "H", "W"]], ids=["static-plane", "symbolic-plane"])
def test_patches_of_an_empty_batch(dims):
    """The patch Conv's output is flattened with its sizes spelled out: ``[0, 0, -1]`` cannot be
    inferred for a batch of 0 rows (the weight gradient is zeros, as PyTorch's)."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
                                              helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3, 3, 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    inputs = {v.name: v for v in model.graph.inputs}
    dw = build_gradients(model.graph, model.graph.outputs[0], [inputs["w"]])[inputs["w"]]
    dw.name = "dw"
    model.graph.outputs.clear()
    model.graph.outputs.append(dw)
    rng = np.random.default_rng(0)
    w = rng.standard_normal([4, 3, 3, 3]).astype(np.float32)
    x = rng.standard_normal([2, 3, 9, 8]).astype(np.float32)
    standard = run(io.to_proto(model), {"x": x, "w": w})[0]
    assert PatchConvPass()(model).modified
    np.testing.assert_allclose(run(io.to_proto(model), {"x": x, "w": w})[0], standard, rtol=1e-5, atol=1e-5)
    empty = run(io.to_proto(model), {"x": x[:0], "w": w})[0]
    assert empty.shape == (4, 3, 3, 3) and not empty.any()
