"""Translations of aten ops that PyTorch's ONNX exporter gets wrong for training.

PyTorch's exporter translates training-mode batch normalization
(``aten._native_batch_norm_legit_functional`` with ``training=True``) as inference-mode
BatchNormalization: it normalizes with the running statistics and returns them
unchanged. For training that is wrong twice (the forward uses the wrong statistics and
the buffers never update), so we translate it ourselves into primitive ops that compute
batch statistics and the updated running statistics exactly as PyTorch does.

``aten.embedding_bag`` (nn.EmbeddingBag, every mode) gathers rows into bags with a ScatterND
instead of the exporter's ``Loop``, which has no gradient. ``aten.embedding`` with a padding index
becomes a Gather like the exporter's, plus node
metadata naming the padding index: the Gather gradient rule then gives that row no
gradient, as ``nn.Embedding(padding_idx=...)`` does in PyTorch.

``aten.detach`` (``tensor.detach()``, and the outputs of a ``torch.no_grad()`` region, which
ORTModule's capture marks with one) becomes an Identity with node metadata saying that no
gradient flows through it: the exporter would otherwise decompose it to an alias, and the
gradient graph differentiate through it.

``aten.cross_entropy_loss`` keeps the exporter's ``SoftmaxCrossEntropyLoss`` and adds the
label-smoothing term the exporter drops. ``aten.multilabel_margin_loss`` is ours: the exporter's
ignores the ``-1`` that ends each sample's targets and computes other numbers. ``nn.RReLU``
(``aten.rrelu_with_noise_functional``, which the exporter lacks) draws its slopes in the graph.
``lgamma``, ``digamma`` and ``polygamma`` (orders 0 and 1; ``torch.distributions`` log-probabilities
use them) are asymptotic series with shifts and reflection, in float32 within ~3e-6 of the exact
values (lgamma, absolute) and ~1e-6 relative (digamma, trigamma). Adaptive max pooling (2-D, and
1-D through it) and 3-D adaptive average pooling are pools where the windows tile the input,
and window-by-window otherwise. ``cummax`` and ``cummin`` are scans by doubling that pick
PyTorch's indices (ties and NaNs included); ``erfinv`` is Giles' approximation refined by Newton
steps; ``torch.linalg.inv`` and ``solve`` invert with onnxruntime's ``com.microsoft.Inverse``,
``det`` is ONNX ``Det``. Fake quantization (quantization-aware training) keeps PyTorch's
straight-through gradient, which the exporter's QuantizeLinear/DequantizeLinear pair drops.
``logaddexp``, ``logaddexp2``, ``logcumsumexp``, ``erfc``, ``erfcx``, ``log_ndtr`` and ``sinc``,
which the exporter writes in forms that overflow, are in ``onnxtrain.torch._log_space``;
``max``/``min`` over a dim (the gradient to the returned index), ``amax``/``amin`` over every
axis, ``std`` and p-norms (PyTorch's 0 gradient where the value is 0) are in
``onnxtrain.torch._reductions``; random draws the exporter gets wrong or lacks (``randint``,
``multinomial`` without replacement, ``uniform_``, ``randperm``) in ``onnxtrain.torch._random``.
Nearest-neighbour interpolation reads PyTorch's source pixels (``onnxtrain.torch._nearest``);
window functions are PyTorch's, as constants (``onnxtrain.torch._windows``); antialiased
interpolation takes PyTorch's weights, as two matrix products (``onnxtrain.torch._antialias``).
``atan2`` keeps PyTorch's signed zeros and a
finite gradient on the axes; ``fmax``/``fmin`` (the exporter has none) skip NaNs. Where the exporter's translation computes something
else than PyTorch and no ONNX graph can do better (``instance_norm`` updating running
statistics in training), ours raises
``NotImplementedError``: the export fails, and ORTModule runs the module in PyTorch.
``scatter_reduce`` with ``reduce="mean"`` (which the exporter takes for a plain scatter) and
``index_reduce`` (which it lacks) are sums and counts of ``ScatterElements``.
"""

from __future__ import annotations

import math
import string

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript
import torch
from onnxscript import opset18 as op

from onnxtrain import names
from onnxtrain.ir.shapes import shapes_equal
from onnxtrain.torch import _antialias, _einsum, _log_space, _nearest, _random, _reductions, _windows
from onnxtrain.torch._exporter import fx_argument
from onnxtrain.torch._log_space import constant_like as _like


def batch_norm_functional(input, weight, bias, running_mean, running_var,
                          training: bool = False, momentum: float = 0.1, eps: float = 1e-5):
    """``aten._native_batch_norm_legit_functional``: (out, save_mean, save_rstd, new_running_mean,
    new_running_var), with PyTorch's semantics: batch statistics in training (biased variance
    to normalize, unbiased variance in the running estimate)."""
    rank = len(input.shape)
    per_channel = op.Constant(value_ints=[1, -1] + [1] * (rank - 2))
    flat = op.Constant(value_ints=[-1])
    if not training:
        mean, var = op.Reshape(running_mean, per_channel), op.Reshape(running_var, per_channel)
        centered = op.Sub(input, mean)
    else:
        axes = op.Constant(value_ints=[0, *range(2, rank)])
        mean = op.ReduceMean(input, axes, keepdims=1)
        centered = op.Sub(input, mean)
        # ReduceSumSquare reads `centered` once (Mul + ReduceMean would write a copy first)
        count = op.CastLike(op.Div(op.Size(input), op.Shape(input, start=1, end=2)), input)
        var = op.Div(op.ReduceSumSquare(centered, axes, keepdims=1), count)
    rstd = op.Reciprocal(op.Sqrt(op.Add(var, _number_like(eps, var))))
    # scale per channel first: one full-size Mul instead of two
    scale = rstd if weight is None else op.Mul(rstd, op.Reshape(weight, per_channel))
    out = op.Mul(centered, scale)
    if bias is not None:
        out = op.Add(out, op.Reshape(bias, per_channel))
    save_mean, save_rstd = op.Reshape(mean, flat), op.Reshape(rstd, flat)
    if not training:
        return out, save_mean, save_rstd, running_mean, running_var
    # PyTorch's running variance is the unbiased estimate: var * n / (n - 1)
    count = op.CastLike(op.Div(op.Size(input), op.Shape(input, start=1, end=2)), var)
    one = _number_like(1.0, var)
    unbiased = op.Div(op.Mul(op.Reshape(var, flat), count), op.Sub(count, one))
    keep = _number_like(1.0 - momentum, var)
    take = _number_like(momentum, var)
    new_mean = op.Add(op.Mul(running_mean, keep), op.Mul(save_mean, take))
    new_var = op.Add(op.Mul(running_var, keep), op.Mul(unbiased, take))
    return out, save_mean, save_rstd, new_mean, new_var


def batch_norm_for_artifacts(input, weight, bias, running_mean, running_var,
                             training: bool = False, momentum: float = 0.1, eps: float = 1e-5):
    """``aten._native_batch_norm_legit_functional`` for a model exported to generate artifacts
    from: in training an ONNX ``BatchNormalization(training_mode=1)`` reading the running
    statistics, which ``torch.onnx.export`` keeps as initializers only if a node reads them (it
    drops buffer updates). The artifacts' training model then writes the node's updated
    statistics back after each step, and their eval model normalizes with them (ONNX updates the
    running variance with the biased batch variance, PyTorch with the unbiased one)."""
    if not training:
        return batch_norm_functional(input, weight, bias, running_mean, running_var, False, momentum, eps)
    channels = op.Shape(input, start=1, end=2)
    scale = weight if weight is not None else op.Expand(_number_like(1.0, input), channels)
    shift = bias if bias is not None else op.Expand(_number_like(0.0, input), channels)
    out, new_mean, new_var = op.BatchNormalization(input, scale, shift, running_mean, running_var, epsilon=eps,
                                                   momentum=1.0 - momentum, training_mode=1)
    # the batch statistics aten returns beside (autograd's; a forward graph leaves them unread)
    _, save_mean, save_rstd, _, _ = batch_norm_functional(input, weight, bias, running_mean, running_var, True,
                                                          momentum, eps)
    return out, save_mean, save_rstd, new_mean, new_var


def _negative_out_of_range(indices, size):
    """``indices`` with each negative one moved past ``size``: ONNX's Gather reads a negative
    index from the end, where PyTorch's embedding raises, so a -1 would silently pick the last
    row; moved out of range, it makes onnxruntime fail the run instead (``size - i``, past the
    last valid index). Class labels of a loss: passes/negative_labels.py."""
    invalid = op.Less(indices, op.CastLike(op.Constant(value_int=0), indices))
    return op.Where(invalid, op.Sub(op.CastLike(size, indices), indices), indices)


def embedding(weight, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False, sparse: bool = False):
    """``aten.embedding``: Gather rows of ``weight``; the padding row gets no gradient. With
    ``scale_grad_by_freq``, each row's gradient is divided by how often the batch uses it (a
    gradient-only factor on each gathered row: the values are the rows themselves). A negative
    index fails the run, as PyTorch's raises (ONNX's Gather would read it from the end). With
    ``sparse`` PyTorch's gradient is a sparse tensor of the rows looked up (what SparseAdam and
    SparseSGD take), which onnxruntime's dense gradient cannot stand in for: refused."""
    if sparse:
        raise NotImplementedError("nn.Embedding(sparse=True): its gradient is a sparse tensor of the rows "
                                  "looked up (for SparseAdam, SparseSGD), which ONNX Runtime's dense gradient "
                                  "cannot stand in for; use sparse=False to train the embedding in ONNX Runtime")
    indices = _negative_out_of_range(indices, op.Squeeze(op.Shape(weight, start=0, end=1)))
    out = op.Gather(weight, indices, axis=0)
    if padding_idx is not None and padding_idx >= 0:
        out.producer().metadata_props[names.PADDING_IDX_METADATA] = str(int(padding_idx))
    if not scale_grad_by_freq:
        return out
    flat = op.Reshape(indices, op.Constant(value_ints=[-1]))
    uses = op.ScatterElements(op.Expand(_like(weight, 0.0), op.Shape(weight, start=0, end=1)), flat,
                              op.Expand(_like(weight, 1.0), op.Shape(flat)), axis=0, reduction="add")
    factor = detach(op.Unsqueeze(op.Reciprocal(op.Gather(uses, indices, axis=0)), op.Constant(value_ints=[-1])))
    return _value_with_gradient(out, out, factor)


_BAG_MODES = {0: "sum", 1: "mean", 2: "max"}


def embedding_bag(weight, indices, offsets, scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
                  per_sample_weights=None, include_last_offset: bool = False, padding_idx=None):
    """``aten.embedding_bag`` / ``aten._embedding_bag`` (nn.EmbeddingBag): each index's row
    scattered into its bag (ScatterND with ``add``, or ``max``), which trains with standard ops.
    The exporter's translation loops over the bags with a ``Loop``, which has no gradient.
    Returns (output, offset2bag, bag_size, max_indices)."""
    bag_mode = _BAG_MODES.get(int(mode))
    if scale_grad_by_freq:
        raise NotImplementedError("nn.EmbeddingBag(scale_grad_by_freq=True) is not supported")
    flat = op.Reshape(indices, op.Constant(value_ints=[-1]))
    starts = op.Slice(offsets, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])) \
        if include_last_offset else offsets
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    length = op.Shape(flat)
    # each position's bag: a mark at every bag's start (starts may repeat for empty bags, or equal
    # the length for trailing ones), counted cumulatively
    marks = op.ScatterElements(op.Expand(zero, op.Add(length, one)), starts, op.Expand(one, op.Shape(starts)),
                               axis=0, reduction="add")
    bag = op.Sub(op.Slice(op.CumSum(marks, zero), zero, length), one)
    at_bag = op.Unsqueeze(bag, one)
    rows = op.Gather(weight, flat, axis=0)
    counted = op.Expand(one, length)
    padded = padding_idx is not None and padding_idx >= 0
    if padded:  # padding indices add nothing and count for nothing
        counted = op.Cast(op.Not(op.Equal(flat, op.Constant(value_int=int(padding_idx)))), to=7)
    bags = op.Shape(starts)
    out_shape = op.Concat(bags, op.Shape(weight, start=1), axis=0)
    sizes = op.ScatterElements(op.Expand(zero, bags), bag, counted, axis=0, reduction="add")
    if bag_mode == "max":
        lowest = _number_like(float("-inf"), weight)
        if padded:
            rows = op.Where(op.Unsqueeze(op.Cast(counted, to=9), one), rows, lowest)
        out = op.ScatterND(op.Expand(lowest, out_shape), at_bag, rows, reduction="max")
        out = op.Where(op.IsInf(out, detect_positive=0), _number_like(0.0, out), out)
        # the position of each bag's largest row, per feature (-1 for an empty bag)
        position = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(length, zero), op.Constant(value_int=1)),
                                one)
        won = op.Equal(rows, op.GatherND(out, at_bag))
        winner = op.Where(won, op.Expand(position, op.Shape(rows)), op.Constant(value_int=-1))
        max_indices = op.ScatterND(op.Expand(op.Constant(value_int=-1), out_shape), at_bag, winner, reduction="max")
        return out, op.Identity(bag), sizes, max_indices
    if padded:
        rows = op.Mul(rows, op.Unsqueeze(op.CastLike(counted, rows), one))
    if per_sample_weights is not None:
        rows = op.Mul(rows, op.Unsqueeze(per_sample_weights, one))
    out = op.ScatterND(op.Expand(_number_like(0.0, weight), out_shape), at_bag, rows,
                       reduction="add")
    if bag_mode == "mean":  # an empty bag stays 0
        out = op.Div(out, op.Unsqueeze(op.CastLike(op.Max(sizes, one), out), one))
    if bag_mode == "sum" and not padded:
        # PyTorch's offset2bag is empty here, and the exporter gives the output that shape: a value
        # the graph uses (bag) must not take it
        return out, op.Slice(bag, zero, zero), sizes, op.Identity(sizes)
    return out, op.Identity(bag), sizes, op.Identity(sizes)


def embedding_bag_padding_idx(weight, indices, offsets, scale_grad_by_freq: bool = False, mode: int = 0,
                              sparse: bool = False, per_sample_weights=None, include_last_offset: bool = False,
                              padding_idx=None):
    """``aten.embedding_bag.padding_idx`` (``F.embedding_bag``, which passes its argument as
    given): a negative ``padding_idx`` counts from the last row, as PyTorch; :func:`embedding_bag`
    takes -1 as ``aten._embedding_bag`` does, for no padding."""
    if padding_idx is not None and padding_idx < 0:
        rows = weight.shape[0] if weight.shape is not None else None
        if not isinstance(rows, int):
            raise NotImplementedError("F.embedding_bag with a negative padding_idx needs a weight of static size")
        padding_idx += rows
    return embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
                         include_last_offset, padding_idx)


def _typed(out, like, dims):
    """``out`` with ``like``'s element type and the shape ``dims`` (what a translation it is handed
    to reads)."""
    out.type, out.shape = like.type, ir.Shape(dims)
    return out


def _number_like(value: float, x):
    """``value`` as a 0-d constant of ``x``'s type: a float64 constant cast like ``x`` (a float32
    one cast to double would carry float32's rounding into a float64 model; folding makes it
    one constant of ``x``'s type)."""
    return op.CastLike(op.Constant(value=ir.tensor(np.array(value, dtype=np.float64))), x)


def _scalar(bound) -> bool:
    return bound is None or (bound.shape is not None and len(bound.shape) == 0)


def clamp(x, min=None, max=None):  # noqa: A002  (aten's argument names)
    """``aten.clamp.Tensor`` (number bounds reach it as 0-d tensors): with scalar bounds a Clip,
    whose gradient passes at the bounds as torch's clamp does (the exporter's Max and Min split
    it in half there); with tensor bounds :func:`_clamp_between`."""
    if _scalar(min) and _scalar(max):
        return op.Clip(x, None if min is None else op.CastLike(min, x), None if max is None else op.CastLike(max, x))
    return _clamp_between(x, None if min is None else op.CastLike(min, x),
                          None if max is None else op.CastLike(max, x))


def _clamp_between(x, low, high):
    """``min(max(x, low), high)`` with tensor bounds, each element taken from the one PyTorch's
    gradient goes to: ``x`` inside the bounds (ties included: the exporter's Max and Min split
    the gradient there), ``low`` below them (where ``low < high``), ``high`` above them or where
    ``high < low``, and a detached ``high`` where ``x < low == high`` (PyTorch gives neither bound
    a gradient there). NaN in ``x`` or a bound comes through as PyTorch's."""
    floating = x.dtype is None or x.dtype.is_floating_point()

    def nan_or(value, condition):
        return op.Or(op.IsNaN(value), condition) if floating else condition

    if high is None:
        return op.Where(nan_or(x, op.GreaterOrEqual(x, low)), x, low)
    if low is None:
        return op.Where(nan_or(x, op.LessOrEqual(x, high)), x, high)
    inside = nan_or(x, op.And(op.GreaterOrEqual(x, low), op.LessOrEqual(x, high)))
    low_wins = nan_or(low, op.And(op.Less(x, low), op.Less(low, high)))
    high_wins = nan_or(high, op.Or(op.Greater(x, high), op.Less(high, low)))
    return op.Where(inside, x, op.Where(low_wins, low, op.Where(high_wins, high, detach(high))))


def clamp_min(x, min):  # noqa: A002
    """``aten.clamp_min.Tensor``: :func:`clamp` with a lower bound only."""
    return clamp(x, min, None)


def clamp_max(x, max):  # noqa: A002
    """``aten.clamp_max.Tensor``: :func:`clamp` with an upper bound only."""
    return clamp(x, None, max)


def hardtanh(x, min_val: float = -1.0, max_val: float = 1.0):
    """``aten.hardtanh``: a Clip marked so that its gradient passes strictly inside the bounds, as
    torch's hardtanh (and relu6) backward does."""
    out = op.Clip(x, _number_like(float(min_val), x), _number_like(float(max_val), x))
    out.producer().metadata_props[names.OPEN_CLIP_METADATA] = "1"
    return out


def relu6(x):
    """``aten.relu6``: ``hardtanh(x, 0, 6)``."""
    return hardtanh(x, 0.0, 6.0)


def detach(x):
    """``aten.detach``: the same tensor, through which no gradient flows."""
    out = op.Identity(x)
    out.producer().metadata_props[names.STOP_GRADIENT_METADATA] = "1"
    return out


def _value_with_gradient(value, source, factor=None):
    """``value``, with ``source``'s gradient (times ``factor``) instead of its own:
    ``detach(value) + (source - detach(source)) * factor``, whose second term is exactly 0."""
    carried = op.Sub(source, detach(source))
    if factor is not None:
        carried = op.Mul(carried, factor)
    return op.Add(detach(value), carried)


def _x_log(x, y, log, lowest: float):
    """``x * log(y)`` as PyTorch's ``xlogy`` family computes it and its gradient: 0 where ``x`` is 0
    (NaN where ``y`` is), the gradient to ``x`` ``log(y)`` there too (0 where ``y <= lowest``, the
    log's domain ending), to ``y`` ``x / y``. The exporter's ``Where(x == 0, x, x * log(y))`` gave
    ``x`` a gradient of 1 where it is 0; the branch not taken reads a safe ``y``, so that its
    gradient has no NaN to leak. An integer argument is taken to the other's floating type (both
    integers: float32), as PyTorch promotes them."""
    if _reductions._may_hold_nan(x):
        y = op.CastLike(y, x)
    elif _reductions._may_hold_nan(y):
        x = op.CastLike(x, y)
    else:
        x, y = op.Cast(x, to=ir.DataType.FLOAT), op.Cast(y, to=ir.DataType.FLOAT)
    at_zero = op.And(op.Equal(x, _number_like(0.0, x)), op.Not(op.IsNaN(y)))
    below = op.LessOrEqual(y, _number_like(lowest, y))
    log_at_zero = detach(op.Where(below, _number_like(0.0, y), log(op.Where(below, _number_like(lowest + 1.0, y), y))))
    elsewhere = op.Mul(x, log(op.Where(at_zero, _number_like(lowest + 1.0, y), y)))
    return op.Where(at_zero, op.Mul(x, log_at_zero), elsewhere)


def xlogy(self, other):
    """``aten.xlogy.Tensor``: :func:`_x_log` with ``log``."""
    return _x_log(self, other, op.Log, 0.0)


def xlogy_scalar_other(self, other: float):
    """``aten.xlogy.Scalar_Other`` (``torch.xlogy(x, 3.0)``): :func:`xlogy`."""
    return _x_log(self, _number_like(float(other), self), op.Log, 0.0)


def xlog1py(self, other):
    """``aten.special_xlog1py``: :func:`_x_log` with ``log(1 + y)``."""
    return _x_log(self, other, lambda y: op.Log(op.Add(y, _number_like(1.0, y))), -1.0)


def xlog1py_other_scalar(self, other: float):
    """``aten.special_xlog1py.other_scalar``: :func:`xlog1py`."""
    return xlog1py(self, _number_like(float(other), self))


def floor_divide_scalar(self, other):
    """``aten.floor_divide.Scalar`` (``mask // 2`` on a bool tensor, where the exporter has no
    translation): PyTorch's promotion (a bool tensor by an integer is int64, any integer tensor
    by a float is float32), then torchlib's floored division."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_floor_divide

    if self.dtype is None:
        raise TypeError("floor_divide of a tensor of unknown element type")
    if isinstance(other, float) and not self.dtype.is_floating_point():
        target = ir.DataType.FLOAT
    elif self.dtype == ir.DataType.BOOL:
        target = ir.DataType.INT64
    else:
        target = self.dtype
    if target != self.dtype:
        self = op.Cast(self, to=target)
    return aten_floor_divide(self, op.Constant(value=ir.tensor(_wrapped_number(other, target))))


def instance_norm(input, weight=None, bias=None, running_mean=None, running_var=None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5, cudnn_enabled: bool = False):
    """``aten.instance_norm``: the exporter's translation, except where it would be wrong: with
    batch statistics and running statistics (``track_running_stats=True`` in training) PyTorch
    also updates the running statistics in place, which no translation of this op can give
    back (NotImplementedError: the export fails, ORTModule runs the module in PyTorch)."""
    if use_input_stats and running_mean is not None:
        raise NotImplementedError("InstanceNorm with track_running_stats=True in training updates its running "
                                  "statistics in place, which the exported graph cannot")
    from onnxscript.function_libs.torch_lib.ops.core import aten_instance_norm
    return aten_instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps,
                              cudnn_enabled)


def _src_like_index(src, index):
    """``src`` cut to ``index``'s shape: PyTorch scatters read only the part of ``src`` that ``index``
    covers (it may be smaller), ONNX's ScatterElements wants the two shapes equal."""
    if src.shape is not None and index.shape is not None and list(src.shape) == list(index.shape):
        return src
    rank = len(index.shape)
    out = op.Slice(src, op.Constant(value_ints=[0] * rank), op.Shape(index), op.Constant(value_ints=list(range(rank))))
    # torchlib's scatter reads the rank and type (not inferred here where src needs no gradient)
    return _typed(out, src, list(index.shape))


def slice_scatter(self, src, dim: int = 0, start=None, end=None, step=1):
    """``aten.slice_scatter`` (``y[:, a:b] = ...`` on a traced tensor): ``self`` with ``src``
    written over ``self[start:end]`` along ``dim``. With a unit step, bounds known at export and
    the axis's size static: the parts of ``self`` before and after, and ``src``, joined by one
    Concat, whose gradient is a Split. The exporter's translation is a ScatterND with both
    tensors transposed to put ``dim`` first, and back (Funnel's ``positional_attn *= cls_mask``
    on a slice: ~53 ms forward and as much backward against eager's ~10). Otherwise it is the
    exporter's."""
    rank = len(self.shape) if self.shape is not None else None
    size = self.shape[dim] if rank is not None and -rank <= dim < rank else None
    if step == 1 and isinstance(size, int) and all(bound is None or isinstance(bound, int) for bound in (start, end)):
        dim %= rank

        def position(bound, default):  # Python's slice bounds: from the end when negative, clamped
            bound = default if bound is None else bound
            return min(max(bound + size if bound < 0 else bound, 0), size)

        first = position(start, 0)
        last = max(position(end, size), first)
        axis = op.Constant(value_ints=[dim])
        pieces = [op.Slice(self, op.Constant(value_ints=[0]), op.Constant(value_ints=[first]), axis)] if first else []
        pieces.append(src)
        if last < size:
            pieces.append(op.Slice(self, op.Constant(value_ints=[last]), op.Constant(value_ints=[size]), axis))
        return op.Concat(*pieces, axis=dim) if len(pieces) > 1 else op.Identity(src)
    from onnxscript.function_libs.torch_lib.ops.core import aten_slice_scatter
    return aten_slice_scatter(self, src, dim, start, end, step)


def scatter_src(self, dim: int, index, src):
    """``aten.scatter.src``: the exporter's translation, with ``src`` cut to ``index``'s shape."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_scatter_src
    return aten_scatter_src(self, dim, index, _src_like_index(src, index))


def scatter_add(self, dim: int, index, src):
    """``aten.scatter_add``: the exporter's translation, with ``src`` cut to ``index``'s shape."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_scatter_add
    return aten_scatter_add(self, dim, index, _src_like_index(src, index))


def scatter_reduce(self, dim: int, index, src, reduce: str, include_self: bool = True):
    """``aten.scatter_reduce.two``: the exporter's translation with ``src`` cut to ``index``'s
    shape; ``reduce="mean"`` (which the exporter turns into a plain scatter) is ours."""
    src = _src_like_index(src, index)
    if reduce == "mean":
        return _scatter_mean(self, dim, index, src, include_self)
    from onnxscript.function_libs.torch_lib.ops.core import aten_scatter_reduce
    return aten_scatter_reduce(self, dim, index, src, reduce, include_self=include_self)


def _scatter_mean(self, dim: int, index, src, include_self: bool):
    """PyTorch's ``scatter_reduce(reduce="mean")``: at each position the mean of the updates
    scattered there and, with ``include_self``, of its own value; a position no update reaches
    keeps its value. The mean of integers is floored, as PyTorch's is. Sums and counts are
    ``ScatterElements(reduction="add")``, so the gradient is ``dy / count`` at each term."""
    shape = op.Shape(self)
    if len(self.shape) == 0:  # ScatterElements wants rank >= 1: a 0-d self is one element
        self, index, src = (op.Reshape(t, op.Constant(value_ints=[-1])) for t in (self, index, src))
    zero, one = _number_like(0.0, self), _number_like(1.0, self)
    start = self if include_self else op.Expand(zero, op.Shape(self))
    total = op.ScatterElements(start, index, src, axis=dim, reduction="add")
    count = op.ScatterElements(op.Expand(one if include_self else zero, op.Shape(self)), index,
                               op.Expand(one, op.Shape(index)), axis=dim, reduction="add")
    reached = op.Greater(count, zero)
    count = op.Max(count, one)  # 1 where nothing was scattered (replaced by self below)
    if self.dtype is not None and self.dtype.is_floating_point():
        mean = op.Div(total, count)
    else:  # floored: the remainder of a positive count takes the divisor's sign
        mean = op.Div(op.Sub(total, op.Mod(total, count)), count)
    if not include_self:
        mean = op.Where(reached, mean, self)
    return op.Reshape(mean, shape)


def index_reduce(self, dim: int, index, source, reduce: str, include_self: bool = True):
    """``aten.index_reduce``: ``scatter_reduce`` with ``index`` (one entry per slice of ``source``
    along ``dim``) spread over each slice; the exporter has no translation."""
    rank = max(len(self.shape), 1)
    dim = dim % rank
    if len(source.shape) == 0:
        source = op.Reshape(source, op.Constant(value_ints=[1]))
    along = op.Reshape(index, op.Constant(value_ints=[1] * dim + [-1] + [1] * (rank - dim - 1)))
    spread = _typed(op.Expand(along, op.Shape(source)), index, list(source.shape))
    if reduce == "mean":
        return _scatter_mean(self, dim, spread, source, include_self)
    from onnxscript.function_libs.torch_lib.ops.core import aten_scatter_reduce
    return aten_scatter_reduce(self, dim, spread, source, reduce, include_self=include_self)


def safe_softmax(x, dim: int, dtype=None):
    """``aten._safe_softmax`` (PyTorch's attention decompositions): softmax along ``dim``, 0 for
    a slice that is -inf throughout, with a zero gradient there. The exporter's decomposition
    took the softmax of the -inf slice (NaN) and chose 0 after it, and the softmax's gradient
    rule made NaN of that row's zero gradient."""
    if dtype is not None:
        x = op.Cast(x, to=dtype)
    masked = op.CastLike(op.Equal(x, _number_like(-math.inf, x)), x)
    dead = op.Cast(op.ReduceMin(masked, op.Constant(value_ints=[dim]), keepdims=1), to=ir.DataType.BOOL)
    zero = _number_like(0.0, x)
    return op.Where(dead, zero, op.Softmax(op.Where(dead, zero, x), axis=dim))


def _attention_rows_kept(attn_mask):
    """For a float mask: the mask with its fully masked rows (every entry -inf) made 0, and the
    ``[..., T, 1]`` factor (1 where the row keeps a key, else 0) that zeroes those rows' output,
    as PyTorch's attention does (a softmax of -inf everywhere is NaN). None for other masks."""
    if attn_mask is None or attn_mask.dtype is None or not attn_mask.dtype.is_floating_point():
        return None
    largest = op.ReduceMax(attn_mask, op.Constant(value_ints=[-1]), keepdims=1)
    kept = op.Not(op.And(op.IsInf(largest), op.Less(largest, _like(attn_mask, 0.0))))
    return op.Where(kept, attn_mask, _like(attn_mask, 0.0)), op.CastLike(kept, attn_mask)


def _attention_with_dropout(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale,
                            enable_gqa: bool):
    """The exporter's attention (4-D inputs) with a training-mode Dropout of the attention weights:
    PyTorch drops them with probability ``dropout_p`` whatever the module's mode (Hugging Face
    passes 0 in eval), where the exporter's Dropout has no ``training_mode`` (an identity: the
    attention dropout of every sdpa model was silently off)."""
    from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

    scale = op.CastLike(torchlib_nn._attention_scale(query) if scale is None else scale, query)
    if is_causal:
        attn_mask = torchlib_nn._causal_attention_mask(query, key)
    if enable_gqa and query.shape[1] != key.shape[1]:
        key, value = torchlib_nn._attention_repeat_kv_for_group_query(query, key, value)
    root = op.Sqrt(scale)
    scores = op.MatMul(op.Mul(query, root), op.Mul(op.Transpose(key, perm=[0, 1, 3, 2]), root))
    boolean = attn_mask is not None and attn_mask.dtype == ir.DataType.BOOL
    if boolean:  # as the exporter writes it (passes/softmax_guard.py recognizes the pattern)
        attn_mask = op.Where(attn_mask, _like(query, 0.0), _like(query, float(query.dtype.min)))
    weights = op.Softmax(op.Add(scores, attn_mask) if attn_mask is not None else scores, axis=-1)
    if boolean:
        weights = op.Where(op.IsNaN(weights), _like(query, 0.0), weights)
    weights, _ = native_dropout(weights, dropout_p, True)
    return op.MatMul(weights, value)


def _batch_axes_flattened(x):
    """``x`` (None passes) with every axis before its last three as one: ``[*batch, a, b, c]`` ->
    ``[prod(batch), a, b, c]``."""
    if x is None:
        return None
    leading = list(x.shape[:-3])
    size = math.prod(leading) if all(isinstance(d, int) for d in leading) else None
    flat = op.Reshape(x, op.Concat(op.Constant(value_ints=[-1]), op.Shape(x, start=-3), axis=0))
    return _typed(flat, x, [size, *x.shape[-3:]])


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale=None, enable_gqa: bool = False):
    """``aten.scaled_dot_product_attention``: the exporter's translation, which takes 4-D inputs
    only; 3-D ones (``[batch, sequence, features]``, one head) get a head axis around it, and
    those with more leading batch axes (timm's NesT, Twins, Hiera: ``[batch, blocks, heads,
    tokens, features]``) are flattened into one batch axis and back. With a
    float mask, a query row whose every key is -inf gives zeros (and a zero gradient), as
    PyTorch's; the exporter's softmax made it NaN. (Boolean masks: ``passes/softmax_guard.py``.)
    With ``dropout_p > 0``: :func:`_attention_with_dropout`."""
    from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention

    attention = _attention_with_dropout if dropout_p > 0 else aten_scaled_dot_product_attention

    rows = _attention_rows_kept(attn_mask)
    if rows is not None:
        masked, factor = rows
        masked.type, masked.shape = attn_mask.type, attn_mask.shape  # the translation reads them
        attn_mask = masked
    if len(query.shape) > 4:
        if attn_mask is not None:  # broadcast over the leading axes, then flattened with them
            scores_shape = op.Concat(op.Shape(query, end=-1), op.Shape(key, start=-2, end=-1), axis=0)
            attn_mask = _typed(op.Expand(attn_mask, scores_shape), attn_mask, [*query.shape[:-1], key.shape[-2]])
        out = attention(*(_batch_axes_flattened(t) for t in (query, key, value, attn_mask)), dropout_p, is_causal,
                        scale, enable_gqa)
        out = op.Reshape(out, op.Concat(op.Shape(query, end=-1), op.Shape(value, start=-1), axis=0))
        return op.Mul(out, factor) if rows is not None else out
    if len(query.shape) != 3:
        out = attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return op.Mul(out, factor) if rows is not None else out
    heads = op.Constant(value_ints=[1])

    def with_head_axis(x):  # the translation reads ranks, dims and element types: give them
        return _typed(op.Unsqueeze(x, heads), x, [x.shape[0], 1, *x.shape[1:]])

    if attn_mask is not None and len(attn_mask.shape) == 3:
        attn_mask = with_head_axis(attn_mask)
    out = attention(with_head_axis(query), with_head_axis(key), with_head_axis(value), attn_mask, dropout_p,
                    is_causal, scale, enable_gqa)
    out = op.Squeeze(out, heads)
    return op.Mul(out, factor) if rows is not None else out


def _is_nan(x, like=None):
    """``IsNaN(x)``, all false where ``like`` (``x`` by default: a value of the same type) is an
    integer or boolean tensor (they hold no NaN, and IsNaN refuses them)."""
    return op.IsNaN(x) if _reductions._may_hold_nan(x if like is None else like) else op.Not(op.Equal(x, x))


def _nan_ignoring(a, b, keeps_a):
    """``a`` where ``keeps_a(a, b)`` or ``b`` is NaN, else ``b``: one ``Where``, whose gradient goes
    to the argument it picks."""
    return op.Where(op.Or(keeps_a(a, b), _is_nan(b, a)), a, b)


def fmax(a, b):
    """``prims.fmax`` (``torch.fmax``; the exporter has none): the larger argument, the other one
    where one is NaN; ties give ``a`` the whole gradient, as PyTorch's."""
    return _nan_ignoring(a, b, op.GreaterOrEqual)


def fmin(a, b):
    """``prims.fmin`` (``torch.fmin``): as :func:`fmax`, the smaller argument."""
    return _nan_ignoring(a, b, op.LessOrEqual)


def sort_stable(x, stable=None, dim: int = -1, descending: bool = False):
    """``aten.sort.stable`` (``torch.sort(..., stable=True)``, ``argsort(stable=True)``), which the
    exporter mistranslates (its arguments reach torchlib's ``sort`` in the wrong places and the
    export fails): a ``TopK`` over the whole axis, whose ties keep the lower index first (ONNX's
    rule), which is the stable order either way."""
    if len(x.shape) == 0:
        return op.Identity(x), op.Constant(value_int=0)
    length = op.Reshape(op.Gather(op.Shape(x), op.Constant(value_int=dim), axis=0), op.Constant(value_ints=[1]))
    return op.TopK(x, length, axis=dim, largest=int(descending), sorted=1)


def _kth_smallest(x, k, dim: int, keepdim: bool):
    """The ``k``-th smallest value along ``dim`` (``k`` a [1] int64 tensor, from 1) and its index:
    the last of TopK's ``k`` smallest (TopK orders NaN after every number, as PyTorch's sort)."""
    axis = op.Constant(value_ints=[dim])
    smallest, indices = op.TopK(x, k, axis=dim, largest=0, sorted=1)
    last = op.Sub(k, op.Constant(value_ints=[1]))
    value, index = op.Gather(smallest, last, axis=dim), op.Gather(indices, last, axis=dim)
    if not keepdim:
        value, index = op.Squeeze(value, axis), op.Squeeze(index, axis)
    return value, index


def median_dim(x, dim: int, keepdim: bool = False):
    """``aten.median.dim``: the lower of the two middle values for an even count, as PyTorch (which
    the exporter cannot translate), and its index; NaN and the index of the first NaN where the
    slice holds one, as PyTorch (whose gradient goes to that NaN)."""
    if x.shape is not None and len(x.shape) == 0:
        return _reductions._of_a_scalar(x)
    count = op.Gather(op.Shape(x), op.Constant(value_ints=[dim]), axis=0)
    one = op.Constant(value_ints=[1])
    middle = op.Add(op.Div(op.Sub(count, one), op.Constant(value_ints=[2])), one)
    if not _reductions._may_hold_nan(x):
        return _kth_smallest(x, middle, dim, keepdim)
    _, index = _kth_smallest(x, middle, dim, keepdim=True)
    index = _reductions._first_nan_or(x, dim, index)
    value = op.GatherElements(x, index, axis=dim)
    if keepdim:
        return value, index
    axis = op.Constant(value_ints=[dim])
    return op.Squeeze(value, axis), op.Squeeze(index, axis)


def kthvalue(x, k: int, dim: int = -1, keepdim: bool = False):
    """``aten.kthvalue`` (the exporter cannot translate it): the ``k``-th smallest and its index."""
    if x.shape is not None and len(x.shape) == 0:
        return _reductions._of_a_scalar(x)
    return _kth_smallest(x, op.Constant(value_ints=[int(k)]), dim, keepdim)


def nanmedian_dim(x, dim: int, keepdim: bool = False):
    """``aten.nanmedian.dim`` (the exporter cannot translate it): :func:`median_dim` of each
    slice's numbers, NaNs left out; NaN for a slice of NaNs only, at index 0 (PyTorch's index
    there is whichever NaN its selection leaves first)."""
    if x.shape is not None and len(x.shape) == 0:
        return _reductions._of_a_scalar(x)
    if not _reductions._may_hold_nan(x):
        return median_dim(x, dim, keepdim)
    axis = op.Constant(value_ints=[dim])
    # sorted with the NaNs last: the middle number of each slice is at (numbers - 1) // 2
    _, indices = op.TopK(x, op.Gather(op.Shape(x), axis, axis=0), axis=dim, largest=0, sorted=1)
    numbers = op.ReduceSum(op.Cast(op.Not(op.IsNaN(x)), to=ir.DataType.INT64), axis, keepdims=1)
    middle = op.Max(op.Div(op.Sub(numbers, op.Constant(value_int=1)), op.Constant(value_int=2)),
                    op.Constant(value_int=0))
    # (a slice of NaNs only: index 0, which TopK's order of NaNs need not give)
    index = op.Where(op.Equal(numbers, op.Constant(value_int=0)), op.Constant(value_int=0),
                     op.GatherElements(indices, middle, axis=dim))
    value = op.GatherElements(x, index, axis=dim)
    if keepdim:
        return value, index
    return op.Squeeze(value, axis), op.Squeeze(index, axis)


def median(x):
    """``aten.median.default``: the median of all elements (:func:`median_dim` of the flat tensor),
    whose gradient is shared evenly by the elements equal to it (NaNs where it is NaN), as
    PyTorch's (the median over a dim sends it to the returned index alone)."""
    return _of_all_elements(x, median_dim)


def nanmedian(x):
    """``aten.nanmedian.default``: :func:`median`, NaNs left out (NaN if every element is)."""
    return _of_all_elements(x, nanmedian_dim)


def _of_all_elements(x, along_dim):
    """``along_dim(flat x, 0)``'s value, its gradient shared evenly by the elements equal to it
    (by the NaNs where it is NaN), as PyTorch's ``evenly_distribute_backward``."""
    flat = op.Reshape(x, op.Constant(value_ints=[-1]))
    value, _ = along_dim(flat, 0)
    if not _reductions._may_hold_nan(x):  # integers: no gradient, no NaN
        return value
    tied = op.Or(op.Equal(flat, value), op.And(op.IsNaN(flat), op.IsNaN(value)))
    ties = op.CastLike(tied, x)
    share = op.Div(ties, op.ReduceSum(ties, keepdims=0))
    # inf - inf is NaN, as is a NaN the value left out (nanmedian's); a NaN value's own NaNs keep their share
    left_out = op.Or(op.IsInf(flat), op.And(op.IsNaN(flat), op.Not(tied)))
    finite = op.Where(left_out, op.CastLike(op.Constant(value_float=0.0), x), flat)
    carried = op.ReduceSum(op.Mul(op.Sub(finite, detach(finite)), detach(share)), keepdims=0)  # 0, with the shares
    return op.Add(detach(value), carried)


def cdist(x1, x2, p: float = 2.0, compute_mode=None):
    """``aten._cdist_forward`` (``torch.cdist``; the exporter has no translation): the p-norms of
    every difference ``x1[..., i, :] - x2[..., j, :]``, computed from the differences themselves
    (the matrix-product shortcut loses precision for close points), so the gradient at a zero
    distance is 0 as in PyTorch."""
    difference = op.Sub(op.Unsqueeze(x1, op.Constant(value_ints=[-2])), op.Unsqueeze(x2, op.Constant(value_ints=[-3])))
    last = op.Constant(value_ints=[-1])
    if p == 2.0:
        return op.ReduceL2(difference, last, keepdims=0)
    if p == 1.0:
        return op.ReduceL1(difference, last, keepdims=0)
    if p == float("inf"):
        return op.ReduceMax(op.Abs(difference), last, keepdims=0)
    if p == 0.0:
        nonzero = op.CastLike(op.Not(op.Equal(difference, _number_like(0.0, difference))),
                              difference)
        return op.ReduceSum(nonzero, last, keepdims=0)
    order = _number_like(p, difference)
    magnitude = op.Abs(difference)
    if 0 < p < 1:  # |d|^p's derivative is infinite at 0: PyTorch's gradient there is 0
        powers = _reductions._root_zero_at_zero(magnitude, lambda value: op.Pow(value, order))
    else:
        powers = op.Pow(magnitude, order)
    summed = op.ReduceSum(powers, last, keepdims=0)
    # the root's derivative is infinite at a zero distance (pdist's diagonal, equal points)
    inverse = op.Div(_number_like(1.0, difference), order)
    return _reductions._root_zero_at_zero(summed, lambda value: op.Pow(value, inverse))


def pdist(x, p: float = 2.0):
    """``aten._pdist_forward`` (``F.pdist``; the exporter cannot translate it): the distances of
    every pair of rows ``i < j``, in PyTorch's order, picked from :func:`cdist`."""
    distances = cdist(x, x, p)
    ones = op.Expand(op.Constant(value_ints=[1]), op.Shape(distances))
    above = op.Cast(op.Trilu(ones, op.Constant(value_int=1), upper=1), to=9)  # bool
    return op.GatherND(distances, op.Transpose(op.NonZero(above), perm=[1, 0]))


def hypot(a, b):
    """``aten.hypot`` (its decomposition reaches ``prims.hypot``, which the exporter lacks):
    ``s · sqrt((a/s)² + (b/s)²)`` with ``s`` the larger magnitude (1 where that is 0, infinite or
    NaN), so that it neither overflows where ``a²`` would (from ~1.8e19 in float32; it gave inf)
    nor loses tiny arguments; inf where either argument is infinite, even against a NaN, as
    PyTorch. ``s`` is held constant, so the gradient is PyTorch's ``a / hypot(a, b)`` (NaN at the
    origin, as PyTorch's; 0 at an infinite argument, where PyTorch's is NaN)."""
    one = _like(a, 1.0)
    larger = op.Max(op.Abs(a), op.Abs(b))
    usable = op.And(op.Greater(larger, _like(a, 0.0)), op.Not(op.IsInf(larger)))  # NaN compares false
    scale = detach(op.Where(usable, larger, one))
    a_scaled, b_scaled = op.Div(a, scale), op.Div(b, scale)
    value = op.Mul(scale, op.Sqrt(op.Add(op.Mul(a_scaled, a_scaled), op.Mul(b_scaled, b_scaled))))
    return op.Where(op.Or(op.IsInf(a), op.IsInf(b)), _like(a, math.inf), value)


def _upper_half(y):
    """``y > 0``, or ``y`` a positive zero: the side of the branch cut atan2 puts at +π."""
    zero = _like(y, 0.0)
    return op.Or(op.Greater(y, zero), op.And(op.Equal(y, zero), op.Greater(op.Reciprocal(y), zero)))


def copysign(x, sign):
    """``aten.copysign`` (the exporter has none): ``|x|`` with the sign of ``sign``, a negative
    zero's included (a NaN counts as positive: ONNX cannot read its sign bit). Its gradient is
    PyTorch's: ``dy * sign(x) * sign(sign)``, 0 where ``x`` is 0, none for ``sign``."""
    def floating(value) -> bool:
        dtype = getattr(value, "dtype", None)  # (copysign.Scalar: ``sign`` is a number)
        return dtype is not None and dtype.is_floating_point()

    if not floating(x):  # integers give floats
        x = op.CastLike(x, sign) if floating(sign) else op.Cast(x, to=ir.DataType.FLOAT)
    # (copysign.Scalar: a number; math.copysign keeps a -0.0's sign)
    sign = op.CastLike(sign, x) if hasattr(sign, "dtype") else _number_like(math.copysign(1.0, sign), x)
    zero = _like(x, 0.0)
    negative = op.Or(op.Less(sign, zero), op.And(op.Equal(sign, zero), op.Less(op.Reciprocal(sign), zero)))
    magnitude = op.Abs(x)
    return op.Where(negative, op.Neg(magnitude), magnitude)


def atan2(y, x):
    """``aten.atan2``: the angle of ``(x, y)`` as PyTorch's, signed zeros included (the exporter's
    gives -π on the negative x axis with ``y = +0``, and -π/2 for ``x = -0``); the gradient
    ``(x dy - y dx) / (x² + y²)`` everywhere, 0 at the origin (through ``atan(y / x)`` it was NaN
    wherever ``x = 0``). The angle is computed without a gradient, which a term valued 0 carries."""
    zero, pi = _like(y, 0.0), _like(y, math.pi)
    above = _upper_half(y)
    slope = op.Atan(op.Div(y, x))
    angle = op.Where(op.Less(x, zero), op.Where(above, op.Add(slope, pi), op.Sub(slope, pi)), slope)
    on_y_axis = op.Equal(x, zero)
    half_pi = _like(y, math.pi / 2)
    angle = op.Where(on_y_axis, op.Where(above, half_pi, op.Neg(half_pi)), angle)
    at_origin = op.Where(_upper_half(x), zero, op.Where(above, pi, op.Neg(pi)))
    angle = op.Where(op.And(on_y_axis, op.Equal(y, zero)), at_origin, angle)
    # the gradient carried by (v - detach(v)) terms, exactly 0 for finite v; an infinite argument
    # carries none (PyTorch's derivatives are 0 there), and x * y - y * x overflowed beyond ~1e19
    x, y = (op.Where(op.IsInf(v), zero, v) for v in (x, y))
    squared = op.Add(op.Mul(x, x), op.Mul(y, y))
    safe = op.Where(op.Equal(squared, zero), _like(y, 1.0), squared)
    carrier = op.Sub(op.Mul(op.Sub(y, detach(y)), detach(op.Div(x, safe))),
                     op.Mul(op.Sub(x, detach(x)), detach(op.Div(y, safe))))
    return op.Add(detach(angle), carrier)


def _avg_pool_divided(x, kernel_size, stride, padding, ceil_mode: bool, count_include_pad: bool,
                      divisor_override, torchlib_pool):
    """``aten.avg_pool2d`` / ``avg_pool3d``: torchlib's translation, which ignores
    ``divisor_override`` (a silently other result); with one, each window's sum (the padded
    average times the kernel's size) divided by it, as PyTorch. With ``ceil_mode`` a window may
    reach past the padding, where the padded average is not sum / size: refused (PyTorch runs it)."""
    if divisor_override is None:
        return torchlib_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad)
    if ceil_mode:
        raise NotImplementedError("avg_pool with divisor_override and ceil_mode")
    mean = torchlib_pool(x, kernel_size, stride, padding, False, True)
    return op.Mul(mean, _like(x, float(np.prod(kernel_size)) / float(divisor_override)))


def avg_pool2d(x, kernel_size, stride=(), padding=(0, 0), ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override=None):
    """``aten.avg_pool2d``: see :func:`_avg_pool_divided`."""
    from onnxscript.function_libs.torch_lib.ops.nn import aten_avg_pool2d

    return _avg_pool_divided(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                             aten_avg_pool2d)


def avg_pool3d(x, kernel_size, stride=(), padding=(0, 0, 0), ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override=None):
    """``aten.avg_pool3d``: see :func:`_avg_pool_divided`."""
    from onnxscript.function_libs.torch_lib.ops.nn import aten_avg_pool3d

    return _avg_pool_divided(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                             aten_avg_pool3d)


def searchsorted(sorted_sequence, values, out_int32: bool = False, right: bool = False, side=None, sorter=None):
    """``aten.searchsorted.Tensor`` (the exporter cannot translate it): for each value, how many
    boundaries lie below it (``right``: at or below), counted against every boundary of its row."""
    if sorter is not None:
        raise NotImplementedError("torch.searchsorted(sorter=...) is not supported")
    last = op.Constant(value_ints=[-1])
    if len(sorted_sequence.shape) == 1:
        boundaries = sorted_sequence
    else:
        boundaries = op.Unsqueeze(sorted_sequence, op.Constant(value_ints=[-2]))
    candidates = op.Unsqueeze(values, last)
    below = op.LessOrEqual(boundaries, candidates) if right or side == "right" else op.Less(boundaries, candidates)
    return op.Cast(op.ReduceSum(op.Cast(below, to=7), last, keepdims=0), to=6 if out_int32 else 7)


def cumprod(x, dim: int, dtype=None):
    """``aten.cumprod`` (the exporter cannot translate it): prefix products by doubling, each
    step multiplying by the values ``2^k`` positions back (ones before the start); log2(n)
    products of the whole tensor, exact where a running product has zeros (no log-space
    trick), differentiable through standard ops. The length along ``dim`` must be static."""
    if dtype is not None:
        raise NotImplementedError("torch.cumprod(dtype=...) is not supported")
    rank = len(x.shape)
    if rank == 0:
        return op.Identity(x)
    axis = dim % rank
    length = x.shape[axis]
    if not isinstance(length, int):
        raise NotImplementedError("torch.cumprod needs a static length along its dim")
    one = _number_like(1.0, x)
    axes = op.Constant(value_ints=[axis])
    product, shift = x, 1
    while shift < length:
        ones_shape = op.Concat(op.Shape(x, start=0, end=axis), op.Constant(value_ints=[shift]),
                               op.Shape(x, start=axis + 1), axis=0) if axis + 1 < rank else \
            op.Concat(op.Shape(x, start=0, end=axis), op.Constant(value_ints=[shift]), axis=0)
        earlier = op.Slice(product, op.Constant(value_ints=[0]), op.Constant(value_ints=[length - shift]), axes)
        product = op.Mul(product, op.Concat(op.Expand(one, ones_shape), earlier, axis=axis))
        shift *= 2
    return product


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _batch_of_one(x):
    """``x`` with a leading axis of size 1, typed and shaped (translations read both)."""
    return _typed(op.Unsqueeze(x, op.Constant(value_ints=[0])), x, [1, *x.shape])


def binary_cross_entropy(self, target, weight=None, reduction: int = 1):
    """``aten.binary_cross_entropy`` (``F.binary_cross_entropy``, ``nn.BCELoss``) on
    probabilities: ``-(t log p + (1 - t) log(1 - p))`` with each logarithm clamped at -100, as
    PyTorch's, and PyTorch's gradient ``(p - t) / max(p (1 - p), 1e-12)``: the exporter's
    decomposition differentiated its clamped logarithms, whose derivative ``1 / p`` is 0 / 0 at a
    probability of exactly 0 or 1 (a saturated softmax, a clamp), so every parameter's gradient
    was NaN. The target's gradient is the clamped logarithms' difference: PyTorch's ``-logit(p)``
    but at probabilities of exactly 0 and 1, where PyTorch's is infinite and ours ±100."""
    one = _number_like(1.0, self)
    lowest = _number_like(-100.0, self)
    producer = self.producer() if isinstance(self, ir.Value) else None
    if (producer is not None and producer.op_type == "Sigmoid" and producer.domain in ("", "ai.onnx")
            and self.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)):
        # of a sigmoid: the logarithms as they are, which passes/log_sigmoid.py writes as softplus
        # forms, exact where float32's sigmoid saturates (and PyTorch's clamp never binds); not
        # float64, which that pass leaves alone (its 1 - sigmoid is 0 from 37 on: a NaN gradient)
        loss = op.Neg(op.Add(op.Mul(target, op.Max(op.Log(self), lowest)),
                             op.Mul(op.Sub(one, target), op.Max(op.Log(op.Sub(one, self)), lowest))))
        return _reduced_loss(loss, weight, reduction)
    probability = detach(self)
    log_p = op.Max(op.Log(probability), lowest)
    log_q = op.Max(op.Log(op.Sub(one, probability)), lowest)
    loss = op.Neg(op.Add(op.Mul(target, log_p), op.Mul(op.Sub(one, target), log_q)))
    slope = op.Div(op.Sub(probability, detach(target)),
                   op.Max(op.Mul(probability, op.Sub(one, probability)), _number_like(1e-12, self)))
    loss = op.Add(loss, op.Mul(op.Sub(self, probability), detach(slope)))  # + 0, with the slope as p's gradient
    return _reduced_loss(loss, weight, reduction)


def _reduced_loss(loss, weight, reduction: int):
    """An elementwise loss times ``weight`` (if any), reduced as aten's ``reduction`` says (0 none,
    1 mean, 2 sum)."""
    if weight is not None:
        loss = op.Mul(loss, weight)
    if reduction == 0:
        return loss
    return op.ReduceSum(loss, keepdims=0) if reduction == 2 else op.ReduceMean(loss, keepdims=0)


def cross_entropy_loss(input, target, weight=None, reduction: int = 1, ignore_index: int = -100,
                       label_smoothing: float = 0.0):
    """``aten.cross_entropy_loss`` with class-index targets: ``SoftmaxCrossEntropyLoss`` (as the
    exporter's), plus PyTorch's label-smoothing term, which the exporter's translation drops:
    ``(1 - e) * nll + e / C * smooth``, ``smooth`` being minus the (class-weighted) sum of the
    log-probabilities over classes, 0 at ignored targets, reduced as ``nll`` (the mean divides
    by the same total weight of the targets not ignored). Class-probability targets (a float
    ``target`` shaped like ``input``): :func:`_soft_cross_entropy`. An unbatched ``[C]`` input is
    a batch of one (ONNX's losses take ``[N, C, ...]``)."""
    if len(input.shape) == 1:
        loss = cross_entropy_loss(_batch_of_one(input), _batch_of_one(target), weight, reduction, ignore_index,
                                  label_smoothing)
        return op.Squeeze(loss, op.Constant(value_ints=[0])) if reduction == 0 else loss
    if target.dtype is not None and target.dtype.is_floating_point():
        return _soft_cross_entropy(input, target, weight, reduction, label_smoothing)
    if not isinstance(ignore_index, int):
        return _cross_entropy_ignoring_at_run_time(input, target, weight, reduction, ignore_index, label_smoothing)
    # a negative target but ignore_index fails the run, as PyTorch's raises: passes/negative_labels.py
    nll, _ = op.SoftmaxCrossEntropyLoss(input, target, weight, reduction=_REDUCTIONS[reduction],
                                        ignore_index=ignore_index)
    if not label_smoothing:
        return nll
    if len(input.shape) < 2:
        raise NotImplementedError("cross_entropy with label_smoothing on unbatched input")
    log_prob = op.LogSoftmax(input, axis=1)
    if weight is not None:
        per_class = op.Reshape(weight, op.Constant(value_ints=[1, -1] + [1] * (len(input.shape) - 2)))
        log_prob = op.Mul(log_prob, per_class)
    zero = _number_like(0.0, input)
    ignored = op.Equal(target, op.Constant(value_int=ignore_index))
    smooth = op.Where(ignored, zero, op.Neg(op.ReduceSum(log_prob, op.Constant(value_ints=[1]), keepdims=0)))
    if reduction == 0:
        term = smooth
    elif reduction == 2:
        term = op.ReduceSum(smooth, keepdims=0)
    else:
        if weight is not None:
            kept = op.Where(ignored, zero, op.Gather(weight, op.Where(ignored, op.CastLike(op.Constant(value_int=0),
                                                                                           target), target)))
        else:
            kept = op.CastLike(op.Not(ignored), input)
        # every target ignored: the nll term is 0/0 already (NaN, as PyTorch's loss); this one
        # divides by 1 so that its gradient is PyTorch's 0 rather than 0 * inf
        total = op.ReduceSum(kept, keepdims=0)
        total = op.Where(op.Equal(total, zero), _number_like(1.0, input), total)
        term = op.Div(op.ReduceSum(smooth, keepdims=0), total)
    classes = op.CastLike(op.Squeeze(op.Shape(input, start=1, end=2)), input)
    scale = op.Div(_number_like(label_smoothing, input), classes)
    keep = _number_like(1.0 - label_smoothing, input)
    return op.Add(op.Mul(nll, keep), op.Mul(term, scale))


# Per-sample losses as ops of onnxtrain's own (see per_sample_losses_as_own_ops): the ``reduction``
# PyTorch's loss ops take is 0 ("none") for both
def _without_class_axis(input: torch.Tensor) -> list:
    return [input.shape[0], *input.shape[2:]] if input.dim() >= 2 else []


@torch.library.custom_op("onnxtrain::per_sample_cross_entropy", mutates_args=())
def _per_sample_cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                              ignore_index: int, label_smoothing: float) -> torch.Tensor:
    return torch.ops.aten.cross_entropy_loss(input, target, weight, 0, ignore_index, label_smoothing)


@_per_sample_cross_entropy.register_fake
def _(input, target, weight, ignore_index, label_smoothing):
    return input.new_empty(_without_class_axis(input))


@torch.library.custom_op("onnxtrain::per_sample_nll_loss", mutates_args=())
def _per_sample_nll_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                         ignore_index: int) -> torch.Tensor:
    return torch.ops.aten.nll_loss_nd(input, target, weight, 0, ignore_index)


@_per_sample_nll_loss.register_fake
def _(input, target, weight, ignore_index):
    return input.new_empty(_without_class_axis(input))


_PER_SAMPLE_LOSSES = {
    # PyTorch op, its arguments after (input, target, weight, reduction), their defaults, onnxtrain's op
    torch.ops.aten.cross_entropy_loss.default: (("ignore_index", "label_smoothing"), (-100, 0.0),
                                                torch.ops.onnxtrain.per_sample_cross_entropy.default),
    torch.ops.aten.nll_loss_nd.default: (("ignore_index",), (-100,), torch.ops.onnxtrain.per_sample_nll_loss.default),
    torch.ops.aten.nll_loss.default: (("ignore_index",), (-100,), torch.ops.onnxtrain.per_sample_nll_loss.default),
}


def per_sample_losses_as_own_ops(program: torch.export.ExportedProgram) -> int:
    """Make each ``aten.cross_entropy_loss``, ``aten.nll_loss_nd`` and ``aten.nll_loss`` with
    ``reduction='none'`` an op of onnxtrain's own, translated as before. The exporter keeps
    these composite ops and torch's ``run_decompositions`` computes their output shape again, and
    with a symbolic batch (torch 2.13) it comes out a scalar instead of ``[N]``: the exporter then
    wrote the per-sample losses' ``.sum()`` as an ``Identity`` (the vector came back) and the
    folder made their ``.mean()``'s gradient N times too large. Its own op's shape comes from its
    fake implementation. Returns how many were rewritten."""
    graph_module = program.graph_module
    count = 0
    for node in graph_module.graph.nodes:
        entry = _PER_SAMPLE_LOSSES.get(node.target) if node.op == "call_function" else None
        if entry is None:
            continue
        names, defaults, own = entry
        if fx_argument(node, 3, "reduction", 1) != 0:
            continue
        rest = [fx_argument(node, 4 + i, name, default) for i, (name, default) in enumerate(zip(names, defaults))]
        weight = fx_argument(node, 2, "weight", None)
        node.target, node.args, node.kwargs = own, (node.args[0], node.args[1], weight, *rest), {}
        count += 1
    if count:
        graph_module.recompile()
    return count


def _ignored_targets(target, ignore_index):
    """``(ignored, safe target)`` for an ``ignore_index`` known at run time only (ONNX's losses take
    it as an attribute): where the target is ignored, and the targets with class 0 there (the index
    itself is out of range); the caller zeroes the ignored losses."""
    ignored = op.Equal(target, op.CastLike(ignore_index, target))
    return ignored, op.Where(ignored, op.CastLike(op.Constant(value_int=0), target), target)


def per_sample_cross_entropy(input, target, weight=None, ignore_index: int = -100, label_smoothing: float = 0.0):
    """``onnxtrain::per_sample_cross_entropy``: :func:`cross_entropy_loss` with ``reduction='none'``."""
    return cross_entropy_loss(input, target, weight, 0, ignore_index, label_smoothing)


def per_sample_nll_loss(input, target, weight=None, ignore_index: int = -100):
    """``onnxtrain::per_sample_nll_loss``: ``aten.nll_loss_nd`` with ``reduction='none'``, ONNX's
    ``NegativeLogLikelihoodLoss`` (an unbatched ``[C]`` input gives a scalar)."""
    unbatched = len(input.shape) == 1
    if unbatched:
        input, target = _batch_of_one(input), _batch_of_one(target)
    if isinstance(ignore_index, int):
        losses = op.NegativeLogLikelihoodLoss(input, target, weight, reduction="none", ignore_index=ignore_index)
    else:  # known at run time only (a dim's size): ONNX's attribute cannot take it, the ignored targets are masked
        ignored, safe_target = _ignored_targets(target, ignore_index)
        losses = op.Where(ignored, _number_like(0.0, input),
                          op.NegativeLogLikelihoodLoss(input, safe_target, weight, reduction="none"))
    return op.Squeeze(losses, op.Constant(value_ints=[0])) if unbatched else losses


def _cross_entropy_ignoring_at_run_time(input, target, weight, reduction: int, ignore_index, label_smoothing: float):
    """Cross entropy whose ``ignore_index`` is known at run time only (Hugging Face's question
    answering heads ignore ``start_logits.size(1)``, a dynamic dim): ONNX's loss takes it as an
    attribute, so the ignored targets are masked here instead. They read class 0 (the index
    itself is out of range), their losses are 0, and the mean divides by the weight of the
    others (0/0, NaN, when every target is ignored, as PyTorch's)."""
    if label_smoothing:
        raise NotImplementedError("cross_entropy with label_smoothing and an ignore_index known at run time only")
    ignored, safe_target = _ignored_targets(target, ignore_index)
    losses, _ = op.SoftmaxCrossEntropyLoss(input, safe_target, weight, reduction="none")
    zero = _number_like(0.0, input)
    losses = op.Where(ignored, zero, losses)
    if _REDUCTIONS[reduction] == "none":
        return losses
    total = op.ReduceSum(losses, keepdims=0)
    if _REDUCTIONS[reduction] == "sum":
        return total
    counted = op.CastLike(op.Not(ignored), input) if weight is None else \
        op.Where(ignored, zero, op.Gather(weight, safe_target))
    return op.Div(total, op.ReduceSum(counted, keepdims=0))


def multilabel_margin_loss(input, target, reduction: int = 1):
    """``aten.multilabel_margin_loss`` (the exporter's translation ignores the ``-1`` that ends
    each sample's targets, and returns other numbers): for each target entry ``j`` before the
    first ``-1`` and each class ``i`` that is not among those targets,
    ``max(0, 1 - (x[target[j]] - x[i]))``, summed and divided by the number of classes (a class
    listed twice counts twice, as in PyTorch)."""
    unbatched = len(input.shape) == 1
    if unbatched:
        first = op.Constant(value_ints=[0])
        input, target = op.Unsqueeze(input, first), op.Unsqueeze(target, first)
    last = op.Constant(value_ints=[-1])
    zero_int = op.Constant(value_int=0)
    # entry p is a target while no -1 came at or before it
    ends = op.Cast(op.Equal(target, op.Constant(value_int=-1)), to=7)
    listed = op.Equal(op.CumSum(ends, op.Constant(value_int=-1)), zero_int)  # [N, C] bool
    safe_target = op.Where(listed, target, zero_int)
    target_score = op.GatherElements(input, safe_target, axis=-1)  # [N, C]: x[target[p]]
    classes = op.Range(zero_int, op.Squeeze(op.Shape(input, start=-1)), op.Constant(value_int=1))
    # class d is a target when a listed entry names it
    names_class = op.And(op.Equal(op.Unsqueeze(safe_target, last), classes), op.Unsqueeze(listed, last))
    is_target = op.Cast(op.ReduceMax(op.Cast(names_class, to=7), op.Constant(value_ints=[-2]), keepdims=0), to=9)
    one = _number_like(1.0, input)
    zero = _number_like(0.0, input)
    # [N, C (entries), C (classes)]: 1 - x[target[p]] + x[d]
    margin = op.Add(op.Sub(one, op.Unsqueeze(target_score, last)), op.Unsqueeze(input, op.Constant(value_ints=[-2])))
    counted = op.And(op.Unsqueeze(listed, last), op.Not(op.Unsqueeze(is_target, op.Constant(value_ints=[-2]))))
    hinge = op.Where(counted, op.Relu(margin), zero)
    count = op.CastLike(op.Shape(input, start=-1), input)
    loss = op.Div(op.ReduceSum(hinge, op.Constant(value_ints=[-2, -1]), keepdims=0), count)
    if _REDUCTIONS[reduction] == "mean":
        return op.ReduceMean(loss, keepdims=0)
    if _REDUCTIONS[reduction] == "sum":
        return op.ReduceSum(loss, keepdims=0)
    return op.Squeeze(loss, op.Constant(value_ints=[0])) if unbatched else loss


def rrelu_with_noise_functional(input, noise, lower: float = 0.125, upper: float = 1.0 / 3.0,
                                training: bool = False, generator=None):
    """``aten.rrelu_with_noise_functional`` (``nn.RReLU``, ``F.rrelu``; the exporter has no
    translation): in training each element at or below 0 is scaled by its own slope drawn from
    ``U(lower, upper)`` (a fresh draw every run, as Dropout's mask: another stream than
    PyTorch's), the others kept, and the slopes returned as the noise (1 where kept); in eval
    the slope is the mean ``(lower + upper) / 2`` and the noise comes back as it was."""
    if generator is not None:
        raise NotImplementedError("F.rrelu with a generator is not supported")
    zero = _number_like(0.0, input)
    negative = op.LessOrEqual(input, zero)
    if not training:
        slope = _number_like((lower + upper) / 2.0, input)
        return op.Where(negative, op.Mul(input, slope), input), noise
    drawn = op.CastLike(op.RandomUniformLike(input, low=float(lower), high=float(upper)), input)
    slopes = op.Where(negative, drawn, _number_like(1.0, input))
    return op.Mul(input, slopes), slopes


# Asymptotic series at z >= the shift (6 in float32, where the first omitted term is below 1e-10;
# 12 in float64, with four more terms: below 1e-17); smaller arguments are shifted up by the
# recurrences Γ(z + 1) = z Γ(z), ψ(z + 1) = ψ(z) + 1 / z, ψ'(z + 1) = ψ'(z) - 1 / z², and
# arguments below 1/2 reflected (Γ(z) Γ(1 - z) = π / sin(πz)). The coefficients are the
# Bernoulli numbers' B_2k / (2k (2k - 1)), B_2k / 2k and B_2k, in powers of 1 / z².
_STIRLING = (1 / 12, -1 / 360, 1 / 1260, -1 / 1680, 1 / 1188, -691 / 360360, 1 / 156, -3617 / 122400)
_DIGAMMA_SERIES = (-1 / 12, 1 / 120, -1 / 252, 1 / 240, -1 / 132, 691 / 32760, -1 / 12, 3617 / 8160)
_TRIGAMMA_SERIES = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6, -3617 / 510)
_HALF_LOG_2PI = 0.9189385332046727


def _precision(x) -> tuple[int, int]:
    """``(shift, terms)`` of the series for ``x``'s type: float64 needs more of both."""
    return (12, 8) if x.dtype == ir.DataType.DOUBLE else (6, 4)


def _series(power, coefficients):
    """``c0 + p (c1 + p (c2 + ...))`` with ``p = power``."""
    return _horner(power, list(reversed(coefficients)))


def _reflected(x):
    """``(below, y)``: where ``x < 1/2``, and ``y = 1 - x`` there, ``x`` elsewhere (so ``y >= 1/2``)."""
    below = op.Less(x, _like(x, 0.5))
    return below, op.Where(below, op.Sub(_like(x, 1.0), x), x)


def _shifted(y, shift: int):
    """``(small, z, steps)``: where ``y < shift``, ``z = y + shift`` there (``y`` elsewhere), and
    ``y, y + 1, ..., y + shift - 1`` of a ``y`` that is 1 where not shifted (finite in every
    branch, so that no gradient of an unused branch is 0 * inf)."""
    small = op.Less(y, _like(y, float(shift)))
    z = op.Where(small, op.Add(y, _like(y, float(shift))), y)
    safe = op.Where(small, y, _like(y, 1.0))
    return small, z, [op.Add(safe, _like(y, float(k))) if k else safe for k in range(shift)]


def _pi_x(x, below):
    """``π r`` with ``r = x - round(x)`` (``|sin(πx)|``, ``tan(πx)`` and ``sin²(πx)`` are those of ``πr``;
    reducing first keeps them accurate far from 0) where ``below``, 1/2 elsewhere (away from the
    zeros and poles of sin and tan)."""
    return op.Where(below, op.Mul(op.Sub(x, op.Round(x)), _like(x, np.pi)), _like(x, 0.5))


def lgamma(x):
    """``aten.lgamma`` (the exporter has no translation; ``torch.distributions`` log-probabilities
    use it): ``log |Γ(x)|`` from Stirling's series at ``z >= 6`` (12 in float64), shifted and
    reflected (above); ``inf`` at 0 and the negative integers, as PyTorch. Its gradient, through
    the same ops, is the digamma function to the series' accuracy."""
    shift, terms = _precision(x)
    below, y = _reflected(x)
    small, z, steps = _shifted(y, shift)
    inverse = op.Reciprocal(z)
    series = op.Mul(inverse, _series(op.Mul(inverse, inverse), _STIRLING[:terms]))
    stirling = op.Add(op.Sub(op.Mul(op.Sub(z, _like(z, 0.5)), op.Log(z)), z), op.Add(_like(z, _HALF_LOG_2PI), series))
    product = steps[0]
    for step in steps[1:]:
        product = op.Mul(product, step)
    at_y = op.Where(small, op.Sub(stirling, op.Log(product)), stirling)
    sine = op.Abs(op.Sin(_pi_x(x, below)))
    return op.Where(below, op.Sub(op.Sub(_like(x, float(np.log(np.pi))), op.Log(sine)), at_y), at_y)


def digamma(x):
    """``aten.digamma`` (the exporter has no translation): ψ from its asymptotic series at
    ``z >= 6`` (12 in float64), shifted and reflected (``ψ(x) = ψ(1 - x) - π / tan(πx)``)."""
    shift, terms = _precision(x)
    below, y = _reflected(x)
    small, z, steps = _shifted(y, shift)
    inverse = op.Reciprocal(z)
    inverse2 = op.Mul(inverse, inverse)
    series = op.Mul(inverse2, _series(inverse2, _DIGAMMA_SERIES[:terms]))
    asymptotic = op.Add(op.Sub(op.Log(z), op.Mul(_like(z, 0.5), inverse)), series)
    correction = op.Reciprocal(steps[0])
    for step in steps[1:]:
        correction = op.Add(correction, op.Reciprocal(step))
    at_y = op.Where(small, op.Sub(asymptotic, correction), asymptotic)
    angle = _pi_x(x, below)
    return op.Where(below, op.Sub(at_y, op.Div(_like(x, np.pi), op.Div(op.Sin(angle), op.Cos(angle)))), at_y)


def trigamma(x):
    """ψ' from its asymptotic series at ``z >= 6`` (12 in float64), shifted and reflected
    (``ψ'(x) = π² / sin²(πx) - ψ'(1 - x)``)."""
    shift, terms = _precision(x)
    below, y = _reflected(x)
    small, z, steps = _shifted(y, shift)
    inverse = op.Reciprocal(z)
    inverse2 = op.Mul(inverse, inverse)
    tail = op.Mul(op.Mul(inverse, inverse2), _series(inverse2, _TRIGAMMA_SERIES[:terms]))
    series = op.Add(op.Mul(inverse, op.Add(_like(z, 1.0), op.Mul(inverse, _like(z, 0.5)))), tail)
    correction = op.Reciprocal(op.Mul(steps[0], steps[0]))
    for step in steps[1:]:
        correction = op.Add(correction, op.Reciprocal(op.Mul(step, step)))
    at_y = op.Where(small, op.Add(series, correction), series)
    sine = op.Sin(_pi_x(x, below))
    return op.Where(below, op.Sub(op.Div(_like(x, np.pi ** 2), op.Mul(sine, sine)), at_y), at_y)


def polygamma(n: int, x):
    """``aten.polygamma`` for ``n`` 0 (digamma) and 1 (trigamma); higher orders are not translated."""
    if n == 0:
        return digamma(x)
    if n == 1:
        return trigamma(x)
    raise NotImplementedError(f"torch.polygamma({n}, x): only orders 0 and 1 are translated")


def _adaptive_windows(size: int, out: int) -> list[tuple[int, int]]:
    """PyTorch's adaptive pooling windows along one axis: ``[floor(i n / m), ceil((i + 1) n / m))``."""
    return [((i * size) // out, -((-(i + 1) * size) // out)) for i in range(out)]


def _spatial_sizes(x, output_size, what: str) -> tuple[list[int], list[int]]:
    sizes = list(x.shape[2:]) if x.shape is not None else []
    if len(sizes) != len(output_size) or not all(isinstance(d, int) for d in sizes):
        raise NotImplementedError(f"{what} needs static spatial sizes")
    return sizes, [int(o) for o in output_size]


def adaptive_max_pool2d(x, output_size):
    """``aten.adaptive_max_pool2d`` (the exporter has no translation): the values and the flat
    index (``h * W + w``) of each window's first maximum, as PyTorch. Windows that tile the input
    are a ``MaxPool`` (the indices from a second one that reports them, dropped when unused);
    others are taken one by one (an ``ArgMax`` over each, its value gathered: the gradient goes
    to that element, as in PyTorch)."""
    (height, width), (out_h, out_w) = _spatial_sizes(x, output_size, "adaptive_max_pool2d")
    if height % out_h == 0 and width % out_w == 0:
        kernel = [height // out_h, width // out_w]
        values, _ = op.MaxPool(x, kernel_shape=kernel, strides=kernel)
        _, flat = op.MaxPool(x, kernel_shape=kernel, strides=kernel)
        return values, op.Mod(flat, op.Constant(value_int=height * width))
    values, indices = [], []
    for h0, h1 in _adaptive_windows(height, out_h):
        row_values, row_indices = [], []
        for w0, w1 in _adaptive_windows(width, out_w):
            window = op.Slice(x, op.Constant(value_ints=[h0, w0]), op.Constant(value_ints=[h1, w1]),
                              op.Constant(value_ints=[2, 3]))
            flat_window = op.Reshape(window, op.Constant(value_ints=[0, 0, -1]))
            first = op.ArgMax(flat_window, axis=-1, keepdims=1)  # [N, C, 1]
            row_values.append(op.GatherElements(flat_window, first, axis=-1))
            span = op.Constant(value_int=w1 - w0)
            row = op.Add(op.Div(first, span), op.Constant(value_int=h0))
            column = op.Add(op.Mod(first, span), op.Constant(value_int=w0))
            row_indices.append(op.Add(op.Mul(row, op.Constant(value_int=width)), column))
        values.append(op.Concat(*row_values, axis=-1))
        indices.append(op.Concat(*row_indices, axis=-1))
    shape = op.Constant(value_ints=[0, 0, out_h, out_w])
    return (op.Reshape(op.Concat(*values, axis=-1), shape), op.Reshape(op.Concat(*indices, axis=-1), shape))


def adaptive_avg_pool3d(x, output_size):
    """``aten._adaptive_avg_pool3d`` (the exporter has no translation): an ``AveragePool`` when the
    windows tile the input, else the mean of each window, axis by axis (a box mean is separable)."""
    sizes, outs = _spatial_sizes(x, output_size, "adaptive_avg_pool3d")
    if all(size % out == 0 for size, out in zip(sizes, outs)):
        kernel = [size // out for size, out in zip(sizes, outs)]
        return op.AveragePool(x, kernel_shape=kernel, strides=kernel)
    for axis, (size, out) in enumerate(zip(sizes, outs), start=2):
        if size == out:
            continue
        axes = op.Constant(value_ints=[axis])
        x = op.Concat(*[op.ReduceMean(op.Slice(x, op.Constant(value_ints=[start]), op.Constant(value_ints=[stop]),
                                               axes), axes, keepdims=1)
                        for start, stop in _adaptive_windows(size, out)], axis=axis)
    return x


def _moved_on(t, shift: int, length: int, axis: int):
    """``t`` moved ``shift`` places on along ``axis`` (of static ``length``); its first ``shift``
    places keep their own values (a scan step then compares them with themselves)."""
    axes = op.Constant(value_ints=[axis])
    head = op.Slice(t, op.Constant(value_ints=[0]), op.Constant(value_ints=[shift]), axes)
    tail = op.Slice(t, op.Constant(value_ints=[0]), op.Constant(value_ints=[length - shift]), axes)
    return op.Concat(head, tail, axis=axis)


def _running_extreme(x, dim: int, larger: bool):
    """``aten.cummax`` / ``aten.cummin``: each prefix's extreme and its index, the latest among
    equal ones and the latest NaN once one is seen, as PyTorch. A scan by doubling over
    ``(value, index)`` pairs (the earlier pair wins only if strictly beyond, or a NaN against a
    number); the values are then gathered at the indices, so the gradient goes to those
    elements, as PyTorch's. The length along ``dim`` must be static."""
    rank = len(x.shape)
    if rank == 0:
        return _reductions._of_a_scalar(x)
    axis = dim % rank
    length = x.shape[axis]
    if not isinstance(length, int):
        raise NotImplementedError("torch.cummax / cummin need a static length along their dim")
    positions = op.Range(op.Constant(value_int=0), op.Constant(value_int=length), op.Constant(value_int=1))
    index = op.Expand(op.Reshape(positions, op.Constant(value_ints=[length] + [1] * (rank - 1 - axis))), op.Shape(x))
    value = op.Cast(x, to=ir.DataType.INT32) if x.dtype == ir.DataType.BOOL else x  # Greater takes no bool
    shift = 1
    while shift < length:
        before, before_index = (_moved_on(t, shift, length, axis) for t in (value, index))
        beyond = op.Greater(before, value) if larger else op.Less(before, value)
        take = op.And(op.Or(beyond, _is_nan(before, x)), op.Not(_is_nan(value, x)))
        value, index = op.Where(take, before, value), op.Where(take, before_index, index)
        shift *= 2
    return op.GatherElements(x, index, axis=axis), index


def cummax(x, dim: int):
    """``aten.cummax`` (the exporter has no translation): see :func:`_running_extreme`."""
    return _running_extreme(x, dim, larger=True)


def cummin(x, dim: int):
    """``aten.cummin`` (the exporter has no translation): see :func:`_running_extreme`."""
    return _running_extreme(x, dim, larger=False)


# erfinv's starting point: M. Giles' single-precision polynomials in w = -log(1 - x²)
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                   -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _horner(t, coefficients):
    result = _like(t, coefficients[0])
    for c in coefficients[1:]:
        result = op.Add(op.Mul(result, t), _like(t, c))
    return result


def erfinv(x):
    """``aten.erfinv`` (the exporter has no translation): Giles' polynomial approximation (two
    ranges of ``w = -log(1 - x²)``), refined by two Newton steps on ``erf(y) = x``; ``±inf`` at
    ``±1`` and NaN beyond, as PyTorch. Its gradient, through the same ops, is
    ``√π / 2 · exp(erfinv(x)²)`` to the approximation's accuracy."""
    one = _like(x, 1.0)
    inside = op.Less(op.Abs(x), one)
    safe = op.Where(inside, x, _like(x, 0.0))  # every branch finite: no 0 * inf in unused gradients
    w = op.Neg(op.Log(op.Mul(op.Sub(one, safe), op.Add(one, safe))))
    central = op.Less(w, _like(x, 5.0))
    near = _horner(op.Sub(op.Where(central, w, _like(x, 2.5)), _like(x, 2.5)), _ERFINV_CENTRAL)
    far = _horner(op.Sub(op.Sqrt(op.Where(central, _like(x, 5.0), w)), _like(x, 3.0)), _ERFINV_TAIL)
    y = op.Mul(op.Where(central, near, far), safe)
    half_sqrt_pi = _like(x, float(np.sqrt(np.pi) / 2))
    for _ in range(2):
        y = op.Sub(y, op.Mul(op.Mul(op.Sub(op.Erf(y), safe), half_sqrt_pi), op.Exp(op.Mul(y, y))))
    # Sign: no gradient path (a product with x would send 0 * inf = NaN back where x is inside)
    edge = op.Where(op.Equal(op.Abs(x), one), op.Mul(op.Sign(x), _like(x, float("inf"))), _like(x, float("nan")))
    return op.Where(inside, y, edge)


def _soft_cross_entropy(input, target, weight, reduction: int, label_smoothing: float):
    """Cross entropy against class probabilities (mixup, distillation; the exporter's translation
    takes them for class indices): ``-sum_c w_c t_c log_softmax(x)_c`` per sample, with
    ``t = (1 - e) t + e / C`` under label smoothing; the mean divides by the number of samples
    (not by the weights), as PyTorch."""
    axis = 0 if len(input.shape) == 1 else 1
    log_prob = op.LogSoftmax(input, axis=axis)
    if label_smoothing:
        classes = op.CastLike(op.Shape(input, start=axis, end=axis + 1), input)
        keep = _number_like(1.0 - label_smoothing, input)
        spread = op.Div(_number_like(label_smoothing, input), classes)
        target = op.Add(op.Mul(target, keep), spread)
    if weight is not None:
        shape = [-1] + [1] * (len(input.shape) - axis - 1)
        log_prob = op.Mul(log_prob, op.Reshape(weight, op.Constant(value_ints=shape)))
    per_sample = op.Neg(op.ReduceSum(op.Mul(log_prob, target), op.Constant(value_ints=[axis]), keepdims=0))
    return _reduced_loss(per_sample, None, reduction)


def masked_select(x, mask):
    """``aten.masked_select`` (the exporter's translation fails): the elements of ``x`` where
    ``mask`` is true (both broadcast to one shape), in order, as a 1-D tensor: a ``Compress`` of
    the flattened tensors, whose gradient scatters back to those elements."""
    shape = op.Shape(op.Add(op.CastLike(op.Cast(mask, to=1), x), x))  # the broadcast shape
    flat = op.Constant(value_ints=[-1])
    return op.Compress(op.Reshape(op.Expand(x, shape), flat), op.Reshape(op.Expand(mask, shape), flat), axis=0)


# onnxruntime's com.microsoft.Inverse (stock onnxruntime ships its CPU kernel; onnx has no schema
# for it, so the exporter's tracer gets this one)
_INVERSE = onnxscript.values.Op(
    onnxscript.values.Opset(domain=names.MS_DOMAIN, version=1), "Inverse",
    onnx.defs.OpSchema("Inverse", names.MS_DOMAIN, 1, inputs=[onnx.defs.OpSchema.FormalParameter("X", "T")],
                       outputs=[onnx.defs.OpSchema.FormalParameter("Y", "T")],
                       type_constraints=[("T", ["tensor(float)", "tensor(double)", "tensor(float16)"],
                                          "matrices of floats")]))


def conv3d(input, weight, bias=None, stride=(1, 1, 1), padding=(0, 0, 0), dilation=(1, 1, 1), groups: int = 1):
    """``aten.conv3d``: a Conv, without a bias input where the layer has none (the exporter's
    writes the missing bias as zeros of shape ``[C_out, 2]``, which onnxruntime refuses)."""
    from onnxscript.function_libs.torch_lib.ops.core import _aten_convolution_onnx

    def per_axis(value):
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        return values * 3 if len(values) == 1 else values

    pads = per_axis(padding)
    return _aten_convolution_onnx(input, weight, bias, transposed=False, strides=per_axis(stride),
                                  pads=[*pads, *pads], dilations=per_axis(dilation), groups=groups)


def _wrapped_number(number, target: ir.DataType) -> np.ndarray:
    """``number`` as a 0-d array of ``target``, converted as PyTorch converts a Python number to a
    tensor's type: an integer out of an integer type's range wraps around (``uint8_tensor // -2``
    divides by 254), a float is truncated toward zero."""
    with np.errstate(over="ignore"):
        return np.array(number).astype(target.numpy())


def scalar_tensor(s, dtype: int = 1, layout: str = "", device: str = "", pin_memory: bool = False):
    """``aten.scalar_tensor`` (how a Python number enters arithmetic): a 0-d constant of ``dtype``
    (an ONNX element type), exact. The exporter's writes a float32 constant and casts it, so a
    float64 model's ``x * 0.1`` multiplied by float32's 0.1. A complex one (``z.mul_(2)``) as the
    exporter holds complex tensors: its real and imaginary parts, shape ``[2]``."""
    if isinstance(s, (bool, int, float, complex)):
        target = ir.DataType(ir.DataType.FLOAT if dtype in (None, -1) else dtype)
        parts = _COMPLEX_PARTS.get(target)
        if parts is not None:
            return op.Constant(value=ir.tensor(np.array([complex(s).real, complex(s).imag], dtype=parts.numpy())))
        return op.Constant(value=ir.tensor(_wrapped_number(s, target)))
    from onnxscript.function_libs.torch_lib.ops.core import aten_scalar_tensor
    return aten_scalar_tensor(s, dtype, layout, device, pin_memory)


def copy(self, src, non_blocking: bool = False):
    """``aten.copy`` (``x.copy_(src)``, also inside ``torch.vander``): ``src`` in ``self``'s type,
    broadcast to ``self``'s shape. The exporter's only casts, and a broadcast source written into
    a slice failed the run (ScatterND's updates of the source's shape)."""
    cast = op.CastLike(src, self)
    if shapes_equal(self.shape, src.shape):
        return cast  # provably the same shape: no broadcast (an Expand would copy)
    return op.Expand(cast, op.Shape(self))


def _repeated_positions(repeats):
    """``[0] * r0 + [1] * r1 + ...``: each position of ``repeats`` as often as it says (int64)."""
    ends = op.CumSum(op.Reshape(op.Cast(repeats, to=ir.DataType.INT64), op.Constant(value_ints=[-1])),
                     op.Constant(value_int=0))
    total = op.ReduceSum(op.Slice(ends, op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**62])),
                         keepdims=0)
    steps = op.Range(op.Constant(value_int=0), total, op.Constant(value_int=1))
    # position t repeats the entry whose run it falls in: the number of runs ended at or before t
    ended = op.LessOrEqual(op.Unsqueeze(ends, op.Constant(value_ints=[0])), op.Unsqueeze(steps, op.Constant(value_ints=[1])))
    return op.ReduceSum(op.Cast(ended, to=ir.DataType.INT64), op.Constant(value_ints=[1]), keepdims=0)


def einsum(equation: str, tensors, path=None):
    """``aten.einsum``: ONNX's Einsum, with each operand's ``...`` written as explicit axes where
    the ranks are known: the same letters for every operand, right-aligned (an operand with fewer
    gets leading 1s, numpy's broadcast, as PyTorch does). onnxruntime refuses ellipses of
    different ranks (``'...ij,...jk'`` with a batched and a single matrix) and fails to sum one
    away (``'...i->i'``). Two operands are multiplied with MatMul where they can be
    (:func:`_einsum_op`)."""
    equation = equation.replace(" ", "")
    terms = equation.split("->")[0].split(",")
    with_ellipsis = [i for i, term in enumerate(terms) if "..." in term]
    if not with_ellipsis:
        output = equation.split("->")[1] if "->" in equation else _letters_met_once(terms)
        return _einsum_op(terms, output, tensors)
    if any(tensors[i].shape is None for i in with_ellipsis):
        return op.Einsum(*tensors, equation=equation)
    widths = {i: len(tensors[i].shape) - len(terms[i].replace("...", "")) for i in with_ellipsis}
    widest = max(widths.values())
    tensors = list(tensors)
    for i, width in widths.items():
        if width < widest:
            start = terms[i].index("...")
            tensors[i] = op.Unsqueeze(tensors[i], op.Constant(value_ints=list(range(start, start + widest - width))))
    block = "".join([c for c in string.ascii_letters if c not in equation][:widest])
    inputs = [term.replace("...", block) for term in terms]
    if "->" in equation:
        output = equation.split("->")[1].replace("...", block)
    else:  # numpy's implicit output: the ellipsis, then the letters met once, in order
        output = block + _letters_met_once(terms)
    return _einsum_op(inputs, output, tensors)


def _einsum_op(terms: list[str], output: str, tensors):
    """Two operands as a MatMul where they can be (torch/_einsum.py: onnxruntime's Einsum is
    slower), else ONNX's Einsum."""
    if len(tensors) == 2:
        product = _einsum.as_matmul(terms, output, *tensors)
        if product is not None:
            return product
    return op.Einsum(*tensors, equation=",".join(terms) + "->" + output)


def _letters_met_once(terms: list[str]) -> str:
    """The labels that occur once over an einsum's operands, in alphabetical order (numpy's
    implicit output, after the ellipsis)."""
    letters = "".join(term.replace("...", "") for term in terms)
    return "".join(sorted(c for c in set(letters) if letters.count(c) == 1))


def repeat_interleave_self_tensor(self, repeats, dim=None, output_size=None):
    """``aten.repeat_interleave.self_Tensor``: ``self``'s entries along ``dim`` (the flattened
    tensor without one), each repeated as ``repeats`` says (one count: all of them), gathered.
    torchlib's repeated along the first axis whatever ``dim`` was, and took no ``output_size``
    (a hint the graph needs not)."""
    if dim is None:
        self, dim = op.Reshape(self, op.Constant(value_ints=[-1])), 0
    else:
        dim %= len(self.shape)
    # one count for every entry (a single count, a 0-d or 1-element tensor, repeats them all)
    repeats = op.Expand(op.Reshape(repeats, op.Constant(value_ints=[-1])), op.Shape(self, start=dim, end=dim + 1))
    return op.Gather(self, _repeated_positions(repeats), axis=dim)


def repeat_interleave_self_int(self, repeats, dim=None, output_size=None):
    """``aten.repeat_interleave.self_int``: each entry of ``self`` along ``dim`` (the flattened
    tensor without one) ``repeats`` times, as a new axis after ``dim`` expanded and merged into it.
    torchlib put a count known at run time only (a symbolic size) on ``dim`` itself instead of the
    new axis: the input came back unrepeated where the sizes matched, and failed elsewhere."""
    if dim is None:
        self, dim = op.Reshape(self, op.Constant(value_ints=[-1])), 0
    else:
        dim %= len(self.shape)
    count = op.Constant(value_ints=[repeats]) if isinstance(repeats, int) else \
        op.Reshape(op.Cast(repeats, to=int(ir.DataType.INT64)), op.Constant(value_ints=[1]))
    after = op.Shape(self, start=dim + 1)
    expanded = op.Expand(op.Unsqueeze(self, op.Constant(value_ints=[dim + 1])),
                         op.Concat(op.Shape(self, start=0, end=dim + 1), count, after, axis=0))
    merged = op.Mul(op.Shape(self, start=dim, end=dim + 1), count)
    return op.Reshape(expanded, op.Concat(op.Shape(self, start=0, end=dim), merged, after, axis=0))


def squeeze_dims(self, dim):
    """``aten.squeeze.dim`` / ``.dims``: the given axes whose size is 1 dropped, the others kept,
    as PyTorch's (torchlib squeezed them all: a model onnxruntime refuses where a size is known to
    be larger, and a failing run where it is symbolic). A symbolic size is at least 2 (the graph
    of a call with a size of 1 is exported with that size static)."""
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self)
    dims = [dim] if isinstance(dim, int) else list(dim)
    axes = sorted({d % rank for d in dims if self.shape[d % rank] == 1})
    return op.Squeeze(self, op.Constant(value_ints=axes)) if axes else op.Identity(self)


def split_with_sizes(self, split_sizes, dim: int = 0):
    """``aten.split_with_sizes``: torchlib's ``SplitToSequence`` where every size is a number (the
    folder makes it a ``Split``); where one is known at run time only, one ``Slice`` per piece
    (the sequence would stay, and no rule differentiates it)."""
    if all(isinstance(size, int) for size in split_sizes):
        from onnxscript.function_libs.torch_lib.ops.core import aten_split_with_sizes

        return aten_split_with_sizes(self, split_sizes, dim)
    axes = op.Constant(value_ints=[dim])
    start, pieces = op.Constant(value_ints=[0]), []
    for size in split_sizes:
        end = op.Add(start, op.Constant(value_ints=[size]) if isinstance(size, int)
                     else op.Reshape(op.Cast(size, to=int(ir.DataType.INT64)), op.Constant(value_ints=[1])))
        pieces.append(op.Slice(self, start, end, axes))
        start = end
    return pieces


def repeat_interleave_tensor(repeats, output_size=None):
    """``aten.repeat_interleave.Tensor`` (``torch.repeat_interleave(repeats)``): the positions of
    ``repeats``, each repeated as it says."""
    return _repeated_positions(repeats)


def native_dropout(input, p: float, train: bool | None = True):
    """``aten.native_dropout``: ONNX's Dropout (onnxruntime takes a ratio below 1 only). With
    ``p = 1`` in training everything is dropped: ``input * 0`` (NaN where the input is not
    finite, and a zero gradient, as PyTorch's) and an all-False mask."""
    if train and p >= 1:
        dropped = op.Mul(input, _number_like(0.0, input))
        return dropped, op.ConstantOfShape(op.Shape(input), value=ir.tensor(np.zeros([1], np.bool_)))
    return op.Dropout(input, op.Constant(value=ir.tensor(np.array(p, np.float32))),
                      op.Constant(value=ir.tensor(np.array(bool(train)))))


def _info(matrix):
    """LAPACK's status per matrix of a ``[..., M, M]`` batch: 0 (int32; nothing checks it in the graph)."""
    return op.ConstantOfShape(op.Shape(matrix, end=-2), value=ir.tensor(np.zeros([1], np.int32)))


def _lu_stand_ins(matrix):
    """``(LU, pivots)`` for ops that also return an LU factorization (for PyTorch's backward):
    stand-ins of the right types, which nothing in the graph reads (an Identity: the exporter
    cannot name an output that is the graph's input itself, a parameter)."""
    return op.Identity(matrix), op.Cast(op.Shape(matrix, start=-1), to=6)


def _inverse(matrix):
    """``com.microsoft.Inverse(matrix)``, typed and shaped as ``matrix`` (onnx's shape inference
    does not know the op; the gradient rules of its readers need their inputs' ranks)."""
    inverse = _INVERSE(matrix)
    inverse.dtype, inverse.shape = matrix.dtype, matrix.shape
    return inverse


def linalg_inv_ex(matrix, check_errors: bool = False):
    """``aten.linalg_inv_ex`` (``torch.linalg.inv``, ``torch.inverse``; the exporter has none):
    onnxruntime's ``com.microsoft.Inverse`` (standard ONNX has no inverse), and a zero status."""
    return _inverse(matrix), _info(matrix)


def linalg_det(matrix):
    """``aten._linalg_det`` (``torch.linalg.det``): ONNX ``Det``; the LU factors and pivots it
    also returns (for PyTorch's backward) are stand-ins nothing in the graph reads."""
    return op.Det(matrix), *_lu_stand_ins(matrix)


def linalg_slogdet(matrix):
    """``aten._linalg_slogdet`` (``torch.linalg.slogdet``, ``torch.logdet``: a normalizing flow's
    log-determinant; the exporter has none): ONNX ``Det`` of the matrix with its rows scaled to
    unit norm, and those norms' logarithms added back (``log |det A| = sum log |a_i| + log |det
    A'|``): a determinant far beyond float range (a 64 x 64 Gaussian matrix's is ~1e44) stays
    finite. Its gradient is ``A^-T``, through Det's rule; the LU factors and pivots are stand-ins.
    The sign of a singular matrix is 0 and its log-determinant -inf, as PyTorch."""
    norms = op.ReduceL2(matrix, op.Constant(value_ints=[-1]), keepdims=1)  # [..., M, 1]
    scaled = op.Div(matrix, op.Where(op.Equal(norms, _like(matrix, 0.0)), _like(matrix, 1.0), norms))
    determinant = op.Det(scaled)
    logabsdet = op.Add(op.Log(op.Abs(determinant)), op.ReduceSum(op.Log(norms), op.Constant(value_ints=[-2, -1]),
                                                                  keepdims=0))
    return op.Sign(determinant), logabsdet, *_lu_stand_ins(matrix)


def linalg_solve_ex(matrix, other, left: bool = True, check_errors: bool = False):
    """``aten._linalg_solve_ex`` (``torch.linalg.solve``): ``A^-1 B`` (``B A^-1`` with
    ``left=False``) through ``com.microsoft.Inverse``: less accurate than an LU solve for
    ill-conditioned ``A``. ``B`` is a batch of vectors when its shape is ``A``'s without the last
    axis, as PyTorch decides (one axis less alone is not enough: ``A`` of ``[2, 3, 3]`` and ``B`` of
    ``[3, 4]`` is a matrix broadcast over the batch)."""
    inverse = _inverse(matrix)
    if len(other.shape) == 1 or tuple(other.shape) == tuple(matrix.shape)[:-1]:  # vectors
        axis = op.Constant(value_ints=[-1 if left else -2])
        result = op.Squeeze(op.MatMul(inverse, op.Unsqueeze(other, axis)) if left
                            else op.MatMul(op.Unsqueeze(other, axis), inverse), axis)
    else:
        result = op.MatMul(inverse, other) if left else op.MatMul(other, inverse)
    return result, *_lu_stand_ins(matrix), _info(matrix)


def _triangle(matrix, upper: bool, unit: bool = False):
    """The upper or lower triangle of ``[..., M, M]`` matrices (the other entries 0), with ones on
    the diagonal where ``unit``: what PyTorch's triangular solves read. Typed and shaped as
    ``matrix`` (for :func:`_inverse`, which passes both on)."""
    if unit:
        strict = op.Trilu(matrix, op.Constant(value_int=1 if upper else -1), upper=int(upper))
        ones = op.Expand(_like(matrix, 1.0), op.Shape(matrix, start=-2))
        triangle = op.Add(strict, op.Trilu(op.Trilu(ones, upper=1), upper=0))
    else:
        triangle = op.Trilu(matrix, upper=int(upper))
    triangle.dtype, triangle.shape = matrix.dtype, matrix.shape
    return triangle


def _transposed(matrix, rank: int):
    """``[..., M, N]`` matrices of ``rank`` axes transposed (their last two axes swapped)."""
    return op.Transpose(matrix, perm=[*range(rank - 2), rank - 1, rank - 2])


def linalg_solve_triangular(matrix, other, upper: bool, left: bool = True, unitriangular: bool = False):
    """``aten.linalg_solve_triangular`` (``torch.linalg.solve_triangular``; the log-probability of a
    ``MultivariateNormal``; the exporter has none): the inverse of the triangle PyTorch reads
    (``com.microsoft.Inverse``) times ``B`` (``B`` times it with ``left=False``). Less accurate than
    a substitution for an ill-conditioned triangle."""
    inverse = _inverse(_triangle(matrix, upper, unitriangular))
    return op.MatMul(inverse, other) if left else op.MatMul(other, inverse)


def _inverse_from_factor(factor, upper: bool):
    """``A^-1`` for ``A = L L^T`` (``U^T U`` when ``upper``), from the triangle of ``factor``."""
    inverse = _inverse(_triangle(factor, upper))  # L^-1 (U^-1)
    transposed = _transposed(inverse, len(factor.shape))
    return op.MatMul(inverse, transposed) if upper else op.MatMul(transposed, inverse)


def cholesky_solve(other, factor, upper: bool = False):
    """``aten.cholesky_solve`` (``torch.cholesky_solve(B, L)``: a Gaussian process's ``K^-1 y``;
    the exporter has none): ``(L L^T)^-1 B`` as ``L^-T L^-1 B``, from the factor's triangle."""
    return op.MatMul(_inverse_from_factor(factor, upper), other)


def cholesky_inverse(factor, upper: bool = False):
    """``aten.cholesky_inverse``: ``(L L^T)^-1`` as ``L^-T L^-1``, from the factor's triangle."""
    return _inverse_from_factor(factor, upper)


_LARGEST_UNROLLED_CHOLESKY = 256  # ~4 M^3 / 2 bytes of float32 columns saved: 32 MB at 256


def linalg_cholesky_ex(matrix, upper: bool = False, check_errors: bool = False):
    """``aten.linalg_cholesky_ex`` (``torch.linalg.cholesky``, a ``MultivariateNormal`` from its
    covariance; standard ONNX has no decomposition): the Cholesky-Banachiewicz columns, unrolled
    over the static size ``M`` (up to 256; larger matrices are not translated): column ``j`` is
    ``(A[:, j] - L[:, :j] L[j, :j]^T) / sqrt(...)`` below the diagonal, from the lower triangle of
    ``A`` as PyTorch reads it. The gradient is PyTorch's symmetric one: the columns read
    ``(A + A^T) / 2``, with the lower triangle's values. A matrix that is not positive definite
    gives NaN where PyTorch raises (``check_errors``) or reports it in ``info`` (here always 0)."""
    size = matrix.shape[-1] if matrix.shape is not None else None
    if not isinstance(size, int):
        raise NotImplementedError("torch.linalg.cholesky of matrices of a symbolic size")
    if size > _LARGEST_UNROLLED_CHOLESKY:  # the columns so far, kept for the backward, grow as M^3
        raise NotImplementedError(f"torch.linalg.cholesky of {size} x {size} matrices (up to "
                                  f"{_LARGEST_UNROLLED_CHOLESKY} are unrolled)")
    rank = len(matrix.shape)
    mirrored = op.Add(op.Trilu(matrix, upper=0),
                      _transposed(op.Trilu(matrix, op.Constant(value_int=-1), upper=0), rank))
    symmetric = op.Mul(op.Add(matrix, _transposed(matrix, rank)), _like(matrix, 0.5))
    source = _value_with_gradient(mirrored, symmetric)  # the lower triangle's values
    columns = []
    for j in range(size):
        column = op.Slice(source, op.Constant(value_ints=[j]), op.Constant(value_ints=[j + 1]),
                          op.Constant(value_ints=[-1]))  # [..., M, 1]
        if columns:
            known = columns[0] if len(columns) == 1 else op.Concat(*columns, axis=-1)  # [..., M, j]
            row = op.Slice(known, op.Constant(value_ints=[j]), op.Constant(value_ints=[j + 1]),
                           op.Constant(value_ints=[-2]))  # [..., 1, j]
            column = op.Sub(column, op.MatMul(known, _transposed(row, rank)))
        pivot = op.Sqrt(op.Slice(column, op.Constant(value_ints=[j]), op.Constant(value_ints=[j + 1]),
                                 op.Constant(value_ints=[-2])))  # [..., 1, 1]
        below = np.zeros((size, 1), dtype=matrix.dtype.numpy() if matrix.dtype is not None else np.float32)
        below[j:] = 1.0
        columns.append(op.Mul(op.Div(column, pivot), op.Constant(value=ir.tensor(below))))
    factor = columns[0] if size == 1 else op.Concat(*columns, axis=-1)
    return (_transposed(factor, rank) if upper else factor), _info(matrix)


def _fake_quantized(x, scale, zero_point, quant_min: int, quant_max: int, per_channel: bool = False,
                    float_zero_point: bool = False):
    """``(values, in range)``: ``(clamp(round(x / scale) + zero_point) - zero_point) * scale`` (round
    half to even, as PyTorch's ``nearbyint``; ``round(x / scale + zero_point)`` for a float zero
    point, as PyTorch's per-channel kernel), and where the rounded value was inside the range.
    ``scale`` and ``zero_point`` are numbers or tensors broadcasting against ``x`` (one per channel
    with ``per_channel``). The steps are rounded where PyTorch's CPU kernels round them: the scale
    to float32 and ``x / scale`` as ``x`` times the float32 reciprocal of the scale, whatever ``x``'s
    type; a float16 or bfloat16 ``x`` is quantized in float32 and the values rounded to its type
    once; for a float64 ``x``, the per-tensor kernels compute the values ``(q - zero_point) *
    scale`` in float32 and the per-channel kernel adds a float zero point to ``x / scale`` rounded
    to float32. The values carry the straight-through gradient PyTorch's fake quantization has:
    ``dy`` where in range, 0 elsewhere, as ``detach(values) + (x - detach(x)) * in_range`` (exactly
    the quantized values: ``x - x`` is 0)."""
    low_precision = x.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    double = x.dtype == ir.DataType.DOUBLE
    computed = op.Cast(x, to=ir.DataType.FLOAT) if low_precision else x
    if isinstance(scale, (int, float)):
        inverse = _like(computed, float(np.float32(1.0) / np.float32(scale)))
        scale = _like(computed, float(np.float32(scale)))
    else:
        scale = op.Cast(scale, to=ir.DataType.FLOAT)
        inverse = op.CastLike(op.Reciprocal(scale), computed)
        scale = op.CastLike(scale, computed)
    zero_point = _like(computed, zero_point) if isinstance(zero_point, (int, float)) else op.CastLike(zero_point, computed)
    scaled = op.Mul(computed, inverse)
    if not float_zero_point:
        rounded = op.Add(op.Round(scaled), zero_point)
    elif double:
        rounded = op.CastLike(op.Round(op.Add(op.Cast(scaled, to=ir.DataType.FLOAT),
                                              op.Cast(zero_point, to=ir.DataType.FLOAT))), computed)
    else:
        rounded = op.Round(op.Add(scaled, zero_point))
    low, high = _like(computed, float(quant_min)), _like(computed, float(quant_max))
    in_range = op.And(op.GreaterOrEqual(rounded, low), op.LessOrEqual(rounded, high))
    steps = op.Sub(op.Clip(rounded, low, high), zero_point)
    if double and not per_channel:
        values = op.CastLike(op.Mul(op.Cast(steps, to=ir.DataType.FLOAT), op.Cast(scale, to=ir.DataType.FLOAT)),
                             computed)
    else:
        values = op.Mul(steps, scale)
    if low_precision:
        values = op.CastLike(values, x)
    return _value_with_gradient(values, x, op.CastLike(in_range, x)), in_range


def fake_quantize_per_tensor_affine_cachemask(x, scale: float, zero_point: int, quant_min: int, quant_max: int):
    """``aten.fake_quantize_per_tensor_affine_cachemask`` (``torch.fake_quantize_per_tensor_affine``,
    quantization-aware training): the exporter's QuantizeLinear/DequantizeLinear pair has no
    gradient, so the module's output would not require grad; this one has PyTorch's."""
    return _fake_quantized(x, float(scale), int(zero_point), quant_min, quant_max)


def fake_quantize_per_tensor_tensor_qparams(x, scale, zero_point, fake_quant_enabled, quant_min: int,
                                            quant_max: int):
    """``aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams`` (the per-tensor op with
    tensor scale and zero point, as ``torch.ao.quantization.FakeQuantize`` calls it): as
    :func:`fake_quantize_per_tensor_affine_cachemask`; ``x`` itself (and all in range) while
    ``fake_quant_enabled`` is 0."""
    values, in_range = _fake_quantized(x, scale, zero_point, quant_min, quant_max)
    enabled = op.Not(op.Equal(op.Cast(fake_quant_enabled, to=7), op.Constant(value_int=0)))
    return op.Where(enabled, values, x), op.Or(in_range, op.Not(enabled))


def fake_quantize_per_channel_affine_cachemask(x, scale, zero_point, axis: int, quant_min: int, quant_max: int):
    """``aten.fake_quantize_per_channel_affine_cachemask`` (``torch.fake_quantize_per_channel_affine``):
    as the per-tensor one with one scale and zero point per index along ``axis``."""
    rank = len(x.shape)
    shape = op.Constant(value_ints=[-1 if k == axis % rank else 1 for k in range(rank)])
    float_zero_point = zero_point.dtype is not None and zero_point.dtype.is_floating_point()
    return _fake_quantized(x, op.Reshape(scale, shape), op.Reshape(zero_point, shape), quant_min, quant_max,
                           per_channel=True, float_zero_point=float_zero_point)


def neg_view(x):
    """``aten._neg_view``: ``-x`` (PyTorch's lazily negated view, as the imaginary part of a
    conjugate: ``torch.fft.ifft(x).imag``), a new tensor in the graph."""
    return op.Neg(x)


def fake_quantize_per_tensor_affine(x, scale: float, zero_point: int, quant_min: int, quant_max: int):
    """``aten.fake_quantize_per_tensor_affine`` (translated before any decomposition): its values."""
    return fake_quantize_per_tensor_affine_cachemask(x, scale, zero_point, quant_min, quant_max)[0]


def fake_quantize_per_tensor_affine_tensor_qparams(x, scale, zero_point, quant_min: int, quant_max: int):
    """``aten.fake_quantize_per_tensor_affine.tensor_qparams``: its values."""
    return _fake_quantized(x, scale, zero_point, quant_min, quant_max)[0]


def fake_quantize_per_channel_affine(x, scale, zero_point, axis: int, quant_min: int, quant_max: int):
    """``aten.fake_quantize_per_channel_affine``: its values."""
    return fake_quantize_per_channel_affine_cachemask(x, scale, zero_point, axis, quant_min, quant_max)[0]


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm`` and transformers' ``grouped_mm_fallback`` (mixture-of-experts layers:
    Mixtral, Qwen-MoE, ...; the exporter has no translation): ``mat_a``'s rows, sorted by expert,
    each times its expert's matrix, ``offs`` the cumulative row count per expert. One product
    per expert (their number is static), on the rows ``offs`` gives it, then concatenated."""
    experts = mat_b.shape[0] if mat_b.shape is not None and len(mat_b.shape) == 3 else None
    if offs is None or not isinstance(experts, int) or mat_a.shape is None or len(mat_a.shape) != 2:
        raise NotImplementedError("grouped matrix product: only rows grouped by offsets times a static number of "
                                  "[K, N] matrices")
    ends = op.Cast(offs, to=onnx.TensorProto.INT64)
    one, first = op.Constant(value_int=1), op.Constant(value_ints=[0])
    products, start = [], op.Constant(value_int=0)
    for expert in range(experts):
        end = op.Squeeze(op.Gather(ends, op.Constant(value_ints=[expert]), axis=0), first)
        rows = op.Gather(mat_a, op.Range(start, end, one), axis=0)
        matrix = op.Gather(mat_b, op.Constant(value_int=expert), axis=0)
        product = op.MatMul(rows, matrix)
        if bias is not None:
            product = op.Add(product, op.Gather(bias, op.Constant(value_int=expert), axis=0))
        products.append(product)
        start = end
    out = op.Concat(*products, axis=0) if len(products) > 1 else products[0]
    return op.Cast(out, to=int(out_dtype)) if out_dtype is not None else out


def _optional_ops() -> dict:
    """Translations of ops that libraries register when imported (transformers' grouped product)."""
    table = {}
    try:
        table[torch.ops.transformers.grouped_mm_fallback.default] = grouped_mm
    except (AttributeError, RuntimeError):  # transformers' MoE integration not imported
        pass
    return table


def translation_table() -> dict:
    """The ``custom_translation_table`` ORTModule passes to ``torch.onnx.export`` (its graphs
    return the module's buffers, so training BatchNorm computes PyTorch's exact buffer updates
    with primitive ops)."""
    return {
        torch.ops.onnxtrain.per_sample_cross_entropy.default: per_sample_cross_entropy,
        torch.ops.onnxtrain.per_sample_nll_loss.default: per_sample_nll_loss,
        torch.ops.aten._native_batch_norm_legit_functional.default: batch_norm_functional,
        torch.ops.aten.embedding.default: embedding,
        torch.ops.aten.embedding_bag.default: embedding_bag,
        torch.ops.aten.embedding_bag.padding_idx: embedding_bag_padding_idx,
        torch.ops.aten._embedding_bag.default: embedding_bag,
        torch.ops.aten._embedding_bag_forward_only.default: embedding_bag,
        torch.ops.aten.detach.default: detach,
        torch.ops.aten.native_dropout.default: native_dropout,
        torch.ops.aten.copy.default: copy,
        torch.ops.aten.einsum.default: einsum,
        torch.ops.aten.repeat_interleave.self_Tensor: repeat_interleave_self_tensor,
        torch.ops.aten.repeat_interleave.self_int: repeat_interleave_self_int,
        torch.ops.aten.split_with_sizes.default: split_with_sizes,
        torch.ops.aten.squeeze.dim: squeeze_dims,
        torch.ops.aten.squeeze.dims: squeeze_dims,
        torch.ops.aten.repeat_interleave.Tensor: repeat_interleave_tensor,
        torch.ops.aten.xlogy.Tensor: xlogy,
        torch.ops.aten.xlogy.Scalar_Other: xlogy_scalar_other,
        torch.ops.aten.floor_divide.Scalar: floor_divide_scalar,
        torch.ops.aten.special_xlog1py.default: xlog1py,
        torch.ops.aten.special_xlog1py.other_scalar: xlog1py_other_scalar,
        torch.ops.aten.scalar_tensor.default: scalar_tensor,
        torch.ops.aten.conv3d.default: conv3d,
        torch.ops.aten.clamp.Tensor: clamp,
        torch.ops.aten.clamp_min.Tensor: clamp_min,
        torch.ops.aten.clamp_max.Tensor: clamp_max,
        torch.ops.aten.hardtanh.default: hardtanh,
        torch.ops.aten.relu6.default: relu6,
        torch.ops.aten.cross_entropy_loss.default: cross_entropy_loss,
        torch.ops.aten.binary_cross_entropy.default: binary_cross_entropy,
        torch.ops.aten.instance_norm.default: instance_norm,
        torch.ops.aten.scatter_reduce.two: scatter_reduce,
        torch.ops.aten.zeros.default: zeros,
        torch.ops.aten.index_reduce.default: index_reduce,
        torch.ops.aten.scatter.src: scatter_src,
        torch.ops.aten.slice_scatter.default: slice_scatter,
        torch.ops.aten.scatter_add.default: scatter_add,
        torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
        torch.ops.aten.median.dim: median_dim,
        torch.ops.aten.median.default: median,
        torch.ops.aten.nanmedian.dim: nanmedian_dim,
        torch.ops.aten.nanmedian.default: nanmedian,
        torch.ops.aten._cdist_forward.default: cdist,
        torch.ops.aten._pdist_forward.default: pdist,
        torch.ops.aten.kthvalue.default: kthvalue,
        torch.ops.aten.hypot.default: hypot,
        torch.ops.aten.atan2.default: atan2,
        torch.ops.aten.copysign.Tensor: copysign,
        torch.ops.aten.copysign.Scalar: copysign,
        torch.ops.prims.fmax.default: fmax,
        torch.ops.prims.fmin.default: fmin,
        torch.ops.aten.sort.stable: sort_stable,
        torch.ops.aten.avg_pool2d.default: avg_pool2d,
        torch.ops.aten.avg_pool3d.default: avg_pool3d,
        torch.ops.aten.searchsorted.Tensor: searchsorted,
        torch.ops.aten.cumprod.default: cumprod,
        torch.ops.aten.multilabel_margin_loss.default: multilabel_margin_loss,
        torch.ops.aten.rrelu_with_noise_functional.default: rrelu_with_noise_functional,
        torch.ops.prims.uniform.default: _random.uniform,
        torch.ops.aten.randperm.default: _random.randperm,
        torch.ops.aten.randint.default: _random.randint,
        torch.ops.aten.randint.low: _random.randint_low,
        torch.ops.aten.randint_like.default: _random.randint_like,
        torch.ops.aten.randint_like.low_dtype: _random.randint_like_low,
        torch.ops.aten.multinomial.default: _random.multinomial,
        torch.ops.aten.lgamma.default: lgamma,
        torch.ops.aten.digamma.default: digamma,
        torch.ops.aten.polygamma.default: polygamma,
        torch.ops.aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
        torch.ops.aten._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
        torch.ops.aten.cummax.default: cummax,
        torch.ops.aten.cummin.default: cummin,
        torch.ops.aten.erfinv.default: erfinv,
        torch.ops.aten.masked_select.default: masked_select,
        torch.ops.aten.linalg_inv_ex.default: linalg_inv_ex,
        torch.ops.aten._linalg_det.default: linalg_det,
        torch.ops.aten._linalg_solve_ex.default: linalg_solve_ex,
        torch.ops.aten._linalg_slogdet.default: linalg_slogdet,
        torch.ops.aten.linalg_solve_triangular.default: linalg_solve_triangular,
        torch.ops.aten.linalg_cholesky_ex.default: linalg_cholesky_ex,
        torch.ops.aten.cholesky_solve.default: cholesky_solve,
        torch.ops.aten.cholesky_inverse.default: cholesky_inverse,
        torch.ops.aten.fake_quantize_per_tensor_affine_cachemask.default: fake_quantize_per_tensor_affine_cachemask,
        torch.ops.aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default:
            fake_quantize_per_tensor_tensor_qparams,
        torch.ops.aten.fake_quantize_per_channel_affine_cachemask.default: fake_quantize_per_channel_affine_cachemask,
        torch.ops.aten.fake_quantize_per_tensor_affine.default: fake_quantize_per_tensor_affine,
        torch.ops.aten._neg_view.default: neg_view,
        torch.ops.aten.fake_quantize_per_tensor_affine.tensor_qparams: fake_quantize_per_tensor_affine_tensor_qparams,
        torch.ops.aten.fake_quantize_per_channel_affine.default: fake_quantize_per_channel_affine,
        torch.ops.aten.logaddexp.default: _log_space.logaddexp,
        torch.ops.aten.logaddexp2.default: _log_space.logaddexp2,
        torch.ops.aten.logcumsumexp.default: _log_space.logcumsumexp,
        torch.ops.aten.erfc.default: _log_space.erfc,
        torch.ops.aten.special_erfcx.default: _log_space.erfcx,
        torch.ops.aten.sinc.default: _log_space.sinc,
        torch.ops.aten.special_log_ndtr.default: _log_space.log_ndtr,
        torch.ops.aten._safe_softmax.default: safe_softmax,
        torch.ops.aten.argmax.default: _reductions.argmax,
        torch.ops.aten.argmin.default: _reductions.argmin,
        torch.ops.aten.max.dim: _reductions.max_dim,
        torch.ops.aten.min.dim: _reductions.min_dim,
        torch.ops.aten.max.default: _reductions.max_all,
        torch.ops.aten.min.default: _reductions.min_all,
        torch.ops.aten.amax.default: _reductions.amax,
        torch.ops.aten.amin.default: _reductions.amin,
        torch.ops.aten.std.correction: _reductions.std_correction,
        torch.ops.aten.std_mean.correction: _reductions.std_mean_correction,
        torch.ops.aten.linalg_vector_norm.default: _reductions.linalg_vector_norm,
        torch.ops.aten._grouped_mm.default: grouped_mm,
        **_nearest.translations(),
        **_windows.translations(),
        **_antialias.translations(),
        **_optional_ops(),
    }


def angle_complex(self):
    """``aten.angle`` of a complex tensor (a real one with a last axis of 2): :func:`atan2` of
    its imaginary and real parts (torchlib's own arctangent gives -π on the negative real axis
    with a +0 imaginary part, and NaN gradients where the real part is 0)."""
    last = op.Constant(value_ints=[-1])
    real = op.Squeeze(op.Slice(self, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), last), last)
    imaginary = op.Squeeze(op.Slice(self, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]), last), last)
    return atan2(imaginary, real)


def copy_complex(self, src, non_blocking: bool = False):
    """``aten.copy`` into a complex tensor (real ones with a last axis of 2) from a complex source
    of the same rank (a Fourier layer's slice assignment, as the capture writes it): :func:`copy`.
    The exporter dispatches here for a real source too, which holds no part axis: ranks that
    differ, or are unknown, are refused (NotImplementedError) rather than broadcast wrongly."""
    if self.shape is None or src.shape is None or len(self.shape) != len(src.shape):
        raise NotImplementedError("copy_ into a complex tensor from a real or broadcast source")
    return copy(self, src, non_blocking)


def einsum_complex(equation: str, tensors, path=None):
    """``aten.einsum`` of complex tensors (real ones with a last axis of 2; the exporter has none):
    one real :func:`einsum` with each operand's part axis as a letter of its own, whose products
    of parts then combine as ``(a + bi)(c + di)``. One or two operands (a Fourier neural
    operator's channel mixing is ``"bix,iox->box"``)."""
    equation = equation.replace(" ", "")
    terms = equation.split("->")[0].split(",")
    if len(terms) != len(tensors) or len(tensors) > 2:
        raise NotImplementedError(f"einsum of {len(tensors)} complex operands (one or two are translated)")
    if "->" in equation:
        output = equation.split("->")[1]
    else:  # numpy's implicit output: the ellipsis, then the letters met once, in order
        output = ("..." if "..." in equation else "") + _letters_met_once(terms)
    parts = [c for c in string.ascii_letters if c not in equation][:len(tensors)]
    products = einsum(",".join(t + p for t, p in zip(terms, parts)) + "->" + output + "".join(parts), tensors)
    if len(tensors) == 1:
        return products
    last = op.Constant(value_ints=[-1])

    def part(i: int, j: int):  # products[..., i, j]: operand 0's part i times operand 1's part j
        picked = op.Slice(products, op.Constant(value_ints=[i, j]), op.Constant(value_ints=[i + 1, j + 1]),
                          op.Constant(value_ints=[-2, -1]))
        return op.Squeeze(picked, op.Constant(value_ints=[-2, -1]))

    real = op.Sub(part(0, 0), part(1, 1))
    imaginary = op.Add(part(0, 1), part(1, 0))
    return op.Concat(op.Unsqueeze(real, last), op.Unsqueeze(imaginary, last), axis=-1)


_COMPLEX_PARTS = {ir.DataType.COMPLEX64: ir.DataType.FLOAT, ir.DataType.COMPLEX128: ir.DataType.DOUBLE}


def zeros(size, dtype: int = ir.DataType.FLOAT, layout: str = "", device: str = "", pin_memory: bool = False):
    """``aten.zeros``: torchlib's, but a complex one (a Fourier neural operator's
    ``torch.zeros(..., dtype=torch.cfloat)`` for its output modes) as the exporter holds complex
    tensors, real with a last axis of 2 (torchlib's expanded a complex constant to that shape and
    typed it real)."""
    from onnxscript.function_libs.torch_lib.ops import common as common_ops
    from onnxscript.function_libs.torch_lib.ops.core import aten_zeros
    parts = _COMPLEX_PARTS.get(ir.DataType(dtype)) if dtype != -1 else None
    if parts is None:
        return aten_zeros(size, dtype, layout, device, pin_memory)
    zero = op.Constant(value=ir.tensor(np.zeros((), parts.numpy())))
    return op.Expand(zero, op.Concat(common_ops.merge_dims(size), op.Constant(value_ints=[2]), axis=0))


def zeros_like_complex(self, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False,
                       memory_format: str = ""):
    """``aten.zeros_like`` (and ``empty_like``) of a complex tensor (a real one with a last axis of
    2): zeros of its shape, both parts, or of its complex shape in a real ``dtype`` given."""
    shape = op.Shape(self)
    if dtype not in (-1, None) and ir.DataType(dtype) not in _COMPLEX_PARTS:
        shape = op.Slice(shape, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]))
        return op.ConstantOfShape(shape, value=ir.tensor(np.zeros(1, ir.DataType(dtype).numpy())))
    zero = op.CastLike(op.Constant(value_float=0.0), self) if dtype in (-1, None) else \
        op.Constant(value=ir.tensor(np.zeros((), _COMPLEX_PARTS[ir.DataType(dtype)].numpy())))
    return op.Expand(zero, shape)


def new_zeros_complex(self, size, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):
    """``aten.new_zeros`` of a complex tensor: :func:`zeros` of ``size`` in ``self``'s type, or
    ``dtype``."""
    if dtype in (-1, None):
        parts = {real: complex_ for complex_, real in _COMPLEX_PARTS.items()}.get(self.dtype)
        if parts is None:
            raise NotImplementedError(f"new_zeros of a complex tensor held as {self.dtype}")
        dtype = parts
    return zeros(size, dtype)


def _before_parts(dim: int) -> int:
    """A complex tensor's axis ``dim`` on its real form (a last axis of 2 added): a negative one
    counts one further from the end."""
    return dim - 1 if dim < 0 else dim


def select_complex(self, dim: int, index: int):
    """``aten.select`` of a complex tensor (a real one with a last axis of 2): the real one's, on
    :func:`_before_parts` of ``dim``."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_select
    return aten_select(self, _before_parts(dim), index)


def unsqueeze_complex(self, dim: int):
    """``aten.unsqueeze`` of a complex tensor: the real one's, on :func:`_before_parts` of ``dim``."""
    return op.Unsqueeze(self, op.Constant(value_ints=[_before_parts(dim)]))


def sym_size_complex(self, dim: int):
    """``aten.sym_size`` of a complex tensor (a size that depends on the data: ``z[mask]``): the
    real one's, on :func:`_before_parts` of ``dim``."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_sym_size
    return aten_sym_size(self, _before_parts(dim))


def index_complex(self, indices):
    """``aten.index`` of a complex tensor (``z[mask]``, ``z[ids]``): the indices address its
    leading axes, so the real one's, whose part axis comes along as a trailing one."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_index
    return aten_index(self, indices)


def complex_translation_table() -> dict:
    """Translations of ops on complex tensors (the exporter dispatches to them for complex
    arguments; ORTModule's and ``export_for_training``'s exports register them)."""
    return {torch.ops.aten.angle.default: angle_complex, torch.ops.aten.einsum.default: einsum_complex,
            torch.ops.aten.copy.default: copy_complex, torch.ops.aten.zeros_like.default: zeros_like_complex,
            torch.ops.aten.empty_like.default: zeros_like_complex, torch.ops.aten.new_zeros.default: new_zeros_complex,
            torch.ops.aten.select.int: select_complex, torch.ops.aten.unsqueeze.default: unsqueeze_complex,
            torch.ops.aten.index.Tensor: index_complex, torch.ops.aten.sym_size.int: sym_size_complex,
            torch.ops.aten.detach.default: detach}


def artifacts_translation_table() -> dict:
    """The ``custom_translation_table`` to export a model with for artifacts (public as
    ``onnxtrain.torch.onnx_translation_table``; :func:`onnxtrain.torch.export_for_training` uses
    it): ORTModule's, except that training-mode BatchNorm is an ONNX ``BatchNormalization`` whose
    running statistics the artifacts update and evaluate with, and a sparse ``nn.Embedding``
    trains with a dense gradient. Padded embeddings carry their padding index,
    ``nn.EmbeddingBag`` exports without a ``Loop``, ``detach()`` stops gradients.

    Example:
        >>> torch.onnx.export(model, args, dynamo=True, optimize=False,
        ...                   custom_translation_table=onnx_translation_table())
    """
    table = translation_table()
    table[torch.ops.aten._native_batch_norm_legit_functional.default] = batch_norm_for_artifacts
    table[torch.ops.aten.embedding.default] = dense_gradient_embedding
    return table


def dense_gradient_embedding(weight, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                             sparse: bool = False):
    """``aten.embedding`` for artifacts: :func:`embedding`, ``nn.Embedding(sparse=True)`` too (the
    artifacts' optimizer updates dense gradients whatever PyTorch's optimizer would have taken)."""
    return embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse=False)
