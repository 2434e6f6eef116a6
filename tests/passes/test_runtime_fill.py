"""RuntimeFillPass: large constant fills computed in each run instead of folded by onnxruntime
into an initializer the session keeps; the same values, and the on-device API's sessions take it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.passes import runtime_fill
from onnxtrain.passes.runtime_fill import RuntimeFillPass
from onnxtrain.runtime import fusions
from tests.passes._graphs import model_of

ROWS, COLS, PICKED = 1024, 512, 6  # a 2 MB fill


def _scatter_into_fill(rows=ROWS, cols=COLS, fill=None, shape_input=None) -> onnx.ModelProto:
    """``ScatterND(ConstantOfShape([rows, cols]), ids, updates, reduction=add)``: an embedding's gradient."""
    value = fill if fill is not None else numpy_helper.from_array(np.zeros(1, np.float32))
    nodes = [helper.make_node("ConstantOfShape", [shape_input or "shape"], ["zeros"], value=value),
             helper.make_node("ScatterND", ["zeros", "ids", "updates"], ["grad"], reduction="add")]
    if shape_input is None:
        nodes.insert(0, helper.make_node("Constant", [], ["shape"],
                                         value=numpy_helper.from_array(np.array([rows, cols], np.int64))))
    inputs = [("ids", [PICKED, 1], TensorProto.INT64), ("updates", [PICKED, cols])]
    if shape_input is not None:
        inputs.append((shape_input, [2], TensorProto.INT64))
    return model_of(nodes, inputs, ["grad"])


def _rewritten(proto: onnx.ModelProto, **kwargs) -> tuple[onnx.ModelProto, bool]:
    model = ir.from_proto(proto)
    modified = RuntimeFillPass(**kwargs)(model).modified
    return ir.to_proto(model), modified


def _largest_session_initializer(proto: onnx.ModelProto, tmp_path) -> int:
    """Bytes of the largest initializer in the graph onnxruntime optimized ``proto`` into."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    return max((numpy_helper.to_array(t).nbytes for t in optimized.graph.initializer), default=0)


def _feeds(rng, cols=COLS):
    return {"ids": np.array([[3], [7], [3], [0], [1023], [7]], np.int64),
            "updates": rng.standard_normal((PICKED, cols)).astype(np.float32)}


def test_a_large_fill_is_made_in_each_run_with_the_same_values(tmp_path):
    proto = _scatter_into_fill()
    rewritten, modified = _rewritten(proto)
    assert modified
    assert "RandomUniform" in [n.op_type for n in rewritten.graph.node]
    # onnxruntime folds the plain fill into a 2 MB initializer; the rewritten one it cannot fold
    assert _largest_session_initializer(proto, tmp_path) == ROWS * COLS * 4
    assert _largest_session_initializer(rewritten, tmp_path) < runtime_fill.DEFAULT_MIN_BYTES
    feeds = _feeds(np.random.default_rng(0))
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    session = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(20):  # the run-time zero is exact whatever the random draw
        np.testing.assert_array_equal(session.run(None, feeds)[0], expected)


def test_the_fill_value_and_dtype_are_kept():
    fill = numpy_helper.from_array(np.array([2.5], np.float32))
    proto = _scatter_into_fill(fill=fill)
    rewritten, modified = _rewritten(proto)
    assert modified
    feeds = _feeds(np.random.default_rng(1))
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
            for m in (proto, rewritten)]
    np.testing.assert_array_equal(runs[1], runs[0])
    assert runs[0][5, 0] == np.float32(2.5)  # a row no id picked


@pytest.mark.parametrize(("case", "kwargs"), [
    ("below the size", {"rows": 16, "cols": 8}),
    ("shape computed at run time", {"shape_input": "shape_in"}),
])
def test_small_fills_and_fills_onnxruntime_cannot_fold_stay(case, kwargs):
    proto = _scatter_into_fill(**kwargs)
    rewritten, modified = _rewritten(proto)
    assert not modified, case
    assert [n.op_type for n in rewritten.graph.node] == [n.op_type for n in proto.graph.node]


def test_the_threshold_is_a_parameter():
    _, modified = _rewritten(_scatter_into_fill(rows=16, cols=8), min_bytes=0)
    assert modified


def _embedding_model(vocab: int, dim: int) -> onnx.ModelProto:
    """ids -> Gather(table) -> mean over the sequence -> MatMul: an embedding classifier."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((vocab, dim)).astype(np.float32) * 0.1, "table")
    head = numpy_helper.from_array(rng.standard_normal((dim, 3)).astype(np.float32) * 0.1, "head")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"]),
             helper.make_node("ReduceMean", ["embedded", "axes"], ["pooled"], keepdims=0),
             helper.make_node("MatMul", ["pooled", "head"], ["output"])]
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 5])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3])],
                              initializer=[table, head, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_on_device_sessions_make_an_embedding_gradient_fill_at_run_time_and_train_the_same(tmp_path, monkeypatch):
    vocab, dim = 4096, 64  # the table's gradient fill: 1 MB
    artifacts.generate_artifacts(_embedding_model(vocab, dim), requires_grad=["table", "head"],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    cpu = ["CPUExecutionProvider"]
    session_bytes = fusions.session_model(tmp_path / "training_model.onnx", cpu)
    assert isinstance(session_bytes, bytes)
    assert "RandomUniform" in [n.op_type for n in onnx.load_from_string(session_bytes).graph.node]

    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, vocab, (4, 5)), rng.standard_normal((4, 3)).astype(np.float32)) for _ in range(4)]

    def train(fused: bool):
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
        optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module, fused_step=fused)
        losses = []
        for ids, target in batches:
            losses.append(float(module(ids, target)))
            optimizer.step()
            module.lazy_reset_grad()
        return losses, state.parameters["table"].data

    runs = {fused: train(fused) for fused in (True, False)}
    # the reference: no run-time fills (onnxruntime folds the zeros)
    monkeypatch.setattr(fusions, "RuntimeFillPass", lambda: RuntimeFillPass(min_bytes=1 << 40))
    assert isinstance(fusions.session_model(tmp_path / "training_model.onnx", cpu, gated_add=False), str)
    reference = train(fused=False)
    for losses, table in runs.values():
        np.testing.assert_allclose(losses, reference[0], rtol=1e-6)
        np.testing.assert_allclose(table, reference[1], rtol=1e-6, atol=1e-7)
