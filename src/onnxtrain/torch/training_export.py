"""Export a PyTorch module as an ONNX model to generate training artifacts from.

``torch.onnx.export`` writes graphs for inference; trained from, several of them compute other
gradients than PyTorch does. :func:`export_for_training` exports the way ORTModule does:
training-mode BatchNorm with batch statistics and running-statistics updates, ``detach()`` and
``torch.no_grad()`` regions as stop-gradients, embeddings' padding rows without a gradient,
``nn.EmbeddingBag`` without a ``Loop``, ``nn.LSTM(proj_size=...)`` with its projection (which
the plain export drops), Hugging Face T5/Swin attention exportable, ``torch.cond`` and torch's
``scan`` and ``while_loop`` as ONNX ``If``, ``Scan`` and ``Loop``, the CTC loss and packed
sequences (``pack_padded_sequence`` into LSTM/GRU/RNN) as scans over the steps, the log-space
functions without overflow, and custom ``torch.autograd.Function``s refused unless declared exact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch

from onnxtrain import names
from onnxtrain.errors import ExportError
from onnxtrain.ir import io
from onnxtrain.torch._export import (
    _check_functions,
    _check_module_hooks,
    autograd_graph,
    check_gradient_paths,
    export_failure,
    module_state_kept,
    quiet_exporter,
)
from onnxtrain.torch._exporter import (EXPORT_LOCK, attention_outputs_contiguous, capture, contiguous_as_clone, export_program,
                                       is_cumulative_batch_norm, mark_gradient_cuts, splits_with_sizes)
from onnxtrain.torch._translations import (artifacts_translation_table, complex_translation_table,
                                           per_sample_losses_as_own_ops)


def _apply_renames(proto: onnx.ModelProto, renames: dict[str, str]) -> None:
    """Rename values of ``proto``'s main graph wherever they are named."""
    if not renames:
        return
    graph = proto.graph
    for named in (*graph.initializer, *graph.input, *graph.output, *graph.value_info):
        named.name = renames.get(named.name, named.name)
    for node in graph.node:
        node.input[:] = [renames.get(i, i) for i in node.input]
        node.output[:] = [renames.get(o, o) for o in node.output]


def _rename(values, names: Sequence[str] | None, what: str, model: onnx.ModelProto) -> None:
    if names is None:
        return
    if len(names) != len(values):
        raise ExportError(f"{len(names)} {what} names given for {len(values)} {what}s "
                          f"({', '.join(v.name for v in values)})")
    _apply_renames(model, {v.name: new for v, new in zip(values, names) if v.name != new})


def _canonical_state_names(model: torch.nn.Module, proto: onnx.ModelProto) -> None:
    """Name each initializer that holds a parameter or buffer as ``named_parameters()`` /
    ``named_buffers()`` name it: a tied tensor (an LM head sharing the embedding) reaches the
    exporter under whichever of its names it meets, often not the first one."""
    renames = {}
    for named in (model.named_parameters, model.named_buffers):
        canonical = {id(t): name for name, t in named()}
        for name, tensor in named(remove_duplicate=False):
            if canonical[id(tensor)] != name:
                renames[name] = canonical[id(tensor)]
    present = {t.name for t in proto.graph.initializer}
    _apply_renames(proto, {old: new for old, new in renames.items() if old in present and new not in present})


def _check_gradient_paths(model: torch.nn.Module, proto: onnx.ModelProto, leaves) -> None:
    """``ExportError`` if a parameter that PyTorch's autograd reaches from the outputs has no
    gradient path in the exported graph: its artifacts would train it with zeros."""
    reached = {id(t) for t in leaves}
    graph = io.load_model(proto).graph
    check_gradient_paths(model, graph, {name: graph.initializers.get(name) for name, p in model.named_parameters()
                                        if id(p) in reached}, graph.outputs,
                         "the exported graph does not differentiate it: a forward that changes a parameter in "
                         "place under torch.no_grad(), as nn.Embedding(max_norm=...) renormalizes its weight, "
                         "exports as a cut no gradient crosses")


def _check_batch_norm_momenta(model: torch.nn.Module) -> None:
    """``ExportError`` for batch norms that train with ``momentum=None`` (a cumulative average,
    whose factor changes every step): the artifacts' ``BatchNormalization`` updates its running
    statistics with a fixed momentum."""
    cumulative = [name for name, sub in model.named_modules() if is_cumulative_batch_norm(sub)]
    if cumulative:
        raise ExportError(f"{', '.join(cumulative)}: BatchNorm with momentum=None (a cumulative average of the "
                          f"batch statistics) cannot be exported for on-device training, whose BatchNormalization "
                          f"has a fixed momentum; set a momentum (PyTorch's default is 0.1)")


def _shapes_from_the_inputs(proto: onnx.ModelProto) -> None:
    """Replace the exporter's shapes of intermediate values with ONNX shape inference's from the
    graph inputs' (symbolic) dims. Torch's trace can fix a dim the inputs leave dynamic (a GRU's
    output keeps the example's sequence length), and a gradient built from that static shape
    only runs at the example's length; where inference cannot tell a dim, the gradient graph
    reads it at run time."""
    del proto.graph.value_info[:]
    declared = {}
    for output in proto.graph.output:  # the trace's output shapes too (a batch-1 example's GRU: [1, 3])
        if output.type.tensor_type.HasField("shape"):
            declared[output.name] = onnx.TypeProto()
            declared[output.name].CopyFrom(output.type)
            output.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    proto.graph.value_info.extend(inferred.graph.value_info)
    for output, found in zip(proto.graph.output, inferred.graph.output):
        if found.type.tensor_type.HasField("shape"):
            output.type.CopyFrom(found.type)
        elif output.name in declared:  # inference cannot tell: the trace's shape stays
            output.type.CopyFrom(declared[output.name])


def _set_metadata(proto: onnx.ModelProto, key: str, value: str) -> None:
    for entry in proto.metadata_props:
        if entry.key == key:
            entry.value = value
            return
    proto.metadata_props.add(key=key, value=value)


def _check_state_updates(model: torch.nn.Module, changed: list[str]) -> None:
    """``ExportError`` naming the buffers and parameters a forward changes other than a training
    BatchNorm's statistics (which the artifacts carry from step to step): an exponential moving
    average, a momentum encoder. The artifacts keep them as exported: the updates would be lost."""
    carried = {f"{prefix}.{name}".lstrip(".") for prefix, sub in model.named_modules()
               if isinstance(sub, torch.nn.modules.batchnorm._NormBase) and sub.training and sub.track_running_stats
               for name in ("running_mean", "running_var", "num_batches_tracked")}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}  # (their gradient path: below)
    lost = [name for name in changed if name not in carried and name not in trainable]
    if lost:
        raise ExportError(f"{type(model).__name__}'s forward changes {lost[:8]} (in place or by replacing them): "
                          f"the artifacts keep buffers and frozen parameters as exported (only a training "
                          f"BatchNorm's running statistics are carried from step to step), so the updates "
                          f"would be lost. Update them outside the model between steps, or train with ORTModule")


def _check_parameter_hooks(model: torch.nn.Module) -> None:
    """``ExportError`` naming the parameters with gradient hooks (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``): the exported graph's gradients never pass them."""
    hooked = [name for name, p in model.named_parameters()
              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:
        raise ExportError(f"{type(model).__name__}'s parameters {hooked[:8]} have gradient hooks (Tensor.register_hook, "
                          f"register_post_accumulate_grad_hook): the exported graph's gradients would not pass "
                          f"through them. Remove them (or train with ORTModule, whose gradients reach the "
                          f"parameters through autograd)")


def export_for_training(model: torch.nn.Module, args: tuple, path: str | os.PathLike | None = None, *,
                        input_names: Sequence[str] | None = None,
                        output_names: Sequence[str] | None = None, dynamic_shapes: Any = None,
                        inline_autograd_functions: Iterable[type] | bool = ()) -> onnx.ModelProto:
    """``model(*args)`` as an ONNX model whose gradients are PyTorch's, for
    :func:`onnxtrain.artifacts.generate_artifacts`.

    The model is exported in its current mode: in ``train()`` mode BatchNorm normalizes with
    batch statistics, as a ``BatchNormalization(training_mode=1)`` whose running statistics
    the artifacts keep as frozen state and update each step; Dropout stays random.

    Args:
        model: the module; its parameters and buffers become the model's initializers, named
            as in ``model.named_parameters()`` and ``model.named_buffers()`` (a tied parameter
            by its first name).
        args: the example positional inputs (a tuple of tensors).
        path: where to write the model (also returned), or None.
        input_names, output_names: names for the graph's user inputs and outputs, in order
            (default: the forward's argument names, and the exporter's output names).
        dynamic_shapes: as for ``torch.export.export`` (e.g. ``({0: torch.export.Dim("batch", min=2)},)``:
            a training-mode BatchNorm needs batches of 2 or more).
        inline_autograd_functions: custom ``torch.autograd.Function`` classes whose backward is
            the exact gradient of their forward (or True for all): the export traces their
            forward, which the gradient graph then differentiates. Others raise.

    Raises:
        ExportError: the model runs custom autograd Functions not declared exact, has backward
            hooks (on modules, or gradient hooks on parameters), changes a parameter in place (no
            gradient path left), or does not export (the reason is in the message).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
        >>> proto = export_for_training(model, (torch.randn(16, 4),), input_names=["x"],
        ...                             dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))
        >>> [i.name for i in proto.graph.input][-1]
        'x'
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export_for_training takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise ExportError(f"args must be a tuple of example inputs, not {type(args).__name__}")
    _check_module_hooks(model)
    _check_parameter_hooks(model)
    _check_batch_norm_momenta(model)
    inline = True if inline_autograd_functions is True else frozenset(inline_autograd_functions or ())
    # the autograd graph of one run names the custom Functions it applied; the run must not
    # change the model (BatchNorm's running statistics, a momentum encoder's parameters) or the
    # random stream (Dropout)
    with module_state_kept(model) as changed, torch.enable_grad():
        outputs = model(*args)
        _check_state_updates(model, changed())
    traced = autograd_graph(torch.utils._pytree.tree_leaves(outputs))
    _check_functions(model, traced.functions, inline,
                     option="export_for_training(..., inline_autograd_functions=[...])")
    try:
        with EXPORT_LOCK, quiet_exporter():
            program = capture(model, args, dynamic_shapes)
            mark_gradient_cuts(program)
            contiguous_as_clone(program)
            attention_outputs_contiguous(program)
            splits_with_sizes(program)
            per_sample_losses_as_own_ops(program)
            proto = export_program(program, artifacts_translation_table(), complex_translation_table()).model_proto
    except Exception as exc:  # the exporter raises many types; the reason is in the message
        raise export_failure(f"torch.onnx.export could not export {type(model).__name__}", exc) from exc
    _canonical_state_names(model, proto)
    initializers = {t.name for t in proto.graph.initializer}
    # what generate_artifacts trains and freezes by default: PyTorch's parameters that require
    # grad, and those that do not (buffers other than BatchNorm's statistics stay constants)
    parameters = [(name, p.requires_grad) for name, p in model.named_parameters() if name in initializers]
    _set_metadata(proto, names.PARAMETERS_METADATA, json.dumps({
        "trainable": [name for name, required in parameters if required],
        "frozen": [name for name, required in parameters if not required]}))
    _rename([i for i in proto.graph.input if i.name not in initializers], input_names, "input", proto)
    _rename(list(proto.graph.output), output_names, "output", proto)
    _check_gradient_paths(model, proto, traced.leaves)
    if dynamic_shapes is not None:
        _shapes_from_the_inputs(proto)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        onnx.save(proto, str(path))
    return proto

