""":func:`export_gradient_graph`: a model, its loss and the loss's gradients as one ONNX graph
(upstream's ``onnxruntime.training.experimental.export_gradient_graph``).

The graph runs in any inference session (onnxruntime in Python, Node, the browser, mobile):
given an input, labels and the parameters, it returns the prediction, the loss and the
gradient of every trainable parameter. Upstream's needed its training build's gradient ops;
this one has standard ONNX ops only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import torch
from torch.utils import _pytree as pytree

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.errors import ExportError
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.passes import pipeline
from onnxtrain.torch._export import _holds_tensors
from onnxtrain.torch.training_export import export_for_training

INPUT, LABELS, OUTPUT, LOSS = "input", "labels", "output", "loss"
GRADIENT_SUFFIX = "_grad"


class _ModelWithLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, input, labels):  # noqa: A002 - the graph input's name, as upstream's
        output = self.model(input)
        name = type(self.model).__name__
        leaves = pytree.tree_leaves(output)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        hiding = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)
                         and _holds_tensors(leaf)})
        if hiding:
            raise ExportError(f"export_gradient_graph: {name} returned tensors inside {', '.join(hiding)} "
                              f"(a Hugging Face cache: pass use_cache=False in the model's config); the graph has one "
                              f"'output': wrap the model to return the tensor the loss reads")
        if len(tensors) != 1:
            raise ExportError(f"export_gradient_graph: {name} returned {len(tensors)} tensors "
                              f"({type(output).__name__}); the graph has one 'output': wrap the model to return the "
                              f"tensor the loss reads")
        loss = self.loss_fn(output, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ExportError(f"export_gradient_graph: loss_fn must return one number as a tensor (loss.backward() "
                              f"needs a scalar), it returned {got}: reduce it (reduction='mean' or 'sum')")
        if any(loss is t for t in tensors):
            raise ExportError(f"export_gradient_graph: loss_fn returned {name}'s output itself; the graph's 'output' "
                              f"and 'loss' are two values: compute the loss from the output")
        return output, loss


def export_gradient_graph(model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any], example_input: torch.Tensor,
                          example_labels: torch.Tensor, gradient_graph_path: str | os.PathLike,
                          opset_version: int | None = None) -> None:
    """Write ``model`` and ``loss_fn(model(input), labels)`` with the loss's gradients as one ONNX model.

    The graph's inputs are ``input``, ``labels`` and every parameter of ``model`` by its
    ``named_parameters()`` name (fed with each run: upstream's graph also kept the values as
    the inputs' defaults, for which onnxruntime warns once per parameter); its outputs
    are ``output``, ``loss`` and ``<name>_grad`` for every parameter that requires grad, in
    that order (upstream's names). The batch dimension (0) of the input and labels is dynamic
    where the model allows it. The model is exported in its current mode (``train()``:
    BatchNorm with batch statistics, its running statistics left as they are; dropout random).

    Args:
        model: the module.
        loss_fn: ``loss_fn(output, labels)``, e.g. ``torch.nn.CrossEntropyLoss()`` or a function.
        example_input, example_labels: a batch to export with.
        gradient_graph_path: where to write the ONNX model.
        opset_version: upstream's argument; the graph has the opset of torch.onnx's (dynamo)
            exporter: a lower value warns that the graph's opset is higher, a higher one raises
            ``ExportError``.

    Raises:
        ExportError: the model does not export (the reason is in the message).
        UnsupportedOpError: an op on the loss's path has no gradient rule.

    Example:
        >>> export_gradient_graph(net, torch.nn.CrossEntropyLoss(), x, y, "gradient_graph.onnx")
        >>> session = onnxruntime.InferenceSession("gradient_graph.onnx")
        >>> output, loss, *grads = session.run(None, {"input": x.numpy(), "labels": y.numpy(),
        ...                                           **{n: p.detach().numpy() for n, p in net.named_parameters()}})
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export_gradient_graph takes a torch.nn.Module, got {type(model).__name__}")
    parameters = dict(model.named_parameters())
    _check_names(parameters)
    proto = export_for_training(_ModelWithLoss(model, loss_fn), (example_input, example_labels),
                                input_names=[INPUT, LABELS], output_names=[OUTPUT, LOSS],
                                dynamic_shapes=(_batch_dim(example_input), _batch_dim(example_labels)))
    exported = io.load_model(proto)
    opset = exported.opset_imports.get("", 0)
    if opset_version is not None and opset_version > opset:
        raise ExportError(f"opset_version={opset_version}: the exporter writes opset {opset}; onnxtrain exports "
                          f"at that opset only")
    if opset_version is not None and opset_version < opset:
        warnings.warn(f"export_gradient_graph: the graph has opset {opset} (torch.onnx's exporter), not "
                      f"{opset_version}: onnxruntime 1.17 or later runs it", UserWarning, stacklevel=2)
    graph = exported.graph
    _strip_prefix(graph, "model.")
    outputs = {v.name: v for v in graph.outputs}
    graph.outputs.clear()
    graph.outputs.extend([outputs[OUTPUT], outputs[LOSS]])  # buffer updates are not outputs here
    for name, param in parameters.items():  # inputs, not constants: nothing folds them
        if name in graph.initializers:
            value = graph.initializers.pop(name)
            value.const_value = None
        else:  # a parameter the forward does not use (the exporter drops it): an input all the same
            value = ir.Value(name=name, type=ir.TensorType(_ir_dtype(param, name)), shape=ir.Shape(list(param.shape)))
        graph.inputs.append(value)
    pipeline.run(exported, pipeline.before_autodiff())
    loss = graph.outputs[1]
    trainable = [v for v in graph.inputs if v.name in parameters and parameters[v.name].requires_grad]
    b = GraphBuilder(graph, scope="")
    grads = build_gradients(graph, loss, trainable, builder=b.child("grad"))
    for param in trainable:
        gradient = b.op.Identity(grads[param])
        gradient.name = param.name + GRADIENT_SUFFIX
        gradient.type, gradient.shape = param.type, param.shape
        graph.outputs.append(gradient)
    pipeline.run(exported, pipeline.training_model())
    io.save_model(exported, gradient_graph_path)


def _check_names(parameters: dict[str, torch.nn.Parameter]) -> None:
    """The graph's names are upstream's: a parameter may not take one of them."""
    taken = {INPUT, LABELS, OUTPUT, LOSS} | {n + GRADIENT_SUFFIX for n, p in parameters.items() if p.requires_grad}
    clashes = sorted(set(parameters) & taken)
    if clashes:
        raise ExportError(f"export_gradient_graph: parameter name(s) {clashes} clash with the graph's names "
                          f"('{INPUT}', '{LABELS}', '{OUTPUT}', '{LOSS}', '<parameter>{GRADIENT_SUFFIX}'): rename them")


_IR_TYPES = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16, torch.float64: ir.DataType.DOUBLE,
             torch.bfloat16: ir.DataType.BFLOAT16}


def _ir_dtype(param: torch.Tensor, name: str) -> ir.DataType:
    if param.dtype not in _IR_TYPES:
        raise ExportError(f"export_gradient_graph: parameter {name!r} has dtype {param.dtype}")
    return _IR_TYPES[param.dtype]


def _batch_dim(example: torch.Tensor):
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"example inputs and labels must be tensors, got {type(example).__name__}")
    return {0: torch.export.Dim.AUTO} if example.dim() else None


def _strip_prefix(graph: ir.Graph, prefix: str) -> None:
    """The wrapper's parameter and buffer names (``model.fc.weight``) as the model's (``fc.weight``)."""
    for name in [n for n in graph.initializers if n.startswith(prefix)]:
        value = graph.initializers.pop(name)
        value.name = name[len(prefix):]
        graph.initializers[value.name] = value

