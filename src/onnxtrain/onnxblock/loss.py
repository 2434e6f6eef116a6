"""Loss blocks with upstream's names, arguments and semantics.

Each takes the name of the model output (and optionally of the target) and
returns the name of the loss. A target name that is not yet a value of the model
becomes a new graph input.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.errors import ArtifactError
from onnxtrain.onnxblock.blocks import Block

_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ArtifactError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


def _check_broadcasts(what: str, array: np.ndarray, output: ir.Value) -> None:
    """``ArtifactError`` unless ``array`` broadcasts to ``output``'s shape without changing it (as
    each element's weight; along a dim of varying size, such as the batch, only 1 does): else the
    model would fail when loaded, or at another batch size, on a Mul naming neither."""
    shape = output.shape
    if shape is None:
        return
    fits = array.ndim <= len(shape) and all(
        size == 1 or (isinstance(dim, int) and size == dim)
        for size, dim in zip(reversed(array.shape), reversed(list(shape))))
    if not fits:
        raise ArtifactError(f"{what} has shape {list(array.shape)}, which does not broadcast to the shape {shape} "
                            f"of the loss input {output.name!r} (each element's weight: its dims must be 1 or "
                            f"the input's, from the last)")


class _ElementwiseLoss(Block):
    """loss = reduce(weight * f(output, target))."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self._reduction = _check_reduction(reduction)

    def _target(self, output: ir.Value, target_name: str) -> ir.Value:
        found = self.context.find(target_name)
        if found is not None:
            return found
        shape = self.context.trusted_shape(output)
        # what the gradient graph derives from the output's shape must not rest on a wrong one either
        output.shape = shape
        target = ir.Value(name=target_name, type=output.type, shape=shape)
        self.context.graph.inputs.append(target)
        if shape is not None and all(isinstance(d, int) or d.value is not None for d in shape):
            return target  # the runtime checks every dim of the target against its declared shape
        # some dim of the output is of unknown size: a target of another shape must still fail,
        # not broadcast (nor be reshaped to the output's), with a message that names it: a Reshape
        # to the output's shape where the two agree and to a -2 (refused) where they do not
        # (onnxruntime names the failing node)
        op = self.op
        agree = op.Equal(op.Shape(target), op.Shape(output))
        checked = op.Reshape(target, op.Where(agree, op.Shape(output), self.context.builder.ints([-2])))
        checked.producer().name = f"onnxblock/{target_name}_must_have_the_shape_of_{output.name}"
        return checked

    def _reduce(self, loss: ir.Value) -> ir.Value:
        b = self.context.builder
        if self._reduction == "none":
            return loss
        return b.reduce("ReduceMean" if self._reduction == "mean" else "ReduceSum", loss, None, keepdims=False)


class MSELoss(_ElementwiseLoss):
    """Mean squared error: ``reduce((output - target) ** 2)``; reduction "mean", "sum" or "none"."""

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        x = self._value(loss_input_name)
        d = self.op.Sub(x, self._target(x, target_name))
        return self._reduce(self.op.Mul(d, d)).name


class L1Loss(_ElementwiseLoss):
    """Mean absolute error: ``reduce(|output - target|)``."""

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        x = self._value(loss_input_name)
        return self._reduce(self.op.Abs(self.op.Sub(x, self._target(x, target_name)))).name


class BCEWithLogitsLoss(_ElementwiseLoss):
    """Binary cross entropy on logits, as ``torch.nn.BCEWithLogitsLoss``.

    ``weight`` rescales each element's loss; ``pos_weight`` weights the positive term.
    Computed in the overflow-free form
    ``(1 - t) x + (1 + (pos_weight - 1) t) (m + log(exp(-m) + exp(-x - m)))``, ``m = max(-x, 0)``
    (upstream's ``log(sigmoid(x))`` form overflows to inf for large |x|), whose gradient is
    exact at ``x = 0`` too.
    """

    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        super().__init__(reduction)
        self._weight = None if weight is None else np.asarray(weight)
        self._pos_weight = None if pos_weight is None else np.asarray(pos_weight)

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        op, b = self.op, self.context.builder
        x = self._value(loss_input_name)
        t = self._target(x, target_name)
        np_dtype = x.dtype.numpy()
        for what, array in (("BCEWithLogitsLoss pos_weight", self._pos_weight), ("BCEWithLogitsLoss weight", self._weight)):
            if array is not None:
                _check_broadcasts(what, array, x)
        one = b.like(x, 1.0)
        # log(1 + exp(-x)) as m + log(exp(-m) + exp(-x - m)), m = max(-x, 0): no exponent above 0,
        # and the derivative in m is 1 - 1 = 0, so the kink of max at x = 0 leaves the gradient
        # -sigmoid(-x) exact there (log(1 + exp(-|x|)) + max(-x, 0) had 0 at x = 0)
        neg_x = op.Neg(x)
        m = op.Relu(neg_x)
        softplus_neg_x = op.Add(m, op.Log(op.Add(op.Exp(op.Neg(m)), op.Exp(op.Sub(neg_x, m)))))
        log_weight = one
        if self._pos_weight is not None:
            pos_weight = b.const(self._pos_weight.astype(np_dtype))
            log_weight = op.Add(one, op.Mul(op.Sub(pos_weight, one), t))
        loss = op.Add(op.Mul(op.Sub(one, t), x), op.Mul(log_weight, softplus_neg_x))
        if self._weight is not None:
            loss = op.Mul(loss, b.const(self._weight.astype(np_dtype)))
        return self._reduce(loss).name


class CrossEntropyLoss(Block):
    """Softmax cross entropy between scores ``[N, C, ...]`` and class labels ``[N, ...]``.

    As ``torch.nn.CrossEntropyLoss``: ``weight`` per class, ``ignore_index`` for labels
    that contribute nothing, reduction "mean" (weighted mean over non-ignored labels),
    "sum" or "none". A labels input created here is int32 (onnxruntime-training 1.19.2's is
    int64, earlier versions' int32; int32 needs no BigInt in JavaScript). The Python runtime
    converts integer labels of another type whose values fit, so int64 labels work too.
    """

    def __init__(self, weight=None, reduction: str = "mean", ignore_index: int | None = None):
        super().__init__()
        self._weight = None if weight is None else np.asarray(weight)
        self._reduction = _check_reduction(reduction)
        self._ignore_index = ignore_index

    def _labels_checked(self, scores: ir.Value, labels: ir.Value) -> ir.Value:
        """``labels``, failing the run unless shaped as ``scores`` without its class axis: where a
        dim of the scores has no name the runtime could tie (a batch after a flatten), labels of
        another batch size ran (onnxruntime's loss reads as many rows as there are labels). A
        Reshape to the scores' dims where the two agree and to a -2 (refused) where not, named for
        the message."""
        op, b = self.op, self.context.builder
        scores_dims = op.Shape(scores)
        expected = op.Concat(op.Slice(scores_dims, b.ints([0]), b.ints([1])),
                             op.Slice(scores_dims, b.ints([2]), b.ints([len(scores.shape)])), axis=0)
        agree = op.Equal(op.Shape(labels), expected)
        checked = op.Reshape(labels, op.Where(agree, expected, b.ints([-2])))
        checked.producer().name = f"onnxblock/{labels.name}_must_have_the_batch_of_{scores.name}"
        return checked

    def build(self, scores_input_name: str, labels_name: str = "labels") -> str:
        b = self.context.builder
        scores = self._value(scores_input_name)
        labels = self.context.find(labels_name)
        # (one shape inference over the model, for the weight's check and a new labels input)
        trusted = self.context.trusted_shape(scores) if self._weight is not None or labels is None else None
        if self._weight is not None:
            classes = trusted[1] if trusted is not None and len(trusted) >= 2 else None
            if self._weight.ndim != 1 or (isinstance(classes, int) and self._weight.shape[0] != classes):
                raise ArtifactError(f"CrossEntropyLoss weight has shape {list(self._weight.shape)}: one weight per "
                                    f"class, {classes if isinstance(classes, int) else 'C'} for the scores "
                                    f"{scores_input_name!r} of shape {trusted}")
        if labels is None:
            shape = None
            scores_shape = scores.shape = trusted
            if scores_shape is not None and len(scores_shape) >= 2:
                dims = list(scores_shape)
                shape = ir.Shape(dims[:1] + dims[2:])
            labels = ir.Value(name=labels_name, type=ir.TensorType(ir.DataType.INT32), shape=shape)
            self.context.graph.inputs.append(labels)
            if shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value is None for d in shape):
                labels = self._labels_checked(scores, labels)
        elif labels.dtype is not None and not labels.dtype.is_integer():
            # (generate_artifacts hands a model's outputs to the loss in order: a second float
            # output became the labels, and the models did not load)
            raise ArtifactError(f"CrossEntropyLoss labels {labels_name!r} are {labels.dtype.name}: class labels are "
                                f"integers; name the values the loss reads (generate_artifacts' loss_input_names, "
                                f"or the block's arguments)")
        inputs = [scores, labels]  # a negative label fails the run: passes/negative_labels.py
        if self._weight is not None:
            inputs.append(b.const(self._weight.astype(scores.dtype.numpy())))
        attrs = {"reduction": self._reduction}
        if self._ignore_index is not None:
            attrs["ignore_index"] = int(self._ignore_index)
        loss, _log_prob = b.add_node("SoftmaxCrossEntropyLoss", inputs, attrs, num_outputs=2)
        return loss.name
