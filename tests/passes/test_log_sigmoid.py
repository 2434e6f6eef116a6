"""LogSigmoidPass: ``Log(Sigmoid(x))`` and ``Log(1 - Sigmoid(x))`` as softplus forms, exact over the
whole float32 range where onnxruntime's Sigmoid is 0 from x ~ -18 (and its logarithm -inf)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper

from onnxtrain.passes.log_sigmoid import LogSigmoidPass
from tests.passes._graphs import model_of, run

X = np.array([-300.0, -90.0, -30.0, -18.0, -5.0, -1e-6, 0.0, 2e-7, 4.0, 17.0, 30.0, 95.0], np.float32)


def _exact_log_sigmoid(x):
    x = x.astype(np.float64)
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def _rewritten(proto):
    model = ir.from_proto(proto)
    modified = LogSigmoidPass()(model).modified
    return ir.to_proto(model), modified


def _graph(elem=TensorProto.FLOAT, one=1.0):
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Log", ["s"], ["log_s"]),
             helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", elem, [], [one])),
             helper.make_node("Sub", ["one", "s"], ["rest"]), helper.make_node("Log", ["rest"], ["log_rest"])]
    return model_of(nodes, [("x", [len(X)])], ["log_s", "log_rest", "s"], elem=elem)


def test_both_logarithms_become_exact():
    proto = _graph()
    before = run(proto, {"x": X})
    assert np.isinf(before[0][:3]).all()  # onnxruntime's Sigmoid underflows: the bug this pass is for
    rewritten, modified = _rewritten(proto)
    assert modified
    log_s, log_rest, s = run(rewritten, {"x": X})
    np.testing.assert_allclose(log_s, _exact_log_sigmoid(X), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(log_rest, _exact_log_sigmoid(-X), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(s, before[2])  # other readers of the sigmoid keep it
    assert [n.op_type for n in rewritten.graph.node].count("Softplus") == 2


def test_other_graphs_are_left_alone():
    # 2 - sigmoid is no sigmoid's complement; double runs the exact double Sigmoid kernel
    for proto in (_graph(one=2.0), _graph(elem=TensorProto.DOUBLE)):
        rewritten, modified = _rewritten(proto)
        ops = [n.op_type for n in rewritten.graph.node]
        assert ops.count("Softplus") == (1 if proto.graph.output[0].type.tensor_type.elem_type == 1 else 0)
        assert modified == ("Softplus" in ops)


def test_log1p_of_minus_sigmoid_as_binary_cross_entropy_writes_it():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Neg", ["s"], ["minus"]),
             helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])),
             helper.make_node("Add", ["minus", "one"], ["rest"]), helper.make_node("Log", ["rest"], ["y"])]
    proto = model_of(nodes, [("x", [len(X)])], ["y"])
    rewritten, modified = _rewritten(proto)
    assert modified
    np.testing.assert_allclose(run(rewritten, {"x": X})[0], _exact_log_sigmoid(-X), rtol=1e-6, atol=1e-7)


def test_low_precision_logarithms_are_computed_in_float32():
    """A model converted to bfloat16/float16 (``.to(torch.bfloat16)``): the rounded sigmoid is 0
    from x ~ -9 in bfloat16 and its logarithm -inf (binary cross entropy with logits infinite,
    its gradient NaN); the softplus forms run in float32 and are rounded once."""
    import onnx

    for elem, numpy_type in ((TensorProto.BFLOAT16, None), (TensorProto.FLOAT16, np.float16)):
        proto = _graph(elem=elem)
        rewritten, modified = _rewritten(proto)
        assert modified
        softplus = [n for n in rewritten.graph.node if n.op_type == "Softplus"]
        assert len(softplus) == 2
        if numpy_type is None:  # numpy has no bfloat16: check the types the pass wrote
            casts = [n for n in rewritten.graph.node if n.op_type == "Cast"]
            assert sorted(onnx.helper.get_attribute_value(c.attribute[0]) for c in casts) == sorted(
                [TensorProto.FLOAT] * 2 + [TensorProto.BFLOAT16] * 2)
            continue
        x = np.array([-30.0, -12.0, -9.0, -5.0, -1.0, -0.1, 0.0, 0.5, 3.0, 9.0, 12.0, 30.0], numpy_type)
        log_s, log_rest, _ = run(rewritten, {"x": x})
        np.testing.assert_allclose(log_s.astype(np.float64), _exact_log_sigmoid(x), rtol=2e-3, atol=1e-7)
        np.testing.assert_allclose(log_rest.astype(np.float64), _exact_log_sigmoid(-x), rtol=2e-3, atol=1e-7)
