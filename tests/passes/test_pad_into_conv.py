"""PadIntoConvPass: Conv(Pad(x, spatial zeros)) -> Conv(x, pads=...), same values and gradients."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff.check import check_gradients
from onnxtrain.ir import io
from onnxtrain.passes.pad_into_conv import PadIntoConvPass
from tests.passes._graphs import model_of, run


def _padded_conv(pads, conv_attrs=(), fill=None, extra=(), outputs=("y",)):
    """y = Conv(Pad(x, pads[, fill]), w); ``extra`` nodes may read the padded value ``p``."""
    inputs = ["x", "pads"] + (["fill"] if fill is not None else [])
    nodes = [helper.make_node("Constant", [], ["pads"], value=helper.make_tensor("v", TensorProto.INT64, [8], pads)),
             helper.make_node("Pad", inputs, ["p"]),
             helper.make_node("Conv", ["p", "w"], ["y"], **dict(conv_attrs)), *extra]
    if fill is not None:
        nodes.insert(0, helper.make_node("Constant", [], ["fill"], value=helper.make_tensor("f", TensorProto.FLOAT, [], [fill])))
    return model_of(nodes, [("x", [2, 3, 7, 6]), ("w", [3, 1, 3, 3])], list(outputs))


def _feeds():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal([2, 3, 7, 6]).astype(np.float32),
            "w": rng.standard_normal([3, 1, 3, 3]).astype(np.float32)}


def _rewritten(model):
    graph_model = io.load_model(model)
    PadIntoConvPass()(graph_model)
    return graph_model


@pytest.mark.parametrize(("pads", "conv_attrs"), [
    ([0, 0, 0, 1, 0, 0, 1, 0], {"group": 3, "strides": [2, 2]}),  # TensorFlow's uneven "same" padding
    ([0, 0, 1, 1, 0, 0, 1, 1], {"group": 3, "pads": [1, 0, 0, 1]}),  # added to the Conv's own pads
    ([0, 0, 2, 0, 0, 0, 0, 2], {"group": 3, "dilations": [2, 1]}),
])
def test_the_conv_pads_its_input_itself(pads, conv_attrs):
    model = _padded_conv(pads, conv_attrs)
    rewritten = _rewritten(model)
    conv = next(n for n in rewritten.graph if n.op_type == "Conv")
    assert conv.inputs[0].name == "x"
    own = list(conv_attrs.get("pads", [0, 0, 0, 0]))
    assert list(conv.attributes.get_ints("pads")) == [a + b for a, b in zip(own, pads[2:4] + pads[6:8])]
    np.testing.assert_allclose(run(io.to_proto(rewritten), _feeds())[0], run(model, _feeds())[0], rtol=1e-6, atol=1e-6)
    check_gradients(io.to_proto(rewritten), _feeds())


@pytest.mark.parametrize(("pads", "fill"), [
    ([0, 1, 1, 1, 0, 0, 1, 1], None),  # a channel padded
    ([0, 0, 1, 1, 0, 0, 1, 1], 1.0),  # padded with ones
    ([0, 0, -1, 0, 0, 0, 0, 0], None),  # a crop
])
def test_other_pads_stay(pads, fill):
    rewritten = _rewritten(_padded_conv(pads, {"group": 3 if pads[1] == 0 else 1}, fill))
    assert next(n for n in rewritten.graph if n.op_type == "Conv").inputs[0].name == "p"


def test_a_pad_others_read_stays_for_them():
    model = _padded_conv([0, 0, 1, 1, 0, 0, 1, 1], {"group": 3}, extra=[helper.make_node("Relu", ["p"], ["r"])],
                         outputs=("y", "r"))
    rewritten = _rewritten(model)
    assert [n.op_type for n in rewritten.graph if n.op_type in ("Pad", "Conv")] == ["Pad", "Conv"]
    assert next(n for n in rewritten.graph if n.op_type == "Conv").inputs[0].name == "x"
    for ours, theirs in zip(run(io.to_proto(rewritten), _feeds()), run(model, _feeds())):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
