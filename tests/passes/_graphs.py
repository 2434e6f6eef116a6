"""Small ONNX graphs for the pass tests, and running them on onnxruntime's CPU provider."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper


def model_of(nodes, inputs, outputs, elem: int = TensorProto.FLOAT, opset: int = 18) -> onnx.ModelProto:
    """A model of ``nodes`` with ``inputs`` given as ``(name, shape)`` and ``outputs`` as names, all of ``elem``."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, elem, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, elem, None) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
