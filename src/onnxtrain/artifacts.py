"""Generate training artifacts from an ONNX model (``onnxruntime.training.artifacts`` compatible).

The artifacts — training, eval and optimizer models and a checkpoint — are
described in docs/artifacts.md and train on stock onnxruntime through
:mod:`onnxtrain.api`.
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile
from dataclasses import dataclass
from enum import Enum
from typing import Any

from onnxtrain.errors import ArtifactError, CheckpointError
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
    def __init__(self, loss_block: blocks.Block, trains_every_parameter: bool):
        super().__init__()
        self._loss = loss_block
        self._trains_every_parameter = trains_every_parameter  # generate_artifacts(requires_grad=None)

    def build(self, *inputs_to_loss):
        return self._loss(*inputs_to_loss)


def _nothing_to_optimize(model, params, requires_grad) -> str:
    """Why no parameter requires gradients, for the error that an optimizer model needs one."""
    from onnxtrain.passes.fake_quant import quantized_weights

    message = "an optimizer model needs at least one parameter that requires gradients"
    if requires_grad is not None and not list(requires_grad):
        return (f"{message}; requires_grad is empty: name the parameters to train, or leave it None to train "
                f"every floating-point initializer that is not frozen")
    if params.frozen:
        return f"{message}; every parameter is frozen: {sorted(params.frozen)}"
    in_attributes = sorted({f"{n.domain}.{n.op_type}" for n in model.graph.all_nodes()
                            if n.domain not in ("", "ai.onnx", "com.microsoft")})
    where = (f" (weights that ops of other domains keep in their attributes, as ai.onnx.ml's LinearClassifier "
             f"does, cannot be trained; this model has {', '.join(in_attributes)})" if in_attributes else "")
    quantized = quantized_weights(model.graph)
    if quantized:
        where += (f" (its weights are stored quantized, integers a DequantizeLinear reads: {quantized[:8]}; "
                  f"quantize with onnxruntime.quantization's extra_options={{'AddQDQPairToWeight': True}} to keep "
                  f"float weights behind a QuantizeLinear, which train)")
    return f"{message}, and the model has no floating-point weights{where}"


def _loss_block(loss) -> blocks.Block:
    if loss is None:
        return blocks.PassThrough()
    if isinstance(loss, LossType):
        return _LOSS_BLOCKS[loss]()
    if isinstance(loss, TrainingBlock):  # a Block too, but one that builds a whole training model
        raise ArtifactError(f"loss is an onnxblock.TrainingBlock ({type(loss).__name__}): generate_artifacts builds "
                            "the training model itself; write the loss as an onnxblock.Block (subclass Block, "
                            "whose build returns the loss's name)")
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


# upstream's size above which it handled the model through a file (protobuf's 2 GB limit); onnx_ir
# holds models of any size, so nothing here depends on it: kept for code that reads it
USE_PATH_THRESHOLD = 2**31

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
            default; naming them explicitly behaves identically in both); for a model from
            :func:`onnxtrain.torch.export_for_training`, the parameters that required grad in
            PyTorch, those that did not being frozen (its buffers, but BatchNorm's running
            statistics, stay constants).
        frozen_params: initializers kept fixed but stored in the checkpoint.
        loss: a :class:`LossType` or a custom ``onnxblock.Block`` returning the loss name;
            None when the model's first output already is the loss. The loss is one number
            (a scalar, or shape ``[1]``): a loss of per-sample values is refused.
        optimizer: an :class:`OptimType` or an ``onnxblock.optim`` block; None: no optimizer model.
        artifact_directory: output folder (created; default the current directory).
        prefix: prepended to every file name.
        ort_format: also write the training, eval and optimizer models in ORT format for mobile
            and minimal onnxruntime builds (``training_model.ort`` ...) and the
            ``required_operators.config`` of a reduced build: :func:`convert_to_ort_format` with its
            defaults runs on ``artifact_directory`` afterwards. The ``.onnx`` files stay.
        custom_op_library: not supported (artifacts use standard ops only).
        additional_output_names: values to output besides the loss (e.g. logits).
        nominal_checkpoint: also write ``nominal_checkpoint``, a checkpoint with the parameters'
            names, shapes and types but no values (to ship with an app that receives the values
            later, e.g. by ``Module.copy_buffer_to_parameters``), in addition to the complete
            ``checkpoint``, as upstream.
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
    from onnxtrain.checkpoint import check_storable, write_checkpoint

    if custom_op_library is not None:
        raise ArtifactError("custom_op_library is not supported: onnxtrain emits standard ONNX ops only")
    for argument, names in (("requires_grad", requires_grad), ("frozen_params", frozen_params),
                            ("additional_output_names", additional_output_names),
                            ("loss_input_names", loss_input_names)):
        if isinstance(names, (str, bytes)):
            raise ArtifactError(f"{argument} must be a list of names, got the string {names!r}")
    base_model = io.load_model(model)
    output_names = [o.name for o in base_model.graph.outputs]
    if loss_input_names is not None:
        unknown = [n for n in loss_input_names if n not in output_names]
        if unknown:
            raise ArtifactError(f"loss_input_names {unknown} are not outputs of the model {output_names}")
        output_names = list(loss_input_names)
    # loss=None: the first output is the loss, the others outputs
    training_block = _Training(_loss_block(loss), trains_every_parameter=requires_grad is None)
    for name in requires_grad or []:
        training_block.requires_grad(name)
    for name in frozen_params or []:
        if requires_grad and name in requires_grad:
            raise ArtifactError(f"parameter {name!r} cannot both require gradients and be frozen")
        training_block.requires_grad(name, False)
    training_block.additional_output_names = list(additional_output_names or [])
    scaler = _precision(training_block, precision, loss_scale, precision_device)

    model_bytes = sum(v.const_value.nbytes for v in base_model.graph.initializers.values() if v.const_value is not None)
    phases = (3 if optimizer is None else 4) + bool(ort_format)
    with Phases("generate_artifacts", phases, tqdm_disable(progress, model_bytes), logger) as bar:
        with bar.phase("training and eval graphs"), base(base_model):
            training_block(*output_names)
        training_model, eval_model = training_block.to_ir_models()
        params = training_block.parameter_values
        if optimizer is not None and not params.trainable:  # checked before any file is written
            raise ArtifactError(_nothing_to_optimize(base_model, params, requires_grad))
        try:
            check_storable({**params.trainable, **params.frozen})
        except CheckpointError as exc:
            raise ArtifactError(f"{exc}. Generate the artifacts from the float32 model; precision='bf16' trains "
                                f"it in mixed precision") from exc

        directory = pathlib.Path(artifact_directory) if artifact_directory is not None else pathlib.Path.cwd()
        if directory.exists() and not directory.is_dir():
            raise ArtifactError(f"artifact_directory {str(directory)!r} is a file, not a folder")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file on the way there, no permission, ...
            raise ArtifactError(f"cannot write the artifacts to {str(directory)!r}: {exc.strerror or exc}") from exc
        with bar.phase("writing the models"):
            io.save_model(training_model, directory / f"{prefix}training_model.onnx")
            io.save_model(eval_model, directory / f"{prefix}eval_model.onnx")
        with bar.phase("writing the checkpoint"):
            all_params = {**params.trainable, **params.frozen}
            write_checkpoint(directory / f"{prefix}checkpoint", all_params, requires_grad=set(params.trainable))
            if nominal_checkpoint:
                write_checkpoint(directory / f"{prefix}nominal_checkpoint", all_params,
                                 requires_grad=set(params.trainable), nominal=True)
        logger.info("wrote training, eval models and checkpoint to %s", directory)

        if optimizer is not None:
            with bar.phase("optimizer graph"):
                optim_block = _optimizer_block(optimizer)
                optim_block.loss_scale = scaler
                with empty_base(opset_version=max(training_model.graph.opset_imports.get("", 18), 13)):
                    optim_block(list(params.trainable.items()))
                io.save_model(optim_block.to_ir_model(), directory / f"{prefix}optimizer_model.onnx")
        if ort_format:
            with bar.phase("ORT format"):
                convert_to_ort_format(directory, prefix=prefix)


# The ORT format conversion (convert_to_ort_format) ----------------------------------------

ORT_MODEL_NAMES = ("training_model", "eval_model", "optimizer_model")
ORT_OPTIMIZATION_LEVELS = ("basic", "extended", "all")
ORT_TARGET_PLATFORMS = ("arm", "amd64")


@dataclass(frozen=True)
class OrtFormatArtifacts:
    """What :func:`convert_to_ort_format` wrote.

    Attributes:
        models: the ``.ort`` files, in the order training, eval, optimizer (those present).
        config: the required-operators configuration of a reduced onnxruntime build
            (``required_operators.config``, or ``required_operators_and_types.config`` with
            type reduction).
    """

    models: tuple[pathlib.Path, ...]
    config: pathlib.Path


def convert_to_ort_format(
    artifact_directory: str | os.PathLike,
    prefix: str = "",
    enable_type_reduction: bool = False,
    optimization_level: str = "all",
    target_platform: str | None = None,
) -> OrtFormatArtifacts:
    """Convert the training, eval and optimizer models of a folder of artifacts to ORT format.

    For mobile and minimal onnxruntime builds, which load only ORT format models. Next to each
    ``{prefix}<name>.onnx`` this writes ``{prefix}<name>.ort`` (the ``.onnx`` files are kept:
    ``Module.export_model_for_inferencing`` needs the eval graph as ONNX), and one
    ``{prefix}required_operators.config`` listing the operators of all the converted models, the
    input of a reduced build (``--minimal_build --include_ops_by_config``). The conversion is the
    one of onnxruntime's own ``python -m onnxruntime.tools.convert_onnx_models_to_ort
    --optimization_style Fixed``: an onnxruntime session optimizes each model and saves the
    optimized graph in ORT format, and the configuration comes from
    ``onnxruntime.tools.ort_format_model.create_config_from_models``.

    An ORT format model holds its optimized graph: onnxruntime does not optimize it again when
    it loads it, whatever the session options say. With the default ``optimization_level="all"``
    the ``.ort`` graphs are the ones onnxruntime's default session options (those of
    :class:`onnxtrain.api.Module`) make from the ``.onnx`` files, less the x86-only NCHWc layout
    (as the stock converter does), so training from either gives the same numbers.

    Args:
        artifact_directory: the folder :func:`generate_artifacts` wrote.
        prefix: the ``prefix`` the artifacts were generated with.
        enable_type_reduction: also record, per operator, the tensor types the models use
            (``required_operators_and_types.config``, for a build with
            ``--enable_reduced_operator_type_support``).
        optimization_level: ``"basic"`` (only hardware-independent rewrites that keep standard
            ONNX ops), ``"extended"`` (also fusions into onnxruntime's ``com.microsoft`` ops) or
            ``"all"`` (also layout rewrites).
        target_platform: as the stock converter's ``--target_platform``: None or ``"arm"`` for
            a portable model (mobile), ``"amd64"`` to keep the x86-only NCHWc layout rewrites.

    Returns:
        :class:`OrtFormatArtifacts`: the ``.ort`` files and the configuration file.

    Raises:
        ArtifactError: the folder or its training model does not exist, an argument is not one
            of the accepted values, or onnxruntime cannot convert a model.
    """
    import onnxruntime as ort

    directory = pathlib.Path(artifact_directory)
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {str(directory)!r} does not exist or is not a folder")
    if optimization_level not in ORT_OPTIMIZATION_LEVELS:
        raise ArtifactError(f"optimization_level must be one of {ORT_OPTIMIZATION_LEVELS}, "
                            f"got {optimization_level!r}")
    if target_platform is not None and target_platform not in ORT_TARGET_PLATFORMS:
        raise ArtifactError(f"target_platform must be None or one of {ORT_TARGET_PLATFORMS}, "
                            f"got {target_platform!r}")
    sources = [directory / f"{prefix}{name}.onnx" for name in ORT_MODEL_NAMES]
    if not sources[0].is_file():
        raise ArtifactError(f"{str(directory)!r} holds no training model {sources[0].name!r}: expected the "
                            f"files generate_artifacts writes (with prefix {prefix!r})")
    sources = [path for path in sources if path.is_file()]

    level = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
             "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
             "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[optimization_level]
    # NCHWc blocks Conv/pool tensors for x86 vector widths: such a model runs only on x86.
    disabled = ["NchwcTransformer"] if optimization_level == "all" and target_platform != "amd64" else None
    targets = []
    # Write into a temporary folder, then rename: a failed conversion leaves no partial .ort files.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".ort_format.") as scratch:
        for source in sources:
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            options.log_severity_level = 3
            options.optimized_model_filepath = str(pathlib.Path(scratch) / source.with_suffix(".ort").name)
            options.add_session_config_entry("session.save_model_format", "ORT")
            options.add_session_config_entry("session.qdqisint8allowed", "1" if target_platform == "arm" else "0")
            try:
                ort.InferenceSession(str(source), sess_options=options, providers=["CPUExecutionProvider"],
                                     disabled_optimizers=disabled)
            except Exception as exc:  # onnxruntime raises several pybind exception types
                raise ArtifactError(f"onnxruntime could not convert {str(source)!r} to ORT format: {exc}") from exc
        for source in sources:
            target = source.with_suffix(".ort")
            os.replace(pathlib.Path(scratch) / target.name, target)
            targets.append(target)
    config_name = "required_operators_and_types.config" if enable_type_reduction else "required_operators.config"
    config = directory / f"{prefix}{config_name}"
    _write_required_operators_config(targets, config, enable_type_reduction)
    logger.info("wrote %s and %s", ", ".join(t.name for t in targets), config)
    return OrtFormatArtifacts(tuple(targets), config)


def _write_required_operators_config(models: list[pathlib.Path], config: pathlib.Path, with_types: bool) -> None:
    """onnxruntime's ``create_config_from_models``, without its logging side effects: its logger
    module calls ``logging.basicConfig()`` when imported (a handler on the root logger of the
    user's program) and it logs "Created config" at INFO through that handler."""
    root = logging.getLogger()
    root_handlers = list(root.handlers)
    from onnxruntime.tools.ort_format_model import create_config_from_models
    from onnxruntime.tools.ort_format_model import utils as ort_config_utils

    for handler in [h for h in root.handlers if h not in root_handlers]:
        root.removeHandler(handler)
    ort_logger = ort_config_utils.log
    level = ort_logger.level
    ort_logger.setLevel(logging.WARNING)
    try:
        create_config_from_models(models, config, with_types)
    finally:
        ort_logger.setLevel(level)
