"""Blocks: composable pieces that add nodes to the model being built.

A block's ``build`` takes and returns value *names* (strings), like upstream's
onnxblock, so custom losses written for ``onnxruntime.training.onnxblock`` work
unchanged. Inside ``build``, ``self.base`` is the model being built and
``self.context`` its :class:`BuildContext`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxtrain.onnxblock._context import BuildContext, _activate, active


class Block(ABC):
    """Base class of all blocks.

    Example:
        >>> from onnxtrain import onnxblock
        >>> class SquaredError(onnxblock.Block):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.sub, self.mul = onnxblock.blocks.Sub(), onnxblock.blocks.Mul()
        ...     def build(self, output, target):
        ...         d = self.sub(output, target)
        ...         return self.mul(d, d)
    """

    def __init__(self):
        self.base: ir.Model | None = None
        self.context: BuildContext | None = None

    @abstractmethod
    def build(self, *args, **kwargs):
        """Add this block's nodes; take and return value names."""

    def __call__(self, *args, **kwargs):
        ctx = active()
        self.context, self.base = ctx, ctx.model
        return self.build(*args, **kwargs)

    def apply(self, context: BuildContext, *args, **kwargs):
        """Build into ``context`` explicitly (no ``with base(...)`` needed)."""
        with _activate(context):
            return self(*args, **kwargs)

    # helpers for subclasses
    @property
    def op(self):
        return self.context.builder.op

    def _value(self, name):
        return self.context.value(name)


class _Elementwise(Block):
    op_type = ""

    def __init__(self, **attributes: Any):
        super().__init__()
        self._attributes = attributes

    def build(self, *input_names: str) -> str:
        values = [self._value(n) for n in input_names]
        return self.context.builder.add_node(self.op_type, values, self._attributes).name


def _op_block(op_type: str, doc: str) -> type[_Elementwise]:
    return type(op_type, (_Elementwise,), {"op_type": op_type, "__doc__": doc})


Add = _op_block("Add", "Adds its two inputs.")
Sub = _op_block("Sub", "Subtracts its second input from its first.")
Mul = _op_block("Mul", "Multiplies its two inputs.")
Div = _op_block("Div", "Divides its first input by its second.")
MatMul = _op_block("MatMul", "Matrix product of its two inputs.")
Neg = _op_block("Neg", "Negates its input.")
Abs = _op_block("Abs", "Absolute value of its input.")
Log = _op_block("Log", "Natural logarithm of its input.")
Exp = _op_block("Exp", "Exponential of its input.")
Sqrt = _op_block("Sqrt", "Square root of its input.")
Sigmoid = _op_block("Sigmoid", "Logistic sigmoid of its input.")
Relu = _op_block("Relu", "Rectified linear unit.")
Tanh = _op_block("Tanh", "Hyperbolic tangent.")
Identity = _op_block("Identity", "Returns its input.")


class Softmax(_Elementwise):
    """Softmax over ``axis`` (default the last)."""

    op_type = "Softmax"

    def __init__(self, axis: int = -1):
        super().__init__(axis=axis)


class LogSoftmax(_Elementwise):
    """Log-softmax over ``axis`` (default the last)."""

    op_type = "LogSoftmax"

    def __init__(self, axis: int = -1):
        super().__init__(axis=axis)


class Pow(Block):
    """Raises its input to a constant ``exponent``."""

    def __init__(self, exponent: float):
        super().__init__()
        self._exponent = exponent

    def build(self, input_name: str) -> str:
        x = self._value(input_name)
        return self.op.Pow(x, self.context.builder.like(x, self._exponent)).name


class _Reduce(Block):
    op_type = ""

    def __init__(self, axes: list[int] | None = None, keepdims: bool = False):
        super().__init__()
        self._axes, self._keepdims = axes, keepdims

    def build(self, input_name: str) -> str:
        return self.context.builder.reduce(self.op_type, self._value(input_name), self._axes, self._keepdims).name


class ReduceMean(_Reduce):
    """Mean over ``axes`` (default: all, to a scalar)."""

    op_type = "ReduceMean"


class ReduceSum(_Reduce):
    """Sum over ``axes`` (default: all, to a scalar)."""

    op_type = "ReduceSum"


class Clip(Block):
    """Clips its input to ``[clip_min, clip_max]`` (either may be None)."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = None):
        super().__init__()
        self._min, self._max = clip_min, clip_max

    def build(self, input_name: str) -> str:
        x = self._value(input_name)
        b = self.context.builder
        lo = b.like(x, self._min) if self._min is not None else None
        hi = b.like(x, self._max) if self._max is not None else None
        return self.op.Clip(x, lo, hi).name


class Cast(Block):
    """Casts its input to ``to`` (an ``onnx.TensorProto`` data type number)."""

    def __init__(self, to: int):
        super().__init__()
        self._to = int(to)

    def build(self, input_name: str) -> str:
        return self.op.Cast(self._value(input_name), to=self._to).name


class Constant(Block):
    """A constant value (numpy array or Python number)."""

    def __init__(self, value, dtype=None):
        super().__init__()
        self._value_array = np.asarray(value, dtype=dtype)

    def build(self) -> str:
        return self.context.builder.const(self._value_array).name


class PassThrough(Block):
    """Returns its input name unchanged (e.g. a model whose output already is the loss)."""

    def build(self, input_name: str) -> str:
        return input_name


class InputLike(Block):
    """Adds a graph input called ``input_name`` with the type and shape of ``like_name``."""

    def __init__(self, like_name: str):
        super().__init__()
        self._like = like_name

    def build(self, input_name: str) -> str:
        like = self._value(self._like)
        self.context.graph.inputs.append(ir.Value(name=input_name, type=like.type, shape=like.shape))
        return input_name
