"""passes/precision.py: which ops ORT CPU runs in bf16/fp16, and what the converted and
legalized graphs compute, against numpy references that round with ml_dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.ir import io
from onnxtrain.passes.precision import (
    FP32_OPS,
    PrecisionConfig,
    PrecisionError,
    PrecisionPass,
    infer_dtypes,
    simplify_casts,
    supported_ops,
)

LOW = {"bf16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16), "fp16": (TensorProto.FLOAT16, np.float16)}


def _session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    proto = model if isinstance(model, onnx.ModelProto) else io.to_proto(model)
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _one_node_model(op: str, elem_type: int) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(name, elem_type, [4, 4]) for name in ("a", "b")]
    arity = 1 if op in ("Relu", "Gelu", "Softmax", "Transpose", "Identity", "Tanh") else 2
    if op == "Clip":  # with its bounds (scalars), as torch.clamp exports
        inputs = [inputs[0], *(helper.make_tensor_value_info(name, elem_type, []) for name in ("low", "high"))]
        arity = 3
    node = helper.make_node(op, [value.name for value in inputs[:arity]], ["y"],
                            **({"axis": 0} if op == "Concat" else {}))
    graph = helper.make_graph([node], "g", inputs[:arity], [helper.make_value_info("y", onnx.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    return model


def _loads(model) -> bool:
    try:
        _session(model)
        return True
    except Exception as exc:  # noqa: BLE001  (ORT raises its own exception types)
        assert "NOT_IMPLEMENTED" in str(exc) or "implementation" in str(exc), str(exc)
        return False


@pytest.mark.parametrize("op", ["MatMul", "Add", "Mul", "Gelu", "Relu", "Softmax", "Tanh",
                                "Transpose", "Identity", "Concat", "Clip"])
def test_cpu_bf16_kernel_table_is_what_onnxruntime_loads(op):
    """The CPU table says which ops run in bf16; ORT CPU loads exactly those (it has no bf16
    arithmetic at all, so every compute op must become an fp32 island)."""
    assert _loads(_one_node_model(op, TensorProto.BFLOAT16)) == (op in supported_ops("cpu", "bf16")), op


def test_unknown_precision_or_device_is_refused():
    with pytest.raises(PrecisionError, match="bf16"):
        supported_ops("cpu", "fp8")
    with pytest.raises(PrecisionError, match="cpu, cuda"):
        supported_ops("tpu", "bf16")


def _mlp_model() -> onnx.ModelProto:
    """y = Softmax(MatMul(x, w) + b); w, b are graph inputs (parameters)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["z"]),
             helper.make_node("Softmax", ["z"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "mlp", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 5]),
        helper.make_tensor_value_info("b", TensorProto.FLOAT, [5]),
    ], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _feeds(rng):
    return {"x": rng.standard_normal((3, 8)).astype(np.float32) * 3,
            "w": rng.standard_normal((8, 5)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_converted_graph_rounds_the_matmul_and_keeps_the_rest_fp32(precision):
    model = io.load_model(_mlp_model())
    PrecisionPass(PrecisionConfig(precision, convert=True))(model)
    assert [(v.name, v.dtype) for v in model.graph.outputs] == [("y", ir.DataType.FLOAT)]
    assert all(v.dtype == ir.DataType.FLOAT for v in model.graph.inputs)  # fp32 master weights
    feeds = _feeds(np.random.default_rng(0))
    (y,) = _session(model).run(None, feeds)

    low = LOW[precision][1]
    rounded = lambda a: a.astype(low).astype(np.float32)  # noqa: E731
    product = rounded(rounded(feeds["x"]).astype(np.float64) @ rounded(feeds["w"]).astype(np.float64))
    expected = _softmax(product + feeds["b"])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    full = _softmax(feeds["x"].astype(np.float64) @ feeds["w"] + feeds["b"])
    assert np.abs(y - full).max() > 1e-5  # the rounding is real: not the fp32 result


def test_fp32_parameters_get_fp32_gradients_through_the_casts():
    """d sum(MatMul(x, w)) / dw with the MatMul in bf16: the Cast's gradient rule brings the
    bf16 gradient back to the fp32 parameter; its value is bf16(x)^T @ 1 rounded to bf16."""
    model = io.load_model(_mlp_model())
    graph = model.graph
    graph.outputs[0] = next(n for n in graph if n.op_type == "MatMul").outputs[0]
    PrecisionPass(PrecisionConfig("bf16", convert=True))(model)
    w = next(v for v in graph.inputs if v.name == "w")
    (out,) = graph.outputs
    grads = build_gradients(graph, out, [w])
    grads[w].name = "w_grad"
    graph.outputs.append(grads[w])
    PrecisionPass(PrecisionConfig("bf16"))(model)
    assert grads[w].dtype == ir.DataType.FLOAT
    feeds = _feeds(np.random.default_rng(1))
    _, dw = _session(model).run(None, feeds)
    assert dw.dtype == np.float32
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    expected = bf(bf(feeds["x"]).T.astype(np.float64) @ np.ones((3, 5)))
    np.testing.assert_allclose(dw, expected, rtol=1e-6)


def _autocast_like_model() -> onnx.ModelProto:
    """What torch.autocast exports: Cast to bf16, bf16 MatMul, bf16 Softmax, bf16 output."""
    nodes = [helper.make_node("Cast", ["x"], ["xl"], to=TensorProto.BFLOAT16),
             helper.make_node("Cast", ["w"], ["wl"], to=TensorProto.BFLOAT16),
             helper.make_node("MatMul", ["xl", "wl"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "autocast", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 5]),
    ], [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["N", 5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_legalized_autocast_graph_loads_keeps_its_types_and_rounds_every_value():
    proto = _autocast_like_model()
    assert not _loads(proto)  # as exported, ORT CPU cannot run it
    model = io.load_model(proto)
    PrecisionPass(PrecisionConfig("bf16"))(model)
    (y_value,) = model.graph.outputs
    assert (y_value.name, y_value.dtype) == ("y", ir.DataType.BFLOAT16)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert softmax.inputs[0].dtype == ir.DataType.FLOAT  # a sensitive op computes in fp32
    readable = ir.node("Cast", [y_value], attributes={"to": int(ir.DataType.FLOAT)})  # numpy has no bf16
    readable.outputs[0].name, readable.outputs[0].dtype = "y_fp32", ir.DataType.FLOAT
    model.graph.append(readable)
    model.graph.outputs[0] = readable.outputs[0]
    feeds = _feeds(np.random.default_rng(2))
    (y,) = _session(model).run(None, {"x": feeds["x"], "w": feeds["w"]})
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    h = bf(bf(feeds["x"]).astype(np.float64) @ bf(feeds["w"]))
    expected = bf(_softmax(np.maximum(h, 0)))
    np.testing.assert_allclose(np.asarray(y, dtype=np.float32), expected, rtol=1e-2, atol=0)
    # every bf16-valued op left in low precision is one ORT CPU has a kernel for
    supported = supported_ops("cpu", "bf16")
    for node in model.graph:
        if any(v is not None and v.dtype == ir.DataType.BFLOAT16 for v in (*node.inputs, *node.outputs)):
            assert node.op_type in supported and node.op_type not in FP32_OPS, node.op_type


def test_simplify_casts_drops_exact_round_trips_only():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.BFLOAT16), shape=ir.Shape([2]))
    f = ir.Value(name="f", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    up = ir.node("Cast", [x], attributes={"to": int(ir.DataType.FLOAT)})
    down = ir.node("Cast", up.outputs, attributes={"to": int(ir.DataType.BFLOAT16)})
    low = ir.node("Cast", [f], attributes={"to": int(ir.DataType.BFLOAT16)})
    back = ir.node("Cast", low.outputs, attributes={"to": int(ir.DataType.FLOAT)})
    use1, use2 = ir.node("Neg", down.outputs), ir.node("Neg", back.outputs)
    for node, dtype in ((up, "FLOAT"), (down, "BFLOAT16"), (low, "BFLOAT16"), (back, "FLOAT"),
                        (use1, "BFLOAT16"), (use2, "FLOAT")):
        node.outputs[0].dtype = ir.DataType[dtype]
    graph = ir.Graph([x, f], [use1.outputs[0], use2.outputs[0]], nodes=[up, down, low, back, use1, use2])
    assert simplify_casts(graph, round_intermediates=True)
    assert use1.inputs[0] is x          # bf16 -> fp32 -> bf16 is exact
    assert use2.inputs[0] is back.outputs[0]  # fp32 -> bf16 -> fp32 rounds: kept
    assert simplify_casts(graph, round_intermediates=False)
    assert use2.inputs[0] is f


def test_gemm_is_converted_with_its_bias_and_parameters_stay_fp32_inputs():
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                               helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    PrecisionPass(PrecisionConfig("fp16", convert=True))(model)
    x = np.full((2, 4), 1.0 + 2.0 ** -12, np.float32)  # rounds to 1 in fp16
    c = np.full(3, 70000.0, np.float32)                # overflows fp16
    (y,) = _session(model).run(None, {"x": x, "c": c})
    assert np.isinf(y).all()  # the bias was added in fp16 range: overflow is real, not emulated away
    (y,) = _session(model).run(None, {"x": x, "c": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(y, np.full((2, 3), 4.0, np.float32))


def test_cpu_fp16_arithmetic_is_onnxruntimes_own_fp32_islands():
    """What the fp16 CPU table rests on: an fp16 MatMul loads, but ORT runs it in fp32
    between Casts it inserts itself; only LayerNormalization has an fp16 kernel."""
    import os
    import tempfile

    folder = tempfile.mkdtemp()
    optimized = os.path.join(folder, "optimized.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.optimized_model_filepath = optimized
    ort.InferenceSession(_one_node_model("MatMul", TensorProto.FLOAT16).SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(optimized).graph.node] == ["Cast", "Cast", "MatMul", "Cast"]


def test_partition_saves_the_narrow_value_behind_a_widening_cast():
    """y = u * u with u = Cast(Sin(q): bf16 -> fp32): the backward needs u, and gets it by recasting
    the saved bf16 t (half the bytes) rather than from a saved fp32 u."""
    from onnxtrain.passes.partition import build_forward_backward

    nodes = [helper.make_node("Cast", ["p"], ["q"], to=TensorProto.BFLOAT16),
             helper.make_node("Sin", ["q"], ["t"]),
             helper.make_node("Cast", ["t"], ["u"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["u", "u"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("p", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                              value_info=[helper.make_tensor_value_info("q", TensorProto.BFLOAT16, [3]),
                                          helper.make_tensor_value_info("t", TensorProto.BFLOAT16, [3]),
                                          helper.make_tensor_value_info("u", TensorProto.FLOAT, [3])])
    graphs = build_forward_backward(io.load_model(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 18)])), ["p"])
    saved = {v.name: v.dtype for v in graphs.forward.graph.outputs[graphs.num_model_outputs:]}
    assert saved == {"t": ir.DataType.BFLOAT16}
    for part in (graphs.forward, graphs.backward):
        PrecisionPass(PrecisionConfig("bf16"))(part)
    forward, backward = _session(graphs.forward), _session(graphs.backward)
    p = np.array([0.3, -1.7, 2.9], np.float32)
    as_ort = ort.OrtValue.ortvalue_from_numpy
    names_out = [o.name for o in forward.get_outputs()]
    outputs = forward.run_with_ort_values(names_out, {"p": as_ort(p)})  # OrtValues: numpy has no bf16
    feeds = {}
    for (source, index), value in zip(graphs.backward_inputs, graphs.backward.graph.inputs):
        feeds[value.name] = as_ort(np.ones(3, np.float32)) if source == "output_grad" else \
            (as_ort(p) if source == "input" else outputs[index])
    (dp,) = backward.run_with_ort_values([o.name for o in backward.get_outputs()], feeds)
    dp = dp.numpy()
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    q = bf(p)
    u = bf(np.sin(q))
    np.testing.assert_allclose(dp, bf(bf(2 * u) * np.cos(q)), rtol=1e-2)


def test_a_second_run_on_a_legalized_graph_names_its_nodes_apart():
    """ORTModule legalizes the exported graph, then again the backward graph cut from it (which
    keeps nodes of the first run): the second run's Casts must not reuse the first run's names."""
    model = io.load_model(_autocast_like_model())
    PrecisionPass(PrecisionConfig("bf16"))(model)
    first = {n.name for n in model.graph}
    (y_value,) = model.graph.outputs
    again = ir.node("Softmax", [y_value], attributes={"axis": -1})  # a new bf16 op without a CPU kernel
    again.outputs[0].name, again.outputs[0].dtype = "z", ir.DataType.BFLOAT16
    again.outputs[0].shape = y_value.shape
    model.graph.append(again)
    model.graph.outputs[0] = again.outputs[0]
    PrecisionPass(PrecisionConfig("bf16"))(model)
    names = [n.name for n in model.graph if n.name]  # (the hand-made nodes have none)
    assert len(names) == len(set(names)), sorted(names)
    assert set(names) - first  # the second run did add nodes
    _session(model)  # ONNX Runtime refuses a graph with two nodes of one name


def test_missing_element_types_come_from_the_attribute_or_input_that_decides_them():
    """ConstantOfShape is typed by its value (float32 without one), not by its int64 shape
    input; TopK's indices are int64; OneHot takes its values' type, EyeLike its dtype."""
    shape = ir.Value(name="shape", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([2]))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3, 4]))
    k = ir.Value(name="k", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]))
    onehot_values = ir.Value(name="values", type=ir.TensorType(ir.DataType.DOUBLE), shape=ir.Shape([2]))
    nodes = [
        ir.node("ConstantOfShape", [shape], attributes={"value": ir.tensor(np.ones([1], np.float16))}),
        ir.node("ConstantOfShape", [shape]),
        ir.node("TopK", [x, k], num_outputs=2),
        ir.node("OneHot", [k, k, onehot_values]),
        ir.node("EyeLike", [x], attributes={"dtype": ir.DataType.INT32.value}),
    ]
    graph = ir.Graph([shape, x, k, onehot_values], [], nodes=nodes, opset_imports={"": 18})
    infer_dtypes(graph)
    assert [[o.dtype for o in n.outputs] for n in nodes] == [
        [ir.DataType.FLOAT16], [ir.DataType.FLOAT], [ir.DataType.FLOAT, ir.DataType.INT64], [ir.DataType.DOUBLE],
        [ir.DataType.INT32]]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_reducing_scatter_is_legalized_to_fp32(precision):
    """ScatterElements with reduction="add" (a max pool's or a gather's gradient) computes: no CPU
    kernel takes fp16 or bf16 there. One that only moves data may stay low."""
    elem_type, _ = LOW[precision]
    nodes = [helper.make_node("ScatterElements", ["data", "indices", "updates"], ["added"], axis=0, reduction="add"),
             helper.make_node("ScatterElements", ["data", "indices", "updates"], ["moved"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("data", elem_type, [4]),
                                           helper.make_tensor_value_info("indices", TensorProto.INT64, [2]),
                                           helper.make_tensor_value_info("updates", elem_type, [2])],
                              [helper.make_tensor_value_info("added", elem_type, [4]),
                               helper.make_tensor_value_info("moved", elem_type, [4])])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    PrecisionPass(PrecisionConfig(precision, "cpu"))(model)
    scatters = {n.attributes.get_string("reduction", "none"): n for n in model.graph if n.op_type == "ScatterElements"}
    assert scatters["add"].outputs[0].dtype == ir.DataType.FLOAT
    assert scatters["none"].outputs[0].dtype == ir.DataType(elem_type)
    if precision == "fp16":
        data = np.array([0, 1, 2, 3], np.float16)
        out = _session(model).run(["added"], {"data": data, "indices": np.array([1, 1]),
                                              "updates": np.array([0.5, 0.25], np.float16)})[0]
        np.testing.assert_array_equal(out, np.array([0, 1.75, 2, 3], np.float16))
