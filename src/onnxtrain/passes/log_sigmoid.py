"""The logarithm of a sigmoid, as a softplus.

onnxruntime's CPU Sigmoid is accurate to ~6e-8 absolute, not relative: below x ~ -8 its result
drifts from the true value, and from x ~ -18 on it is exactly 0, where the true value is 1.5e-8
and below. Its logarithm is then -inf, and the gradient through it NaN. PyTorch's exporter writes
``F.logsigmoid`` as ``Log(Sigmoid(x))``, and binary cross entropy with logits
(``F.binary_cross_entropy_with_logits``, ``nn.BCEWithLogitsLoss``, ``multilabel_soft_margin_loss``)
decomposes into it: a confidently wrong logit of -20 gave an infinite loss where PyTorch gives 20,
and a NaN gradient for every parameter.

This pass writes ``Log(Sigmoid(x))`` as ``-Softplus(-x)`` and ``Log(1 - Sigmoid(x))`` (also as
``log1p(-sigmoid)``, how ``F.binary_cross_entropy``'s decomposition reads it) as ``-Softplus(x)``,
which onnxruntime computes without overflow or underflow over the whole range
(and whose gradients, sigmoids again, are within that absolute accuracy). Float32, and float16
and bfloat16 computed in float32 (a model converted with ``.to(torch.bfloat16)``: the rounded
sigmoid is 0 from x ~ -9 in bfloat16, its logarithm -inf, where PyTorch's fused loss stays
finite; onnxruntime's CPU provider has a float32 Softplus only). Not double: its Sigmoid kernel
is exact. Where eager float32 rounds the sigmoid itself to 0 or 1 (|x| above
~17 or ~88), its logarithm is -inf (``binary_cross_entropy`` clamps it to -100, with a zero
gradient); the rewritten graph keeps the exact value and gradient there instead. Standard ops,
so artifacts keep running on any onnxruntime.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor, replace_nodes_and_values

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass


def _is_broadcast_one(value: ir.Value, x: ir.Value) -> bool:
    """``value`` is a constant 1 whose broadcast against ``x`` leaves ``x``'s shape: one element,
    of no more axes than ``x`` (a scalar where ``x``'s rank is unknown)."""
    tensor = get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return False
    rank = len(x.shape) if x.shape is not None else 0
    return len(tensor.shape) <= rank and float(tensor.numpy().reshape(-1)[0]) == 1.0


def _sigmoid_input(value: ir.Value | None) -> ir.Value | None:
    producer = value.producer() if value is not None else None
    return producer.inputs[0] if is_onnx_op(producer, "Sigmoid") else None


def _complement_input(value: ir.Value | None) -> ir.Value | None:
    """``x`` where ``value`` is ``1 - Sigmoid(x)``: ``Sub(1, Sigmoid(x))``, or ``Add`` of 1 and
    ``Neg(Sigmoid(x))`` (``torch.log1p(-p)``, as binary cross entropy's decomposition writes it)."""
    producer = value.producer() if value is not None else None
    if is_onnx_op(producer, "Sub"):
        one, sigmoid = producer.inputs
    elif is_onnx_op(producer, "Add"):
        negated = [v for v in producer.inputs if is_onnx_op(v.producer(), "Neg")]
        if not negated:
            return None
        sigmoid = negated[0].producer().inputs[0]
        one = producer.inputs[1] if producer.inputs[0] is negated[0] else producer.inputs[0]
    else:
        return None
    x = _sigmoid_input(sigmoid)
    return x if x is not None and _is_broadcast_one(one, x) else None


_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


class LogSigmoidPass(NodeRewritePass):
    """Rewrite float32 ``Log(Sigmoid(x))`` as ``Neg(Softplus(Neg(x)))`` and ``Log(1 - Sigmoid(x))``
    as ``Neg(Softplus(x))`` (float16/bfloat16 ones computed in float32)."""

    def match(self, node: ir.Node, opset: int) -> tuple[ir.Value, bool, ir.DataType] | None:
        if not is_onnx_op(node, "Log"):
            return None
        argument = node.inputs[0]
        x, of_sigmoid = _sigmoid_input(argument), True
        if x is None:
            x, of_sigmoid = _complement_input(argument), False
        # the sigmoid's input's type: values a translation made may have none yet
        dtype = x.dtype if x is not None else None
        return (x, of_sigmoid, dtype) if dtype in (ir.DataType.FLOAT, *_LOW) else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: tuple[ir.Value, bool, ir.DataType]) -> None:
        x, of_sigmoid, dtype = plan
        new = NewNodes(node, "softplus")
        old = node.outputs[0]
        if dtype in _LOW:
            x = new.add("Cast", [x], {"to": int(ir.DataType.FLOAT)})
        softplus = new.add("Softplus", [new.add("Neg", [x]) if of_sigmoid else x])
        out = new.add("Neg", [softplus])
        if dtype in _LOW:
            out = new.add("Cast", [out], {"to": int(dtype)})
        out.shape = old.shape  # its type follows from x's (the Log's own may be unknown)
        replace_nodes_and_values(graph, node, [node], new.nodes, [old], [out])
