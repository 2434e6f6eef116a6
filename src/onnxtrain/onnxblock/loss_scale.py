"""Dynamic loss scaling inside the graphs (fp16 artifacts), with ``torch.amp.GradScaler`` semantics.

The training model takes a ``loss_scale`` input: the loss gradient is seeded with it
instead of 1, so small fp16 gradients do not flush to zero, and the gradients of the
(fp32) parameters are divided by it again before they are accumulated: they come out
unscaled, in fp32, possibly inf/NaN when an fp16 value overflowed.

The optimizer model checks that every gradient it reads is finite (``all_finite``
output); if not, it returns the parameters and optimizer states unchanged (the step is
skipped, as ``GradScaler.step`` skips ``optimizer.step()``). It also updates the scale:
after an overflow ``scale *= backoff_factor``; after ``growth_interval`` finite steps in a
row ``scale *= growth_factor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from onnxtrain import names
from onnxtrain.errors import ArtifactError
from onnxtrain.ir.builder import GraphBuilder


@dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss-scale settings; the defaults are ``torch.amp.GradScaler``'s.

    Example:
        >>> from onnxtrain import artifacts
        >>> from onnxtrain.onnxblock.loss_scale import DynamicLossScale
        >>> scaler = DynamicLossScale(init_scale=2.0**12, growth_interval=500)
        >>> # artifacts.generate_artifacts(model, ..., precision="fp16", loss_scale=scaler)
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ArtifactError(f"DynamicLossScale needs init_scale > 0, growth_factor > 1, "
                                f"0 < backoff_factor < 1 and growth_interval >= 1; got {self}")

    def to_json(self) -> dict:
        return {"init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}


def all_finite(b: GraphBuilder, grads: Sequence[ir.Value]) -> ir.Value:
    """A bool scalar: every element of every gradient is finite.

    ``ReduceSum`` of a tensor holding inf or NaN is inf or NaN, and ``0 * that`` is NaN, while
    a finite sum gives 0: one reduction per gradient, no elementwise mask. (A finite fp32 sum
    overflowing to inf would need gradients near 3e38: not a case for unscaled gradients.)
    """
    op = b.op
    sums = [b.cast_to(b.reduce_sum(g, None, keepdims=False), ir.DataType.FLOAT) for g in grads]
    total = sums[0] if len(sums) == 1 else op.Sum(*sums)
    return op.Not(op.IsNaN(op.Mul(total, b.like(total, 0.0))))


def update_scale(b: GraphBuilder, config: DynamicLossScale, finite: ir.Value, scale: ir.Value,
                 tracker: ir.Value) -> tuple[ir.Value, ir.Value]:
    """New ``(scale, growth tracker)`` after a step, as ``torch._amp_update_scale_``."""
    op = b.op
    counted = op.Add(tracker, b.scalar_int(1))
    grow = op.Equal(counted, b.scalar_int(config.growth_interval))
    grown = op.Where(grow, op.Mul(scale, b.like(scale, config.growth_factor)), scale)
    new_scale = op.Where(finite, grown, op.Mul(scale, b.like(scale, config.backoff_factor)))
    zero = b.scalar_int(0)
    new_tracker = op.Where(finite, op.Where(grow, zero, counted), zero)
    return new_scale, new_tracker


def skip_unless(b: GraphBuilder, finite: ir.Value, nodes: list[ir.Node], updated: Sequence[ir.Value],
                unchanged: Sequence[ir.Value]) -> list[ir.Value]:
    """Move ``nodes`` (the update, already in the graph) into the then-branch of an ``If`` on
    ``finite`` whose else-branch returns ``unchanged``; return the If's outputs.

    An ``If`` runs only the taken branch: a skipped step costs one copy per tensor, and the
    update's arithmetic on non-finite gradients never runs.
    """
    graph = b.graph
    for node in nodes:
        graph.remove(node)
    then_outputs = []
    for value in updated:
        if value.producer() not in nodes:  # an outer value returned as is: a branch needs its own
            copy = ir.node("Identity", [value], name=b.fresh_name("skip/keep"))
            copy.outputs[0].name = copy.name + "_out"
            copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
            nodes.append(copy)
            value = copy.outputs[0]
        then_outputs.append(value)
    keep = []
    for value in unchanged:
        copy = ir.node("Identity", [value], name=b.fresh_name("skip/old"))
        copy.outputs[0].name = copy.name + "_out"
        copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
        keep.append(copy)
    then_branch = ir.Graph([], then_outputs, nodes=nodes, name="finite_step")
    else_branch = ir.Graph([], [n.outputs[0] for n in keep], nodes=keep, name="skipped_step")
    outputs = b.op.If(finite, then_branch=then_branch, else_branch=else_branch, _outputs=len(updated))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for out, value in zip(outputs, unchanged):
        out.type, out.shape = value.type, value.shape
    return list(outputs)


def scale_inputs(b: GraphBuilder) -> tuple[ir.Value, ir.Value]:
    """The optimizer model's loss-scale state inputs."""
    return (b.input(names.LOSS_SCALE, ir.DataType.FLOAT, []),
            b.input(names.LOSS_SCALE_GROWTH_TRACKER, ir.DataType.INT64, []))
