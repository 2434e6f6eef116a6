"""Ops with floating-point outputs whose derivative is zero almost everywhere.

Registered so that the autodiff walk passes through them with zero gradients instead of
reporting them as unsupported. Ops whose outputs are integers or booleans (Shape, ArgMax,
comparisons, IsNaN, ...) need no entry: no gradient flows along such values.

Not here on purpose: Mod (piecewise linear, dy/da = 1; see elementwise.py), Clip, Abs,
Relu-like activations (nonzero derivative on a set of positive measure).
"""

from __future__ import annotations

from onnxtrain.autodiff.registry import nondifferentiable, shape_only

# piecewise-constant rounding functions
nondifferentiable("Sign", "Floor", "Ceil", "Round")
# a one-hot of the arg-max: piecewise constant too
nondifferentiable("Hardmax")
# a random sample with no pathwise derivative (Bernoulli draws 0/1 from the input
# probabilities); its output still requires grad, as PyTorch's bernoulli(p) does
nondifferentiable("Bernoulli")
# the output depends on the input only through its shape and type: not on any gradient path
shape_only("EyeLike", "RandomUniformLike", "RandomNormalLike")
# integer outputs: no entry needed where their type is known, but an exporter may leave it unknown
shape_only("Shape", "Size")
