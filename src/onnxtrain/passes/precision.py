"""Mixed precision: fp16/bf16 compute with fp32 master weights and fp32 islands.

Two steps, one pass (:class:`PrecisionPass`):

* **convert** (for an fp32 graph, e.g. the artifacts' model): the ops that gain from low
  precision (:data:`LOW_PRECISION_OPS`, PyTorch autocast's "lower precision" list in ONNX
  names) read their inputs cast to the low dtype, and their outputs are cast back to fp32
  for the rest of the graph. Parameters stay fp32 graph inputs (master weights); the
  ``Cast`` in front of their use carries the gradient back as fp32 (Cast's gradient rule
  casts it), so fp32 parameters receive fp32 gradients.
* **legalize** (for any graph holding low-precision values, e.g. one exported under
  ``torch.autocast`` or the gradient graph of a converted one): a node that reads or
  writes a low-precision value, and either is numerically sensitive (:data:`FP32_OPS`:
  softmax, normalizations, losses, reductions, exp/log) or is not run in that dtype by the
  target execution provider (:func:`supported_ops`), computes in fp32: its low-precision
  inputs are cast up and its low-precision outputs are cast back down. Value types are
  unchanged, so the graph means what it meant (every low-precision value is still
  rounded to the low dtype); only where the arithmetic happens changes.

Afterwards redundant casts go: ``Cast(Cast(x: low -> fp32) -> low)`` is ``x`` exactly.
With ``round_intermediates=False`` the other round trip ``Cast(Cast(x: fp32 -> low) -> fp32)``
is dropped too: chains of fp32 islands then stay in fp32 (faster on an EP without
low-precision kernels, not bit-faithful to a low-precision graph).

Example:
    >>> import onnx_ir as ir
    >>> from onnxtrain.passes.precision import PrecisionConfig, PrecisionPass
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    >>> w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3, 4]))
    >>> node = ir.node("MatMul", [x, w])
    >>> node.outputs[0].dtype = ir.DataType.FLOAT
    >>> model = ir.Model(ir.Graph([x, w], node.outputs, nodes=[node], opset_imports={"": 18}), ir_version=10)
    >>> _ = PrecisionPass(PrecisionConfig("bf16", convert=True))(model)
    >>> [n.op_type for n in model.graph]
    ['Cast', 'Cast', 'Cast', 'Cast', 'MatMul', 'Cast', 'Cast']
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import TopologicalSortPass

from onnxtrain.errors import OnnxTrainError
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.ir.nodes import has_subgraphs, is_onnx_op, subgraphs
from onnxtrain.passes.dce import RemoveUnusedNodesPass

FP32 = ir.DataType.FLOAT
LOW_DTYPES = {"bf16": ir.DataType.BFLOAT16, "fp16": ir.DataType.FLOAT16}

# Ops that run in low precision when converting an fp32 graph: PyTorch autocast's
# "lower_precision_fp" list (mm, matmul, linear/addmm, conv, conv_transpose, einsum) in ONNX names.
LOW_PRECISION_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})

# Numerically sensitive ops: always computed in fp32, whatever the EP supports. PyTorch
# autocast's fp32 list (softmax, log_softmax, norms, losses, exp/log/pow, sums) in ONNX names.
FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "BatchNormalization", "GroupNormalization",
    "InstanceNormalization", "RMSNormalization", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
    "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceProd", "CumSum", "Exp", "Log", "Pow", "Reciprocal", "Sum", "Mean",
})

# Type-agnostic ops (they move bytes and never compute on them): ORT implements them for every
# tensor type. Measured on ORT 1.32 CPU for bf16 and fp16: Identity, Reshape, Transpose,
# Squeeze, Unsqueeze, Flatten, Slice, Split, Concat, Gather, GatherElements, ScatterElements,
# Shape, ConstantOfShape, Cast, CastLike. (Expand, Tile, Pad, Where, Dropout are not.)
_DATA_MOVEMENT = frozenset({
    "Constant", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Split",
    "Concat", "Gather", "GatherElements", "ScatterElements", "Shape", "Size", "ConstantOfShape", "Cast",
    "CastLike", "IsNaN", "IsInf",
})

# Ops with low-precision compute kernels per execution provider and dtype.
# CPU, measured with onnxruntime 1.32 on x86-64 (tests/passes/test_precision.py re-measures
# it): bf16 has no arithmetic kernel at all (MatMul, Add, Gelu, ... fail to load); fp16 loads
# because ORT wraps every fp16 node without a kernel in Casts to fp32 itself (its
# InsertCastTransformer) -- the only real fp16 kernel among the ops we use is
# LayerNormalization, in FP32_OPS anyway. So on CPU every island is explicit and ours.
# CUDA (not measurable here: no GPU): ORT's CUDA EP registers fp16 and bf16 kernels for the
# GEMMs and elementwise math of transformer training.
_CUDA_LOW = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Add", "Sub", "Mul", "Div", "Relu", "Gelu", "FastGelu",
    "Tanh", "Sigmoid", "Erf", "Sqrt", "Neg", "Abs", "Where", "Expand", "Tile", "Pad", "Dropout", "Equal",
    "Less", "Greater", "Max", "Min", "Clip", "Trilu", "Einsum",
})
_SUPPORTED = {
    ("cpu", "bf16"): _DATA_MOVEMENT,  # Clip with bounds: its body's Less has no bf16 kernel
    ("cpu", "fp16"): _DATA_MOVEMENT | {"Clip"},
    ("cuda", "bf16"): _DATA_MOVEMENT | _CUDA_LOW,
    ("cuda", "fp16"): _DATA_MOVEMENT | _CUDA_LOW,
}

# Ops whose output element type is not their first float input's (for filling unknown types).
_INT64_OUT = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_BOOL_OUT = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor",
                       "IsNaN", "IsInf"})


class PrecisionError(OnnxTrainError):
    """A precision name or execution provider the precision pass does not know."""


def low_dtype(precision: str) -> ir.DataType:
    """The element type of ``"bf16"`` or ``"fp16"``."""
    try:
        return LOW_DTYPES[precision]
    except KeyError:
        raise PrecisionError(f"precision must be one of {sorted(LOW_DTYPES)}, got {precision!r}") from None


def supported_ops(device: str, precision: str) -> frozenset[str]:
    """Ops the execution provider for ``device`` (``"cpu"``, ``"cuda"``) runs in ``precision``."""
    low_dtype(precision)
    key = ("cuda" if device.startswith("cuda") else device, precision)
    if key not in _SUPPORTED:
        raise PrecisionError(f"no low-precision kernel table for device {device!r}; known: cpu, cuda")
    return _SUPPORTED[key]


@dataclass(frozen=True)
class PrecisionConfig:
    """What :class:`PrecisionPass` does.

    Args:
        precision: ``"bf16"`` or ``"fp16"``.
        device: the execution provider's device (``"cpu"``, ``"cuda"``): which ops stay low.
        convert: first move :data:`LOW_PRECISION_OPS` of an fp32 graph to low precision.
        round_intermediates: keep ``fp32 -> low -> fp32`` round trips between fp32 islands
            (faithful to the low-precision graph) instead of dropping them.
    """

    precision: str
    device: str = "cpu"
    convert: bool = False
    round_intermediates: bool = True


class PrecisionPass(ir.passes.InPlacePass):
    """Convert and/or legalize a graph for mixed precision (see the module docstring)."""

    def __init__(self, config: PrecisionConfig):
        super().__init__()
        self.config = config
        self.low = low_dtype(config.precision)
        self.supported = supported_ops(config.device, config.precision)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        main = GraphBuilder(graph, scope=_unused_scope(graph, f"precision_{self.config.precision}"))
        modified = False
        # If branches and loop bodies too (one name counter: names stay unique across them)
        nested = [inner for node in ir.traversal.RecursiveGraphIterator(graph) for inner in subgraphs(node)]
        for g in [graph, *nested]:
            infer_dtypes(g)
            b = main if g is graph else main.for_subgraph(g, main.scope)
            if self.config.convert:
                modified |= self._convert(b)
            modified |= self._legalize(b)
            modified |= simplify_casts(g, self.config.round_intermediates)
        if modified:
            RemoveUnusedNodesPass()(model)
            TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified)

    def _convert(self, b: GraphBuilder) -> bool:
        nodes = [n for n in b.graph if is_onnx_op(n, *LOW_PRECISION_OPS)
                 and any(_is(v, FP32) for v in n.inputs) and all(_is(o, FP32) for o in n.outputs)]
        for node in nodes:
            _retype(b, node, FP32, self.low)
        return bool(nodes)

    def _legalize(self, b: GraphBuilder) -> bool:
        changed = False
        for node in list(b.graph):
            if not is_onnx_op(node) or node.op_type in ("Cast", "Constant") or has_subgraphs(node):
                continue
            touches_low = any(_is(v, self.low) for v in (*node.inputs, *node.outputs))
            if touches_low and (node.op_type in FP32_OPS or node.op_type not in self.supported
                                or _accumulates(node)):
                _retype(b, node, self.low, FP32)
                changed = True
        return changed


def _unused_scope(graph: ir.Graph, base: str) -> str:
    """``base``, or ``base_<k>`` if an earlier run named nodes under it: ORTModule runs the pass
    on the exported graph and again on the forward and backward graphs cut from it, and a
    second ``precision_bf16/Cast_1`` in one graph is a model ONNX Runtime refuses."""
    used = {node.name.split("/", 1)[0] for node in graph if node.name and "/" in node.name}
    scope, k = base, 1
    while scope in used:
        k += 1
        scope = f"{base}_{k}"
    return scope


def _accumulates(node: ir.Node) -> bool:
    """A scatter that adds or multiplies into its data (gradients of gathers and pools): it
    computes, in fp32 (onnxruntime's CPU kernel has no fp16 reduction; sums of many fp16
    gradients would lose their small terms)."""
    return node.op_type == "ScatterElements" and node.attributes.get_string("reduction", "none") != "none"


def _is(value: ir.Value | None, dtype: ir.DataType) -> bool:
    return value is not None and value.dtype == dtype


def _retype(b: GraphBuilder, node: ir.Node, old: ir.DataType, new: ir.DataType) -> None:
    """Make ``node`` compute in ``new``: its ``old`` inputs are cast to ``new``; each ``old``
    output becomes ``new`` and a Cast back to ``old`` takes its place for every consumer."""
    for i, value in enumerate(node.inputs):
        if _is(value, old):
            node.replace_input_with(i, _cast(b, value, new))
    for out in node.outputs:
        if not _is(out, old):
            continue
        back = b.op.Cast(out, to=int(old))
        back.shape = out.shape
        out.replace_all_uses_with(back, replace_graph_outputs=True)
        back.producer().replace_input_with(0, out)  # replace_all_uses_with rewired the Cast too
        name = out.name
        out.name, back.name = f"{name}.{new.name.lower()}", name
        out.type = ir.TensorType(new)  # a new type object: ``out.dtype = new`` would edit a shared one


def _cast(b: GraphBuilder, value: ir.Value, dtype: ir.DataType) -> ir.Value:
    out = b.op.Cast(value, to=int(dtype))
    out.shape = value.shape
    return out


def simplify_casts(graph: ir.Graph, round_intermediates: bool = True) -> bool:
    """Bypass ``Cast(Cast(x))`` where it returns ``x`` (or only drops a rounding, when
    ``round_intermediates`` is False) and casts to the type a value already has."""
    changed = False
    for node in list(graph):
        if not is_onnx_op(node, "Cast"):
            continue
        out, src = node.outputs[0], node.inputs[0]
        target = ir.DataType(node.attributes["to"].value)
        if src is None or out.is_graph_output():
            continue
        replacement = None
        if src.dtype == target:
            replacement = src
        else:
            inner = src.producer()
            if is_onnx_op(inner, "Cast"):
                origin = inner.inputs[0]
                if origin is not None and origin.dtype == target and _round_trip_exact(target, src.dtype,
                                                                                       round_intermediates):
                    replacement = origin
        if replacement is not None:
            out.replace_all_uses_with(replacement)
            changed = True
    return changed


def _round_trip_exact(outer: ir.DataType, middle: ir.DataType, round_intermediates: bool) -> bool:
    """Whether ``outer -> middle -> outer`` may be dropped: exact when ``middle`` is wider."""
    if outer in LOW_DTYPES.values() and middle in (FP32, ir.DataType.DOUBLE):
        return True
    return not round_intermediates and outer == FP32 and middle in LOW_DTYPES.values()


def infer_dtypes(graph: ir.Graph) -> None:
    """Fill missing element types of node outputs from their inputs (the exporter leaves some
    unset): Cast's ``to``, int64 for shape ops, bool for comparisons, else the first float
    input's type (elementwise and data-movement ops keep their input's type)."""
    for node in graph:
        if all(o.dtype is not None for o in node.outputs) or has_subgraphs(node):
            continue
        op = node.op_type
        if op == "Cast":
            dtype = ir.DataType(node.attributes["to"].value)
        elif op in _INT64_OUT:
            dtype = ir.DataType.INT64
        elif op in _BOOL_OUT:
            dtype = ir.DataType.BOOL
        elif op == "Where":
            dtype = node.inputs[1].dtype
        elif op == "CastLike":
            dtype = node.inputs[1].dtype
        else:
            known = [v.dtype for v in node.inputs if v is not None and v.dtype is not None]
            floats = [d for d in known if d.is_floating_point()]
            dtype = floats[0] if floats else (known[0] if known else None)
        dtype = _typed_by_attribute_or_input(node, dtype)
        if dtype is None:
            continue
        for i, out in enumerate(node.outputs):
            if out.dtype is None and not (op == "Dropout" and i == 1):
                # a second output of indices (TopK's, MaxPool's) is int64
                out.dtype = ir.DataType.INT64 if i == 1 and op in ("TopK", "MaxPool") else dtype


def _typed_by_attribute_or_input(node: ir.Node, inferred: ir.DataType | None) -> ir.DataType | None:
    """The output element type of ops whose type is not their first input's: an attribute's
    (ConstantOfShape's ``value``, float32 without one; the ``dtype`` of EyeLike and the random
    ops), or another input's (OneHot's values, DequantizeLinear's scale)."""
    op, attributes = node.op_type, node.attributes
    if op == "ConstantOfShape":
        value = attributes.get("value")
        return value.value.dtype if value is not None else ir.DataType.FLOAT
    if op in ("EyeLike", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"):
        dtype = attributes.get("dtype")
        if dtype is not None:
            return ir.DataType(dtype.value)
        return ir.DataType.INT32 if op == "Multinomial" else inferred
    if op == "OneHot" and len(node.inputs) > 2 and node.inputs[2] is not None:
        return node.inputs[2].dtype
    if op == "DequantizeLinear" and len(node.inputs) > 1 and node.inputs[1] is not None:
        return node.inputs[1].dtype
    return inferred
