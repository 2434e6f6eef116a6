"""Write a sum over leading axes as a product with a row of ones.

Un-broadcasting a gradient sums it over the leading axes: a linear layer's bias gradient is
``ReduceSum(dY, axes=[0, 1])`` over ``[batch, seq, features]``, a LayerNorm's scale and bias
gradients the same over ``[batch, seq, hidden]``. onnxruntime's CPU ReduceSum walks such a
reduction slowly (every output element strided over all rows); a ``[1, rows] @ [rows, cols]``
product with a row of ones reads the same memory once, in MLAS's GEMM: on 2 cores
``[16, 64, 1024] -> [1024]`` takes 0.14 against 0.33 ms, ``[16, 64, 256] -> [256]`` 0.035
against 0.084 ms, and the bench's 4-layer GPT has 36 such sums per step. This pass rewrites

    ReduceSum(x, axes=[0, .., k-1])  ->  Reshape(MatMul(ones[1, rows], Reshape(x, [-1, cols])), out_shape)

for float and double ``x`` whose trailing dims (after the ``k`` summed ones) are static; the
leading dims may be symbolic, then the row of ones is built at run time (opset 15+) from the
shapes of the graph inputs that carry those dims, so that every sum over the same rows builds
the same nodes and the cleanup merges them (a dynamic-batch GPT training graph: 760 -> 664
nodes), or from ``Shape(x)`` where no input carries one. The result is standard ONNX, so
artifacts keep running on any onnxruntime. The sum's order differs (GEMM accumulates in
blocks), so results match ReduceSum's to float rounding, not bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values

from onnxtrain.ir.nodes import NewNodes, constant_axes, is_onnx_op, node_reads, upstream_nodes
from onnxtrain.passes.rewrite import NodeRewritePass

_DTYPES = (ir.DataType.FLOAT, ir.DataType.DOUBLE)
# below this many summed rows (all static) ReduceSum is as fast and the product's nodes cost more
MIN_ROWS = 16
# ReduceSum's axes became an input at opset 13; Shape(x, end=k) for symbolic rows needs opset 15
_AXES_INPUT_OPSET = 13
_SHAPE_SLICE_OPSET = 15


class LeadingAxesSumPass(NodeRewritePass):
    """Rewrite ``ReduceSum`` over a tensor's leading axes as a ``MatMul`` with a row of ones."""

    def match(self, node: ir.Node, opset: int):
        return _plan(node, opset)

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan) -> None:
        _rewrite(graph, node, *plan)


def _plan(node: ir.Node, opset: int) -> tuple[int, int | None, int, list[int]] | None:
    """``(k, rows or None if symbolic, cols, output shape)`` when ``node`` sums its input's
    ``k`` leading axes in a form the product can take, else None."""
    if not is_onnx_op(node, "ReduceSum") or not node.inputs or node.inputs[0] is None:
        return None
    x = node.inputs[0]
    if x.dtype not in _DTYPES or x.shape is None:
        return None
    rank = len(x.shape)
    axes = constant_axes(node, opset, _AXES_INPUT_OPSET)
    if axes is None or rank < 2:
        return None
    k = len(axes)
    if sorted(a + rank if a < 0 else a for a in axes) != list(range(k)) or k >= rank:
        return None
    lead, trail = list(x.shape)[:k], list(x.shape)[k:]
    if not all(isinstance(d, int) for d in trail) or math.prod(trail) == 0:
        return None  # Reshape(x, [-1, 0]) could not infer the rows
    rows = math.prod(lead) if all(isinstance(d, int) for d in lead) else None
    if rows is None and opset < _SHAPE_SLICE_OPSET:
        return None
    if rows is not None and rows < MIN_ROWS:
        return None
    keepdims = node.attributes.get("keepdims")
    keep = keepdims is None or bool(keepdims.value)
    return k, rows, math.prod(trail), ([1] * k if keep else []) + trail


def _rewrite(graph: ir.Graph, node: ir.Node, k: int, rows: int | None, cols: int, out_shape: list[int]) -> None:
    x, out = node.inputs[0], node.outputs[0]
    new_nodes = NewNodes(node, "ones_product")
    add = new_nodes.add

    def ints(values: list[int]) -> ir.Value:
        return add("Constant", [], attributes={"value": ir.tensor(values, dtype=ir.DataType.INT64)})

    np_dtype = x.dtype.numpy()
    if rows is not None:
        ones = add("Constant", [], attributes={"value": ir.tensor(np.ones([1, rows], dtype=np_dtype))})
    else:
        dims = _dims_from_graph_inputs(_inputs_upstream(x), list(x.shape)[:k], add, ints)
        if dims is None:  # a leading dim no graph input carries: read it off x
            dims = add("Shape", [x], attributes={"end": k})
        row_count = add("ReduceProd", [dims], attributes={"keepdims": 1})
        ones_shape = add("Concat", [ints([1]), row_count], attributes={"axis": 0})
        ones = add("ConstantOfShape", [ones_shape], attributes={"value": ir.tensor(np.ones([1], dtype=np_dtype))})
    matrix = add("Reshape", [x, ints([-1, cols])])
    product = add("MatMul", [ones, matrix])
    product.type, product.shape = out.type, ir.Shape([1, cols])
    summed = add("Reshape", [product, ints(out_shape)])
    summed.type, summed.shape = out.type, ir.Shape(out_shape)
    replace_nodes_and_values(graph, node, [node], new_nodes.nodes, [out], [summed])


def _inputs_upstream(value: ir.Value) -> list[ir.Value]:
    """The graph inputs ``value`` is computed from (or is), in the graph's input order."""
    reads = {value, *(read for node in upstream_nodes(value) for read in node_reads(node))}
    graph = value.graph
    return [v for v in graph.inputs if v in reads] if graph is not None else []


def _dims_from_graph_inputs(inputs: list[ir.Value], lead: list, add, ints) -> ir.Value | None:
    """``lead``'s sizes as a 1-D int64 tensor read off the graph ``inputs`` (those the summed
    value is computed from: static dims as constants, each named symbolic dim from the first
    input that carries it), or None if one is on none of them. Sums over the same leading dims
    then build the same nodes from the same values, which common-subexpression elimination
    merges into one row of ones per graph (a GPT training graph has ~30 such sums over
    ``[batch, seq]``); and those nodes read graph inputs only, so they can run before any sum
    needs them. Only inputs the sum reads: a forward sum whose dim only an output gradient's
    input carries (a flattened ``[batch * seq]``) would otherwise read that gradient, and the
    forward could not be cut from the backward."""
    carriers: dict[str, tuple[ir.Value, int]] = {}
    for value in inputs:
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                carriers.setdefault(dim.value, (value, axis))
    pieces = []
    for dim in lead:
        if isinstance(dim, int):
            pieces.append(ints([dim]))
        elif isinstance(dim, ir.SymbolicDim) and dim.value in carriers:
            value, axis = carriers[dim.value]
            pieces.append(add("Shape", [value], attributes={"start": axis, "end": axis + 1}))
        else:
            return None
    return pieces[0] if len(pieces) == 1 else add("Concat", pieces, attributes={"axis": 0})
