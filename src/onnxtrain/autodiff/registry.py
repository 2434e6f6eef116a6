"""The gradient-rule registry: ``@grad("Op")`` plus helpers for families of ops.

A rule receives a :class:`GradContext` (the node, its inputs and outputs, the
gradients of its outputs and a builder) and returns one gradient per input,
``None`` where an input gets none. Rules for broadcasting ops return gradients in
the output's shape and declare ``broadcasting=True``; the autodiff builder then
un-broadcasts them centrally. A rule whose gradient is a smaller tensor repeated over the
input (a reduction's) may return it wrapped in :class:`Broadcast`: the builder adds it to the
input's other gradients by broadcasting, and expands it only when it is the input's only one. A
gradient that is zero almost everywhere may be returned as a
:class:`~onnxtrain.autodiff.partial.Partial` (a Slice's, a Gather's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.ir.nodes import is_onnx_op

RuleFn = Callable[["GradContext"], Sequence["ir.Value | None"]]


_CONSTANT_SCALAR_ATTRS = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32,
                          "value_floats": np.float32}


def constant_node_value(node: ir.Node):
    """The numpy value of a ``Constant`` node (any of its numeric forms), or None (e.g. sparse)."""
    attr = node.attributes.get("value")
    if attr is not None:
        return attr.value.numpy()
    for name, dtype in _CONSTANT_SCALAR_ATTRS.items():
        attr = node.attributes.get(name)
        if attr is not None:
            return np.array(attr.value, dtype=dtype)
    return None


@dataclass(frozen=True)
class Broadcast:
    """A gradient given as ``value``, which broadcasts (ONNX rules) to the shape of the input it is
    the gradient of. Summed with full-sized gradients it costs no pass of its own; alone it is
    expanded to the input's shape."""

    value: ir.Value


@dataclass
class GradContext:
    """What a rule sees: one forward node and the gradients flowing into its outputs."""

    node: ir.Node
    b: GraphBuilder
    grad_outputs: list[ir.Value | None]
    needs_grad: list[bool]
    opset: int
    # values of enclosing graphs the node's subgraphs read that need a gradient (If, Loop, Scan
    # capture them without listing them as inputs); a rule puts their gradients in captured_grads
    captured_needing_grad: list[ir.Value] = field(default_factory=list)
    captured_grads: dict[ir.Value, ir.Value] = field(default_factory=dict)

    @property
    def op(self):
        return self.b.op

    @property
    def inputs(self) -> list[ir.Value | None]:
        return list(self.node.inputs)

    @property
    def outputs(self) -> list[ir.Value]:
        return list(self.node.outputs)

    @property
    def x(self) -> ir.Value:
        return self.node.inputs[0]

    @property
    def y(self) -> ir.Value:
        return self.node.outputs[0]

    @property
    def dy(self) -> ir.Value:
        """Gradient of the first output (zeros if none flowed into it)."""
        return self.grad_output(0)

    def grad_output(self, index: int) -> ir.Value:
        g = self.grad_outputs[index]
        if g is None:
            g = self.b.zeros_like(self.node.outputs[index])
            self.grad_outputs[index] = g
        return g

    def forward_output(self, index: int, dtype: ir.DataType, label: str) -> ir.Value:
        """Output ``index`` of the forward node, added to the node if it does not produce it.

        Rules use this to reuse what the forward kernel computes anyway (a Dropout mask,
        LayerNormalization's statistics) instead of recomputing or re-randomizing it.
        """
        node = self.node
        if len(node.outputs) <= index:
            node.resize_outputs(index + 1)
        out = node.outputs[index]
        if not out.name:  # newly added, or an omitted optional output
            out.name = self.b.fresh_name(f"{node.op_type}_{label}")
        if out.type is None:
            out.type = ir.TensorType(dtype)
        return out

    def needs(self, index: int) -> bool:
        return index < len(self.needs_grad) and self.needs_grad[index]

    def attr(self, name: str, default: Any = None) -> Any:
        attr = self.node.attributes.get(name)
        if attr is None:
            return default
        value = attr.value
        if isinstance(value, ir.TensorProtocol):
            return value.numpy()
        if isinstance(value, Sequence) and not isinstance(value, str):
            return list(value)
        return value

    def const_input(self, index: int):
        """The numpy value of input ``index`` if it is a constant or initializer, else None."""
        if index >= len(self.node.inputs) or self.node.inputs[index] is None:
            return None
        v = self.node.inputs[index]
        if v.const_value is not None:
            return v.const_value.numpy()
        producer = v.producer()
        if not is_onnx_op(producer, "Constant"):
            return None
        return constant_node_value(producer)

    def like(self, x: ir.Value, value: float) -> ir.Value:
        return self.b.like(x, value)


@dataclass(frozen=True)
class GradRule:
    op_type: str
    domain: str
    since: int
    until: int | None  # inclusive; None = no upper bound
    fn: RuleFn
    broadcasting: bool = False
    # the outputs depend on the inputs through their shape and type only: they carry no gradient
    # and need none (PyTorch's ``rand_like(y)`` does not require grad however ``y`` does)
    shape_only: bool = False

    def covers(self, version: int) -> bool:
        return self.since <= version and (self.until is None or version <= self.until)


@dataclass
class Registry:
    """Rules by (domain, op type); several version ranges may exist for one op."""

    rules: dict[tuple[str, str], list[GradRule]] = field(default_factory=dict)

    def add(self, rule: GradRule) -> None:
        self.rules.setdefault((rule.domain, rule.op_type), []).append(rule)

    def lookup(self, domain: str, op_type: str, version: int) -> GradRule | None:
        domain = "" if domain == "ai.onnx" else domain
        for rule in self.rules.get((domain, op_type), ()):
            if rule.covers(version):
                return rule
        return None

    def reads_shape_only(self, node: ir.Node) -> bool:
        """Whether ``node``'s outputs depend on its inputs through their shape and type only
        (registered with :func:`shape_only`): no gradient path goes through it."""
        domain = "" if node.domain == "ai.onnx" else node.domain
        return any(rule.shape_only for rule in self.rules.get((domain, node.op_type), ()))

    def registered(self) -> list[GradRule]:
        return [r for rules in self.rules.values() for r in rules]


DEFAULT_REGISTRY = Registry()


def grad(op_type: str, *, domain: str = "", versions: tuple[int, int | None] = (1, None),
         broadcasting: bool = False, registry: Registry = DEFAULT_REGISTRY):
    """Register a gradient rule for ``op_type`` over the opset range ``versions`` (inclusive)."""

    def decorate(fn: RuleFn) -> RuleFn:
        registry.add(GradRule(op_type, domain, versions[0], versions[1], fn, broadcasting))
        return fn

    return decorate


def unary(op_type: str, derivative: Callable[[GradContext], ir.Value], **kwargs) -> None:
    """Register ``dx = dy * derivative(ctx)`` for a one-input elementwise op."""

    def rule(ctx: GradContext):
        return (ctx.op.Mul(ctx.dy, derivative(ctx)),)

    rule.__name__ = f"grad_{op_type}"
    rule.__module__ = derivative.__module__  # the rule family's module, where the derivative is written
    grad(op_type, **kwargs)(rule)


def _no_gradient(ctx: GradContext):
    return (None,) * len(ctx.node.inputs)


_no_gradient.nondifferentiable = True  # the grad-table meta-test needs no row for these


def nondifferentiable(*op_types: str, domain: str = "") -> None:
    """Register ops whose float inputs get no gradient (their outputs are piecewise constant)."""
    for op_type in op_types:
        grad(op_type, domain=domain)(_no_gradient)


def shape_only(*op_types: str, domain: str = "") -> None:
    """Register ops whose outputs depend on their inputs through shape and type only (``EyeLike``,
    ``RandomUniformLike``): the autodiff walk does not go through them and their outputs need
    no gradient."""
    for op_type in op_types:
        DEFAULT_REGISTRY.add(GradRule(op_type, domain, 1, None, _no_gradient, shape_only=True))
