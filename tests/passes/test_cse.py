"""DistinctDrawsCSEPass: duplicates merge, random draws (Dropout, Bernoulli) stay apart."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnxtrain.ir import io
from onnxtrain.passes.cse import DistinctDrawsCSEPass


def _model() -> ir.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4000]))
    ratio = ir.Value(name="ratio", const_value=ir.tensor(np.array(0.5, np.float32)))
    training = ir.Value(name="training", const_value=ir.tensor(np.array(True)))
    nodes = [ir.node("Relu", [x]), ir.node("Relu", [x]),
             ir.node("Dropout", [x, ratio, training]), ir.node("Dropout", [x, ratio, training])]
    graph = ir.Graph([x], [n.outputs[0] for n in nodes], nodes=nodes, initializers=[ratio, training],
                     opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def test_duplicates_merge_and_dropouts_draw_apart():
    model = _model()
    DistinctDrawsCSEPass()(model)
    ops = [node.op_type for node in model.graph]
    assert ops.count("Relu") == 1 and ops.count("Dropout") == 2
    assert all("onnxtrain_distinct_draw" not in node.attributes for node in model.graph)
    session = ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"])
    _, _, first, second = session.run(None, {"x": np.ones(4000, np.float32)})
    assert 0.4 < float(np.mean((first == 0) == (second == 0))) < 0.6  # independent masks
