"""A straight-through gradient for quantize-dequantize pairs (quantization-aware training of QDQ models).

A QDQ model (``onnxruntime.quantization``'s QDQ format, or any quantization-aware export)
simulates quantization with ``DequantizeLinear(QuantizeLinear(x, s, z), s, z)``: the value is
``x`` rounded to the grid of step ``s`` and clamped to the integer type's range. The pair's
derivative is zero almost everywhere (and ``QuantizeLinear``'s integer output carries none at
all), so training such a model moved nothing: every parameter behind a pair got a zero gradient.
Quantization-aware training uses the straight-through estimator instead, as PyTorch's fake
quantization: the gradient passes unchanged where the quantized value is inside the integer
range, and is zero where it was clamped.

This pass writes each such pair, in the training model only, as

    fq = DequantizeLinear(QuantizeLinear(x, s, z), s, z)                 # the same value
    kept = qmin <= Round(x / s) + z <= qmax                              # no gradient
    y = fq + Where(kept, x - StopGradient(x), 0)

whose second term is exactly 0 (``x - x``, or 0 where the value was clamped or ``x`` is not
finite) and whose gradient to ``x`` is the incoming one where ``kept``. Scales and zero points
stay constants (they are quantization parameters, not weights to train). Per-tensor and per-axis
quantization to 8-, 16- and 4-bit integers; blocked quantization and float8 types are left alone
(their gradient stays zero).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor

from onnxtrain import names
from onnxtrain.ir.nodes import NewNodes
from onnxtrain.passes.rewrite import NodeRewritePass, hand_over

_INTEGER_RANGES = {
    ir.DataType.INT8: (-128, 127),
    ir.DataType.UINT8: (0, 255),
    ir.DataType.INT16: (-32768, 32767),
    ir.DataType.UINT16: (0, 65535),
    ir.DataType.INT4: (-8, 7),
    ir.DataType.UINT4: (0, 15),
}


def _is_quantizer(node: ir.Node | None, op_type: str) -> bool:
    """A standard ``op_type`` node, or onnxruntime's ``com.microsoft`` one of the same meaning (its
    quantizer writes those for 4-bit types below opset 21)."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx", "com.microsoft")


def quantization_parameters(graph: ir.Graph) -> set[str]:
    """Names of the values every ``QuantizeLinear`` / ``DequantizeLinear`` reads as its scale or
    zero point, and the float inputs of quantized ops (``QLinearConv``'s scales, ...): constants
    of the quantization, not parameters to train."""
    found = set()
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if _is_quantizer(node, "QuantizeLinear") or _is_quantizer(node, "DequantizeLinear"):
            found.update(v.name for v in node.inputs[1:] if v is not None)
        elif node.op_type.startswith("QLinear") or node.op_type == "QGemm":
            found.update(v.name for v in node.inputs if v is not None and v.dtype is not None
                         and v.dtype.is_floating_point())
    return found


def quantized_weights(graph: ir.Graph) -> list[str]:
    """Integer initializers a ``DequantizeLinear`` reads as its data: weights stored quantized
    (onnxruntime.quantization's default), which no gradient can train."""
    return sorted({node.inputs[0].name for node in ir.traversal.RecursiveGraphIterator(graph)
                   if _is_quantizer(node, "DequantizeLinear") and node.inputs[0] is not None
                   and node.inputs[0].is_initializer() and node.inputs[0].dtype is not None
                   and not node.inputs[0].dtype.is_floating_point()})


def _same(a: ir.Value | None, b: ir.Value | None) -> bool:
    """The same value, or equal constants (an exporter may repeat a scale)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    left, right = get_const_tensor(a), get_const_tensor(b)
    if left is None or right is None or left.dtype != right.dtype:
        return False
    left, right = left.numpy(), right.numpy()
    if left.size == 1 and right.size == 1:  # a per-tensor scale of shape [] or [1]
        return bool(left.reshape(()) == right.reshape(()))
    return np.array_equal(left, right)


def _quantized_type(quantize: ir.Node) -> ir.DataType | None:
    zero_point = quantize.inputs[2] if len(quantize.inputs) > 2 else None
    if zero_point is not None:
        return zero_point.dtype
    chosen = quantize.attributes.get_int("output_dtype", 0)
    return ir.DataType(chosen) if chosen else ir.DataType.UINT8


class QuantizeDequantizeStraightThroughPass(NodeRewritePass):
    """Give every ``DequantizeLinear(QuantizeLinear(x, s, z), s, z)`` the straight-through gradient
    of PyTorch's fake quantization (module docstring). For training models only: the values do
    not change, the eval and inference models keep their plain pairs."""

    def match(self, node: ir.Node, opset: int):
        if not _is_quantizer(node, "DequantizeLinear") or node.attributes.get_int("block_size", 0):
            return None
        quantize = node.inputs[0].producer()
        if not _is_quantizer(quantize, "QuantizeLinear") or quantize.attributes.get_int("block_size", 0):
            return None
        x = quantize.inputs[0]
        if x is None or x.dtype is None or not x.dtype.is_floating_point():
            return None
        scale, zero = quantize.inputs[1], quantize.inputs[2] if len(quantize.inputs) > 2 else None
        dequantized_zero = node.inputs[2] if len(node.inputs) > 2 else None
        if not _same(scale, node.inputs[1]) or not _same(zero, dequantized_zero):
            return None
        bounds = _INTEGER_RANGES.get(_quantized_type(quantize))
        rank_of_scale = len(scale.shape) if scale.shape is not None else None
        if bounds is None or rank_of_scale not in (0, 1) or (rank_of_scale == 1 and x.shape is None):
            return None
        per_axis = rank_of_scale == 1 and scale.shape[0] != 1
        axis = quantize.attributes.get_int("axis", 1)
        if per_axis:  # the axis matters only then, and -1 names the same axis as rank - 1
            rank = len(x.shape)
            if not -rank <= axis < rank or axis % rank != node.attributes.get_int("axis", 1) % rank:
                return None
        return x, scale, zero, bounds, axis, per_axis

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan) -> None:
        x, scale, zero, (low, high), axis, per_axis = plan
        new = NewNodes(node, "straight_through")
        dtype = x.dtype
        quantized = node.inputs[0]
        if quantized.dtype is None:  # a com.microsoft quantizer's: ONNX's inference does not type it
            quantized.dtype = _quantized_type(quantized.producer())
        if node.outputs[0].dtype is None:
            node.outputs[0].dtype = dtype
        if node.outputs[0].shape is None:  # the pair keeps its input's shape
            node.outputs[0].shape = x.shape

        def along_axis(value: ir.Value) -> ir.Value:
            if not per_axis:
                return value
            rank = len(x.shape)
            shape = [1] * rank
            shape[axis % rank] = -1
            return new.add("Reshape", [value, _constant(new, np.array(shape, np.int64))])

        def as_float(value: ir.Value) -> ir.Value:
            return new.add("Cast", [value], {"to": ir.Attr("to", ir.AttributeType.INT, dtype.value)})

        steps = new.add("Round", [new.add("Div", [x, along_axis(as_float(scale))])])
        if zero is not None:
            steps = new.add("Add", [steps, along_axis(as_float(zero))])
        at_least = new.add("GreaterOrEqual", [steps, _constant(new, np.array(low, dtype.numpy()))])
        at_most = new.add("LessOrEqual", [steps, _constant(new, np.array(high, dtype.numpy()))])
        kept = new.add("And", [at_least, at_most])
        for value in (at_least, at_most, kept):
            value.dtype = ir.DataType.BOOL
        stopped = new.add("Identity", [x])
        stopped.producer().metadata_props[names.STOP_GRADIENT_METADATA] = "1"
        carrier = new.add("Sub", [x, stopped])
        passed = new.add("Where", [kept, carrier, _constant(new, np.array(0, dtype.numpy()))])
        for value in (steps, stopped, carrier, passed):
            value.dtype = dtype
        out = node.outputs[0]
        result = new.add("Add", [out, passed])
        result.dtype, result.shape = out.dtype, out.shape
        graph.insert_after(node, new.nodes)
        hand_over(graph, out, result, "quantized")


def _constant(new: NewNodes, array: np.ndarray) -> ir.Value:
    value = new.add("Constant", [], {"value": ir.Attr("value", ir.AttributeType.TENSOR, ir.tensor(array))})
    value.const_value = ir.tensor(array)
    return value
