"""Spectral ops: DFT (torch.fft.fft / rfft / ifft / irfft and their n-dimensional forms) and STFT (torch.stft).

A DFT is linear, and as a map between real vectors (a complex value being its real and
imaginary parts) its adjoint is the conjugate-transposed matrix: the gradient of a forward
transform of length ``N`` is ``N`` times the inverse transform of the output gradient (ONNX's
inverse divides by ``N``), and that of an inverse transform is the forward transform over ``N``.
Around it: a real input (last dim 1) keeps the real part; a one-sided output (the first
``N // 2 + 1`` bins of a real signal's transform) is the full output with the other bins
dropped, so its gradient is the full one with zeros in their place; a ``dft_length`` that padded
the signal with zeros (or cut it) is undone by cutting (or padding) the gradient. A one-sided
inverse (a real signal from half a spectrum, ``irfft``) has the one-sided forward transform for
gradient, doubled at the bins whose mirror image it also read.

An STFT is a DFT of each windowed frame: its signal gradient is each frame's adjoint
transform (as above, one-sided bins padded back), times the window, added back where the frame
was read from (overlap-add: a ``ScatterElements`` that adds); its window gradient sums,
over batches and frames, each frame's adjoint transform times the frame's samples.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.ir.shapes import normalize_axis, rank_of

_AXIS_AS_INPUT = 20  # DFT-20 takes the axis as its third input (default -2); DFT-17 as an attribute (default 1)


def _axis(ctx: GradContext, rank: int) -> int:
    if ctx.opset >= _AXIS_AS_INPUT:
        if len(ctx.node.inputs) > 2 and ctx.node.inputs[2] is not None:
            value = ctx.const_input(2)
            if value is None:
                raise NotImplementedError("DFT gradient needs a constant axis")
            return normalize_axis(int(value.reshape(-1)[0]), rank)
        return rank - 2
    return normalize_axis(int(ctx.attr("axis", 1)), rank)


def _along(ctx: GradContext, rank: int, axis: int, amount) -> object:
    """Pads ``[0] * 2 * rank`` with ``amount`` (a [1] int64 value) as the end pad of ``axis``."""
    before, after = rank + axis, rank - axis - 1  # zeros before and after the end pad of axis
    pieces = [*([ctx.b.ints([0] * before)] if before else []), amount,
              *([ctx.b.ints([0] * after)] if after else [])]
    return ctx.op.Concat(*pieces, axis=0)


def _length(ctx: GradContext, scalar) -> object:
    """A length input (an integer scalar or [1]) as a [1] int64 value."""
    return ctx.op.Reshape(ctx.op.Cast(scalar, to=7), ctx.b.ints([1]))


def _transform(ctx: GradContext, signal, axis: int, inverse: bool, onesided: bool = False):
    op = ctx.op
    if ctx.opset >= _AXIS_AS_INPUT:
        return op.DFT(signal, None, ctx.b.scalar_int(axis), inverse=int(inverse), onesided=int(onesided))
    return op.DFT(signal, axis=axis, inverse=int(inverse), onesided=int(onesided))


@grad("DFT", versions=(17, None))
def _dft(ctx: GradContext):
    op, b, x = ctx.op, ctx.b, ctx.x
    rank = rank_of(x)
    parts = x.shape[-1] if rank else None
    if rank is None or parts not in (1, 2):
        raise NotImplementedError("DFT gradient needs the input's rank and its last dim (1: real, 2: complex)")
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    if onesided and (parts == 2) != inverse:
        raise NotImplementedError("a one-sided DFT of a complex signal, or a one-sided inverse of a real one")
    axis = _axis(ctx, rank)
    axes = b.ints([axis])
    signal_length = op.Gather(op.Shape(x), axes, axis=0)  # [1]
    has_length = len(ctx.node.inputs) > 1 and ctx.node.inputs[1] is not None
    length = _length(ctx, ctx.node.inputs[1]) if has_length else signal_length
    if onesided and inverse:
        return (_one_sided_inverse(ctx, x, rank, axis, signal_length, length),)
    dy = ctx.dy
    if onesided:  # the dropped bins get no gradient
        bins = op.Gather(op.Shape(dy), axes, axis=0)
        dy = op.Pad(dy, _along(ctx, rank, axis, op.Sub(length, bins)))
    full = _transform(ctx, dy, axis, inverse=not inverse)
    count = op.CastLike(length, full)
    dx = op.Div(full, count) if inverse else op.Mul(full, count)
    if parts == 1:
        dx = op.Slice(dx, b.ints([0]), b.ints([1]), b.ints([rank - 1]))
    if has_length:  # back from the transform's length to the signal's: cut, then pad what was cut off
        dx = op.Slice(dx, b.ints([0]), signal_length, axes)
        dx = op.Pad(dx, _along(ctx, rank, axis, op.Max(op.Sub(signal_length, length), b.ints([0]))))
    return (dx,)


def _one_sided_inverse(ctx: GradContext, x: ir.Value, rank: int, axis: int, bins, length) -> object:
    """The gradient of a one-sided inverse DFT (``torch.fft.irfft``: the real signal of ``length``
    whose spectrum is the input's bins, the others by conjugate symmetry), as PyTorch's: the
    one-sided forward transform of the output gradient's real part over ``length``, doubled at
    the bins whose mirror image the inverse also read (1 to ``length - (length // 2 + 1)``), and
    zeros for the input's bins past ``length // 2 + 1``, which it does not read. PyTorch's irfft
    gives the DFT at least ``length // 2 + 1`` bins; fewer (which onnxruntime reads otherwise) are
    refused where the shapes say so."""
    op, b = ctx.op, ctx.b
    known_length = ctx.const_input(1)
    known_bins = x.shape[axis] if x.shape is not None else None
    if known_length is not None and isinstance(known_bins, int) and known_bins < int(known_length) // 2 + 1:
        raise NotImplementedError(f"a one-sided inverse DFT of {known_bins} bins to length {int(known_length)}")
    real = op.Slice(ctx.dy, b.ints([0]), b.ints([1]), b.ints([rank - 1]))
    spectrum = _transform(ctx, real, axis, inverse=False, onesided=True)
    half = op.Add(op.Div(length, b.ints([2])), b.ints([1]))  # the bins the forward transform gives
    index = op.Range(b.scalar_int(0), op.Reshape(half, b.ints([])), b.scalar_int(1))
    mirrored = op.And(op.GreaterOrEqual(index, b.scalar_int(1)),
                      op.LessOrEqual(index, op.Reshape(op.Sub(length, half), b.ints([]))))
    weight = op.Div(op.Add(op.CastLike(mirrored, spectrum), ctx.like(spectrum, 1.0)),
                    op.CastLike(length, spectrum))  # (1 or 2) / length
    shape = [1] * rank
    shape[axis] = -1
    grad = op.Mul(spectrum, op.Reshape(weight, b.ints(shape)))
    grad = op.Slice(grad, b.ints([0]), bins, b.ints([axis]))
    return op.Pad(grad, _along(ctx, rank, axis, op.Max(op.Sub(bins, half), b.ints([0]))))


def _frame_transforms(ctx: GradContext, frame_length) -> object:
    """``[batch, frames, frame_length, 2]``: each frame's adjoint transform of the output gradient
    (one-sided bins padded back with zeros)."""
    op = ctx.op
    dy = ctx.dy  # [batch, frames, bins, 2]
    if ctx.attr("onesided", 1):
        bins = op.Gather(op.Shape(dy), ctx.b.ints([2]), axis=0)
        dy = op.Pad(dy, _along(ctx, 4, 2, op.Sub(frame_length, bins)))
    full = _transform(ctx, dy, 2, inverse=True)
    return op.Mul(full, op.CastLike(frame_length, full))


@grad("STFT", versions=(17, None))
def _stft(ctx: GradContext):
    op, b, x = ctx.op, ctx.b, ctx.x
    parts = x.shape[-1] if x.shape is not None and len(x.shape) == 3 else None
    if parts not in (1, 2):
        raise NotImplementedError("STFT gradient needs a [batch, length, 1 or 2] signal of known last dim")
    step = ctx.const_input(1)
    if step is None:
        raise NotImplementedError("STFT gradient needs a constant frame_step")
    step = int(step.reshape(-1)[0])
    window = ctx.inputs[2] if len(ctx.inputs) > 2 else None
    if window is not None:
        frame_length = op.Shape(window)
    elif len(ctx.inputs) > 3 and ctx.inputs[3] is not None:
        frame_length = _length(ctx, ctx.inputs[3])
    else:
        raise NotImplementedError("an STFT without a window or a frame_length")
    u = _frame_transforms(ctx, frame_length)  # [batch, frames, frame_length, 2]
    # where each frame's taps were read from: signal[:, f * step + n] for frame f, tap n
    frames = op.Gather(op.Shape(u), b.ints([1]), axis=0)
    starts = op.Mul(op.Range(b.scalar_int(0), op.Squeeze(frames, b.ints([0])), b.scalar_int(1)), b.scalar_int(step))
    taps = op.Range(b.scalar_int(0), op.Squeeze(frame_length, b.ints([0])), b.scalar_int(1))
    positions = op.Add(op.Unsqueeze(starts, b.ints([1])), taps)  # [frames, taps]
    if parts == 1:
        u = op.Slice(u, b.ints([0]), b.ints([1]), b.ints([3]))
    grads = [None, None, None, None]
    if ctx.needs(0):
        z = op.Mul(u, op.Reshape(window, b.ints([1, 1, -1, 1]))) if window is not None else u
        # overlap-add: every frame's taps added back where they were read
        updates = op.Reshape(z, b.ints([0, -1, parts]))  # [batch, frames * taps, parts]
        where = op.Expand(op.Reshape(positions, b.ints([1, -1, 1])), op.Shape(updates))
        zeros = op.ConstantOfShape(op.Shape(x), value=ir.tensor(np.zeros([1], x.dtype.numpy())))
        grads[0] = op.ScatterElements(zeros, where, updates, axis=1, reduction="add")
    if window is not None and ctx.needs(2):
        read = op.Gather(x, positions, axis=1)  # [batch, frames, taps, parts]
        grads[2] = op.ReduceSum(op.Mul(u, read), b.ints([0, 1, 3]), keepdims=0)
    return tuple(grads[:len(ctx.inputs)])
