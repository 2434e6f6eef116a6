"""Run 2-D Convs whose weights change (training) in onnxruntime's blocked layout, on the CPU provider.

onnxruntime's CPU provider has a faster 2-D convolution for tensors in a blocked channel layout
("NCHWc": channels in blocks of 8 or 16 floats, innermost), the ``com.microsoft.nchwc`` kernels
that ship with every build. Its graph optimizer moves a Conv there only when the weights are a
constant initializer (it reorders them once, while optimizing): in a training graph the weights
are inputs, so every Conv ran in the plain layout. This pass writes the move into the graph
itself, weight reorder included, for Convs whose weights are not constant:

    Conv(x, w, b)  ->  ReorderOutput(nchwc.Conv(ReorderInput(x), blocked(w), b), channels=O)

where ``blocked(w)`` is ``w`` (``[O, I, kh, kw]``) as ``[O/B, I/B, kh, kw, B_in, B_out]``, what
onnxruntime's own reorder writes (onnxruntime's ReorderInput blocks the input channels, one
Transpose moves the output block innermost: tens of microseconds for a weight). A stride-1 ConvTranspose (the input gradient of a stride-1 Conv) is the Conv of
its input with the kernel transposed and flipped, padded by ``dilation * (k - 1) - pad``, and
moves the same way.

Measured on the bench's CNN (second conv, ``[64, 32, 14, 14]`` to 64 channels, 3x3, 2 threads,
AVX-512): forward 1.50 -> 0.97 ms and input gradient 1.71 -> 1.12 ms, reorders included.

Where onnxruntime's kernels take the Conv (as its own optimizer decides for constant weights):
2-D, float32, a static weight shape, ungrouped or depthwise (one group per channel), channel
counts padded up to whole blocks with zero filters (the output Reorder drops them), an input of
fewer channels than a block read in the plain layout. Results differ from the plain kernel's by
rounding (another summation order). The block size is onnxruntime's choice for this CPU
(:func:`onnxtrain.runtime.fusions.nchwc_block_size` reads it off onnxruntime's own rewrite of a
probe model); the rewrite is for sessions this process creates, never for artifacts written to
disk (the layout is this CPU's).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor, replace_nodes_and_values

from onnxtrain.ir.nodes import NewNodes, base_name, is_onnx_op

NCHWC_DOMAIN = "com.microsoft.nchwc"
_INT64_MIN = np.iinfo(np.int64).min
# Each moved Conv pays for reordering its input and output; onnxruntime's plain kernel is a
# matrix product over ``input channels * taps``. Measured (2 threads, AVX-512, reorders
# included), the move loses where that product is already efficient or tiny: 1x1 kernels
# (64 -> 128 channels at 28x28, batch 32: 0.97 -> 1.51 ms; 256 -> 256 at 14x14: 0.87 -> 1.00)
# and one input channel with 3x3 taps (0.121 -> 0.142 ms); it wins from 2 channels x 3x3
# (0.217 -> 0.203), 1 x 5x5 (0.30 -> 0.26), 3x3 over many channels (128 -> 128 at 28x28: 9.0 ->
# 7.8 ms), and on every depthwise Conv (32 channels, 3x3: 1.13 -> 0.41 ms).
_MIN_TAPS = 2
_MIN_PRODUCT_DEPTH = 16  # input channels per group x taps
# onnxruntime's ReorderInput takes channel counts in multiples of this (it pads them up to a block)
_REORDER_CHANNEL_MULTIPLE = 4


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def blocked_weight_layout(weight: np.ndarray, block: int) -> np.ndarray:
    """``weight`` (``[O, I, kh, kw]``, O a multiple of ``block``) in onnxruntime's blocked filter
    layout, with the same shape: ``[O/B, I/B, kh, kw, B_in, B_out]`` where I is a multiple of the
    block too, ``[O/B, I, kh, kw, B_out]`` where ``I < block`` (the Conv then reads its input in
    the plain layout). What :class:`NchwcConvPass` computes in the graph."""
    o, i, kh, kw = weight.shape
    if i < block:
        blocked = weight.reshape(o // block, block, i, kh, kw).transpose(0, 2, 3, 4, 1)
    else:
        blocked = weight.reshape(o // block, block, i // block, block, kh, kw).transpose(0, 2, 4, 5, 3, 1)
    return np.ascontiguousarray(blocked).reshape(weight.shape)


@dataclasses.dataclass
class _Plan:
    """How one Conv or ConvTranspose node runs as a blocked Conv."""

    transposed: bool
    depthwise: bool  # one group per channel; else ungrouped
    out_channels: int
    in_channels: int  # per group
    kernel: list[int]
    pads: list[int] | None  # None: the node's auto_pad

    def padded(self, block: int) -> tuple[int, int]:
        """Channel counts of the blocked weight: output channels up to a whole block, input
        channels too unless fewer than a block (read in the plain layout) or depthwise (one)."""
        small = self.depthwise or self.in_channels < block
        return _round_up(self.out_channels, block), self.in_channels if small else _round_up(self.in_channels, block)

    def reads_plain_input(self, block: int) -> bool:
        """Whether the blocked Conv reads its input in the plain layout (few input channels)."""
        return not self.depthwise and self.in_channels < block


class NchwcConvPass(ir.passes.InPlacePass):
    """Move Convs (and stride-1 ConvTransposes) with run-time float32 weights to onnxruntime's
    ``com.microsoft.nchwc`` kernels with channel blocks of ``block``."""

    def __init__(self, block: int):
        super().__init__()
        self.block = block

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(model.graph):
            plan = _plan(node, self.block)
            if plan is not None:
                _rewrite(model.graph, node, self.block, plan)
                modified = True
        if modified:
            model.opset_imports.setdefault(NCHWC_DOMAIN, 1)
        return ir.passes.PassResult(model, modified)


def moves_to_nchwc(node: ir.Node, block: int) -> bool:
    """Whether :class:`NchwcConvPass` with ``block`` rewrites ``node``."""
    return _plan(node, block) is not None


def _ints(node: ir.Node, name: str, count: int, default: int) -> list[int]:
    attr = node.attributes.get(name)
    return [int(v) for v in attr.value] if attr is not None else [default] * count


def _plan(node: ir.Node, block: int) -> _Plan | None:
    """How ``node`` runs as a blocked Conv, or None if it stays."""
    transposed = is_onnx_op(node, "ConvTranspose")
    if not (transposed or is_onnx_op(node, "Conv")) or len(node.inputs) < 2 or len(node.outputs) != 1:
        return None
    x, w = node.inputs[:2]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if any(v is not None and v.dtype != ir.DataType.FLOAT for v in (x, w, bias)) or x is None or w is None:
        return None
    if get_const_tensor(w) is not None:
        return None  # onnxruntime's own layout optimizer moves Convs with constant weights
    if w.shape is None or len(w.shape) != 4 or not all(isinstance(d, int) for d in w.shape):
        return None
    if x.shape is not None and len(x.shape) != 4:
        return None
    first, second, kh, kw = (int(d) for d in w.shape)
    group = node.attributes.get_int("group", 1)
    # grouped: depthwise only, a weight of [C, 1, kh, kw] with C groups (Conv and ConvTranspose alike)
    depthwise = group != 1
    if depthwise and (group != first or second != 1):
        return None
    kernel = [kh, kw]
    if node.attributes.get("kernel_shape") is not None and _ints(node, "kernel_shape", 2, 0) != kernel:
        return None
    # a Conv's weight is [O, I, ...]; a ConvTranspose's [I, O, ...]
    out_channels, in_channels = (second, first) if transposed and not depthwise else (first, second)
    if kh * kw < _MIN_TAPS or (not depthwise and in_channels * kh * kw < _MIN_PRODUCT_DEPTH):
        return None  # not worth its reorders
    if transposed:
        pads = _transposed_as_conv_pads(node, kernel)
        if pads is None:
            return None
    else:
        auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
        pads = _ints(node, "pads", 4, 0) if auto_pad == "NOTSET" else None
    plan = _Plan(transposed, depthwise, out_channels, in_channels, kernel, pads)
    input_channels = out_channels if depthwise else in_channels
    if not plan.reads_plain_input(block) and input_channels % _REORDER_CHANNEL_MULTIPLE:
        return None
    return plan


def _transposed_as_conv_pads(node: ir.Node, kernel: list[int]) -> list[int] | None:
    """The pads of the Conv that equals a stride-1 ConvTranspose, or None if it has no such Conv
    here (strides, output padding or shape, automatic pads)."""
    if _ints(node, "strides", 2, 1) != [1, 1] or any(_ints(node, "output_padding", 2, 0)):
        return None
    if node.attributes.get("output_shape") is not None or node.attributes.get_string("auto_pad", "NOTSET") != "NOTSET":
        return None
    dilations = _ints(node, "dilations", 2, 1)
    extent = [d * (k - 1) for d, k in zip(dilations, kernel)]
    conv_pads = [extent[i % 2] - p for i, p in enumerate(_ints(node, "pads", 4, 0))]
    return conv_pads if all(p >= 0 for p in conv_pads) else None


def _rewrite(graph: ir.Graph, node: ir.Node, block: int, plan: _Plan) -> None:
    prefix = f"{base_name(node)}/nchwc"
    new_nodes = NewNodes(node, "nchwc")
    add = new_nodes.add

    def constant(label: str, values) -> ir.Value:
        value = ir.Value(name=f"{prefix}/{label}", const_value=ir.tensor(np.asarray(values, np.int64)))
        graph.register_initializer(value)
        return value

    x, w = node.inputs[:2]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if plan.transposed:  # [I, O, kh, kw] -> [O, I, kh, kw] (depthwise: [C, 1, ...] as it is), each kernel turned
        if not plan.depthwise:
            w = add("Transpose", [w], {"perm": [1, 0, 2, 3]})
        w = add("Slice", [w, constant("flip_starts", [-1, -1]), constant("flip_ends", [_INT64_MIN, _INT64_MIN]),
                          constant("flip_axes", [2, 3]), constant("flip_steps", [-1, -1])])
    out_channels, in_channels = plan.padded(block)
    kh, kw = plan.kernel
    if (out_channels, in_channels) != (plan.out_channels, plan.in_channels):  # zero filters and taps
        w = add("Pad", [w, constant("weight_pads", [0, 0, 0, 0, out_channels - plan.out_channels,
                                                     in_channels - plan.in_channels, 0, 0])])
        if bias is not None and out_channels != plan.out_channels:
            bias = add("Pad", [bias, constant("bias_pads", [0, out_channels - plan.out_channels])])
    # [O, I, kh, kw] -> [O/B, I/B, kh, kw, B_in, B_out] (or [O/B, I, kh, kw, B_out] for fewer input
    # channels than a block): the input blocks by onnxruntime's own ReorderInput, reading the
    # weight as a batch of O images of I channels, then the output block moved innermost by one
    # Transpose of a single axis (onnxruntime's fast path). One 6-D Transpose does the same at a
    # crawl: 336 against 74 us for [128, 128, 3, 3], 1.52 ms against 0.25 for [256, 256, 3, 3].
    if in_channels >= block:
        w = add("ReorderInput", [w], {"channels_last": 0}, NCHWC_DOMAIN)
    rows = add("Reshape", [w, constant("split_blocks", [out_channels // block, block, in_channels * kh * kw])])
    blocked = add("Reshape", [add("Transpose", [rows], {"perm": [0, 2, 1]}),
                              constant("weight_shape", [out_channels, in_channels, kh, kw])])
    attributes: dict = {"kernel_shape": plan.kernel, "group": out_channels if plan.depthwise else 1}
    if plan.pads is not None:
        attributes["pads"] = plan.pads
    names = ("dilations",) if plan.transposed else ("strides", "dilations", "auto_pad")
    for name in names:
        if node.attributes.get(name) is not None:
            attributes[name] = node.attributes[name].value
    data = x if plan.reads_plain_input(block) else add("ReorderInput", [x], {"channels_last": 0}, NCHWC_DOMAIN)
    conv = add("Conv", [data, blocked, *([bias] if bias is not None else [])], attributes, NCHWC_DOMAIN)
    out = node.outputs[0]
    result = add("ReorderOutput", [conv], {"channels": plan.out_channels, "channels_last": 0}, NCHWC_DOMAIN)
    result.type, result.shape = out.type, out.shape
    replace_nodes_and_values(graph, node, [node], new_nodes.nodes, [out], [result])
