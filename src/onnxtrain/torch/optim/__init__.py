"""Optimizers for PyTorch parameters (upstream's ``onnxruntime.training.optim`` names).

- :class:`FusedAdam` with :class:`AdamWMode`: Adam / AdamW over all parameters in a few
  multi-tensor kernels.
"""

from onnxtrain.torch.optim.errors import OptimizerConfigError
from onnxtrain.torch.optim.fused_adam import AdamWMode, FusedAdam

__all__ = ["AdamWMode", "FusedAdam", "OptimizerConfigError"]

from onnxtrain.torch.optim.zero import ZeroOptimizer, ZeroStepError, partition_parameters  # noqa: E402
from onnxtrain.torch.optim.zero_checkpoint import consolidate_state_dict  # noqa: E402

__all__ += ["ZeroOptimizer", "ZeroStepError", "consolidate_state_dict", "partition_parameters"]
