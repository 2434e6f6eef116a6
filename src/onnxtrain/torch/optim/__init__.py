"""Optimizers for PyTorch parameters (upstream's ``onnxruntime.training.optim`` names).

- :class:`FusedAdam` with :class:`AdamWMode`: Adam / AdamW over all parameters in a few
  multi-tensor kernels.
- :class:`LAMB`: LAMB (Adam moments, per-tensor trust ratio, global gradient clipping) in
  multi-tensor kernels.
- :class:`FP16_Optimizer`: fp32 master weights and (dynamic) loss scaling around any optimizer
  of fp16/bf16 parameters.
- :class:`ZeroOptimizer`: ZeRO stage 1 (optimizer state partitioned across data-parallel
  ranks) around any of them, with sharded checkpoints and :func:`consolidate_state_dict`.
"""

from onnxtrain.torch.optim.errors import OptimizerConfigError, ScalerStateError
from onnxtrain.torch.optim.fp16_optimizer import FP16_Optimizer
from onnxtrain.torch.optim.fused_adam import AdamWMode, FusedAdam
from onnxtrain.torch.optim.lamb import LAMB

from onnxtrain.torch.optim.zero import ZeroOptimizer, ZeroStepError, partition_parameters
from onnxtrain.torch.optim.zero_checkpoint import consolidate_state_dict

__all__ = ["AdamWMode", "FP16_Optimizer", "FusedAdam", "LAMB", "OptimizerConfigError", "ScalerStateError",
           "ZeroOptimizer", "ZeroStepError", "consolidate_state_dict", "partition_parameters"]
