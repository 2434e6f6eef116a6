"""The input/output naming contract of the generated graphs, written once.

Names follow upstream ONNX Runtime training artifacts so that code written for
``onnxruntime.training`` finds the same inputs and outputs.
"""

from __future__ import annotations

GRAD_SUFFIX = "_grad"
ACCUMULATION_BUFFER_SUFFIX = "_grad.accumulation.buffer"
ACCUMULATION_OUT_SUFFIX = "_grad.accumulation.out"
LAZY_RESET_GRAD = "lazy_reset_grad"
LEARNING_RATE = "learning_rate"
STEP = "step"
UPDATED_SUFFIX = ".updated"
# fp16 artifacts with dynamic loss scaling (docs/artifacts.md): the training model's loss-scale
# input, the optimizer model's scale state (also the CheckpointState property names holding it)
# and its flag output "this step's gradients were all finite"
LOSS_SCALE = "loss_scale"
LOSS_SCALE_GROWTH_TRACKER = "loss_scale_growth_tracker"
ALL_FINITE = "all_finite"
# optimizer state names per parameter, as upstream's checkpoint calls them
FIRST_MOMENT = "momentum0"
SECOND_MOMENT = "momentum1"
MOMENTUM_BUFFER = "momentum0"
# onnxruntime's contrib-op domain (Inverse, GatedAdd, FusedMatMul: stock onnxruntime ships them)
MS_DOMAIN = "com.microsoft"
# Node metadata on a Gather that implements an embedding lookup with a padding index: the
# rows of that index get no gradient (PyTorch's ``nn.Embedding(padding_idx=...)``).
PADDING_IDX_METADATA = "onnxtrain.padding_idx"
# Node metadata on an Identity whose output carries no gradient (PyTorch's ``detach()`` and the
# outputs of a ``torch.no_grad()`` region): the autodiff does not differentiate through it.
STOP_GRADIENT_METADATA = "onnxtrain.stop_gradient"
# metadata_props key of a model exported from PyTorch: a JSON object, {"trainable": [...],
# "frozen": [...]}, its parameters that required grad there and those that did not;
# generate_artifacts trains the first and keeps the second frozen by default
PARAMETERS_METADATA = "onnxtrain.parameters"
# Node metadata on a Clip translating PyTorch's hardtanh or relu6, whose gradient passes strictly
# inside the bounds (clamp's includes them, as an unmarked Clip's does).
OPEN_CLIP_METADATA = "onnxtrain.open_clip"


def grad_name(param: str) -> str:
    """Name of the gradient of ``param``."""
    return param + GRAD_SUFFIX


def accumulation_buffer_name(param: str) -> str:
    return param + ACCUMULATION_BUFFER_SUFFIX


def accumulation_out_name(param: str) -> str:
    return param + ACCUMULATION_OUT_SUFFIX


def state_name(param: str, state: str) -> str:
    """Name of the optimizer-graph input carrying optimizer state ``state`` of ``param``."""
    return f"{param}.{state}"


def updated_name(name: str) -> str:
    """Name of an optimizer-graph output carrying the new value of input ``name``."""
    return name + UPDATED_SUFFIX
