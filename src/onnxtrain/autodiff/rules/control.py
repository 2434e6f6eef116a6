"""Gradient rules: control flow (If).

A branch of an ``If`` reads the values of the enclosing graph it needs without listing them as
inputs: their gradients are what the rule computes. It runs a gradient ``If`` on the same
condition whose branches are copies of the forward branches, each differentiated by the same
autodiff (seeded with the gradients of the ``If``'s outputs, read from the enclosing graph), so
the taken branch computes the gradient of the taken computation. A captured value a branch does
not read gets zeros from that branch.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.autodiff.builder import build_gradients, is_float
from onnxtrain.autodiff.registry import GradContext, grad


def _branch_gradients(ctx: GradContext, branch: ir.Graph, label: str) -> ir.Graph:
    """A copy of ``branch`` whose outputs are the gradients of ``ctx.captured_needing_grad``."""
    copy = branch.clone(allow_outer_scope_values=True)
    copy.name = f"{branch.name or label}_gradient"
    b = ctx.b.for_subgraph(copy, f"{ctx.b.scope}/{label}")
    seeded = [(out, g) for out, g in zip(copy.outputs, ctx.grad_outputs) if g is not None and is_float(out)]
    wanted = ctx.captured_needing_grad
    if seeded:
        grads = build_gradients(copy, [out for out, _ in seeded], wanted, loss_grad=[g for _, g in seeded], builder=b)
    else:
        grads = {w: b.zeros_like(w) for w in wanted}
    outputs = []
    for w in wanted:
        g = b.owned(grads[w])
        g.type, g.shape = w.type, w.shape
        outputs.append(g)
    copy.outputs.clear()
    copy.outputs.extend(outputs)
    return copy


@grad("If", versions=(13, None))
def _if(ctx):
    wanted = ctx.captured_needing_grad
    if wanted:
        then_branch = _branch_gradients(ctx, ctx.node.attributes["then_branch"].value, "then")
        else_branch = _branch_gradients(ctx, ctx.node.attributes["else_branch"].value, "else")
        grads = ctx.op.If(ctx.inputs[0], then_branch=then_branch, else_branch=else_branch, _outputs=len(wanted))
        grads = grads if isinstance(grads, tuple) else (grads,)
        for value, g in zip(wanted, grads):
            g.type, g.shape = value.type, value.shape
            ctx.captured_grads[value] = g
    return (None,)  # the condition is boolean
