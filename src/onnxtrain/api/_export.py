"""Turn the eval model into an inference model (``Module.export_model_for_inferencing``)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx_ir as ir

from onnxtrain.errors import ModelError
from onnxtrain.ir import io
from onnxtrain.passes.dce import RemoveUnusedNodesPass

_METADATA_KEYS = ("onnxtrain.training",)


def export_inference_model(eval_model_uri: str, inference_model_uri: str | os.PathLike, output_names: list[str],
                           parameters: dict[str, np.ndarray], loss_inputs: list[str]) -> None:
    """Keep the nodes needed for ``output_names``, embed ``parameters`` as initializers and
    drop inputs nothing uses any more (the loss inputs among them). Any output of the base
    model can be named: the eval model outputs them all (its metadata's ``inference_outputs``)."""
    model = io.load_model(eval_model_uri)
    graph = model.graph
    values = {v.name: v for v in graph.inputs}
    values.update({v.name: v for v in graph.initializers.values()})
    for node in graph:
        values.update({v.name: v for v in node.outputs})
    unknown = [n for n in output_names if n not in values]
    if unknown:
        meta = json.loads(model.metadata_props.get(_METADATA_KEYS[0]) or "{}")
        older = ("; these artifacts predate eval models that keep every output of the base model (no "
                 "'inference_outputs' in their metadata): generate them again to export one the loss does not read"
                 if "inference_outputs" not in meta else "")
        raise ModelError(f"graph outputs {unknown} are not values of the eval model (its outputs are "
                         f"{[o.name for o in graph.outputs]}, and it has {len(values)} other values): the eval "
                         f"model keeps only what the loss, the additional outputs and the base model's outputs "
                         f"compute; to export another value, name it in generate_artifacts(..., "
                         f"additional_output_names=[...]){older}")
    graph.outputs.clear()
    graph.outputs.extend(values[n] for n in output_names)
    RemoveUnusedNodesPass()(model)

    used_loss_inputs = [n for n in loss_inputs if n in values and values[n].uses()]
    if used_loss_inputs:
        raise ModelError(f"the requested outputs {output_names} depend on the loss inputs {used_loss_inputs}; "
                         f"pick outputs computed before the loss")
    kept = []
    for value in list(graph.inputs):
        needed = bool(value.uses()) or value.is_graph_output()
        if value.name in parameters:
            if needed:
                value.const_value = ir.tensor(np.ascontiguousarray(parameters[value.name]), name=value.name)
                graph.register_initializer(value)
        elif needed:
            kept.append(value)
    graph.inputs.clear()
    graph.inputs.extend(kept)
    _alias_repeated_outputs(graph)
    for key in _METADATA_KEYS:
        model.metadata_props.pop(key, None)
        graph.metadata_props.pop(key, None)
    io.save_model(model, inference_model_uri)


def _alias_repeated_outputs(graph: ir.Graph) -> None:
    """An output requested again becomes an Identity of it named ``<name>_alias_<k>`` (a value is
    one graph output). An input requested as an output stays the input, under its own name:
    ONNX and onnxruntime take that, and the model is fed by the input's name."""
    seen: dict[ir.Value, int] = {}
    for position, value in enumerate(list(graph.outputs)):
        if value not in seen:
            seen[value] = 0
            continue
        seen[value] += 1
        alias = ir.node("Identity", [value], name=f"{value.name}_alias_{seen[value]}")
        alias.outputs[0].name = f"{value.name}_alias_{seen[value]}"
        alias.outputs[0].type, alias.outputs[0].shape = value.type, value.shape
        graph.append(alias)
        graph.outputs[position] = alias.outputs[0]
