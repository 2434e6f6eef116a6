"""Nodes with subgraphs depend on the values their subgraphs capture from the enclosing graph.

ONNX lets an If branch or a Loop/Scan body read any value in scope without listing it as an
input. Autodiff must see those reads: a parameter used only inside a Loop body is on the path
to the loss, and the control-flow rules differentiate their subgraphs and give the captured
values their gradients (never zeros by omission).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts
from onnxtrain.ir import io
from onnxtrain.ir.nodes import captured_values, node_reads


def _scaled_by_loop(w_used_in_body: bool = True):
    """y = sum(x * w^3), the cube taken by a 3-trip Loop whose body reads ``w`` from outside."""
    factor = "w" if w_used_in_body else "two"
    body = helper.make_graph(
        [helper.make_node("Mul", ["acc_in", factor], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("Loop", ["trips", "", "x"], ["cubed"], body=body, name="cube_loop"),
             helper.make_node("ReduceSum", ["cubed"], ["y"], keepdims=0)]
    inits = [numpy_helper.from_array(np.array([0.5, 1.0, 2.0], np.float32), "w"),
             numpy_helper.from_array(np.array(3, np.int64), "trips"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_captured_values_are_the_outer_values_a_body_reads():
    model = io.load_model(_scaled_by_loop())
    loop = next(n for n in model.graph if n.op_type == "Loop")
    assert [v.name for v in captured_values(loop)] == ["w"]
    assert [v.name for v in node_reads(loop)] == ["trips", "x", "w"]


def test_a_parameter_read_only_inside_a_loop_body_trains(tmp_path):
    """Artifacts of y = sum(x * w^3), w read only inside the Loop's body: the training model's
    gradient of w is 3 w^2 x (not zeros), and the checkpoint trains."""
    from onnxtrain.api import CheckpointState, Module

    artifacts.generate_artifacts(_scaled_by_loop(), requires_grad=["w"], loss=artifacts.LossType.L1Loss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x = np.array([1.0, -2.0, 0.5], np.float32)
    w = np.array([0.5, 1.0, 2.0], np.float32)
    module(x, np.zeros((), np.float32))  # L1 against 0: d loss / d y = sign(y)
    y = np.sum(x * w ** 3)
    grad = state.parameters["w"].grad
    np.testing.assert_allclose(grad, np.sign(y) * 3 * w ** 2 * x, rtol=1e-5)


def _switch_model():
    """y = If(flag, then: tanh(w) * w, else: x * 2) * x, the branches reading w and x from outside."""
    then = helper.make_graph([helper.make_node("Tanh", ["w"], ["t"]), helper.make_node("Mul", ["t", "w"], ["w_out"])],
                             "then", [], [helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [3])])
    other = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["x_out"])], "else", [],
                              [helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("If", ["flag"], ["picked"], then_branch=then, else_branch=other, name="pick"),
             helper.make_node("Mul", ["picked", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                              [numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "w"),
                               numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("flag", [True, False])
def test_if_branches_differentiate_what_they_read_from_outside(flag):
    """The taken branch's gradient reaches the captured values; the other branch's does not."""
    import onnxruntime as ort

    from onnxtrain.autodiff import build_gradients

    model = io.load_model(_switch_model())
    graph = model.graph
    x = graph.inputs[0]
    w = graph.initializers["w"]
    grads = build_gradients(graph, graph.outputs[0], [w, x])
    graph.outputs.extend([grads[w], grads[x]])
    session = ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"])
    xv, wv = np.array([1.5, -0.5, 0.25], np.float32), np.array([0.5, -1.0, 2.0], np.float32)
    _, dw, dx = session.run(None, {"x": xv, "flag": np.array(flag)})
    if flag:  # y = tanh(w) w x
        np.testing.assert_allclose(dw, xv * (np.tanh(wv) + wv * (1 - np.tanh(wv) ** 2)), rtol=1e-5)
        np.testing.assert_allclose(dx, np.tanh(wv) * wv, rtol=1e-5)
    else:  # y = 2 x^2
        np.testing.assert_allclose(dw, np.zeros(3), atol=0)
        np.testing.assert_allclose(dx, 4 * xv, rtol=1e-5)


def test_if_gradients_pass_the_finite_difference_check():
    from onnxtrain.autodiff.check import check_gradients

    for flag in (True, False):
        check_gradients(_switch_model(), {"x": np.array([1.5, -0.5, 0.25], np.float32), "flag": np.array(flag)},
                        wrt=["x", "w"])


def test_a_loop_that_reads_no_parameter_stays_off_the_path():
    """A Loop whose body captures only a constant and whose inputs need no gradient is not
    differentiated: y = (x * 2^3) * w trains w."""
    from onnxtrain.autodiff import build_gradients

    model = _scaled_by_loop(w_used_in_body=False)
    model.graph.node[-1].CopyFrom(helper.make_node("Mul", ["cubed", "w"], ["y"]))
    model.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 3
    ir_model = io.load_model(model)
    graph = ir_model.graph
    w = graph.initializers["w"]
    grads = build_gradients(graph, graph.outputs[0], [w])
    graph.outputs.append(grads[w])
    import onnxruntime as ort

    session = ort.InferenceSession(io.serialize(ir_model), providers=["CPUExecutionProvider"])
    x = np.array([1.0, -2.0, 0.5], np.float32)
    _, dw = session.run(None, {"x": x})
    np.testing.assert_allclose(dw, x * 8)


def test_if_branches_of_different_shapes_train_on_either_branch(tmp_path):
    """loss = sum(If(sum(x) > 0, then: x @ W [2, 3], else: b * b [3])^2): legal ONNX. The If
    output's gradient is shared by both branches' gradient graphs; it must not take the then
    branch's static shape (onnxruntime would allocate it so, and the else branch's step fail)."""
    from onnxtrain.api import CheckpointState, Module

    def out(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    then = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"])], "then", [], [out("t", [2, 3])])
    other = helper.make_graph([helper.make_node("Mul", ["b", "b"], ["e"])], "else", [], [out("e", [3])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
             helper.make_node("Greater", ["sx", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    w, b = np.full((3, 3), 0.1, np.float32), np.array([0.5, -1.0, 2.0], np.float32)
    graph = helper.make_graph(nodes, "g", [out("x", [2, 3])], [out("loss", [])],
                              [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b"),
                               numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, requires_grad=["W", "b"], loss=None, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x = np.ones((2, 3), np.float32)
    module(x)  # then: d loss / d W = x^T 2 (x W)
    np.testing.assert_allclose(state.parameters["W"].grad, x.T @ (2 * x @ w), rtol=1e-6)
    module.lazy_reset_grad()
    np.testing.assert_allclose(module(-x), np.sum(b ** 4), rtol=1e-6)  # else
    np.testing.assert_allclose(state.parameters["b"].grad, 4 * b ** 3, rtol=1e-6)


def _growing_loop_model():
    """loss = sum(acc) where a Loop runs h <- tanh(h * b) and appends each h to acc (Concat):
    a state whose shape changes every iteration (declared without a shape, as ONNX allows)."""
    def info(name, dtype, shape=None):
        return helper.make_tensor_value_info(name, dtype, shape)

    body = helper.make_graph(
        [helper.make_node("Mul", ["h", "b"], ["hb"]), helper.make_node("Tanh", ["hb"], ["h2"]),
         helper.make_node("Concat", ["acc", "h2"], ["acc2"], axis=0), helper.make_node("Identity", ["c"], ["c2"])],
        "body", [info("i", TensorProto.INT64, []), info("c", TensorProto.BOOL, []), info("h", TensorProto.FLOAT, [3]),
                 info("acc", TensorProto.FLOAT)],
        [info("c2", TensorProto.BOOL, []), info("h2", TensorProto.FLOAT, [3]), info("acc2", TensorProto.FLOAT)])
    nodes = [helper.make_node("Loop", ["n", "", "x", "x"], ["h_last", "acc_last"], body=body),
             helper.make_node("ReduceSum", ["acc_last"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, [3]), info("n", TensorProto.INT64, [])],
                              [info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_loop_state_that_grows_each_iteration_gets_its_gradient(tmp_path):
    """The history of a state whose shape changes cannot be stacked as a scan output (onnxruntime
    refuses outputs of changing shape): it is collected in a sequence instead. Finite
    differences agree, and the artifacts train (every step failed before)."""
    from onnxtrain.api import CheckpointState, Module
    from onnxtrain.autodiff.check import check_gradients

    x = np.array([0.3, 0.2, -0.4], np.float32)
    for trips in (0, 1, 3):
        check_gradients(_growing_loop_model(), {"x": x, "n": np.array(trips, np.int64)}, wrt=["x", "b"])
    artifacts.generate_artifacts(_growing_loop_model(), requires_grad=["b"], loss=None, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    module(x, np.array(3, np.int64))
    b, h = np.array([0.5, -1.0, 2.0]), x.astype(np.float64)
    dh_db, expected = np.zeros(3), np.zeros(3)  # d sum(h_1 + h_2 + h_3) / d b, forward-mode by hand
    for _ in range(3):
        new_h = np.tanh(h * b)
        dh_db = (1 - new_h ** 2) * (dh_db * b + h)
        expected += dh_db
        h = new_h
    np.testing.assert_allclose(state.parameters["b"].grad, expected, rtol=1e-5)


def test_a_scan_whose_scanned_inputs_need_no_gradient(caplog):
    """Only a captured weight needs a gradient: the gradient Scan has no scan outputs, and gets
    no empty scan_output_axes (onnx_ir warned that an empty list has no attribute type)."""
    from onnxtrain.autodiff.check import check_gradients

    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    body = helper.make_graph([helper.make_node("Mul", ["xs", "w"], ["t"]), helper.make_node("Add", ["s", "t"], ["s2"])],
                             "body", [info("s", [3]), info("xs", [3])], [info("s2", [3])])
    graph = helper.make_graph([helper.make_node("Scan", ["init", "xs"], ["final"], body=body, num_scan_inputs=1)],
                              "g", [info("init", [3]), info("xs", [4, 3])], [info("final", [3])],
                              [numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    check_gradients(model, {"init": rng.normal(size=3).astype(np.float32),
                            "xs": rng.normal(size=(4, 3)).astype(np.float32)}, wrt=["w"])
    assert not [r for r in caplog.records if "ambiguous" in r.getMessage()]
