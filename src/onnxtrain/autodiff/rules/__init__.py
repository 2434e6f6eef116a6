"""Gradient rules, one family per module; importing this package registers them all."""

from onnxtrain.autodiff.rules import elementwise, matmul, reduce  # noqa: F401
