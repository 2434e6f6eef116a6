"""onnxblock: build training, eval and optimizer models from blocks.

Names follow ``onnxruntime.training.onnxblock``: ``Block``, ``TrainingBlock``,
``ForwardBlock``, ``base``, ``empty_base``, ``blocks``, ``loss``, ``optim``.
"""

from onnxtrain.onnxblock import blocks, loss, loss_scale, optim
from onnxtrain.onnxblock._context import BuildContext, base, custom_op_library, empty_base
from onnxtrain.onnxblock.checkpoint_utils import load_checkpoint_to_model, save_checkpoint
from onnxtrain.onnxblock.blocks import Block
from onnxtrain.onnxblock.training_block import ForwardBlock, TrainingBlock

__all__ = ["Block", "TrainingBlock", "ForwardBlock", "BuildContext", "base", "empty_base", "custom_op_library",
           "blocks", "loss", "loss_scale", "optim", "save_checkpoint", "load_checkpoint_to_model"]
