"""onnxtrain.ir.io.save_model: a model written again to the same path replaces its files, large
ones with their external data too (onnx appends to an existing data file), from any current
directory; the caller's ModelProto keeps its tensors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir import io


def _model(scale: float) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.full((64, 32), scale, np.float32), "w")  # 8 KB
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "m",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _output(path) -> np.ndarray:
    return ort.InferenceSession(str(path)).run(None, {"x": np.ones((1, 64), np.float32)})[0]


def test_a_large_model_saved_again_replaces_its_data(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 1000)  # stands in for a model over ~1.8 GB
    path, data = tmp_path / "model.onnx", tmp_path / "model.onnx.data"
    for scale in (1.0, 2.0, 3.0):
        proto = _model(scale)
        io.save_model(proto, path)
        assert data.stat().st_size == 64 * 32 * 4  # one model's weights, not every export's
        np.testing.assert_allclose(_output(path), np.full((1, 32), 64 * scale))
        assert proto.graph.initializer[0].HasField("raw_data")  # the caller's proto is untouched
    monkeypatch.chdir(tmp_path)  # onnx's own save refused a data file of that name here
    io.save_model(_model(4.0), "model.onnx")
    np.testing.assert_allclose(_output(path), np.full((1, 32), 256.0))
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 1 << 40)
    io.save_model(_model(5.0), path)  # small now: everything inline, the old data file goes
    assert not data.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    np.testing.assert_allclose(_output(path), np.full((1, 32), 320.0))


def test_a_model_saved_through_a_symbolic_link_writes_the_file_it_names(tmp_path):
    target = tmp_path / "real" / "model.onnx"
    target.parent.mkdir()
    io.save_model(_model(1.0), target)
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    io.save_model(_model(2.0), link)
    assert link.is_symlink()  # the link itself stays a link
    np.testing.assert_allclose(_output(target), np.full((1, 32), 128.0))
