"""Zero fully masked attention rows with a per-row factor instead of a NaN guard over every entry.

``torch.onnx.export`` translates ``scaled_dot_product_attention`` with a boolean mask (what
Hugging Face's BERT-family models call) as

    mask = Where(keep, 0, lowest)                # [..., T, S]; lowest: the dtype's most negative finite value
    probs = Softmax(scores + mask, axis=-1)      # [B, H, T, S]
    probs = Where(IsNaN(probs), 0, probs)        # meant for rows whose every key is masked

Two things are wrong with that on a training step. The guard reads and writes the whole
attention tensor twice per layer (IsNaN, then a scalar-broadcast ``Where``, one of onnxruntime's
slow CPU kernels), and the backward pays it again: ~25 ms of BERT-mini's ~270 ms step, forward
and backward. And it never fires: with ``lowest`` instead of ``-inf`` a fully masked row is
``Softmax`` of equal values, a uniform row, where PyTorch's attention (since 2.5) gives a row
of zeros. This pass writes what PyTorch computes, from the small mask:

    kept_row = any entry of the mask's row is kept          # [..., T, 1], once per mask
    probs = Softmax(scores + Where(kept_row, mask, 0)) * Cast(kept_row)

A row with a kept entry gets the same Softmax of the same sum, times 1: bit-identical to the
exporter's graph. A fully masked row gets zeros (PyTorch's value, and the guard's intent).
Where the attention product ``probs @ v`` alone reads the probabilities (float32), the factor
zeroes the product's rows instead: the same values, on a tensor ``S / D`` times smaller, and
the backward keeps no scaled copy of the probabilities. The
mask's masking branch may be ``-inf`` or the dtype's lowest value; if neither branch masks (both
finite and above ``lowest``) no row can be NaN and the guard is dropped. Only for scores that are
themselves NaN or infinite does the result differ from the guard's (it zeroed such rows; here
the NaN carries on, as in PyTorch).

A mask the model builds from constants alone reaches this pass already folded: the ``Where`` is a
constant float tensor. Its kept rows and the factor are then computed here, as constants.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor, replace_all_uses_with

from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.ir.nodes import base_name, is_onnx_op

# Softmax normalizes along one axis from opset 13 on (it flattened the trailing axes before)
_SINGLE_AXIS_SOFTMAX_OPSET = 13
# the most negative finite value per float dtype: the exporter's stand-in for -inf in masks
_LOWEST = {
    ir.DataType.FLOAT: float(np.finfo(np.float32).min),
    ir.DataType.DOUBLE: float(np.finfo(np.float64).min),
    ir.DataType.FLOAT16: float(np.finfo(np.float16).min),
    ir.DataType.BFLOAT16: -(2 - 2**-7) * 2.0**127,
}


def _scalar(value: ir.Value | None) -> tuple[float, ir.DataType] | None:
    """``(value, dtype)`` of a constant rank-0 float tensor, else None."""
    tensor = get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.shape.dims != () or not tensor.dtype.is_floating_point():
        return None
    return float(tensor.numpy()), tensor.dtype


def _masks(scalar: tuple[float, ir.DataType]) -> bool:
    """Whether a mask entry of this value removes its key: ``-inf`` or the dtype's lowest value."""
    value, dtype = scalar
    return value == -math.inf or value == _LOWEST.get(dtype)


class SoftmaxNaNGuardPass(ir.passes.InPlacePass):
    """Rewrite ``Where(IsNaN(p), 0, p)`` with ``p = Softmax(s + Where(c, a, b))`` (``a``, ``b``
    constant scalars) into a Softmax whose fully masked rows are zeroed by a per-row factor."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", 1)
        # per mask (condition and branches: each attention layer may build its own copy): (safe mask, keep)
        row_factors: dict[tuple, tuple[ir.Value, ir.Value]] = {}
        modified = False
        for node in list(model.graph):
            match = _match(node, opset)
            if match is None:
                continue
            softmax, add, scores, mask, can_be_masked = match
            guard_out = node.outputs[0]
            is_nan = node.inputs[0].producer()
            if not can_be_masked:  # no masking branch, or no fully masked row: no row is ever NaN
                replace_all_uses_with(guard_out, softmax.outputs[0])
                _remove_unused(model.graph, [node, is_nan])
                modified = True
                continue
            mask_node = mask.producer()
            if not is_onnx_op(mask_node, "Where"):  # a constant mask (a constant boolean mask's Where, folded)
                key = (id(mask),)
                if key not in row_factors:
                    row_factors[key] = _constant_row_factors(model.graph, mask, opset, before=node)
            else:
                key = (id(mask_node.inputs[0]), _scalar(mask_node.inputs[1]), _scalar(mask_node.inputs[2]))
                if key not in row_factors:
                    row_factors[key] = _row_factors(model.graph, mask_node, opset, before=node)
            safe_mask, keep = row_factors[key]
            new_add = ir.node("Add", [scores, safe_mask], name=f"{base_name(add)}/rows")
            new_softmax = ir.node("Softmax", [new_add.outputs[0]], attributes=dict(softmax.attributes),
                                  name=f"{base_name(softmax)}/rows")
            for value, like in ((new_add.outputs[0], add.outputs[0]), (new_softmax.outputs[0], softmax.outputs[0])):
                value.type, value.shape = like.type, like.shape
            model.graph.insert_after(node, [new_add, new_softmax])
            probs = new_softmax.outputs[0]
            product = _attention_product(guard_out)
            # float32 only: under autocast the mixed-precision pass (run later) types the product's
            # readers for a bf16/fp16 product, which a Mul after it would not match; there the
            # probabilities themselves are scaled
            if product is not None and product.outputs[0].dtype == keep.dtype == ir.DataType.FLOAT:
                # zero the rows of ``probs @ v`` instead: the same values, on a tensor S / D times smaller,
                # and the backward reads no extra full-size tensor
                product.replace_input_with(0, probs)
                _scale_rows(model.graph, product.outputs[0], keep, f"{base_name(node)}/rows")
            else:
                _scale_rows(model.graph, probs, keep, f"{base_name(node)}/rows", replacing=guard_out)
            _remove_unused(model.graph, [node, is_nan, softmax, add] + ([mask_node] if mask_node is not None else []))
            modified = True
        return ir.passes.PassResult(model, modified)


def _attention_product(probs: ir.Value) -> ir.Node | None:
    """The ``MatMul(probs, v)`` that alone reads ``probs``, when its result is no graph output."""
    uses = list(probs.uses())
    if len(uses) != 1 or probs.is_graph_output():
        return None
    node, index = uses[0].node, uses[0].idx
    if not is_onnx_op(node, "MatMul") or index != 0 or node.outputs[0].is_graph_output():
        return None
    return node


def _scale_rows(graph: ir.Graph, value: ir.Value, keep: ir.Value, name: str, replacing: ir.Value | None = None):
    """``value * keep`` for every reader of ``replacing`` (default: of ``value`` itself)."""
    replacing = value if replacing is None else replacing
    product = ir.node("Mul", [value, keep], name=name)
    product.outputs[0].type, product.outputs[0].shape = replacing.type, replacing.shape
    graph.insert_after(value.producer(), product)
    for usage in list(replacing.uses()):
        if usage.node is not product:
            usage.node.replace_input_with(usage.idx, product.outputs[0])


def _remove_unused(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove ``nodes`` (readers before what they read) whose outputs nothing reads any more."""
    for node in nodes:
        if node.graph is graph and not any(v.uses() or v.is_graph_output() for v in node.outputs):
            graph.remove(node, safe=True)


def _match(node: ir.Node, opset: int):
    """``(softmax, add, scores, mask, whether a row can be fully masked)`` when ``node`` is the
    NaN guard of a masked Softmax in the form the rewrite preserves (the mask a ``Where`` or a
    constant)."""
    if not is_onnx_op(node, "Where") or len(node.inputs) != 3 or any(v is None for v in node.inputs):
        return None
    is_nan, zero, probs = node.inputs
    zero = _scalar(zero)
    if zero is None or zero[0] != 0.0 or not is_onnx_op(is_nan.producer(), "IsNaN") \
            or is_nan.producer().inputs[0] is not probs:
        return None
    if node.outputs[0].is_graph_output():
        return None  # the graph's own output (an attention map, not a training step's hot path): left as is
    softmax = probs.producer()
    if not is_onnx_op(softmax, "Softmax") or not _normalizes_last_axis(softmax, probs, opset):
        return None
    add = softmax.inputs[0].producer()
    if not is_onnx_op(add, "Add") or len(add.inputs) != 2 or any(v is None for v in add.inputs):
        return None
    for scores, mask in (add.inputs, reversed(add.inputs)):
        can_be_masked = _mask_branches(mask)
        if can_be_masked is None:
            can_be_masked = _constant_mask_rows(mask)
        if can_be_masked is not None:
            return softmax, add, scores, mask, can_be_masked
    return None


def _normalizes_last_axis(softmax: ir.Node, probs: ir.Value, opset: int) -> bool:
    """Whether ``softmax`` normalizes each row along the last axis (any opset: before 13 the
    axis is where the flattening into rows starts, so the last axis means the same)."""
    axis = softmax.attributes.get_int("axis", -1 if opset >= _SINGLE_AXIS_SOFTMAX_OPSET else 1)
    if axis == -1:
        return True
    return probs.shape is not None and len(probs.shape) > 0 and axis == len(probs.shape) - 1


def _mask_branches(mask: ir.Value) -> bool | None:
    """Whether one branch masks, when ``mask = Where(c, a, b)`` with ``a``, ``b`` constant rank-0
    floats (the mask then has ``c``'s shape), not both masking, neither NaN nor ``+inf``."""
    where = mask.producer()
    if not is_onnx_op(where, "Where") or len(where.inputs) != 3 or where.inputs[0] is None:
        return None
    branches = [_scalar(where.inputs[1]), _scalar(where.inputs[2])]
    if any(b is None or math.isnan(b[0]) or b[0] == math.inf for b in branches):
        return None
    masking = [_masks(b) for b in branches]
    if all(masking):
        return None  # every entry masked: left as it is
    condition = where.inputs[0]
    if any(masking) and (condition.shape is None or len(condition.shape) == 0):
        return None  # the mask's rows: its rank must be known
    return any(masking)


def _masked_entries(array: np.ndarray, dtype: ir.DataType) -> np.ndarray:
    """Which entries of a constant mask remove their key (``-inf`` or the dtype's lowest value)."""
    return np.isneginf(array) | (array == _LOWEST.get(dtype, -math.inf))


def _constant_mask_rows(mask: ir.Value) -> bool | None:
    """For a constant float mask of rank >= 1 (what folding leaves of a constant boolean mask's
    ``Where``) with no NaN or ``+inf`` entry: whether one of its rows is fully masked; else None."""
    tensor = get_const_tensor(mask)
    if tensor is None or not tensor.dtype.is_floating_point() or len(tensor.shape) == 0:
        return None
    array = tensor.numpy()
    if np.isnan(array).any() or np.isposinf(array).any():
        return None
    return bool(_masked_entries(array, tensor.dtype).all(axis=-1).any())


def _row_factors(graph: ir.Graph, where: ir.Node, opset: int, before: ir.Node) -> tuple[ir.Value, ir.Value]:
    """``(safe mask, keep)`` for the mask ``where`` computes: the mask with its fully masked rows
    zeroed, and a ``[..., 1]`` factor of the mask's dtype, 0 for those rows and 1 for the others,
    both built from the mask's boolean condition (nodes inserted before ``before``)."""
    condition, a, _ = where.inputs
    dtype = _scalar(a)[1]
    b = GraphBuilder(graph, scope=f"{base_name(where)}/rows", opset=opset)
    # the entries the mask keeps: where the condition picks the branch that does not mask
    kept = b.op.Not(condition) if _masks(_scalar(a)) else condition
    keep = b.reduce("ReduceMax", b.cast_to(kept, ir.DataType.FLOAT), [-1])
    safe = b.op.Where(b.cast_to(keep, ir.DataType.BOOL), where.outputs[0], b.const(0, dtype))
    safe.dtype = dtype
    keep = b.cast_to(keep, dtype)
    _move_before(graph, b, before)
    return safe, keep


def _move_before(graph: ir.Graph, b: GraphBuilder, before: ir.Node) -> None:
    """The nodes ``b`` appended to ``graph``, moved before ``before`` (the first guard)."""
    for node in b.created:
        graph.remove(node)
    graph.insert_before(before, b.created)


def _constant_row_factors(graph: ir.Graph, mask: ir.Value, opset: int, before: ir.Node) -> tuple[ir.Value, ir.Value]:
    """``(safe mask, keep)`` as :func:`_row_factors`, for a constant mask: both constants."""
    tensor = get_const_tensor(mask)
    array = tensor.numpy()
    kept = ~_masked_entries(array, tensor.dtype).all(axis=-1, keepdims=True)
    b = GraphBuilder(graph, scope=f"{mask.name}/rows", opset=opset)
    safe = b.const(np.where(kept, array, 0).astype(array.dtype))
    keep = b.const(kept.astype(array.dtype))
    for value in (safe, keep):
        value.dtype = tensor.dtype
    _move_before(graph, b, before)
    return safe, keep
