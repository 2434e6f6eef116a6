"""PyTorch front door: :class:`ORTModule` runs a module's forward and backward in ONNX Runtime.

Importing this package needs PyTorch (``pip install torch``); ``import onnxtrain`` does not.
"""

from onnxtrain.torch._environment import IgnoredSettingWarning, ORTModuleEnvironmentError
from onnxtrain.torch._export import DroppedOutputWarning, ForwardHookWarning
from onnxtrain.torch._translations import artifacts_translation_table as onnx_translation_table
from onnxtrain.torch.memory import MemoryEstimate, estimate_memory
from onnxtrain.torch.gradient_graph import export_gradient_graph
from onnxtrain.torch.hierarchical import HierarchicalORTModule
from onnxtrain.torch.ortmodule import DebugOptions, LogLevel, MemoryOptionsError, ORTModule, ORTModuleFallbackWarning
from onnxtrain.torch.training_export import export_for_training

__all__ = ["ORTModule", "HierarchicalORTModule", "DebugOptions", "LogLevel", "ORTModuleFallbackWarning", "ForwardHookWarning", "DroppedOutputWarning",
           "MemoryOptionsError", "ORTModuleEnvironmentError", "IgnoredSettingWarning", "MemoryEstimate", "estimate_memory", "onnx_translation_table", "export_for_training",
           "export_gradient_graph"]
