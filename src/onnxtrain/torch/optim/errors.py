"""Errors of the optimizers in :mod:`onnxtrain.torch.optim`."""

from onnxtrain.errors import OnnxTrainError


class OptimizerConfigError(OnnxTrainError, ValueError):
    """An optimizer argument is out of its range, or a parameter cannot be optimized."""


class ScalerStateError(OnnxTrainError, RuntimeError):
    """A loss scaler's methods were called out of order (``unscale_`` twice, ``step`` before
    ``scale``, ``update`` with nothing checked, ...)."""
