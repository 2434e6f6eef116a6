"""Generate training artifacts from an ONNX model (``onnxruntime.training.artifacts`` compatible).

The artifacts — training, eval and optimizer models and a checkpoint — are
described in docs/artifacts.md and train on stock onnxruntime through
:mod:`onnxtrain.api`.
"""

from __future__ import annotations

import logging
import os
import pathlib
from enum import Enum
from typing import Any

from onnxtrain.errors import ArtifactError
from onnxtrain.ir import io
from onnxtrain.onnxblock import blocks, loss as loss_blocks, optim as optim_blocks
from onnxtrain.onnxblock._context import base, empty_base
from onnxtrain.onnxblock.loss_scale import DynamicLossScale
from onnxtrain.onnxblock.training_block import TrainingBlock
from onnxtrain.progress import Phases, tqdm_disable

logger = logging.getLogger(__name__)


class LossType(Enum):
    """Loss to add on top of the model (``loss=`` of :func:`generate_artifacts`)."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(Enum):
    """Optimizer of the optimizer model (``optimizer=`` of :func:`generate_artifacts`).

    ``AdamW`` is upstream's AdamW (Hugging Face transformers update, eps 1e-6); for the
    exact ``torch.optim.AdamW`` update pass ``onnxblock.optim.AdamW(mode="torch")``.
    """

    AdamW = 1
    SGD = 2


_LOSS_BLOCKS = {
    LossType.MSELoss: loss_blocks.MSELoss,
    LossType.CrossEntropyLoss: loss_blocks.CrossEntropyLoss,
    LossType.BCEWithLogitsLoss: loss_blocks.BCEWithLogitsLoss,
    LossType.L1Loss: loss_blocks.L1Loss,
}
_OPTIM_BLOCKS = {OptimType.AdamW: optim_blocks.AdamW, OptimType.SGD: optim_blocks.SGD}


class _Training(TrainingBlock):
    def __init__(self, loss_block: blocks.Block):
        super().__init__()
        self._loss = loss_block

    def build(self, *inputs_to_loss):
        return self._loss(*inputs_to_loss)


def _loss_block(loss) -> blocks.Block:
    if loss is None:
        return blocks.PassThrough()
    if isinstance(loss, LossType):
        return _LOSS_BLOCKS[loss]()
    if isinstance(loss, blocks.Block):
        return loss
    raise ArtifactError(f"loss must be an artifacts.LossType or an onnxblock.Block, got {type(loss).__name__}")


def _optimizer_block(optimizer):
    if isinstance(optimizer, OptimType):
        return _OPTIM_BLOCKS[optimizer]()
    if isinstance(optimizer, optim_blocks._OptimizerBlock):  # noqa: SLF001
        return optimizer
    raise ArtifactError(
        f"optimizer must be an artifacts.OptimType or an onnxblock.optim block, got {type(optimizer).__name__}"
    )


PRECISIONS = ("fp32", "bf16", "fp16")


def _precision(block: TrainingBlock, precision: str, loss_scale, device: str) -> DynamicLossScale | None:
    """Configure ``block`` for ``precision``; return the loss scaler the optimizer model uses."""
    from onnxtrain.passes.precision import PrecisionConfig, supported_ops

    if precision not in PRECISIONS:
        raise ArtifactError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if loss_scale is not None and precision != "fp16":
        raise ArtifactError(f"loss_scale applies to precision='fp16' only, not {precision!r}")
    if precision == "fp32":
        return None
    supported_ops(device, precision)  # an unknown device fails here, with the known ones
    block.precision = PrecisionConfig(precision, device)
    if precision != "fp16":
        return None  # bf16 has fp32's exponent range: no loss scaling
    scaler = loss_scale if loss_scale is not None else DynamicLossScale()
    block.loss_scale = scaler.init_scale
    return scaler


def generate_artifacts(
    model: io.ModelLike,
    requires_grad: list[str] | None = None,
    frozen_params: list[str] | None = None,
    loss: LossType | blocks.Block | None = None,
    optimizer: OptimType | Any | None = None,
    artifact_directory: str | os.PathLike | None = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: str | os.PathLike | None = None,
    additional_output_names: list[str] | None = None,
    nominal_checkpoint: bool = False,
    loss_input_names: list[str] | None = None,
    precision: str = "fp32",
    loss_scale: DynamicLossScale | None = None,
    precision_device: str = "cpu",
    progress: bool | None = None,
) -> None:
    """Write ``training_model.onnx``, ``eval_model.onnx``, ``checkpoint`` and ``optimizer_model.onnx``.

    Args:
        model: the forward model (path, ``onnx.ModelProto`` or ``onnx_ir.Model``); its
            parameters are its initializers.
        requires_grad: initializers to train. Default (None): every floating-point
            initializer of rank >= 1 not in ``frozen_params`` (upstream trains none by
            default; naming them explicitly behaves identically in both).
        frozen_params: initializers kept fixed but stored in the checkpoint.
        loss: a :class:`LossType` or a custom ``onnxblock.Block`` returning the loss name;
            None when the model's (only) output already is the loss.
        optimizer: an :class:`OptimType` or an ``onnxblock.optim`` block; None: no optimizer model.
        artifact_directory: output folder (created; default the current directory).
        prefix: prepended to every file name.
        ort_format: not supported (stock onnxruntime loads the .onnx files directly).
        custom_op_library: not supported (artifacts use standard ops only).
        additional_output_names: values to output besides the loss (e.g. logits).
        nominal_checkpoint: write a checkpoint with names, shapes and types but no values.
        loss_input_names: model outputs fed to the loss (default: all outputs, in order).
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: the training and eval models
            compute matrix products (MatMul, Gemm, Conv) in that dtype, with fp32 islands
            for everything else; the checkpoint keeps fp32 master weights and the gradients
            come out fp32 (docs/artifacts.md, "Mixed precision").
        loss_scale: fp16 only: dynamic loss scaling settings (default
            ``DynamicLossScale()``, torch GradScaler's); the training model takes a
            ``loss_scale`` input and the optimizer model skips non-finite steps.
        precision_device: the device the artifacts will train on (``"cpu"``, ``"cuda"``):
            decides which ops its onnxruntime execution provider runs in low precision.
        progress: a progress bar over the phases (gradient graph, files, optimizer graph):
            True always, False never, None (default) on a terminal for models of 100 MB of
            parameters or more. Each phase's time is also logged at INFO on
            ``onnxtrain.artifacts``.

    Example:
        >>> import numpy as np, tempfile
        >>> from onnx import helper, numpy_helper, TensorProto
        >>> from onnxtrain import artifacts
        >>> w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
        >>> g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
        >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        >>> out = tempfile.mkdtemp()
        >>> artifacts.generate_artifacts(m, requires_grad=["w"], loss=artifacts.LossType.CrossEntropyLoss,
        ...                              optimizer=artifacts.OptimType.AdamW, artifact_directory=out)
        >>> sorted(p.name for p in pathlib.Path(out).iterdir())
        ['checkpoint', 'eval_model.onnx', 'optimizer_model.onnx', 'training_model.onnx']
    """
    from onnxtrain.checkpoint import write_checkpoint

    if ort_format:
        raise ArtifactError("ort_format=True is not supported: stock onnxruntime loads the .onnx artifacts directly")
    if custom_op_library is not None:
        raise ArtifactError("custom_op_library is not supported: onnxtrain emits standard ONNX ops only")
    base_model = io.load_model(model)
    output_names = [o.name for o in base_model.graph.outputs]
    if loss_input_names is not None:
        unknown = [n for n in loss_input_names if n not in output_names]
        if unknown:
            raise ArtifactError(f"loss_input_names {unknown} are not outputs of the model {output_names}")
        output_names = list(loss_input_names)
    if loss is None and len(output_names) != 1:
        raise ArtifactError(f"with loss=None the model must have exactly one output (the loss), it has {output_names}")

    training_block = _Training(_loss_block(loss))
    for name in requires_grad or []:
        training_block.requires_grad(name)
    for name in frozen_params or []:
        if requires_grad and name in requires_grad:
            raise ArtifactError(f"parameter {name!r} cannot both require gradients and be frozen")
        training_block.requires_grad(name, False)
    training_block.additional_output_names = list(additional_output_names or [])
    scaler = _precision(training_block, precision, loss_scale, precision_device)

    model_bytes = sum(v.const_value.nbytes for v in base_model.graph.initializers.values() if v.const_value is not None)
    phases = 3 if optimizer is None else 4
    with Phases("generate_artifacts", phases, tqdm_disable(progress, model_bytes), logger) as bar:
        with bar.phase("training and eval graphs"), base(base_model):
            training_block(*output_names)
        training_model, eval_model = training_block.to_ir_models()
        params = training_block.parameter_values

        directory = pathlib.Path(artifact_directory) if artifact_directory is not None else pathlib.Path.cwd()
        directory.mkdir(parents=True, exist_ok=True)
        with bar.phase("writing the models"):
            io.save_model(training_model, directory / f"{prefix}training_model.onnx")
            io.save_model(eval_model, directory / f"{prefix}eval_model.onnx")
        with bar.phase("writing the checkpoint"):
            write_checkpoint(directory / f"{prefix}checkpoint", {**params.trainable, **params.frozen},
                             requires_grad=set(params.trainable), nominal=nominal_checkpoint)
        logger.info("wrote training, eval models and checkpoint to %s", directory)

        if optimizer is None:
            return
        if not params.trainable:
            raise ArtifactError("an optimizer model needs at least one parameter that requires gradients")
        with bar.phase("optimizer graph"):
            optim_block = _optimizer_block(optimizer)
            optim_block.loss_scale = scaler
            with empty_base(opset_version=max(training_model.graph.opset_imports.get("", 18), 13)):
                optim_block(list(params.trainable.items()))
            io.save_model(optim_block.to_ir_model(), directory / f"{prefix}optimizer_model.onnx")
