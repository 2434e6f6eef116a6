"""FlatGatherPass: a Gather of a 1-D tensor's elements becomes a GatherElements, same values."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.ir import io
from onnxtrain.passes.flat_gather import FlatGatherPass
from tests.passes._graphs import model_of, run


def _gather(data_shape, index_shape, index_type=TensorProto.INT64):
    return model_of([helper.make_node("Gather", ["x", "i"], ["y"], axis=0)],
                    [("x", data_shape), ("i", index_shape, index_type)], ["y"])


def _rewritten(model):
    graph_model = io.load_model(model)
    FlatGatherPass()(graph_model)
    return graph_model, io.to_proto(graph_model)


@pytest.mark.parametrize("index_shape", [[5], [2, 3], [2, 1, 4], [0], ["K", 2]])
@pytest.mark.parametrize("index_type", [TensorProto.INT64, TensorProto.INT32])
def test_elements_gathered_alike(index_shape, index_type):
    model = _gather([7], index_shape, index_type)
    rewritten, proto = _rewritten(model)
    assert [n.op_type for n in rewritten.graph if n.op_type.startswith("Gather")] == ["GatherElements"]
    shape = [3 if isinstance(d, str) else d for d in index_shape]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal([7]).astype(np.float32),
             "i": rng.integers(-7, 7, size=shape).astype(np.int64 if index_type == TensorProto.INT64 else np.int32)}
    expected, = run(model, feeds)
    got, = run(proto, feeds)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_the_gathered_value_keeps_its_name_as_a_graph_output():
    rewritten, _ = _rewritten(_gather([7], [2, 3]))
    assert [o.name for o in rewritten.graph.outputs] == ["y"]
    assert rewritten.graph.outputs[0].producer().op_type == "Reshape"


@pytest.mark.parametrize(("data_shape", "index_shape"), [([7, 2], [3]), ([7], []), (None, [3])])
def test_rows_scalar_indices_and_unknown_ranks_are_left_alone(data_shape, index_shape):
    rewritten, _ = _rewritten(_gather(data_shape, index_shape))
    assert [n.op_type for n in rewritten.graph] == ["Gather"]
