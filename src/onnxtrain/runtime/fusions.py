"""Rewrites for the onnxruntime that will run a graph, applied just before its session is created.

Artifacts and exported graphs keep standard ONNX ops so that any onnxruntime runs them. A
session this process creates runs on one known onnxruntime with known providers, so the
graph it gets may use that build's contrib kernels where they are faster (as onnxruntime's
own graph optimizers do, for fusions they do not know).

Two rewrites, for sessions on the CPU provider alone:

- ``X + Y * r`` into ``com.microsoft.GatedAdd`` (passes/gated_add.py), for the on-device API's
  optimizer model and fused training step, whose optimizer updates are most of the fusions
  (GPT of the bench: 159 of 168, 3 per parameter; fused step 141 -> 137 ms, MLP 1.98 -> 1.80
  ms). ORTModule's forward and backward sessions do not take it (``gated_add=False``): their
  graphs have a few fusions (one per LayerNormalization gradient), the GPT step did not
  measurably change, and the recompute run of tests/ortmodule/test_memory.py peaked 2 MB higher
  (why was not pinned down; a GatedAdd output may not reuse an input's buffer as Add's can).
- a Conv weight gradient's patches gathered by one grouped Conv (passes/conv_patches.py), for
  every training session: ORTModule's backward, the on-device training model and fused step.
"""

from __future__ import annotations

import functools
import os

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass
from onnxruntime.capi import _pybind_state

from onnxtrain.errors import ModelError
from onnxtrain.ir import io
from onnxtrain.passes.conv_patches import PATCHES_METADATA, PatchConvPass
from onnxtrain.passes.gated_add import FUSED_DTYPES, MS_DOMAIN, GatedAddFusionPass
from onnxtrain.runtime.session import is_ort_format

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


def for_session(model: ir.Model, providers, infer_shapes: bool = True, gated_add: bool = True) -> bool:
    """Rewrite ``model`` in place for a session on ``providers``; True if anything changed.

    Where :func:`applies_to`: Conv weight gradients' patches come from a grouped Conv
    (passes/conv_patches.py); with ``gated_add``, shapes are inferred (the fusion needs them;
    ``infer_shapes=False`` for a model that :func:`onnxtrain.ir.io.load_model` just loaded,
    which infers them) and ``X + Y * r`` becomes ``GatedAdd`` (passes/gated_add.py).
    """
    return applies_to(providers) and _rewrite(model, infer_shapes, gated_add)


def _rewrite(model: ir.Model, infer_shapes: bool, gated_add: bool = True) -> bool:
    modified = PatchConvPass()(model).modified
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
