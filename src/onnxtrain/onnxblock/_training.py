"""Turn a forward+loss model into the training and eval models of docs/artifacts.md."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import TopologicalSortPass

from onnxtrain import names
from onnxtrain.autodiff.builder import FLOAT_TYPES, build_gradients
from onnxtrain.errors import ArtifactError, NoGradientWarning
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.ir.nodes import is_onnx_op
from onnxtrain.passes import pipeline
from onnxtrain.passes.dce import RemoveUnusedNodesPass
from onnxtrain.passes.fake_quant import QuantizeDequantizeStraightThroughPass, quantization_parameters
from onnxtrain.passes.full_dropout import FullDropoutPass
from onnxtrain.passes.precision import PrecisionConfig

TRAINING_METADATA_KEY = "onnxtrain.training"

# Initializer names that PyTorch's and other exporters give to folded constants
# (scales, epsilons, shapes): not parameters when the caller names none.
_EXPORTER_CONSTANT = re.compile(r"^(_?val_\d+|const(ant)?_|onnx::|_onnx_|scalar_tensor)")


@dataclass
class Parameters:
    """Trainable and frozen parameters with their values (taken from the base model)."""

    trainable: dict[str, np.ndarray] = field(default_factory=dict)
    frozen: dict[str, np.ndarray] = field(default_factory=dict)


def _batch_norm_statistics(graph: ir.Graph, training_mode_only: bool = False) -> list[str]:
    """Initializers used as BatchNormalization running mean/variance (buffers, not parameters);
    with ``training_mode_only``, of the nodes in training mode (which update them)."""
    stats = []
    for node in graph:
        if not is_onnx_op(node, "BatchNormalization"):
            continue
        mode = node.attributes.get("training_mode")
        if training_mode_only and not (mode is not None and mode.as_int()):
            continue
        stats += [v.name for v in node.inputs[3:5] if v is not None and v.is_initializer() and v.name not in stats]
    return stats


def declared_parameters(model: ir.Model) -> dict[str, list[str]] | None:
    """``{"trainable": [...], "frozen": [...]}``: the parameters of a model exported from
    PyTorch (``onnxtrain.torch.export_for_training``) that required grad there and those that
    did not; None for other models."""
    declared = model.metadata_props.get(names.PARAMETERS_METADATA)
    return json.loads(declared) if declared else None


# (op, input positions) that read a weight: a matrix, a kernel, a recurrent weight
_WEIGHT_INPUTS = {"MatMul": (0, 1), "Gemm": (0, 1), "Conv": (1,), "ConvTranspose": (1,),
                  "LSTM": (1, 2), "GRU": (1, 2), "RNN": (1, 2)}
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"


def folded_weights(model: ir.Model) -> list[str]:
    """Initializers named like exporter constants that ops read as weights (rank >= 2 floats in a
    weight slot of a MatMul, Gemm, Conv or recurrent op): parameters an exporter's constant folding
    renamed (``Transpose(W)`` as ``val_0``), each with the parameter it came from where the
    in-memory model still records it. None in a model exported by ``export_for_training``."""
    if declared_parameters(model) is not None:
        return []
    found = []
    for node in model.graph:
        for position in _WEIGHT_INPUTS.get(node.op_type, ()) if is_onnx_op(node) else ():
            value = node.inputs[position] if len(node.inputs) > position else None
            if (value is None or not value.is_initializer() or value.dtype not in FLOAT_TYPES
                    or value.const_value is None or len(value.const_value.shape) < 2
                    or not _EXPORTER_CONSTANT.match(value.name or "")):
                continue
            origin = value.metadata_props.get(_FOLDED_FROM)
            label = f"{value.name} (from {origin})" if origin else value.name
            if label not in found:
                found.append(label)
    return found


def default_trainable(model: ir.Model, frozen: Sequence[str] = ()) -> list[str]:
    """Float initializers of rank >= 1 that are not exporter constants, statistics, quantization
    scales or frozen; for a model exported from PyTorch those among the parameters that
    required grad there, scalars included (not its buffers, nor what it froze)."""
    stats = set(_batch_norm_statistics(model.graph)) | quantization_parameters(model.graph)
    declared = declared_parameters(model)
    required = set(declared["trainable"]) if declared else None
    # a parameter PyTorch declared trains whatever its rank (a learnable scalar: CLIP's logit_scale)
    return [
        name for name, value in model.graph.initializers.items()
        if value.dtype in FLOAT_TYPES and value.const_value is not None
        and (len(value.const_value.shape) >= 1 or required is not None)
        and not _EXPORTER_CONSTANT.match(name) and name not in frozen and name not in stats
        and (required is None or name in required)
    ]


def select_parameters(model: ir.Model, requires_grad: Sequence[str] | None,
                      frozen_params: Sequence[str] | None, *, added: Sequence[str] = (),
                      constants: Collection[str] = ()) -> Parameters:
    """Validate the user's parameter lists against the model's initializers.

    With ``requires_grad=None`` every float initializer of rank >= 1 trains, except
    BatchNormalization running statistics, which are frozen (kept in the checkpoint and,
    for training-mode BatchNormalization, updated by every training step), and ``constants``
    (initializers a loss block added). ``added`` (parameters blocks created, such as
    ``blocks.Linear``'s) train unless frozen.
    """
    frozen_params = list(frozen_params or [])
    if requires_grad is None:
        folded = folded_weights(model)
        if folded:
            raise ArtifactError(
                f"the model's weight(s) {folded} are constants the exporter folded from parameters (named like "
                f"exporter constants: torch.onnx.export's default optimize=True writes Transpose(weight) as a new "
                f"initializer), so requires_grad=None would leave them untrained, and a tied weight folded into a "
                f"copy would train apart from its original; export with torch.onnx.export(..., optimize=False) "
                f"(or onnxtrain.torch.export_for_training) so that parameters keep their names, or name what "
                f"trains in requires_grad")
        requires_grad = [n for n in default_trainable(model, frozen_params) if n not in constants]
        frozen_params += [n for n in _batch_norm_statistics(model.graph) if n not in frozen_params]
        # what PyTorch froze stays a parameter (in the checkpoint), not trained
        declared = declared_parameters(model) or {"frozen": []}
        frozen_params += [n for n in declared["frozen"] if n not in frozen_params and n in model.graph.initializers]
    else:
        # running statistics a training-mode BatchNormalization updates are state, whatever the
        # lists say: left out of both, they would become constants and never move
        requires_grad = list(requires_grad)
        frozen_params += [n for n in _batch_norm_statistics(model.graph, training_mode_only=True)
                          if n not in frozen_params and n not in requires_grad]
    requires_grad = list(requires_grad)
    requires_grad += [n for n in added if n not in requires_grad and n not in frozen_params]
    inits = model.graph.initializers
    overlap = sorted(set(requires_grad) & set(frozen_params))
    if overlap:
        raise ArtifactError(f"parameters cannot both require gradients and be frozen: {overlap}")
    absent_frozen = [n for n in frozen_params if n not in inits]
    if absent_frozen:
        # as upstream, which looks names up among the initializers: a list made from PyTorch's
        # named_buffers() (BatchNorm's num_batches_tracked, a position_ids buffer the exporter
        # folded) names tensors the model does not hold, and there is nothing to freeze
        warnings.warn(f"frozen_params names {absent_frozen[:8]}{' ...' if len(absent_frozen) > 8 else ''}, which "
                      f"are not initializers of the model (nothing to freeze): left out", UserWarning, stacklevel=4)
        frozen_params = [n for n in frozen_params if n in inits]
    missing = sorted(n for n in requires_grad if n not in inits)
    if missing:
        known = sorted(inits)
        folded = folded_weights(model)
        hint = (f"; the exporter folded weights into constants {folded[:8]}{' ...' if len(folded) > 8 else ''} "
                f"(torch.onnx.export's default optimize=True): export with optimize=False, or with "
                f"onnxtrain.torch.export_for_training, so that parameters keep their names") if folded else ""
        raise ArtifactError(
            f"no initializer named {missing} in the model{hint}; its initializers are: "
            f"{known[:20]}{' ...' if len(known) > 20 else ''}"
        )
    scales = sorted(set(requires_grad) & quantization_parameters(model.graph))
    if scales:
        raise ArtifactError(f"{scales} are quantization scales or zero points, which stay fixed (the "
                            f"straight-through gradient trains the weights they quantize): leave them out of "
                            f"requires_grad")
    not_float = sorted(n for n in requires_grad if inits[n].dtype not in FLOAT_TYPES)
    if not_float:
        raise ArtifactError(f"only floating-point parameters can require gradients, not {not_float}")
    for name in requires_grad + frozen_params:
        if inits[name].const_value is None:
            raise ArtifactError(f"initializer {name!r} has no value")
    # Each group in the model's initializer order, whatever order the lists name them in (as
    # upstream: a buffer of the trainable parameters then has the same layout in both).
    trainable, frozen = set(requires_grad), set(frozen_params)
    params = Parameters()
    for name in inits:
        if name in trainable:
            params.trainable[name] = _parameter_value(inits[name])
        elif name in frozen:
            params.frozen[name] = _parameter_value(inits[name])
    return params


def _parameter_value(value: ir.Value) -> np.ndarray:
    """An initializer's array; ``ArtifactError`` naming the file when its data is external and
    cannot be read (a model loaded with ``load_external_data=False``, or moved from its data)."""
    try:
        return value.const_value.numpy()
    except OSError as exc:
        location = getattr(value.const_value, "path", None) or getattr(exc, "filename", None)
        raise ArtifactError(
            f"initializer {value.name!r} keeps its data in the external file {str(location)!r}, which cannot be "
            f"read ({exc.strerror or exc}): pass the model's path, or load it with its external data "
            f"(onnx.load(path) with the data file beside it)") from exc


def _more_than_one(dim: int | ir.SymbolicDim) -> bool:
    """Whether a loss's dim holds (or, named, stands for) more than one element: a fixed size
    other than 1, or a named one (a batch); an unnamed unknown dim may well be 1."""
    return dim != 1 if isinstance(dim, int) else dim.value is not None


def _lift_parameters(model: ir.Model, params: Parameters) -> None:
    """Parameters become graph inputs (trainable first, then frozen), in that order."""
    graph = model.graph
    for name in [*params.trainable, *params.frozen]:
        value = graph.initializers.pop(name)
        value.const_value = None
        graph.inputs.append(value)


def _order_parameter_inputs(graph: ir.Graph, params: Parameters) -> None:
    """Put the parameter inputs (contiguous after the user's) in ``params``' order again:
    trainable, then frozen."""
    names = [*params.trainable, *params.frozen]
    wanted = set(names)
    positions = [i for i, v in enumerate(graph.inputs) if v.name in wanted]
    if not positions:
        return
    by_name = {graph.inputs[i].name: graph.inputs[i] for i in positions}
    others = [v for v in graph.inputs if v.name not in wanted]
    ordered = [*others[:positions[0]], *(by_name[n] for n in names if n in by_name), *others[positions[0]:]]
    graph.inputs.clear()
    graph.inputs.extend(ordered)


def _clean(model: ir.Model) -> ir.Model:
    return pipeline.run(model, pipeline.training_model())


def _metadata(params: Parameters, user_inputs, loss_inputs, loss_name, additional, buffer_updates=None,
              extra: dict | None = None) -> str:
    return json.dumps({**(extra or {}),
        "trainable": list(params.trainable), "frozen": list(params.frozen),
        "user_inputs": list(user_inputs), "loss_inputs": list(loss_inputs),
        "loss_output": loss_name, "additional_outputs": list(additional),
        "buffer_updates": dict(buffer_updates or {}),
    })


def _is_training_batch_norm(node: ir.Node, opset: int) -> bool:
    if not is_onnx_op(node, "BatchNormalization"):
        return False
    mode = node.attributes.get("training_mode")
    if opset >= 14:
        return mode is not None and mode.value == 1
    return len(node.outputs) > 1  # before opset 14, extra outputs meant training mode


def _expose_running_statistics(graph: ir.Graph, frozen: Sequence[str]) -> dict[str, str]:
    """Make the updated running statistics of training-mode BatchNormalization graph outputs.

    Returns {output name: frozen parameter it updates}; the runtime writes each output
    back into its parameter after a training step, as PyTorch updates its buffers.
    """
    updates: dict[str, str] = {}
    opset = graph.opset_imports.get("", 0)
    for node in graph:
        if not _is_training_batch_norm(node, opset):
            continue
        if len(node.outputs) < 3:
            node.resize_outputs(3)
        for stat, out in zip(node.inputs[3:5], node.outputs[1:3]):
            if stat is None or stat.name not in frozen or stat.name in updates.values():
                continue
            if out.is_graph_output():
                out = GraphBuilder(graph, scope="buffers").op.Identity(out)
            out.name = names.updated_name(stat.name)
            out.type, out.shape = stat.type, stat.shape
            graph.outputs.append(out)
            updates[out.name] = stat.name
    return updates


def _branch(name: str, outputs: list[ir.Value], nodes: list[ir.Node]) -> ir.Graph:
    return ir.Graph([], outputs, nodes=nodes, name=name)


def _accumulate(b: GraphBuilder, reset: ir.Value, params: list[tuple[ir.Value, ir.Value, ir.Value]]) -> None:
    """Graph outputs ``<p>_grad.accumulation.out`` = grad if ``reset`` else buffer + grad.

    One ``If`` over all parameters: a Where with a scalar condition costs ORT several
    passes per tensor (measured ~3x an Add), while the taken branch of an If is one
    copy or one Add per parameter.
    """
    fresh, summed = [], []
    for p, g, buffer in params:
        copy = ir.node("Identity", [g], name=b.fresh_name("accumulate/fresh"))
        add = ir.node("Add", [buffer, g], name=b.fresh_name("accumulate/add"))
        for out in (copy.outputs[0], add.outputs[0]):
            out.name = f"{out.producer().name}_out"
            out.type, out.shape = p.type, p.shape
        fresh.append(copy)
        summed.append(add)
    branch_fresh = _branch("fresh_gradients", [n.outputs[0] for n in fresh], fresh)
    branch_summed = _branch("accumulated_gradients", [n.outputs[0] for n in summed], summed)
    outputs = b.op.If(reset, then_branch=branch_fresh, else_branch=branch_summed, _outputs=len(params))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for (p, _, _), out in zip(params, outputs):
        out.name = names.accumulation_out_name(p.name)
        out.type, out.shape = p.type, p.shape
        b.graph.outputs.append(out)


def build_training_and_eval(
    model: ir.Model,
    loss_name: str,
    params: Parameters,
    user_inputs: Sequence[str],
    additional_output_names: Sequence[str] = (),
    precision: PrecisionConfig | None = None,
    loss_scale: float | None = None,
    inference_outputs: Sequence[str] = (),
) -> tuple[ir.Model, ir.Model]:
    """From ``model`` (forward + loss, parameters still initializers) build both models.

    ``user_inputs`` are the base model's input names; any other graph input was added by
    the loss block. ``inference_outputs`` (the base model's output names) become outputs of
    the eval model after the loss and the additional outputs, listed in its metadata as
    ``inference_outputs``, so that ``Module.export_model_for_inferencing`` can export any of
    them (a head the loss does not read, an exporter's Identity of a value it does), as
    upstream's eval model kept every node of the base model; the training model does not
    compute them. ``model`` is consumed. With ``precision`` both models compute in low
    precision (passes/precision.py, converting the fp32 model); with ``loss_scale`` (its
    initial value) the training model takes a ``loss_scale`` input that seeds the loss
    gradient and divides the parameter gradients again (onnxblock/loss_scale.py).
    """
    graph = model.graph
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        for out in node.outputs:
            values[out.name] = out
    values.update(graph.initializers)
    if loss_name not in values:
        raise ArtifactError(f"the loss block returned {loss_name!r}, which is not a value of the model")
    missing = [n for n in additional_output_names if n not in values]
    if missing:
        raise ArtifactError(f"additional_output_names {missing} are not values of the model")
    loss = values[loss_name]
    if loss.dtype not in FLOAT_TYPES:
        raise ArtifactError(f"the loss {loss_name!r} must be floating point, not {loss.dtype}")
    if loss.shape is not None and any(_more_than_one(dim) for dim in loss.shape):
        raise ArtifactError(f"the loss {loss_name!r} has shape {loss.shape}: a loss is one number (a scalar, or "
                            "shape [1]) to differentiate; reduce it (a mean or sum over the batch) in the model or "
                            "the loss block" + (" (loss=None takes the model's first output as the loss)"
                                                if loss_name == graph.outputs[0].name else ""))
    loss_inputs = [v.name for v in graph.inputs if v.name not in user_inputs]

    _lift_parameters(model, params)
    graph.outputs.clear()
    graph.outputs.append(loss)
    graph.outputs.extend(values[n] for n in additional_output_names)
    # the base model's outputs stay graph outputs through the simplification, so that their nodes
    # (and an Identity's name: folding gives it to the Identity's input) survive for the eval model;
    # the training model drops them again below (its ops are as without them)
    requested = {loss_name, *additional_output_names}
    exposed = [n for n in dict.fromkeys(inference_outputs) if n in values and n not in requested]
    graph.outputs.extend(values[n] for n in exposed)
    pipeline.run(model, pipeline.before_autodiff())
    loss = graph.outputs[0]  # folding may have replaced the node that produced it
    if loss.name.startswith("onnxblock/") and "loss" not in values:
        loss.name = loss_name = "loss"  # a generated name: give the loss output a readable one
    # the eval model keeps the exposed outputs; the training model computes what the loss and the
    # additional outputs need, as if the exposed outputs had never been there
    eval_model = io.load_model(io.to_proto(model))
    first_exposed = 1 + len(additional_output_names)
    if len(graph.outputs) > first_exposed:
        while len(graph.outputs) > first_exposed:
            graph.outputs.pop()  # one by one: onnx_ir's slice deletion leaves is_graph_output() True
        pipeline.run(model, [RemoveUnusedNodesPass(), TopologicalSortPass()])  # as before_autodiff ends
    if precision is not None:  # parameters stay fp32 inputs; their uses are cast
        for converted in (model, eval_model):
            pipeline.run(converted, pipeline.mixed_precision(dataclasses.replace(precision, convert=True)))
        loss = graph.outputs[0]
    extra = {"precision": precision.precision} if precision is not None else {}
    if loss_scale is not None:
        extra["loss_scale"] = float(loss_scale)
    # the eval model's extra outputs, under the names the simplification left them
    eval_extra = {**extra, "inference_outputs": [v.name for v in eval_model.graph.outputs[first_exposed:]]}
    model.metadata_props[TRAINING_METADATA_KEY] = _metadata(
        params, user_inputs, loss_inputs, loss_name, additional_output_names, extra=extra)
    eval_model.metadata_props[TRAINING_METADATA_KEY] = _metadata(
        params, user_inputs, loss_inputs, loss_name, additional_output_names, extra=eval_extra)
    pipeline.run(eval_model, pipeline.eval_model())
    # quantize-dequantize pairs train with a straight-through gradient (the training model only)
    QuantizeDequantizeStraightThroughPass()(model)
    FullDropoutPass()(model)  # a Dropout of ratio 1 drops everything (onnxruntime's kernel refuses it)

    b = GraphBuilder(graph, scope="")
    trainable = [v for v in graph.inputs if v.name in params.trainable]
    seed = None
    if loss_scale is not None:
        scale = b.input(names.LOSS_SCALE, ir.DataType.FLOAT, [])
        seed = b.op.Expand(b.op.CastLike(scale, loss), b.op.Shape(loss))
    unreached: list[ir.Value] = []
    grads = build_gradients(graph, loss, trainable, loss_grad=seed, builder=b.child("grad"), unreached=unreached)
    if unreached:
        warnings.warn(NoGradientWarning(
            f"the loss {loss_name!r} does not depend on the trainable parameter(s) "
            f"{[v.name for v in unreached]} through differentiable ops (unused, or behind an integer cast, a "
            f"comparison or a rounding): they have no gradient, so they become frozen parameters (kept in the "
            f"checkpoint, never updated: PyTorch's optimizers skip a parameter without gradient, weight decay "
            f"included); check the graph if they should train"), stacklevel=2)
        # frozen in both models: no gradient buffer, no optimizer state, no weight decay
        gone = {v.name for v in unreached}
        params.frozen.update((n, params.trainable.pop(n)) for n in [n for n in params.trainable if n in gone])
        trainable = [v for v in trainable if v.name not in gone]
        for parameterized in (graph, eval_model.graph):
            _order_parameter_inputs(parameterized, params)
        eval_model.metadata_props[TRAINING_METADATA_KEY] = _metadata(
            params, user_inputs, loss_inputs, loss_name, additional_output_names, extra=eval_extra)
        model.metadata_props[TRAINING_METADATA_KEY] = _metadata(
            params, user_inputs, loss_inputs, loss_name, additional_output_names, extra=extra)
    if loss_scale is not None:  # unscale: the accumulated gradients are the true ones
        inverse = b.op.Reciprocal(scale)
        grads = {p: b.op.Mul(g, b.cast_to(inverse, g.dtype)) for p, g in grads.items()}
    buffers = [b.input(names.accumulation_buffer_name(p.name), p.dtype, p.shape) for p in trainable]
    reset = b.input(names.LAZY_RESET_GRAD, ir.DataType.BOOL, [])
    if trainable:
        _accumulate(b, reset, [(p, grads[p], buffer) for p, buffer in zip(trainable, buffers)])
    updates = _expose_running_statistics(graph, list(params.frozen))
    if updates:
        model.metadata_props[TRAINING_METADATA_KEY] = _metadata(
            params, user_inputs, loss_inputs, loss_name, additional_output_names, updates, extra=extra)
    if precision is not None:  # the gradient graph's own low-precision ops
        pipeline.run(model, pipeline.mixed_precision(dataclasses.replace(precision, convert=False)))
    return _clean(model), eval_model
