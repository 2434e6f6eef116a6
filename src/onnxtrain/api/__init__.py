"""On-device training runtime, mirroring ``onnxruntime.training.api``.

Migrating from upstream is a change of import::

    from onnxtrain.api import CheckpointState, Module, Optimizer, LinearLRScheduler
"""

from onnxtrain.api.checkpoint_state import CheckpointState, Parameter, Parameters, Properties
from onnxtrain.api.lr_scheduler import LinearLRScheduler
from onnxtrain.api.module import Module
from onnxtrain.api.optimizer import Optimizer

__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter", "Parameters", "Properties"]
