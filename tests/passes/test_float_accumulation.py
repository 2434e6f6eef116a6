"""A float16 model's gradients that scatters accumulate (embeddings, gathers, max pools) add in
float32 (passes/float_accumulation.py): onnxruntime's CPU kernels have no float16 reduction, and
the training step of such a model failed."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts, names


def _model(dtype):
    """``MaxPool(GatherElements(E[ids] @ W, picks))``: an embedding (Gather), a GatherElements and
    a max pool, whose gradients are scatters that add."""
    rng = np.random.default_rng(0)
    numpy_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    embedding = numpy_helper.from_array(rng.standard_normal((10, 4)).astype(numpy_type), "E")
    weight = numpy_helper.from_array(rng.standard_normal((4, 6)).astype(numpy_type), "W")
    picks = numpy_helper.from_array(np.array([[0, 5, 5, 2]] * 5, np.int64), "picks")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("MatMul", ["e", "W"], ["h"]),
             helper.make_node("GatherElements", ["h", "picks"], ["g"], axis=1),
             helper.make_node("Unsqueeze", ["g", "axes"], ["g3"]),
             helper.make_node("MaxPool", ["g3"], ["p"], kernel_shape=[2], strides=[1]),
             helper.make_node("Squeeze", ["p", "axes"], ["out"])]
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    graph = helper.make_graph(nodes, "scatters", [helper.make_tensor_value_info("ids", TensorProto.INT64, [5])],
                              [helper.make_tensor_value_info("out", dtype, [5, 3])],
                              [embedding, weight, picks, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _gradients(directory, dtype, ids, target):
    session = ort.InferenceSession(str(directory / "training_model.onnx"), providers=["CPUExecutionProvider"])
    params = {t.name: numpy_helper.to_array(t) for t in _model(dtype).graph.initializer if t.name in ("E", "W")}
    feeds = {"ids": ids, "target": target.astype(params["E"].dtype), **params, names.LAZY_RESET_GRAD: np.array(True),
             **{names.accumulation_buffer_name(p): np.zeros_like(v) for p, v in params.items()}}
    outputs = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    found = dict(zip([o.name for o in session.get_outputs()], outputs))
    return [found[names.accumulation_out_name(p)] for p in ("E", "W")]


def test_a_float16_model_with_embedding_gather_and_pool_gradients_trains_like_float32(tmp_path):
    ids = np.array([1, 2, 3, 1, 0], np.int64)
    target = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    got = {}
    for dtype in (TensorProto.FLOAT16, TensorProto.FLOAT):
        directory = tmp_path / str(dtype)
        artifacts.generate_artifacts(_model(dtype), requires_grad=["E", "W"], loss=artifacts.LossType.MSELoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=directory)
        got[dtype] = _gradients(directory, dtype, ids, target)
    for low, full in zip(got[TensorProto.FLOAT16], got[TensorProto.FLOAT]):
        assert low.dtype == np.float16
        np.testing.assert_allclose(low.astype(np.float32), full, rtol=2e-2, atol=2e-2 * np.abs(full).max())
    assert np.count_nonzero(got[TensorProto.FLOAT][0]) > 0  # the embedding's rows were reached


def test_float32_scatters_are_left_alone():
    import onnx_ir as ir

    from onnxtrain.passes.float_accumulation import FloatAccumulationPass
    nodes = [helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], reduction="add")]
    for dtype, rewritten in ((TensorProto.FLOAT, False), (TensorProto.FLOAT16, True)):
        graph = helper.make_graph(nodes, "scatter", [helper.make_tensor_value_info("data", dtype, [4]),
                                                    helper.make_tensor_value_info("indices", TensorProto.INT64, [2, 1]),
                                                    helper.make_tensor_value_info("updates", dtype, [2])],
                                  [helper.make_tensor_value_info("out", dtype, [4])])
        model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
        assert FloatAccumulationPass()(model).modified is rewritten
        assert model.graph.outputs[0].name == "out" and model.graph.outputs[0].dtype == ir.DataType(dtype)
        if rewritten:
            data = np.array([0, 1, 2, 3], np.float16)
            session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                           providers=["CPUExecutionProvider"])
            out = session.run(None, {"data": data, "indices": np.array([[1], [1]]),
                                     "updates": np.array([0.5, 0.25], np.float16)})[0]
            np.testing.assert_array_equal(out, np.array([0, 1.75, 2, 3], np.float16))
