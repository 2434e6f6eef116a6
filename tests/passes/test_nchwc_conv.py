"""NchwcConvPass: Convs with run-time weights in onnxruntime's blocked layout, same results up to rounding."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxtrain.ir import io
from onnxtrain.passes.nchwc_conv import NCHWC_DOMAIN, NchwcConvPass, blocked_weight_layout
from onnxtrain.runtime import fusions
from tests.passes._graphs import run

BLOCK = fusions.nchwc_block_size()
needs_blocked_kernels = pytest.mark.skipif(BLOCK is None, reason="this onnxruntime has no blocked Conv on this CPU")

# name: (op, input shape, weight shape, attributes, with bias)
MOVED = {
    "3x3_pads": ("Conv", [4, 32, 9, 8], [64, 32, 3, 3], {"pads": [1, 1, 1, 1]}, False),
    "bias_stride_2": ("Conv", [3, 16, 11, 10], [32, 16, 3, 3], {"strides": [2, 2], "pads": [1, 0, 1, 2]}, True),
    "few_input_channels": ("Conv", [2, 3, 12, 12], [16, 3, 5, 5], {"pads": [2, 2, 2, 2]}, True),
    "one_input_channel_5x5": ("Conv", [5, 1, 10, 9], [32, 1, 5, 5], {}, False),
    "padded_channels": ("Conv", [2, 20, 7, 7], [20, 20, 3, 3], {"pads": [1, 1, 1, 1]}, True),
    "dilated_rectangular": ("Conv", [2, 16, 13, 11], [16, 16, 3, 2], {"dilations": [2, 1], "pads": [2, 0, 2, 1]}, False),
    "same_upper": ("Conv", [2, 16, 9, 9], [32, 16, 3, 3], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, True),
    "transposed": ("ConvTranspose", [4, 64, 9, 8], [64, 32, 3, 3], {"pads": [1, 1, 1, 1]}, False),
    "transposed_no_pads_bias": ("ConvTranspose", [2, 16, 5, 6], [16, 16, 3, 3], {}, True),
    "transposed_padded_dilated": ("ConvTranspose", [2, 20, 8, 8], [20, 6, 3, 3],
                                  {"dilations": [2, 2], "pads": [1, 2, 3, 0]}, True),
    "depthwise": ("Conv", [3, 32, 10, 10], [32, 1, 3, 3], {"group": 32, "pads": [1, 1, 1, 1]}, True),
    "depthwise_padded_strided": ("Conv", [2, 24, 11, 9], [24, 1, 5, 3],
                                 {"group": 24, "strides": [2, 1], "pads": [2, 1, 1, 1]}, False),
    "depthwise_transposed": ("ConvTranspose", [2, 20, 7, 6], [20, 1, 3, 3], {"group": 20, "pads": [1, 0, 1, 2]}, True),
    "few_odd_input_channels": ("Conv", [2, 5, 8, 8], [7, 5, 3, 3], {}, True),
}
# name: (op, input shape, weight shape, attributes): what the pass leaves as it is (what the
# kernels do not take, and what the reorders would cost more than they save)
LEFT = {
    "pointwise": ("Conv", [3, 32, 6, 6], [48, 32, 1, 1], {}),
    "one_input_channel_3x3": ("Conv", [5, 1, 10, 9], [32, 1, 3, 3], {}),
    "transposed_pointwise": ("ConvTranspose", [3, 32, 6, 6], [32, 48, 1, 1], {}),
    "grouped": ("Conv", [2, 32, 8, 8], [32, 16, 3, 3], {"group": 2}),
    "depthwise_multiplier_2": ("Conv", [2, 16, 8, 8], [32, 1, 3, 3], {"group": 16}),
    # onnxruntime's input reorder takes channels in multiples of 4 only
    "input_channels_not_a_multiple_of_4": ("Conv", [2, 18, 8, 8], [33, 18, 3, 3], {}),
    "transposed_input_channels_not_a_multiple_of_4": ("ConvTranspose", [2, 17, 8, 8], [17, 5, 3, 3], {}),
    "depthwise_channels_not_a_multiple_of_4": ("Conv", [2, 17, 8, 8], [17, 1, 3, 3], {"group": 17}),
    "1d": ("Conv", [2, 16, 12], [16, 16, 3], {}),
    "3d": ("Conv", [1, 16, 4, 5, 6], [16, 16, 2, 2, 2], {}),
    "transposed_stride_2": ("ConvTranspose", [2, 16, 5, 5], [16, 16, 3, 3], {"strides": [2, 2]}),
    "transposed_output_padding": ("ConvTranspose", [2, 16, 5, 5], [16, 16, 3, 3], {"output_padding": [1, 0]}),
    "transposed_wide_pads": ("ConvTranspose", [2, 16, 7, 7], [16, 16, 3, 3], {"pads": [3, 3, 3, 3]}),
}


def _model(op: str, x_shape, w_shape, attrs: dict, bias: bool, batch: str | None = None,
           elem: int = TensorProto.FLOAT) -> ir.Model:
    out_channels = _out_channels(op, w_shape, attrs)
    inputs = [helper.make_tensor_value_info("x", elem, [batch or x_shape[0], *x_shape[1:]]),
              helper.make_tensor_value_info("w", elem, w_shape)]
    if bias:
        inputs.append(helper.make_tensor_value_info("b", elem, [out_channels]))
    node = helper.make_node(op, ["x", "w", *(["b"] if bias else [])], ["y"], **attrs)
    graph = helper.make_graph([node], "conv", inputs, [helper.make_tensor_value_info("y", elem, None)])
    return io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _out_channels(op: str, w_shape, attrs: dict) -> int:
    """A Conv's weight is [O, I / group, ...], a ConvTranspose's [I, O / group, ...]."""
    return w_shape[1] * attrs.get("group", 1) if op == "ConvTranspose" else w_shape[0]


def _case_feeds(case: dict, name: str, seed: int = 0) -> dict:
    op, x_shape, w_shape, attrs, bias = case[name]
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32), "w": rng.standard_normal(w_shape).astype(np.float32)}
    if bias:
        feeds["b"] = rng.standard_normal(_out_channels(op, w_shape, attrs)).astype(np.float32)
    return feeds


def _blocked_nodes(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph if n.domain == NCHWC_DOMAIN]


def _assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    # another summation order: rounding-level differences, scaled to the sums' size
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


@needs_blocked_kernels
@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_convs_compute_the_same(name):
    op, x_shape, w_shape, attrs, bias = MOVED[name]
    model = _model(op, x_shape, w_shape, attrs, bias)
    feeds = _case_feeds(MOVED, name)
    expected = run(io.to_proto(model), feeds)[0]
    assert NchwcConvPass(BLOCK)(model).modified
    assert not [n for n in model.graph if n.domain in ("", "ai.onnx") and n.op_type in ("Conv", "ConvTranspose")]
    assert "Conv" in _blocked_nodes(model) and "ReorderOutput" in _blocked_nodes(model)
    actual = run(io.to_proto(model), feeds)[0]
    assert actual.shape == expected.shape
    _assert_close(actual, expected)


@needs_blocked_kernels
def test_each_run_reads_the_current_weights():
    """Training changes the weights between runs: nothing may be packed once and kept."""
    op, x_shape, w_shape, attrs, bias = MOVED["padded_channels"]
    model = _model(op, x_shape, w_shape, attrs, bias)
    plain = onnx.load_from_string(io.serialize(model))
    NchwcConvPass(BLOCK)(model)
    import onnxruntime as ort

    session = ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"])
    for seed in (1, 2, 3):
        feeds = _case_feeds(MOVED, "padded_channels", seed)
        _assert_close(session.run(None, feeds)[0], run(plain, feeds)[0])


@needs_blocked_kernels
def test_a_dynamic_batch():
    op, x_shape, w_shape, attrs, bias = MOVED["bias_stride_2"]
    model = _model(op, x_shape, w_shape, attrs, bias, batch="batch")
    plain = onnx.load_from_string(io.serialize(model))
    assert NchwcConvPass(BLOCK)(model).modified
    for batch in (1, 7):
        feeds = _case_feeds(MOVED, "bias_stride_2")
        feeds["x"] = np.random.default_rng(batch).standard_normal([batch, *x_shape[1:]]).astype(np.float32)
        _assert_close(run(io.to_proto(model), feeds)[0], run(plain, feeds)[0])


@needs_blocked_kernels
@pytest.mark.parametrize("name", sorted(LEFT))
def test_what_does_not_move_is_left(name):
    op, x_shape, w_shape, attrs = LEFT[name]
    assert not NchwcConvPass(BLOCK)(_model(op, x_shape, w_shape, attrs, False)).modified


@needs_blocked_kernels
def test_constant_weights_and_other_types_are_left():
    """onnxruntime moves Convs with constant weights itself; its blocked kernels are float32 only."""
    op, x_shape, w_shape, attrs, _ = MOVED["3x3_pads"]
    model = _model(op, x_shape, w_shape, attrs, False)
    w = next(v for v in model.graph.inputs if v.name == "w")
    w.const_value = ir.tensor(np.ones(w_shape, np.float32))
    model.graph.inputs.remove(w)
    model.graph.register_initializer(w)
    assert not NchwcConvPass(BLOCK)(model).modified
    assert not NchwcConvPass(BLOCK)(_model(op, x_shape, w_shape, attrs, False, elem=TensorProto.DOUBLE)).modified


@needs_blocked_kernels
def test_the_layout_is_onnxruntimes_own():
    """blocked_weight_layout equals what onnxruntime writes when it moves a constant-weight Conv."""
    import os
    import tempfile

    import onnxruntime as ort

    for out_channels, in_channels, group in ((2 * BLOCK, 2 * BLOCK, 1), (BLOCK, 3, 1), (2 * BLOCK, 2 * BLOCK, 2 * BLOCK)):
        weight = np.random.default_rng(0).standard_normal((out_channels, in_channels // group, 3, 2)).astype(np.float32)
        node = helper.make_node("Conv", ["x", "w"], ["y"], group=group)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, in_channels, 6, 6])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                                  [onnx.numpy_helper.from_array(weight, "w")])
        with tempfile.TemporaryDirectory() as folder:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.optimized_model_filepath = os.path.join(folder, "m.onnx")
            ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(),
                                 options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(options.optimized_model_filepath)
        written = [onnx.numpy_helper.to_array(t) for t in optimized.graph.initializer]
        assert len(written) == 1
        np.testing.assert_array_equal(written[0], blocked_weight_layout(weight, BLOCK))


@needs_blocked_kernels
def test_for_session_moves_convs_on_cpu_alone(tmp_path):
    """The file keeps its standard Conv (any runtime, any CPU); the CPU session's bytes have the
    blocked one."""
    op, x_shape, w_shape, attrs, bias = MOVED["transposed"]
    model = _model(op, x_shape, w_shape, attrs, bias)
    assert fusions.rewrites(model, ["CPUExecutionProvider"])
    assert not fusions.rewrites(model, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    path = tmp_path / "model.onnx"
    io.save_model(model, path)
    rewritten = fusions.session_model(path, ["CPUExecutionProvider"], gated_add=False)
    assert isinstance(rewritten, bytes)
    assert not _blocked_nodes(io.load_model(path))
    assert _blocked_nodes(ir.from_proto(onnx.load_from_string(rewritten)))
    assert fusions.session_model(path, ["CUDAExecutionProvider"], gated_add=False) == str(path)
    feeds = _case_feeds(MOVED, "transposed")
    _assert_close(run(onnx.load_from_string(rewritten), feeds)[0], run(onnx.load(path), feeds)[0])


def test_no_block_no_rewrite(monkeypatch):
    """Where onnxruntime has no blocked Conv for this CPU, sessions get the standard graph."""
    op, x_shape, w_shape, attrs, bias = MOVED["3x3_pads"]
    model = _model(op, x_shape, w_shape, attrs, bias)
    monkeypatch.setattr(fusions, "nchwc_block_size", lambda: None)
    assert not fusions.rewrites(model, ["CPUExecutionProvider"])
    assert not fusions.for_session(model, ["CPUExecutionProvider"], gated_add=False)
