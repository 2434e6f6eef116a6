"""ORTModule's SessionRunner: a CPU run hands its inputs and outputs to onnxruntime in one batch
(``OrtValueVector``) when every input can go that way, and binds them one by one otherwise
(an empty tensor, bfloat16); both give the same tensors, errors and aliasing rules."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from onnxtrain.errors import RunError  # noqa: E402
from onnxtrain.runtime.device import Device  # noqa: E402
from onnxtrain.torch import _bridge  # noqa: E402


def _runner(element_type: int, op: str = "Neg") -> _bridge.SessionRunner:
    """x -> (op(x), shape of x, Identity(i)) and a Gather of the table by the int64 ``i``."""
    nodes = [helper.make_node(op, ["x"], ["y"]), helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["table", "i"], ["picked"]), helper.make_node("Identity", ["i"], ["j"])]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", element_type, None), helper.make_tensor_value_info("table", TensorProto.FLOAT, [4, 2]),
         helper.make_tensor_value_info("i", TensorProto.INT64, None)],
        [helper.make_empty_tensor_value_info(name) for name in ("y", "s", "picked", "j")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return _bridge.SessionRunner(ir.from_proto(onnx.shape_inference.infer_shapes(proto)), Device("cpu"), None, "test graph")


def _spy(monkeypatch) -> list[bool]:
    """Per run, whether it went the batched way."""
    ways = []
    batched = _bridge.SessionRunner._run_batched
    monkeypatch.setattr(_bridge.SessionRunner, "_run_batched",
                        lambda self, inputs: ways.append(True) or batched(self, inputs))
    return ways


@pytest.mark.parametrize(("dtype", "element_type", "op"), [
    (torch.float32, TensorProto.FLOAT, "Neg"), (torch.float16, TensorProto.FLOAT16, "Identity"),
    (torch.float64, TensorProto.DOUBLE, "Neg"), (torch.int32, TensorProto.INT32, "Neg"),
    (torch.int8, TensorProto.INT8, "Neg"), (torch.uint8, TensorProto.UINT8, "Identity"),
    (torch.bool, TensorProto.BOOL, "Not"),
])
def test_a_batched_run_gives_the_outputs_of_the_bound_one(monkeypatch, dtype, element_type, op):
    ways = _spy(monkeypatch)
    runner = _runner(element_type, op)
    x = (torch.arange(24).reshape(4, 6) % 5).to(dtype).t()  # not contiguous
    table, i = torch.randn(4, 2, requires_grad=True), torch.tensor([[3, 0], [1, 1]])
    y, s, picked, j = runner.run([x, table, i])
    assert ways == [True]
    expected = torch.logical_not(x) if dtype == torch.bool else x if op == "Identity" else -x
    assert y.dtype == dtype and torch.equal(y, expected)
    assert s.tolist() == [6, 4] and torch.equal(picked, table.detach()[i]) and torch.equal(j, i)
    assert x.dtype == dtype and torch.equal(x, (torch.arange(24).reshape(4, 6) % 5).to(dtype).t())  # inputs untouched


@pytest.mark.parametrize("case", ["empty", "bfloat16", "scalar"])
def test_inputs_the_batch_cannot_take_are_bound_one_by_one(monkeypatch, case):
    ways = _spy(monkeypatch)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    # (onnxruntime's CPU Neg takes no bfloat16)
    runner = _runner(TensorProto.BFLOAT16, "Identity") if case == "bfloat16" else _runner(TensorProto.FLOAT)
    x = {"empty": torch.zeros(0, 3), "bfloat16": torch.randn(2, 3, dtype=dtype), "scalar": torch.tensor(2.5)}[case]
    y, s, _, _ = runner.run([x, torch.randn(4, 2), torch.tensor([1])])
    assert ways == ([True] if case == "scalar" else [])  # a 0-d tensor has data: batched
    assert y.dtype == dtype and torch.equal(y, x if case == "bfloat16" else -x) and s.tolist() == list(x.shape)


def test_a_failed_batched_run_is_a_run_error_naming_the_integer_inputs():
    runner = _runner(TensorProto.FLOAT)
    with pytest.raises(RunError, match=r"out of range.*'i \(int64 \[1\]\)'"):
        runner.run([torch.randn(2), torch.randn(4, 2), torch.tensor([7])])
