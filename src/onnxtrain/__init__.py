"""onnxtrain: train models with stock ONNX Runtime.

Submodules: ``artifacts`` (generate training artifacts from an ONNX model),
``onnxblock`` (build custom losses and optimizers), ``api`` (the on-device training
runtime: CheckpointState, Module, Optimizer, LinearLRScheduler), ``autodiff``
(gradient graphs; ``check_gradients``). ``onnxtrain.torch`` needs PyTorch.
"""

from onnxtrain.autodiff.check import check_gradients
from onnxtrain.errors import (
    ArtifactError,
    CheckpointError,
    GradientCheckError,
    InputMismatchError,
    ModelError,
    NoGradientWarning,
    OnnxTrainError,
    UnsupportedOpError,
)
from onnxtrain.logs import LogLevel, set_verbosity

__version__ = "0.1.0"

__all__ = [
    "check_gradients",
    "OnnxTrainError",
    "UnsupportedOpError",
    "InputMismatchError",
    "CheckpointError",
    "ArtifactError",
    "ModelError",
    "NoGradientWarning",
    "GradientCheckError",
    "LogLevel",
    "set_verbosity",
    "__version__",
]


def estimate_memory(module, *args, **kwargs):
    """Estimated peak memory of training a torch module with ORTModule (needs PyTorch);
    see :func:`onnxtrain.torch.estimate_memory`."""
    from onnxtrain.torch.memory import estimate_memory as estimate

    return estimate(module, *args, **kwargs)


__all__.append("estimate_memory")
