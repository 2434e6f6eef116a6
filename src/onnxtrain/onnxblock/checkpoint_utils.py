"""``onnxblock.save_checkpoint`` and ``onnxblock.load_checkpoint_to_model``, as upstream names them."""

from __future__ import annotations

import os

import numpy as np

from onnxtrain.checkpoint import read_checkpoint, write_checkpoint
from onnxtrain.errors import CheckpointError
from onnxtrain.ir import io


def _as_array(param) -> tuple[str, np.ndarray]:
    if hasattr(param, "data_type") and hasattr(param, "dims"):  # onnx.TensorProto
        return param.name, io.tensor_to_numpy(param)
    name, value = param
    return name, np.asarray(value)


def save_checkpoint(parameters, path_to_checkpoint: str | os.PathLike, nominal_checkpoint: bool = False) -> None:
    """Write ``parameters`` — upstream's ``(trainable, frozen)`` pair of lists of
    ``onnx.TensorProto`` (or ``(name, array)`` pairs), as ``TrainingBlock.parameters()``
    returns — to a checkpoint file (docs/artifacts.md)."""
    if parameters is None:
        raise CheckpointError("no parameters given to save_checkpoint")
    trainable, frozen = parameters
    trainable = dict(_as_array(p) for p in trainable)
    frozen = dict(_as_array(p) for p in frozen)
    write_checkpoint(path_to_checkpoint, {**trainable, **frozen}, requires_grad=set(trainable),
                     nominal=nominal_checkpoint)


def load_checkpoint_to_model(path_to_checkpoint: str | os.PathLike, model):
    """Copy the checkpoint's parameter values into the matching initializers of ``model``.

    ``model`` is an ``onnx.ModelProto`` (updated in place, as upstream does, and returned).
    Raises ``CheckpointError`` if the checkpoint is nominal or a parameter does not match.
    """
    data = read_checkpoint(path_to_checkpoint)
    if data.nominal:
        raise CheckpointError(f"{os.fspath(path_to_checkpoint)!r} is a nominal checkpoint: it holds no values")
    values = {name: record.value for name, record in data.parameters.items()}
    io.replace_initializers(model, values)
    return model
