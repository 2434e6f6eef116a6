"""Translations of reductions whose gradient or export the exporter gets wrong.

``aten.max.dim`` / ``aten.min.dim`` (``x.max(dim)``, ``torch.min(x, dim)``) return values and
indices; PyTorch sends the values' gradient to the returned index alone, the first of equal
elements. The exporter computes the values with ``ReduceMax``, whose gradient splits among ties
(``amax``'s definition): with ties the parameters got other gradients. Ours gathers the values at
the ``ArgMax`` indices, so the gradient goes where PyTorch's goes.

``aten.amax`` / ``aten.amin`` over all axes (``x.amax()``, ``dim=()``) do not export at all
(torchlib's function requires ``dim``); ours reduces every axis. Both, and ``max``/``min`` over a
dim, return NaN where a NaN is among the reduced elements (and its index), as PyTorch: onnxruntime's
reductions and ArgMax keep a NaN only where it comes first. So do ``argmax``/``argmin`` and the
±inf vector norms.

``aten.std.correction`` (and ``std_mean``) and ``aten.linalg_vector_norm`` of orders other than 0, 1, 2 and ±inf
end in a root, whose infinite derivative at 0 times the zero gradient inside made NaN where
every element is equal (std) or zero (the norm); PyTorch defines the gradient there as 0, and so
do ours (the root taken of 1 where the value is 0, and 0 chosen).
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript import opset18 as op


def _nan_flags(x):
    """1 where ``x`` is NaN, else 0, in ``x``'s type."""
    return op.CastLike(op.IsNaN(x), x)


def _may_hold_nan(x) -> bool:
    """Whether ``x`` is of a floating type (integers and booleans hold no NaN; IsNaN refuses them)."""
    return x.dtype is None or x.dtype.is_floating_point()


def _first_extreme(x, dim: int, largest: bool):
    """The index of the first largest (smallest) element along ``dim``, kept as an axis of 1;
    the first NaN's where the slice holds one, as PyTorch's (onnxruntime's ArgMax/ArgMin skip
    a NaN unless it comes first)."""
    select = op.ArgMax if largest else op.ArgMin
    boolean = x.dtype is not None and x.dtype == ir.DataType.BOOL
    indices = select(op.Cast(x, to=ir.DataType.INT32) if boolean else x, axis=dim, keepdims=1)  # no bool ArgMax
    return _first_nan_or(x, dim, indices) if _may_hold_nan(x) else indices


def _first_nan_or(x, dim: int, indices):
    """``indices`` (along ``dim``, kept as an axis of 1), the first NaN's index instead where the
    slice holds one: where PyTorch's max, min, argmax and median point."""
    flags = _nan_flags(x)
    first_nan = op.ArgMax(flags, axis=dim, keepdims=1)
    has_nan = op.Cast(op.GatherElements(flags, first_nan, axis=dim), to=ir.DataType.BOOL)
    return op.Where(has_nan, first_nan, indices)


def _of_a_scalar(x):
    """A 0-d tensor's value and index (0) along its only "dim", as ``max``, ``median``,
    ``kthvalue`` and ``cummax`` give them."""
    return op.Identity(x), op.Constant(value_int=0)


def _value_at_index(x, dim: int, keepdim: bool, largest: bool):
    if len(x.shape) == 0:
        return _of_a_scalar(x)
    indices = _first_extreme(x, dim, largest)
    values = op.GatherElements(x, indices, axis=dim)
    if keepdim:
        return values, indices
    axes = op.Constant(value_ints=[dim])
    return op.Squeeze(values, axes), op.Squeeze(indices, axes)


def max_dim(x, dim: int, keepdim: bool = False):
    """``aten.max.dim``: the values gathered at the first maximum's index."""
    return _value_at_index(x, dim, keepdim, largest=True)


def min_dim(x, dim: int, keepdim: bool = False):
    """``aten.min.dim``: the values gathered at the first minimum's index."""
    return _value_at_index(x, dim, keepdim, largest=False)


def _arg_extreme(x, dim, keepdim: bool, largest: bool):
    """``aten.argmax`` / ``aten.argmin``: :func:`_first_extreme`; with no ``dim``, the index in
    the flattened tensor (of shape ``[1] * rank`` with ``keepdim``, as PyTorch's)."""
    rank = len(x.shape) if x.shape is not None else None
    if rank == 0:
        return op.Constant(value_int=0)
    if dim is not None:
        indices = _first_extreme(x, dim, largest)
        return indices if keepdim else op.Squeeze(indices, op.Constant(value_ints=[dim]))
    indices = _first_extreme(op.Reshape(x, op.Constant(value_ints=[-1])), 0, largest)
    if keepdim and rank is not None:
        return op.Reshape(indices, op.Constant(value_ints=[1] * rank))
    return op.Squeeze(indices, op.Constant(value_ints=[0]))


def argmax(x, dim=None, keepdim: bool = False):
    """``aten.argmax``: see :func:`_arg_extreme` (the exporter's ArgMax skipped NaNs)."""
    return _arg_extreme(x, dim, keepdim, largest=True)


def argmin(x, dim=None, keepdim: bool = False):
    """``aten.argmin``: see :func:`_arg_extreme`."""
    return _arg_extreme(x, dim, keepdim, largest=False)


def _axes(dim):
    """A reduction's axes input: None (every axis) for no dim or an empty list."""
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return None
    return op.Constant(value_ints=list(dim) if isinstance(dim, (list, tuple)) else [dim])


def _reduce(function, x, axes, keepdim: bool):
    """``function`` (an ONNX reduction) of ``x`` over ``axes`` (None: every axis)."""
    if axes is None:
        return function(x, keepdims=int(keepdim))
    return function(x, axes, keepdims=int(keepdim))


def _extreme(x, dim, keepdim: bool, reduce):
    """``reduce`` (ReduceMax or ReduceMin) over ``dim``, NaN where a NaN is among the reduced
    elements, as PyTorch's (onnxruntime's kernels keep a NaN only where it comes first)."""
    if x.shape is not None and len(x.shape) == 0:
        return op.Identity(x)
    axes = _axes(dim)
    result = _reduce(reduce, x, axes, keepdim)
    if not _may_hold_nan(x):
        return result
    has_nan = op.Cast(_reduce(op.ReduceMax, _nan_flags(x), axes, keepdim), to=ir.DataType.BOOL)
    return op.Where(has_nan, op.CastLike(op.Constant(value_float=math.nan), x), result)


def amax(x, dim=(), keepdim: bool = False):
    """``aten.amax``, ``dim=()`` reducing every axis (the gradient shared among ties, as PyTorch's)."""
    return _extreme(x, dim, keepdim, op.ReduceMax)


def amin(x, dim=(), keepdim: bool = False):
    """``aten.amin``, ``dim=()`` reducing every axis (the gradient shared among ties, as PyTorch's)."""
    return _extreme(x, dim, keepdim, op.ReduceMin)


def max_all(x):
    """``aten.max.default`` (``x.max()``): the largest element, NaN if one is NaN."""
    return _extreme(x, (), False, op.ReduceMax)


def min_all(x):
    """``aten.min.default`` (``x.min()``): the smallest element, NaN if one is NaN."""
    return _extreme(x, (), False, op.ReduceMin)


def _root_zero_at_zero(value, root):
    """``root(value)`` where ``value`` is not 0, and 0 where it is, through a branch whose argument
    is never 0: PyTorch's std and norms define the gradient there as 0, where the root's
    derivative (infinite) times the inner zero gradient would be NaN."""
    zero = op.CastLike(op.Constant(value_float=0.0), value)
    at_zero = op.Equal(value, zero)
    return op.Where(at_zero, zero, root(op.Where(at_zero, op.CastLike(op.Constant(value_float=1.0), value), value)))


def std_correction(x, dim=None, correction=None, keepdim: bool = False):
    """``aten.std.correction``: the root of the corrected variance, 0 (and a 0 gradient, as
    PyTorch's) where every element is equal."""
    correction = 1.0 if correction is None else float(correction)
    axes = _axes(dim)
    deviation = op.Sub(x, _reduce(op.ReduceMean, x, axes, True))
    total = _reduce(op.ReduceSum, op.Mul(deviation, deviation), axes, keepdim)
    sizes = op.Shape(x) if axes is None else op.Gather(op.Shape(x), axes, axis=0)
    count = op.CastLike(op.ReduceProd(sizes, keepdims=0), x)
    variance = op.Div(total, op.Sub(count, op.CastLike(op.Constant(value_float=correction), x)))
    return _root_zero_at_zero(variance, op.Sqrt)


def std_mean_correction(x, dim=None, correction=None, keepdim: bool = False):
    """``aten.std_mean.correction`` (``torch.std_mean``): :func:`std_correction` and the mean (the
    exporter's plain root gave NaN gradients where every element is equal)."""
    return std_correction(x, dim, correction, keepdim), _reduce(op.ReduceMean, x, _axes(dim), keepdim)


def linalg_vector_norm(x, ord=2.0, dim=None, keepdim: bool = False, dtype=None):  # noqa: A002 (aten's name)
    """``aten.linalg_vector_norm``: as the exporter's for orders inf, -inf, 0, 1 and 2 (whose
    gradient rules handle zero); other orders ``(Σ|x|^p)^(1/p)`` with PyTorch's 0 gradient at a
    zero vector (the exporter's root gave NaN there), and for orders below 1 at zero elements."""
    if dtype is not None and dtype != -1:
        x = op.Cast(x, to=dtype)
    axes = _axes(dim)  # None: every axis (kept as 1s with keepdim, as PyTorch's)
    ord = float(ord)
    if math.isinf(ord):  # NaN where one is among the elements, as PyTorch's
        return _extreme(op.Abs(x), dim, keepdim, op.ReduceMax if ord > 0 else op.ReduceMin)
    if ord == 0.0:  # a count, whose gradient is 0 (PyTorch's): a term valued 0 carries it to x
        nonzero = op.CastLike(op.Cast(x, to=ir.DataType.BOOL), x)
        zero = op.CastLike(op.Constant(value_float=0.0), x)
        finite = op.Where(op.Or(op.IsInf(x), op.IsNaN(x)), zero, x)
        return _reduce(op.ReduceSum, op.Add(nonzero, op.Mul(finite, zero)), axes, keepdim)
    if ord == 1.0:
        return _reduce(op.ReduceL1, x, axes, keepdim)
    if ord == 2.0:
        return _reduce(op.ReduceL2, x, axes, keepdim)
    magnitude = x if ord > 0 and ord % 2 == 0 else op.Abs(x)
    exponent = op.CastLike(op.Constant(value_float=ord), x)
    if 0 < ord < 1:  # |x|^p's derivative is infinite at 0: PyTorch's gradient there is 0
        powers = _root_zero_at_zero(magnitude, lambda value: op.Pow(value, exponent))
    else:
        powers = op.Pow(magnitude, exponent)
    total = _reduce(op.ReduceSum, powers, axes, keepdim)
    inverse = op.CastLike(op.Constant(value_float=1.0 / ord), x)
    return _root_zero_at_zero(total, lambda value: op.Pow(value, inverse))
