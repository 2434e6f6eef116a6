"""Numerical gradient checking through onnxruntime.

``check_gradients`` builds our gradient graph for a model, then compares, for
random directions ``u`` (per input) and a random output weighting ``v``, the
analytic directional derivative ``<dL/dx, u>`` of ``L = sum_k <v_k, y_k>``
against central finite differences ``(L(x + eps u) - L(x - eps u)) / 2 eps``.
It runs in float64 when onnxruntime has float64 kernels for every op of the
model and falls back to float32 (with a larger step and tolerance) otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnxtrain.autodiff.builder import build_gradients, is_float
from onnxtrain.autodiff.decompose import DecomposePass
from onnxtrain.autodiff.registry import DEFAULT_REGISTRY, Registry
from onnxtrain.errors import GradientCheckError, ModelError
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder

# Finite-difference steps and tolerances: float64 central differences are accurate to
# ~eps^2 * f''' ~ 1e-10 relative with eps=1e-6; float32 needs a larger step (cancellation).
_SETTINGS = {
    ir.DataType.DOUBLE: dict(eps=1e-6, rtol=1e-5, atol=1e-7),
    ir.DataType.FLOAT: dict(eps=1e-2, rtol=2e-2, atol=2e-3),
}


@dataclass
class GradientCheckResult:
    """Per checked input: analytic and numerical directional derivatives."""

    dtype: str
    analytic: dict[str, list[float]]
    numeric: dict[str, list[float]]

    def max_relative_error(self) -> float:
        worst = 0.0
        for name in self.analytic:
            for a, n in zip(self.analytic[name], self.numeric[name]):
                worst = max(worst, abs(a - n) / max(abs(n), 1e-12))
        return worst


def to_double(model: ir.Model) -> ir.Model:
    """Rewrite every float32 tensor, input, output, constant and Cast of ``model`` to float64."""
    f32, f64 = ir.DataType.FLOAT, ir.DataType.DOUBLE
    graph = model.graph

    def retype(value: ir.Value) -> None:
        if value.type is not None and value.dtype == f32:
            value.type = ir.TensorType(f64)

    for value in list(graph.inputs) + list(graph.outputs):
        retype(value)
    for init in graph.initializers.values():
        retype(init)
        if init.const_value is not None and init.const_value.dtype == f32:
            init.const_value = ir.tensor(init.const_value.numpy().astype(np.float64), name=init.name)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for out in node.outputs:
            retype(out)
        for name, attr in list(node.attributes.items()):
            if attr.type == ir.AttributeType.TENSOR and attr.value.dtype == f32:
                node.attributes[name] = ir.AttrTensor(name, ir.tensor(attr.value.numpy().astype(np.float64)))
            elif name in ("to", "dtype") and attr.type == ir.AttributeType.INT and attr.value == int(f32):
                node.attributes[name] = ir.AttrInt64(name, int(f64))
    return model


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(io.serialize(model), options, providers=["CPUExecutionProvider"])


def _gradient_model(model: ir.Model, wrt: Sequence[str], rng: np.random.Generator,
                    output_values: Mapping[str, np.ndarray], registry: Registry):
    """Add loss = sum_k <v_k, y_k> and its gradients w.r.t. ``wrt`` as graph outputs."""
    graph = model.graph
    # initializers that are checked become graph inputs so they can be perturbed
    values = {v.name: v for v in graph.inputs}
    for name in wrt:
        if name not in values:
            if name not in graph.initializers:
                raise ModelError(f"{name!r} is neither a graph input nor an initializer")
            init = graph.initializers.pop(name)
            init.const_value = None
            graph.inputs.append(init)
            values[name] = init
    b = GraphBuilder(graph, scope="check")
    terms = []
    for out in graph.outputs:
        if not is_float(out) or out.name not in output_values:
            continue
        weight = rng.standard_normal(output_values[out.name].shape).astype(out.dtype.numpy())
        terms.append(b.op.ReduceSum(b.op.Mul(out, b.const(weight)), keepdims=0))
    if not terms:
        raise ModelError("the model has no floating-point output to differentiate")
    loss = terms[0] if len(terms) == 1 else b.op.Sum(*terms)
    loss.name = "check_loss"
    grads = build_gradients(graph, loss, [values[n] for n in wrt], registry=registry)
    outputs = [loss]
    for name in wrt:
        g = grads[values[name]]
        if g.is_graph_output() or g in graph.inputs:
            g = b.op.Identity(g)
        g.name = f"check_grad::{name}"
        outputs.append(g)
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    return model


def check_gradients(
    model: io.ModelLike,
    inputs: Mapping[str, np.ndarray],
    wrt: Sequence[str] | None = None,
    *,
    directions: int = 2,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    prefer_double: bool = True,
    raise_on_error: bool = True,
    registry: Registry = DEFAULT_REGISTRY,
) -> GradientCheckResult:
    """Check onnxtrain's gradients of ``model`` against central finite differences.

    Args:
        model: an ONNX model (path, ``onnx.ModelProto`` or ``onnx_ir.Model``).
        inputs: a value for every graph input.
        wrt: names of float inputs or initializers to check; default: every float input
            and initializer.
        directions: random directions tried per checked value.
        rtol, atol: tolerances; defaults depend on the precision the check runs in.
        prefer_double: run in float64 where onnxruntime supports every op in it.
        raise_on_error: raise ``GradientCheckError`` on a mismatch (else only report it).
        registry: the gradient rules to use (default: onnxtrain's).

    Example:
        >>> import numpy as np, onnx
        >>> from onnx import helper, TensorProto
        >>> g = helper.make_graph([helper.make_node("Tanh", ["x"], ["y"])], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
        >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        >>> r = check_gradients(m, {"x": np.array([0.1, -0.5, 2.0], np.float32)})
        >>> r.max_relative_error() < 1e-5
        True
    """
    base = io.load_model(model)
    # as the artifact pipeline does: ops without a rule are replaced by their function body
    # (before the float64 rewrite, so the body's own casts are rewritten too)
    DecomposePass(registry)(base)
    if wrt is None:
        wrt = [v.name for v in base.graph.inputs if is_float(v)]
        wrt += [name for name, v in base.graph.initializers.items() if is_float(v) and name not in wrt]
    wrt = list(wrt)
    rng = np.random.default_rng(seed)

    candidates = [ir.DataType.DOUBLE, ir.DataType.FLOAT] if prefer_double else [ir.DataType.FLOAT]
    last_error: Exception | None = None
    for dtype in candidates:
        work = io.load_model(io.to_proto(base))
        if dtype == ir.DataType.DOUBLE:
            work = to_double(work)
        feeds = {}
        for v in work.graph.inputs:
            if v.name not in inputs:
                raise ModelError(f"no value given for graph input {v.name!r}")
            arr = np.asarray(inputs[v.name])
            feeds[v.name] = arr.astype(dtype.numpy()) if arr.dtype.kind == "f" else arr
        try:
            forward_outputs = dict(zip([o.name for o in work.graph.outputs],
                                       _session(work).run(None, feeds)))
        except Exception as exc:  # no kernel for this precision: try the next one
            last_error = exc
            continue
        for name in wrt:
            if name not in feeds:
                feeds[name] = work.graph.initializers[name].const_value.numpy()
        grad_model = _gradient_model(work, wrt, rng, forward_outputs, registry)
        try:
            session = _session(grad_model)
        except Exception as exc:
            last_error = exc
            continue
        return _compare(session, feeds, wrt, dtype, rng, directions, rtol, atol, raise_on_error)
    raise ModelError(f"onnxruntime could not run the gradient check model: {last_error}")


def _compare(session, feeds, wrt, dtype, rng, directions, rtol, atol, raise_on_error):
    settings = dict(_SETTINGS[dtype])
    if rtol is not None:
        settings["rtol"] = rtol
    if atol is not None:
        settings["atol"] = atol
    eps = settings["eps"]
    results = session.run(None, feeds)
    grads = dict(zip(wrt, results[1:]))

    def loss_at(name, delta):
        shifted = dict(feeds)
        shifted[name] = np.asarray(feeds[name].astype(np.float64) + delta, dtype=feeds[name].dtype)
        return float(session.run(["check_loss"], shifted)[0])

    analytic: dict[str, list[float]] = {}
    numeric: dict[str, list[float]] = {}
    failures = []
    for name in wrt:
        if grads[name].shape != feeds[name].shape:  # a broadcast-shaped gradient would pass the sums below
            failures.append(f"{name}: gradient of shape {list(grads[name].shape)} for an input of shape "
                            f"{list(feeds[name].shape)}")
            continue
        for _ in range(directions):
            u = rng.standard_normal(feeds[name].shape)
            a = float(np.sum(grads[name].astype(np.float64) * u))
            n = (loss_at(name, eps * u) - loss_at(name, -eps * u)) / (2 * eps)
            analytic.setdefault(name, []).append(a)
            numeric.setdefault(name, []).append(n)
            scale = max(1.0, float(np.sqrt(np.sum(grads[name].astype(np.float64) ** 2) * u.size)))
            if abs(a - n) > settings["atol"] * scale + settings["rtol"] * abs(n):
                failures.append(f"{name}: analytic {a:.8g} vs numeric {n:.8g}")
    result = GradientCheckResult(dtype.name.lower(), analytic, numeric)
    if failures and raise_on_error:
        raise GradientCheckError(
            f"gradients disagree with finite differences ({result.dtype}):\n  " + "\n  ".join(failures)
        )
    return result
