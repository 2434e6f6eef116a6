"""Small ONNX graphs for the pass tests, and running them on onnxruntime's CPU provider."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper


def model_of(nodes, inputs, outputs, elem: int = TensorProto.FLOAT, opset: int = 18) -> onnx.ModelProto:
    """A model of ``nodes`` with ``inputs`` given as ``(name, shape)`` (of ``elem``) or ``(name, shape,
    element type)`` and ``outputs`` as names, all of ``elem``."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(i[0], i[2] if len(i) > 2 else elem, i[1])
                                           for i in inputs],
                              [helper.make_tensor_value_info(n, elem, None) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
