"""Gradient rules, one family per module; importing this package registers them all."""

from onnxtrain.autodiff.rules import (  # noqa: F401
    control,
    conv,
    elementwise,
    index,
    linalg,
    loss,
    matmul,
    nn,
    nondiff,
    recurrent,
    reduce,
    sampling,
    shape,
    spectral,
)
