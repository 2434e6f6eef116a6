"""Rewrites for the onnxruntime that will run a graph, applied just before its session is created.

Artifacts and exported graphs keep standard ONNX ops so that any onnxruntime runs them. A
session this process creates runs on one known onnxruntime with known providers, so the
graph it gets may use that build's contrib kernels where they are faster (as onnxruntime's
own graph optimizers do, for fusions they do not know).

Three rewrites, for sessions on the CPU provider alone:

- ``X + Y * r`` into ``com.microsoft.GatedAdd`` (passes/gated_add.py), for the on-device API's
  optimizer model and fused training step, whose optimizer updates are most of the fusions
  (GPT of the bench: 159 of 168, 3 per parameter; fused step 141 -> 137 ms, MLP 1.98 -> 1.80
  ms). ORTModule's forward and backward sessions do not take it (``gated_add=False``): their
  graphs have a few fusions (one per LayerNormalization gradient), the GPT step did not
  measurably change, and the recompute run of tests/ortmodule/test_memory.py peaked 2 MB higher
  (why was not pinned down; a GatedAdd output may not reuse an input's buffer as Add's can).
- a Conv weight gradient's patches gathered by one grouped Conv (passes/conv_patches.py), for
  every training session: ORTModule's backward, the on-device training model and fused step.
- 2-D Convs with run-time weights (and stride-1 ConvTransposes: the input gradients) in
  onnxruntime's blocked channel layout (passes/nchwc_conv.py), for every session: onnxruntime
  moves only Convs with constant weights there itself.

And, for the on-device API's sessions (``runtime_fills``), large constant fills (the zeros an
embedding's gradient scatters into) made at run time rather than folded by onnxruntime into
initializers it keeps for the session's life (passes/runtime_fill.py): the bench's BERT-mini
trained on-device, 31 MB of zeros in each of the training and fused-step sessions, peak RSS
998 -> 938 MB, the step as fast. ORTModule's backward does not take it: there the gradient is
a graph output, which onnxruntime never computes in place, so the run-time fill needs its bytes
in the arena at the backward's peak, where the initializer needed them outside it (peak
unchanged, measured).
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass
from onnxruntime.capi import _pybind_state

from onnxtrain.errors import ModelError
from onnxtrain.ir import io
from onnxtrain.names import MS_DOMAIN
from onnxtrain.passes.conv_patches import PATCHES_METADATA, PatchConvPass
from onnxtrain.passes.gated_add import FUSED_DTYPES, GatedAddFusionPass
from onnxtrain.passes.nchwc_conv import NCHWC_DOMAIN, NchwcConvPass, blocked_weight_layout, moves_to_nchwc
from onnxtrain.passes.runtime_fill import RuntimeFillPass
from onnxtrain.runtime.session import create_session, is_ort_format, quiet_session_options

_CPU = "CPUExecutionProvider"
_ORT_TYPE_NAMES = {ir.DataType.FLOAT: "tensor(float)", ir.DataType.FLOAT16: "tensor(float16)"}


def _provider_name(provider) -> str:
    return provider[0] if isinstance(provider, (tuple, list)) else str(provider)


@functools.cache
def cpu_kernel_types(op_type: str, domain: str) -> frozenset[str]:
    """The type strings (``"tensor(float)"``, ...) of this onnxruntime's CPU kernels for an op
    (read once per process: the kernel registry does not change, and listing it takes ms)."""
    types: set[str] = set()
    for kernel in _pybind_state.get_all_opkernel_def():
        if kernel.provider == _CPU and kernel.op_name == op_type and kernel.domain == domain:
            for allowed in kernel.type_constraints.values():
                types.update(allowed)
    return frozenset(types)


def applies_to(providers) -> bool:
    """Whether :func:`for_session` rewrites anything for a session on ``providers``: on the CPU
    provider alone. Other providers get graphs unchanged: a CPU-only contrib node inside a GPU
    graph would cost two copies, and onnxruntime-web's WebGPU provider computes the patches'
    grouped Conv wrongly."""
    return bool(providers) and all(_provider_name(p) == _CPU for p in providers)


def _has_gated_add() -> bool:
    """Whether this onnxruntime has the ``com.microsoft.GatedAdd`` CPU kernel for every dtype
    the fusion may produce."""
    available = cpu_kernel_types("GatedAdd", MS_DOMAIN)
    return all(_ORT_TYPE_NAMES[dtype] in available for dtype in FUSED_DTYPES)


def has_patches(model: ir.Model) -> bool:
    """Whether ``model`` holds a Conv weight gradient's patch gather that :func:`for_session` rewrites."""
    return any(PATCHES_METADATA in node.metadata_props for node in model.graph)


# channel blocks onnxruntime's CPU layout may use (MLAS: 8 with AVX2, 16 with AVX-512)
_CANDIDATE_BLOCKS = (4, 8, 16, 32)
# the probe's Convs: input channels a multiple of every candidate block, and fewer than any
_PROBE_CONVS = {"wide": (32, 32), "narrow": (32, 3)}


@functools.cache
def nchwc_block_size() -> int | None:
    """The channel block of this onnxruntime's blocked (NCHWc) Conv kernels on this CPU, or None
    where it has none (no ``com.microsoft.nchwc`` kernels, a CPU without them, another layout).

    Read off onnxruntime itself, once per process (~10 ms): probe Convs with constant weights go
    through its graph optimizer, and the block is the one whose filter layouts (both kinds,
    :func:`onnxtrain.passes.nchwc_conv.blocked_weight_layout`) equal the reordered weights it
    wrote. Layouts that match no candidate are not used.
    """
    if "tensor(float)" not in cpu_kernel_types("Conv", NCHWC_DOMAIN):
        return None
    weights, inputs, nodes = {}, [], []
    for label, (out_channels, in_channels) in _PROBE_CONVS.items():
        weight = np.arange(out_channels * in_channels * 9, dtype=np.float32).reshape(out_channels, in_channels, 3, 3)
        x = ir.Value(name=f"{label}_x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, in_channels, 8, 8]))
        w = ir.Value(name=f"{label}_w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(list(weight.shape)),
                     const_value=ir.tensor(weight))
        conv = ir.node("Conv", [x, w], attributes={"pads": [1, 1, 1, 1]})
        conv.outputs[0].name, conv.outputs[0].type = f"{label}_y", ir.TensorType(ir.DataType.FLOAT)
        weights[label] = (weight, w)
        nodes.append(conv)
        inputs.append(x)
    graph = ir.Graph(inputs, [n.outputs[0] for n in nodes], nodes=nodes, initializers=[w for _, w in weights.values()],
                     opset_imports={"": 17})
    with tempfile.TemporaryDirectory() as folder:
        options = quiet_session_options()  # also quiets its warning that the saved model is this CPU's
        options.optimized_model_filepath = os.path.join(folder, "probe.onnx")
        try:
            create_session(io.serialize(ir.Model(graph, ir_version=8)), [_CPU], options, "layout probe")
            optimized = ir.load(options.optimized_model_filepath)
        except Exception:  # noqa: BLE001 - no probe, no rewrite
            return None
    written = {}
    for node in optimized.graph:
        if node.domain == NCHWC_DOMAIN and node.op_type == "Conv" and len(node.inputs) > 1:
            tensor = node.inputs[1].const_value
            if tensor is not None:
                written[tensor.shape[1]] = tensor.numpy()
    for block in _CANDIDATE_BLOCKS:
        if all(np.array_equal(blocked_weight_layout(weight, block).reshape(-1),
                              written.get(weight.shape[1], np.empty(0)).reshape(-1))
               for weight, _ in weights.values()):
            return block
    return None


def rewrites(model: ir.Model, providers) -> bool:
    """Whether :func:`for_session` would change ``model`` for a session on ``providers``
    (optimizer updates aside): patch gathers, or Convs to move to the blocked layout."""
    if not applies_to(providers):
        return False
    if has_patches(model):
        return True
    block = nchwc_block_size()
    return block is not None and any(moves_to_nchwc(node, block) for node in model.graph)


def for_session(model: ir.Model, providers, infer_shapes: bool = True, gated_add: bool = True,
                runtime_fills: bool = True) -> bool:
    """Rewrite ``model`` in place for a session on ``providers``; True if anything changed.

    Where :func:`applies_to`: Conv weight gradients' patches come from a grouped Conv
    (passes/conv_patches.py), Convs with run-time weights run in onnxruntime's blocked layout
    (passes/nchwc_conv.py); with ``gated_add``, shapes are inferred (the fusion needs them;
    ``infer_shapes=False`` for a model that :func:`onnxtrain.ir.io.load_model` just loaded,
    which infers them) and ``X + Y * r`` becomes ``GatedAdd`` (passes/gated_add.py); with
    ``runtime_fills``, large constant fills are made at run time (passes/runtime_fill.py).
    """
    return applies_to(providers) and _rewrite(model, infer_shapes, gated_add, runtime_fills)


def _rewrite(model: ir.Model, infer_shapes: bool, gated_add: bool = True, runtime_fills: bool = True) -> bool:
    modified = PatchConvPass()(model).modified
    if runtime_fills:
        modified = RuntimeFillPass()(model).modified or modified
    block = nchwc_block_size()
    if block is not None:
        modified = NchwcConvPass(block)(model).modified or modified
    if gated_add and _has_gated_add():
        if infer_shapes:
            ShapeInferencePass(strict_mode=False)(model)
        modified = GatedAddFusionPass()(model).modified or modified
    return modified


def session_model(path: str | os.PathLike, providers, gated_add: bool = True) -> str | bytes:
    """What to create a session for the ONNX file at ``path`` from: its rewritten bytes when
    :func:`for_session` changes it, else the path (ORT format files and files that do not
    load are left to the session to read, or to report)."""
    path = os.fspath(path)
    if not applies_to(providers) or not os.path.isfile(path) or is_ort_format(path):
        return path  # nothing to rewrite: do not read the file
    try:
        model = io.load_model(path)
    except ModelError:
        return path
    return io.serialize(model) if _rewrite(model, infer_shapes=False, gated_add=gated_add) else path
