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

from onnxtrain.ir import io
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

    def __init__(self, temp_file_name: str | None = None):
        # temp_file_name: upstream's scratch file for models over 2 GB; onnx_ir needs none
        self.base: ir.Model | None = None
        self.context: BuildContext | None = None

    @abstractmethod
    def build(self, *args, **kwargs):
        """Add this block's nodes; take and return value names."""

    def __call__(self, *args, **kwargs):
        ctx = active()
        self.context, self.base = ctx, ctx.ir_model
        return self.build(*args, **kwargs)

    def infer_shapes_on_base(self):
        """The model being built, shape-inferred by ONNX, as an ``onnx.ModelProto`` (upstream's)."""
        return io.to_proto(io.infer_shapes(io.load_model(active().model)))

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


class _Binary(_Elementwise):
    """Two inputs, under upstream's argument names (``Add()(input_name1=..., input_name2=...)``)."""

    def build(self, input_name1: str, input_name2: str) -> str:
        return super().build(input_name1, input_name2)


class _Unary(_Elementwise):
    """One input, under upstream's argument name (``input_name``)."""

    def build(self, input_name: str) -> str:
        return super().build(input_name)


def _op_block(op_type: str, doc: str, base: type[_Elementwise]) -> type[_Elementwise]:
    return type(op_type, (base,), {"op_type": op_type, "__doc__": doc})


Add = _op_block("Add", "Adds its two inputs.", _Binary)
Sub = _op_block("Sub", "Subtracts its second input from its first.", _Binary)
Mul = _op_block("Mul", "Multiplies its two inputs.", _Binary)
Div = _op_block("Div", "Divides its first input by its second.", _Binary)
MatMul = _op_block("MatMul", "Matrix product of its two inputs.", _Binary)
Neg = _op_block("Neg", "Negates its input.", _Unary)
Abs = _op_block("Abs", "Absolute value of its input.", _Unary)
Log = _op_block("Log", "Natural logarithm of its input.", _Unary)
Exp = _op_block("Exp", "Exponential of its input.", _Unary)
Sqrt = _op_block("Sqrt", "Square root of its input.", _Unary)
Sigmoid = _op_block("Sigmoid", "Logistic sigmoid of its input.", _Unary)
Relu = _op_block("Relu", "Rectified linear unit.", _Unary)
Tanh = _op_block("Tanh", "Hyperbolic tangent.", _Unary)
Identity = _op_block("Identity", "Returns its input.", _Unary)


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

    def build(self, pow_input_name: str) -> str:
        x = self._value(pow_input_name)
        return self.op.Pow(x, self.context.builder.like(x, self._exponent)).name


class _Reduce(Block):
    """``keepdims`` comes first, as in upstream's blocks (``ReduceMean(False)``); its default here
    is False: over all axes the result is a scalar (upstream's default keeps the dims, ``[1, 1]``
    for a matrix, the same value)."""

    op_type = ""

    def __init__(self, keepdims: bool = False, axes: list[int] | None = None):
        super().__init__()
        if not isinstance(keepdims, (bool, int)):
            raise TypeError(f"{type(self).__name__}: keepdims must be a bool, got {keepdims!r} "
                            f"(reduce over some axes with axes=[...])")
        self._axes, self._keepdims = axes, bool(keepdims)

    def build(self, input_name: str) -> str:
        return self.context.builder.reduce(self.op_type, self._value(input_name), self._axes, self._keepdims).name


class ReduceMean(_Reduce):
    """Mean over ``axes`` (default: all, to a scalar unless ``keepdims``)."""

    op_type = "ReduceMean"


class ReduceSum(_Reduce):
    """Sum over ``axes`` (default: all, to a scalar unless ``keepdims``)."""

    op_type = "ReduceSum"


class Clip(Block):
    """Clips its input to ``[clip_min, clip_max]`` (either may be None)."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = None):
        super().__init__()
        self._min, self._max = clip_min, clip_max

    def build(self, clip_input_name: str) -> str:
        x = self._value(clip_input_name)
        b = self.context.builder
        lo = b.like(x, self._min) if self._min is not None else None
        hi = b.like(x, self._max) if self._max is not None else None
        return self.op.Clip(x, lo, hi).name


class Cast(Block):
    """Casts its input to ``to`` (an ``onnx.TensorProto`` data type number)."""

    def __init__(self, to: int):
        super().__init__()
        self._to = int(to)

    def build(self, cast_input_name: str) -> str:
        return self.op.Cast(self._value(cast_input_name), to=self._to).name


class Constant(Block):
    """A constant value, given positionally or as ``value_float=`` (upstream's slot: float32,
    whatever the number's type, as upstream's ``Constant(value_float)``; ``Constant(2)`` times a
    float loss is a float model), or as ``value=`` (a numpy array or scalar keeps its dtype,
    Python floats become float32 and Python ints int64). ``dtype`` overrides either.
    """

    def __init__(self, value_float=None, dtype=None, *, value=None):
        super().__init__()
        if (value_float is None) == (value is None):
            raise TypeError("Constant takes one value: Constant(x), Constant(value_float=x) (upstream's "
                            "keyword) or Constant(value=array)")
        if value is None and dtype is None:  # upstream's slot: a float32 constant, whatever the number's type
            dtype = np.float32
        value = value_float if value is None else value
        array = np.asarray(value, dtype=dtype)
        if dtype is None and array.dtype == np.float64 and not isinstance(value, (np.ndarray, np.generic)):
            array = array.astype(np.float32)
        self._value_array = array

    def build(self) -> str:
        return self.context.builder.const(self._value_array).name


class PassThrough(Block):
    """Returns its input names unchanged (e.g. a model whose outputs already are the loss, then
    other values): one name as it is, several as a tuple (upstream's)."""

    def build(self, *input_names: str) -> str | tuple[str, ...]:
        if not input_names:
            raise TypeError("PassThrough takes at least one input name")
        return input_names[0] if len(input_names) == 1 else input_names


class InputLike(Block):
    """Adds a graph input called ``input_name`` (default: a fresh name) with the type and shape of
    ``like`` (a graph input or output, or any value of the model; upstream's argument name)."""

    def __init__(self, like: str):
        super().__init__()
        self._like = like

    def build(self, input_name: str | None = None) -> str:
        like = self._value(self._like)
        name = input_name or self.context.builder.fresh_name("input")
        self.context.graph.inputs.append(ir.Value(name=name, type=like.type, shape=like.shape))
        return name


class Linear(Block):
    """``alpha * x @ W + beta * b``: a new fully connected layer (a classification head on a
    base model, as upstream's block), whose weight ``W`` (``[in_features, out_features]``) and
    bias ``b`` are parameters to train. They start as ``torch.nn.Linear``'s do, uniform in
    ``±1 / sqrt(in_features)`` (``seed`` makes that draw repeatable), and are named
    ``<name>.weight`` and ``<name>.bias`` (``name`` made unique in the model).

    Example:
        >>> from onnxtrain import onnxblock
        >>> class Head(onnxblock.TrainingBlock):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.linear, self.loss = onnxblock.blocks.Linear(512, 10), onnxblock.loss.CrossEntropyLoss()
        ...     def build(self, features):
        ...         return self.loss(self.linear(features))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, alpha: float = 1.0,
                 beta: float = 1.0, *, name: str = "linear", seed: int | None = None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"Linear needs positive sizes, got in_features={in_features}, "
                             f"out_features={out_features}")
        self._sizes = (int(in_features), int(out_features))
        self._bias, self._alpha, self._beta = bias, float(alpha), float(beta)
        self._name, self._seed = name, seed

    def _layer_name(self) -> str:
        """``name``, or ``name_1``, ``name_2``, ... : the first whose parameters' names are free."""
        def taken(prefix: str) -> bool:
            return any(self.context.find(f"{prefix}.{suffix}") is not None for suffix in ("weight", "bias"))

        prefix, count = self._name, 0
        while taken(prefix):
            count += 1
            prefix = f"{self._name}_{count}"
        return prefix

    def _parameter(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                         shape=ir.Shape(array.shape), const_value=ir.tensor(array, name=name))
        self.context.graph.register_initializer(value)
        self.context.new_parameters.append(name)
        return value

    def build(self, linear_input_name: str) -> str:
        x = self._value(linear_input_name)
        dtype = x.dtype.numpy() if x.dtype is not None and x.dtype.is_floating_point() else np.float32
        rng = np.random.default_rng(self._seed)
        in_features, out_features = self._sizes
        bound = 1.0 / np.sqrt(in_features)
        layer = self._layer_name()
        builder = self.context.builder
        weight = self._parameter(f"{layer}.weight",
                                 rng.uniform(-bound, bound, (in_features, out_features)).astype(dtype))
        out = self.op.MatMul(x, weight)
        if self._alpha != 1.0:
            out = self.op.Mul(out, builder.like(weight, self._alpha))
        if self._bias:
            bias = self._parameter(f"{layer}.bias", rng.uniform(-bound, bound, (out_features,)).astype(dtype))
            if self._beta != 1.0:
                bias = self.op.Mul(bias, builder.like(bias, self._beta))
            out = self.op.Add(out, bias)
        return out.name


class ReduceAllL2(Block):
    """The L2 norm of all its inputs together, ``sqrt(sum of every element squared)`` (upstream's
    block is onnxruntime's training-only ``com.microsoft.ReduceAllL2``; this one uses standard ops)."""

    def build(self, *input_names: str) -> str:
        builder = self.context.builder
        squares = [builder.reduce("ReduceSumSquare", self._value(n), None, keepdims=False) for n in input_names]
        total = squares[0] if len(squares) == 1 else self.op.Sum(*squares)
        return self.op.Sqrt(total).name


class SequenceConstruct(Block):
    """A sequence of its inputs (``SequenceConstruct``), e.g. to pass several tensors to a block
    that takes one sequence."""

    def build(self, *sequence_input_names: str) -> str:
        return self.op.SequenceConstruct(*[self._value(n) for n in sequence_input_names]).name


class LabelEncoder(Block):
    """Maps labels through a table (``ai.onnx.ml.LabelEncoder``, upstream's arguments): e.g. string
    class names to the integer labels a loss takes, inside the training model."""

    def __init__(self, default_float: float = 0.0, default_int64: int = -1, default_string: str = "_Unused",
                 keys_floats=None, keys_int64s=None, keys_strings=None, values_floats=None,
                 values_int64s=None, values_strings=None):
        super().__init__()
        tables = {name: list(given) for name, given in (
            ("keys_floats", keys_floats), ("keys_int64s", keys_int64s), ("keys_strings", keys_strings),
            ("values_floats", values_floats), ("values_int64s", values_int64s), ("values_strings", values_strings),
        ) if given is not None}
        keys = [table for name, table in tables.items() if name.startswith("keys_")]
        values = [table for name, table in tables.items() if name.startswith("values_")]
        if len(keys) != 1 or len(values) != 1 or len(keys[0]) != len(values[0]):
            raise ValueError("LabelEncoder needs one list of keys and one list of values, of the same length")
        self._attributes = {"default_float": float(default_float), "default_int64": int(default_int64),
                            "default_string": default_string, **tables}

    def build(self, label_encoder_input_name: str) -> str:
        opsets = self.context.ir_model.opset_imports
        opsets.setdefault(_ML_DOMAIN, _LABEL_ENCODER_OPSET)
        out = self.op.LabelEncoder(self._value(label_encoder_input_name), _domain=_ML_DOMAIN, **self._attributes)
        out.type = ir.TensorType(self._output_dtype)
        return out.name

    @property
    def _output_dtype(self) -> ir.DataType:
        for attribute, dtype in (("values_int64s", ir.DataType.INT64), ("values_floats", ir.DataType.FLOAT)):
            if attribute in self._attributes:
                return dtype
        return ir.DataType.STRING


_ML_DOMAIN = "ai.onnx.ml"
_LABEL_ENCODER_OPSET = 2  # keys and values as typed lists (attributes), as upstream's block writes them
