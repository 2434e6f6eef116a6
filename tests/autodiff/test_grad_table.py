"""Every row of the gradient table against finite differences, at both ends of its opset range."""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.autodiff import DEFAULT_REGISTRY
from onnxtrain.autodiff.check import check_gradients

from .grad_table import CASES, Case

_ONNX_TYPES = {"float32": onnx.TensorProto.FLOAT, "float64": onnx.TensorProto.DOUBLE,
               "int64": onnx.TensorProto.INT64, "int32": onnx.TensorProto.INT32, "bool": onnx.TensorProto.BOOL}


def _sample(spec, rng, dims):
    shape = tuple(dims[d] if isinstance(d, str) else d for d in spec.shape)
    x = rng.uniform(spec.low, spec.high, size=shape)
    for point in spec.away_from:
        close = np.abs(x - point) < 0.05
        x[close] = point + np.where(x[close] >= point, 0.05, -0.05) + np.sign(x[close] - point + 1e-9) * 0.1
    return np.asarray(x, dtype=spec.dtype)


def build_case_model(case: Case, opset: int, rng):
    # each symbolic dim gets a random run-time size (fixed per row and opset by the seed), except
    # in rows with constant inputs (indices, labels), which are written for a size of 3
    symbols = sorted({d for spec in case.inputs if spec is not None for d in spec.shape if isinstance(d, str)})
    has_constants = any(spec is not None and spec.value is not None for spec in case.inputs)
    sizes = {sym: case.dims.get(sym, 3 if has_constants else int(rng.integers(2, 6))) for sym in symbols}
    graph_inputs, initializers, feeds, wrt, names = [], [], {}, [], []
    for i, spec in enumerate(case.inputs):
        if spec is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if spec.value is not None:
            initializers.append(numpy_helper.from_array(np.asarray(spec.value), name))
            continue
        graph_inputs.append(helper.make_tensor_value_info(name, _ONNX_TYPES[spec.dtype], list(spec.shape)))
        feeds[name] = _sample(spec, rng, sizes)
        if spec.grad:
            wrt.append(name)
    for k, spec in enumerate(case.captured):  # graph inputs the node's subgraphs read by name
        name = f"cap{k}"
        graph_inputs.append(helper.make_tensor_value_info(name, _ONNX_TYPES[spec.dtype], list(spec.shape)))
        feeds[name] = _sample(spec, rng, sizes)
        wrt.append(name)
    outputs = [f"out{k}" for k in range(case.outputs)]
    node = helper.make_node(case.op, names, outputs, domain=case.domain, **case.attrs)
    graph = helper.make_graph([node], case.name, graph_inputs,
                              [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outputs],
                              initializer=initializers)
    opsets = [helper.make_opsetid("", opset)]
    if case.domain:
        opsets.append(helper.make_opsetid(case.domain, 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    inferred = {vi.name: vi for vi in model.graph.value_info}
    first_type = next((i.type.tensor_type.elem_type for i in model.graph.input), onnx.TensorProto.FLOAT)
    for out in model.graph.output:  # take output types from inference
        if out.name in inferred:
            out.CopyFrom(inferred[out.name])
        elif out.type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED:
            # some schemas (GroupNormalization) infer no type: outputs have input 0's
            out.type.tensor_type.elem_type = first_type
    return model, feeds, wrt


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("end", ["lowest", "highest"])
def test_rule_matches_finite_differences(case: Case, end: str):
    opset = case.opsets[0] if end == "lowest" else case.opsets[1]
    rng = np.random.default_rng(zlib.crc32(f"{case.name}@{opset}".encode()))  # stable across runs
    model, feeds, wrt = build_case_model(case, opset, rng)
    check_gradients(model, feeds, wrt, rtol=case.rtol, prefer_double=case.precision == "float64")


def test_every_rule_has_a_row():
    covered = {(c.domain, c.op) for c in CASES}
    exempt = {(r.domain, r.op_type) for r in DEFAULT_REGISTRY.registered() if getattr(r.fn, "nondifferentiable", False)}
    missing = sorted(
        f"{r.domain}::{r.op_type}" if r.domain else r.op_type
        for r in DEFAULT_REGISTRY.registered()
        if (r.domain, r.op_type) not in covered and (r.domain, r.op_type) not in exempt
    )
    assert not missing, f"gradient rules without a row in grad_table.py: {missing}"
