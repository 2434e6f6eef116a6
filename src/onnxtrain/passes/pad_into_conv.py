"""A zero ``Pad`` of a ``Conv``'s input taken into the Conv's own ``pads``.

Models written for TensorFlow's "same" padding pad explicitly before a convolution (Hugging
Face's MobileNetV2, EfficientNet and MobileViT with ``tf_padding``; ``F.pad`` then ``conv2d``).
The Conv reads padded zeros either way, and its ``pads`` attribute (begin and end apart, so an
uneven "same" padding too) says the same without a padded copy: in the graph that copy is a
Pad kernel in the forward, a saved activation larger than the input, and a cropping Pad in the
backward. MobileNetV2 (batch 32, 64x64) spent 29 of its forward's 113 ms and 21 of its
backward's 249 ms in those Pads. Runs before autodiff: the Conv's gradient rule reads the
pads. A Pad something else also reads stays for that reader.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.ir.nodes import is_onnx_op
from onnxtrain.ir.shapes import rank_of
from onnxtrain.passes.conv_patches import zero_padded_source
from onnxtrain.passes.rewrite import NodeRewritePass


class PadIntoConvPass(NodeRewritePass):
    """Rewrite ``Conv(Pad(x, spatial zeros), w)`` as ``Conv(x, w, pads=pads + the Pad's)``."""

    def match(self, node: ir.Node, opset: int) -> tuple[ir.Value, list[int]] | None:
        if not is_onnx_op(node, "Conv") or node.attributes.get_string("auto_pad", "NOTSET") != "NOTSET":
            return None
        weight_rank = rank_of(node.inputs[1])
        if weight_rank is None or weight_rank < 3:
            return None
        source, pads = zero_padded_source(node.inputs[0], weight_rank - 2)
        return (source, pads) if source is not node.inputs[0] and any(pads) else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: tuple[ir.Value, list[int]]) -> None:
        source, pads = plan
        own = node.attributes.get_ints("pads", [0] * len(pads))
        node.attributes["pads"] = ir.AttrInt64s("pads", [a + b for a, b in zip(own, pads)])
        node.replace_input_with(0, source)
