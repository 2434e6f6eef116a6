"""Pools with ``ceil_mode`` written in floor mode, where that computes the same windows.

With ``ceil_mode=1`` a pool adds a last window that may reach past the input, except (PyTorch's
and onnxruntime's kernels) one that would start in the end padding. ONNX's shape inference
counts that one too: ``AvgPool2d(2, stride=2, padding=1, ceil_mode=True)`` over 7 rows gives 4
rows in the kernels and 5 in the inferred shape, and onnxruntime, which checks shapes when it
loads a model, refused the training model (a gradient op between the two), or the loss's target
took the wrong shape.

Per spatial axis, with ``o`` the kernels' output length: where floor mode gives ``o`` already,
``ceil_mode`` is dropped; where it gives one less, the end padding grows to
``(o - 1) * stride + extent - size - begin`` so that floor mode counts the last window. Both keep
every window's cells: exact for MaxPool (padding never wins), LpPool (zero padding adds 0) and
AveragePool without ``count_include_pad`` (the divisor counts input cells only). An AveragePool
that counts padding and needs the larger end padding would divide its last window by more cells:
left as it is. Static spatial sizes and explicit pads only.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from onnxtrain.ir.nodes import is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass

_POOLS = ("AveragePool", "MaxPool", "LpPool")


def _ints(node: ir.Node, name: str, count: int, default: int) -> list[int]:
    attr = node.attributes.get(name)
    return [int(v) for v in attr.value] if attr is not None else [default] * count


def kernel_output_length(size: int, kernel: int, stride: int, dilation: int, begin: int, end: int) -> int:
    """The output length PyTorch's and onnxruntime's ceil-mode pools give along one axis."""
    extent = dilation * (kernel - 1) + 1
    length = math.ceil((size + begin + end - extent) / stride) + 1
    if (length - 1) * stride >= size + begin:  # the last window would start in the end padding
        length -= 1
    return length


class CeilModePoolPass(NodeRewritePass):
    """Write each ``ceil_mode`` pool in floor mode where the windows stay the same (module docstring)."""

    def match(self, node: ir.Node, opset: int):
        if not is_onnx_op(node, *_POOLS) or not node.attributes.get_int("ceil_mode", 0):
            return None
        auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
        if auto_pad not in ("NOTSET", "VALID"):
            return None
        x = node.inputs[0]
        kernel = _ints(node, "kernel_shape", 0, 0)
        r = len(kernel)
        if x is None or x.shape is None or len(x.shape) != r + 2 or not all(isinstance(d, int) for d in x.shape[2:]):
            return None
        strides, dilations = _ints(node, "strides", r, 1), _ints(node, "dilations", r, 1)
        pads = _ints(node, "pads", 2 * r, 0) if auto_pad == "NOTSET" else [0] * (2 * r)
        counts_padding = node.op_type == "AveragePool" and node.attributes.get_int("count_include_pad", 0)
        new_ends, lengths = [], []
        for axis in range(r):
            size, begin, end = int(x.shape[2 + axis]), pads[axis], pads[r + axis]
            extent = dilations[axis] * (kernel[axis] - 1) + 1
            length = kernel_output_length(size, kernel[axis], strides[axis], dilations[axis], begin, end)
            floor_length = (size + begin + end - extent) // strides[axis] + 1
            if floor_length == length:
                new_ends.append(end)
            else:
                if counts_padding:
                    return None
                new_ends.append((length - 1) * strides[axis] + extent - size - begin)
            lengths.append(length)
        return pads[:r] + new_ends, lengths

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan) -> None:
        pads, lengths = plan
        node.attributes.pop("auto_pad", None)
        node.attributes["ceil_mode"] = ir.AttrInt64("ceil_mode", 0)
        node.attributes["pads"] = ir.AttrInt64s("pads", pads)
        for out in node.outputs[:2]:  # the pooled values (and MaxPool's indices)
            if out is not None and out.shape is not None and len(out.shape) == len(lengths) + 2:
                out.shape = ir.Shape([*out.shape[:2], *lengths])
