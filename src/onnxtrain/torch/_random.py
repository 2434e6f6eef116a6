"""Translations of random draws that the exporter gets wrong or has none for.

Every draw here is a fresh one on each run (onnxruntime's random ops without a seed), from
another stream than PyTorch's: the same ``torch.manual_seed`` gives other numbers, with the same
distribution.

- ``torch.randint`` (and ``randint_like``): torchlib floors a float32 ``U(0, 1)`` draw scaled to
  the range, which skips integers beyond 2^24 (``randint(0, 2**26)`` drew only multiples of 4 in
  its upper half) and can round up to ``high`` itself. Ours floors a float64 draw over
  ``[low, high)`` and caps it at ``high - 1``.
- ``torch.multinomial(..., replacement=False)``: torchlib's ONNX ``Multinomial`` always draws
  with replacement, so the samples repeated. Ours is the Gumbel top-k draw (the ``k`` largest of
  ``log(weight) + Gumbel noise``), whose order is distributed as successive draws without
  replacement.
- ``Tensor.uniform_`` (``prims.uniform``) and ``torch.randperm`` (the order that sorts ``n``
  uniform draws), which the exporter has no translation for.
"""

from __future__ import annotations

from onnxscript import DOUBLE, FLOAT, INT64
from onnxscript import opset18 as op

_DEFAULT_DTYPE = -1  # what the exporter passes for ``dtype=None``


def _no_generator(generator, what: str) -> None:
    if generator is not None:
        raise NotImplementedError(f"{what} with a generator is not supported")


def uniform(shape: INT64, low: float, high: float, dtype: int = FLOAT.dtype, device=None, stride=None,
            generator=None):
    """``prims.uniform`` (``Tensor.uniform_``): ``U(low, high)`` values of ``shape``."""
    _no_generator(generator, "Tensor.uniform_")
    return op.RandomUniformLike(op.ConstantOfShape(shape), low=float(low), high=float(high), dtype=dtype)


def randperm(n: INT64, dtype: int = INT64.dtype, layout=None, device=None, pin_memory=None):
    """``aten.randperm``: a random permutation of ``0 .. n-1`` (every one equally likely)."""
    length = op.Reshape(n, op.Constant(value_ints=[1]))
    draws = op.RandomUniformLike(op.ConstantOfShape(length), dtype=FLOAT.dtype)
    _, order = op.TopK(draws, length, axis=0, largest=1, sorted=1)
    return op.Cast(order, to=dtype)


def _integers(shaper, low, high, dtype: int):
    """Uniform integers in ``[low, high)`` of ``shaper``'s shape, as ``dtype``: the floor of a
    float64 draw over the range, capped at ``high - 1`` (the draw's rounding can reach ``high``)."""
    low, high = op.Cast(low, to=DOUBLE.dtype), op.Cast(high, to=DOUBLE.dtype)
    draws = op.RandomUniformLike(shaper, dtype=DOUBLE.dtype)  # [0, 1)
    values = op.Add(op.Floor(op.Mul(draws, op.Sub(high, low))), low)
    last = op.Sub(high, op.CastLike(op.Constant(value_float=1.0), high))
    return op.Cast(op.Min(values, last), to=dtype)


def randint(high: INT64, size: INT64, dtype: int = INT64.dtype, layout=None, device=None, pin_memory=None):
    """``aten.randint`` (``torch.randint(high, size)``)."""
    return randint_low(op.Constant(value_int=0), high, size, dtype)


def randint_low(low: INT64, high: INT64, size: INT64, dtype: int = INT64.dtype, layout=None, device=None,
                pin_memory=None):
    """``aten.randint.low`` (``torch.randint(low, high, size)``)."""
    return _integers(op.ConstantOfShape(size), low, high, INT64.dtype if dtype == _DEFAULT_DTYPE else dtype)


def randint_like(self, high: INT64, dtype: int = _DEFAULT_DTYPE, layout=None, device=None, pin_memory=None,
                 memory_format=None):
    """``aten.randint_like`` (``torch.randint_like(x, high)``): ``x``'s dtype unless given."""
    return randint_like_low(self, op.Constant(value_int=0), high, dtype)


def randint_like_low(self, low: INT64, high: INT64, dtype: int = _DEFAULT_DTYPE, layout=None, device=None,
                     pin_memory=None, memory_format=None):
    """``aten.randint_like.low_dtype`` (``torch.randint_like(x, low, high)``)."""
    values = _integers(op.ConstantOfShape(op.Shape(self)), low, high, INT64.dtype)
    return op.CastLike(values, self) if dtype == _DEFAULT_DTYPE else op.Cast(values, to=dtype)


def multinomial(self, num_samples: int, replacement: bool = False, generator=None):
    """``aten.multinomial``: ``num_samples`` category indices per row of the (unnormalized,
    non-negative) weights; with replacement ONNX ``Multinomial``, without it the Gumbel top-k."""
    _no_generator(generator, "torch.multinomial")
    one_row = len(self.shape) == 1
    rows = op.Unsqueeze(self, op.Constant(value_ints=[0])) if one_row else self
    logits = op.Log(op.Cast(rows, to=FLOAT.dtype))
    if replacement:
        samples = op.Multinomial(logits, dtype=INT64.dtype, sample_size=int(num_samples))
    else:
        uniform_draws = op.RandomUniformLike(logits, dtype=FLOAT.dtype)  # [0, 1); 0 gives a -inf key
        gumbel = op.Neg(op.Log(op.Neg(op.Log(uniform_draws))))
        _, samples = op.TopK(op.Add(logits, gumbel), op.Constant(value_ints=[int(num_samples)]), axis=-1,
                             largest=1, sorted=1)
    return op.Squeeze(samples, op.Constant(value_ints=[0])) if one_row else samples
