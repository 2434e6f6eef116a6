"""An op builder on onnx_ir: ``op.Mul(x, y)`` appends a node and returns its output.

Graph-building code reads like the math: ``dx = op.Mul(dy, op.Sigmoid(x))``. The
builder also keeps the element type of every value it creates (so constants can be
made ``like`` a value) and names nodes deterministically from a scope prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxtrain.ir.nodes import infer_output_dtypes


def _attr_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ir.tensor(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return value


class _OpNamespace:
    def __init__(self, builder: "GraphBuilder"):
        self._builder = builder

    def __getattr__(self, op_type: str):
        if op_type.startswith("_"):
            raise AttributeError(op_type)

        def make(*inputs, _outputs: int = 1, _domain: str = "", **attributes):
            return self._builder.add_node(op_type, inputs, attributes, num_outputs=_outputs, domain=_domain)

        make.__name__ = op_type
        return make


class GraphBuilder:
    """Appends nodes to ``graph`` (or collects them in ``nodes`` when ``graph`` is None).

    Example:
        >>> import onnx_ir as ir
        >>> g = ir.Graph([], [], nodes=[], opset_imports={"": 18})
        >>> b = GraphBuilder(g)
        >>> x = b.input("x", ir.DataType.FLOAT, [2, 3])
        >>> y = b.op.Mul(x, b.like(x, 2.0))
        >>> y.dtype == ir.DataType.FLOAT
        True
    """

    def __init__(self, graph: ir.Graph, *, scope: str = "", opset: int | None = None, _counter=None):
        self.graph = graph
        self.scope = scope
        self.opset = opset if opset is not None else graph.opset_imports.get("", 18)
        self.op = _OpNamespace(self)
        # shared by child builders so names stay unique across scopes of one graph
        self._counter = _counter if _counter is not None else itertools.count(1)
        self.created: list[ir.Node] = []

    def child(self, scope: str) -> "GraphBuilder":
        """A builder on the same graph whose node names start with ``scope``."""
        return GraphBuilder(self.graph, scope=scope, opset=self.opset, _counter=self._counter)

    def for_subgraph(self, graph: ir.Graph, scope: str) -> "GraphBuilder":
        """A builder on ``graph`` (a subgraph of this builder's model) sharing this one's name
        counter: names stay unique across both, whatever scopes child builders take."""
        return GraphBuilder(graph, scope=scope, opset=self.opset, _counter=self._counter)

    def owned(self, value: ir.Value) -> ir.Value:
        """``value`` if a node of this builder's graph computes it, else an Identity of it: a
        graph's outputs must be computed in it (a subgraph's may not be read from outside)."""
        producer = value.producer()
        if producer is not None and producer.graph is self.graph:
            return value
        return self.op.Identity(value)

    def distinct_outputs(self, values) -> list[ir.Value]:
        """``values`` ready to be this builder's graph's outputs: each computed in the graph
        (:meth:`owned`) and listed once (a repeat becomes an Identity of the first)."""
        outputs: list[ir.Value] = []
        for value in values:
            outputs.append(self.op.Identity(value) if value in outputs else self.owned(value))
        return outputs

    def fresh_name(self, base: str) -> str:
        """A name unique within this builder's graph, under this builder's scope."""
        prefix = f"{self.scope}/" if self.scope else ""
        return f"{prefix}{base}_{next(self._counter)}"

    # -- nodes ----------------------------------------------------------------
    def add_node(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: dict[str, Any] | None = None,
        *,
        num_outputs: int = 1,
        domain: str = "",
    ):
        attrs = {k: _attr_value(v) for k, v in (attributes or {}).items() if v is not None}
        name = self.fresh_name(op_type)
        node = ir.Node(
            domain,
            op_type,
            list(inputs),
            attributes=ir.convenience.convert_attributes(attrs),
            num_outputs=num_outputs,
            name=name,
        )
        for i, out in enumerate(node.outputs):
            out.name = name if num_outputs == 1 else f"{name}:{i}"
        infer_output_dtypes(node)
        self.graph.append(node)
        self.created.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    # -- graph inputs ---------------------------------------------------------
    def input(self, name: str, dtype: ir.DataType, shape: Sequence[int | str | None] | None) -> ir.Value:
        """Add a graph input."""
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape) if shape is not None else None)
        self.graph.inputs.append(value)
        return value

    # -- constants ------------------------------------------------------------
    def const(self, array: Any, dtype: ir.DataType | None = None) -> ir.Value:
        """A Constant node holding ``array`` (numpy-convertible)."""
        if dtype is not None:
            array = np.asarray(array, dtype=dtype.numpy())
        else:
            array = np.asarray(array)
        tensor = ir.tensor(array)
        out = self.add_node("Constant", [], {"value": tensor})
        out.const_value = tensor
        out.shape = ir.Shape(array.shape)
        return out

    def like(self, x: ir.Value, value: float) -> ir.Value:
        """A scalar constant with the element type of ``x``."""
        if x.dtype is None:
            raise ValueError(f"element type of {x.name!r} is unknown; cannot make a constant like it")
        return self.const(np.array(value, dtype=x.dtype.numpy()))

    def ints(self, values: Sequence[int]) -> ir.Value:
        """A 1-D int64 constant, e.g. axes or a shape."""
        return self.const(np.array(list(values), dtype=np.int64))

    def scalar_int(self, value: int) -> ir.Value:
        return self.const(np.array(value, dtype=np.int64))

    # -- opset-aware helpers --------------------------------------------------
    def reduce(self, op_type: str, x: ir.Value, axes: Sequence[int] | ir.Value | None, keepdims: bool = True,
               noop_with_empty_axes: bool = False) -> ir.Value:
        """Reduce* with axes as an attribute or input, whichever this opset wants."""
        axes_as_input = self.opset >= 18 or (op_type == "ReduceSum" and self.opset >= 13)
        attrs: dict[str, Any] = {"keepdims": int(keepdims)}
        if noop_with_empty_axes:
            attrs["noop_with_empty_axes"] = 1
        if axes is None:
            return self.add_node(op_type, [x], attrs)
        if axes_as_input:
            axes_value = axes if isinstance(axes, ir.Value) else self.ints(axes)
            return self.add_node(op_type, [x, axes_value], attrs)
        if isinstance(axes, ir.Value):
            raise ValueError(f"{op_type} at opset {self.opset} needs static axes")
        attrs["axes"] = list(axes)
        return self.add_node(op_type, [x], attrs)

    def reduce_sum(self, x: ir.Value, axes: Sequence[int] | ir.Value | None, keepdims: bool = True) -> ir.Value:
        return self.reduce("ReduceSum", x, axes, keepdims)

    def unsqueeze(self, x: ir.Value, axes: Sequence[int] | ir.Value) -> ir.Value:
        return self._squeeze_like("Unsqueeze", x, axes)

    def squeeze(self, x: ir.Value, axes: Sequence[int] | ir.Value | None = None) -> ir.Value:
        if axes is None:
            return self.op.Squeeze(x)
        return self._squeeze_like("Squeeze", x, axes)

    def _squeeze_like(self, op_type: str, x: ir.Value, axes: Sequence[int] | ir.Value) -> ir.Value:
        if self.opset >= 13:  # axes became an input at opset 13
            return self.add_node(op_type, [x, axes if isinstance(axes, ir.Value) else self.ints(axes)])
        if isinstance(axes, ir.Value):
            raise ValueError(f"{op_type} at opset {self.opset} needs static axes")
        return self.add_node(op_type, [x], {"axes": list(axes)})

    def zeros_like(self, x: ir.Value) -> ir.Value:
        """Zeros with the shape and element type of ``x`` (works for dynamic shapes)."""
        zero = ir.tensor(np.zeros([1], dtype=x.dtype.numpy()))
        return self.op.ConstantOfShape(self.op.Shape(x), value=zero)

    def ones_like(self, x: ir.Value) -> ir.Value:
        one = ir.tensor(np.ones([1], dtype=x.dtype.numpy()))
        return self.op.ConstantOfShape(self.op.Shape(x), value=one)

    def cast_to(self, x: ir.Value, dtype: ir.DataType) -> ir.Value:
        if x.dtype == dtype:
            return x
        return self.op.Cast(x, to=int(dtype))

    def keep_where(self, condition: ir.Value, x: ir.Value) -> ir.Value:
        """``x`` where ``condition`` holds, else 0, as ``x * Cast(condition)``.

        ONNX Runtime's CPU ``Where`` runs several times slower than ``Cast`` + ``Mul``; the one
        difference is that an inf or NaN in ``x`` at a masked-out position gives NaN, not 0.
        """
        return self.op.Mul(x, self.cast_to(condition, x.dtype))
