"""Gradients a rule gives in a form that is cheaper to sum than a full-sized tensor.

A rule may return, for an input, a :class:`Partial` in place of a tensor: a description of a
gradient that is zero almost everywhere (a Slice's, a Gather's). Where an input gets several of
one kind (an expert's weight ``W[e]`` taken in a loop, a recurrence's ``x[:, t]``, the rows of a
hidden state each expert reads), the autodiff builder hands them to their class's
:meth:`Partial.join` together, which writes them into as few full-sized tensors as it can,
rather than widening each to the input's size and adding them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.ir.builder import GraphBuilder

_INT64_MAX = int(np.iinfo(np.int64).max)


class Partial:
    """Base of the gradients in parts (module docstring)."""

    @classmethod
    def join(cls, b: GraphBuilder, parts: list[Partial], primal: ir.Value) -> list[ir.Value]:
        """Full-sized tensors (of ``primal``'s shape and type) whose sum is the sum of ``parts``,
        all of this class."""
        raise NotImplementedError


@dataclass(frozen=True)
class Region(Partial):
    """A gradient that is zero outside positions ``first`` ... ``first + count - 1`` along ``axis``
    of its input (of rank ``rank`` and runtime shape ``shape``), given as ``value``: those
    positions only. Regions that do not overlap are written side by side with one Concat, zeros
    between them (one pass over the input's size, where padding each and adding them takes two
    per region: RoPE's ``rotate_half`` halves, a Qwen2-MoE expert's ``W[e]``); a region alone is
    padded."""

    value: ir.Value
    axis: int
    first: int
    count: int
    rank: int
    shape: ir.Value

    @classmethod
    def join(cls, b: GraphBuilder, parts: list[Region], primal: ir.Value) -> list[ir.Value]:
        op = b.op
        joined = []
        for layer in _disjoint_layers(parts):
            first, last = layer[0], layer[-1]
            axis, rank = first.axis, first.rank
            static = primal.shape[axis] if primal.shape is not None and len(primal.shape) == rank else None
            end = last.first + last.count
            tail = (b.ints([static - end]) if isinstance(static, int)
                    else op.Sub(op.Gather(first.shape, b.ints([axis]), axis=0), b.ints([end])))
            if len(layer) == 1:
                after = [0] * (rank - axis - 1)
                pads = op.Concat(b.ints([0] * axis + [first.first] + after + [0] * axis), tail,
                                 *([b.ints(after)] if after else []), axis=0)
                joined.append(op.Pad(first.value, pads))
                continue
            pieces, position = [], 0
            for region in layer:
                if region.first > position:
                    pieces.append(region.zeros(b, b.ints([region.first - position]), primal))
                pieces.append(region.value)
                position = region.first + region.count
            if not (isinstance(static, int) and static == end):
                pieces.append(first.zeros(b, tail, primal))
            joined.append(op.Concat(*pieces, axis=axis))
        return joined

    def zeros(self, b: GraphBuilder, length: ir.Value, primal: ir.Value) -> ir.Value:
        """Zeros of the input's shape and type (``primal``'s) but ``length`` (a [1] tensor)
        positions along the axis."""
        op, axis = b.op, self.axis
        shape = op.Concat(op.Slice(self.shape, b.ints([0]), b.ints([axis])), length,
                          op.Slice(self.shape, b.ints([axis + 1]), b.ints([_INT64_MAX])), axis=0)
        dtype = (self.value.dtype or primal.dtype).numpy()
        return op.ConstantOfShape(shape, value=ir.tensor(np.zeros([1], dtype=dtype)))


def _disjoint_layers(regions: list[Region]) -> list[list[Region]]:
    """``regions`` split into as few lists as can be, each of regions along one axis that do not
    overlap, in order of position (interval partitioning: each region joins the first list whose
    last region ends at or before its start)."""
    layers: list[list[Region]] = []
    for region in sorted(regions, key=lambda r: (r.axis, r.first)):
        layer = next((layer for layer in layers if layer[-1].axis == region.axis
                      and layer[-1].first + layer[-1].count <= region.first), None)
        if layer is None:
            layers.append([region])
        else:
            layer.append(region)
    return layers
