"""The shape most of onnxtrain's passes share: find the nodes a rule matches, rewrite each one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

# ReduceMean takes its axes as an input from this opset on (an attribute before)
REDUCE_MEAN_AXES_INPUT_OPSET = 18


def default_opset(model: ir.Model) -> int:
    """The model's version of the default ONNX domain (1 if it imports none)."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))


class NodeRewritePass(ir.passes.InPlacePass):
    """An in-place pass that visits the main graph's nodes once, in order: :meth:`match` says
    whether a node is to be rewritten (returning what :meth:`rewrite` needs, or None), and
    :meth:`rewrite` replaces it. Nodes a rewrite adds are not visited."""

    def match(self, node: ir.Node, opset: int) -> Any | None:
        raise NotImplementedError

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: Any) -> None:
        raise NotImplementedError

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = default_opset(model)
        modified = False
        for node in list(model.graph):
            plan = self.match(node, opset)
            if plan is not None:
                self.rewrite(model.graph, node, plan)
                modified = True
        return ir.passes.PassResult(model, modified)


def hand_over(graph: ir.Graph, old: ir.Value, new: ir.Value, suffix: str) -> None:
    """Every reader of ``old`` but ``new``'s own producer reads ``new`` instead; where ``old`` is a
    graph output, ``new`` takes its place there and its name (``old`` becomes ``<name>/<suffix>``)."""
    own = new.producer()
    for usage in list(old.uses()):
        if usage.node is not own:
            usage.node.replace_input_with(usage.idx, new)
    if old in graph.outputs:  # not is_graph_output(): onnx_ir can leave that flag stale
        name = old.name
        old.name, new.name = f"{name}/{suffix}", name
        graph.outputs[graph.outputs.index(old)] = new


def constant_maker(add: Callable, dtype) -> Callable[..., ir.Value]:
    """``constant(value, value_dtype=dtype)``: a Constant node made with ``add`` (NewNodes.add)."""
    def constant(value, value_dtype=dtype) -> ir.Value:
        return add("Constant", [], attributes={"value": ir.tensor(np.asarray(value, value_dtype))})
    return constant


def mean_maker(add: Callable, axes: Sequence[int], opset: int) -> Callable[[ir.Value], ir.Value]:
    """``mean(v)``: ``ReduceMean(v)`` over ``axes``, kept, as ``opset`` writes it."""
    if opset >= REDUCE_MEAN_AXES_INPUT_OPSET:
        axes_value = constant_maker(add, np.int64)(list(axes))
        return lambda v: add("ReduceMean", [v, axes_value], {"keepdims": 1})
    return lambda v: add("ReduceMean", [v], {"keepdims": 1, "axes": list(axes)})
