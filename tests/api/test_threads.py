"""One CheckpointState used from several threads: onnxruntime releases the GIL while it runs,
so without a lock two steps bound the same ping-pong buffers (lost updates, another thread's
loss) and a write between them was lost. Steps and the state's reads and writes take turns:
every result equals some serial order of the calls."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer

WIDTH, CLASSES, ROWS = 384, 10, 128  # a run of a few ms: long enough for threads to overlap
TRIALS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * 0.04).astype(np.float32), "w1"),
             numpy_helper.from_array(np.zeros(WIDTH, np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((WIDTH, CLASSES)) * 0.04).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["ha"]),
             helper.make_node("Relu", ["ha"], ["hr"]), helper.make_node("MatMul", ["hr", "w2"], ["logits"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])], inits)
    out = tmp_path_factory.mktemp("threads")
    artifacts.generate_artifacts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=out)
    return out


def _batch(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((ROWS, WIDTH)).astype(np.float32), rng.integers(0, CLASSES, ROWS).astype(np.int32)


def _make(folder, **optimizer_options):
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    return state, module, Optimizer(folder / "optimizer_model.onnx", module, **optimizer_options)


def _together(*calls):
    barrier, errors = threading.Barrier(len(calls)), []

    def run(call):
        barrier.wait()
        try:
            call()
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def _grads(state):
    return {n: p.grad for n, p in state.parameters.items() if p.requires_grad}


def test_steps_from_two_threads_take_turns(folder):
    x, y = _batch(0)
    state, module, optimizer = _make(folder)
    for _ in range(3):
        module(x, y)
    accumulated = _grads(state)  # the same batch three times: any order gives these gradients
    optimizer.step()
    updated = {n: p.data for n, p in state.parameters.items()}
    for _ in range(TRIALS):
        state, module, optimizer = _make(folder)
        module(x, y)
        _together(lambda m=module: m(x, y), lambda m=module: m(x, y))
        for name, grad in _grads(state).items():
            np.testing.assert_array_equal(grad, accumulated[name])
        _together(optimizer.step, lambda s=state: s.parameters["b1"].data)
        assert optimizer.step_count == 1
        for name, param in state.parameters.items():
            np.testing.assert_array_equal(param.data, updated[name])


def test_eval_from_two_threads_returns_each_threads_loss(folder):
    batches = [_batch(1), _batch(2)]
    _, module, _ = _make(folder)
    module.eval()
    expected = [float(module(*b)) for b in batches]
    got = [[], []]

    def evaluate(i):
        return lambda: got[i].extend(float(module(*batches[i])) for _ in range(40))

    _together(evaluate(0), evaluate(1))
    assert got == [[expected[0]] * 40, [expected[1]] * 40]


class _SlowRuns:
    """The optimizer's session, with a pause after each run: the moment a step has updated the
    spare buffers and not yet swapped them in, held open long enough for another thread's write
    to land there when nothing keeps it out (then the swap would drop the write)."""

    def __init__(self, session, ran: threading.Event):
        self._session, self._ran = session, ran

    def run_with_iobinding(self, binding, *args):
        self._session.run_with_iobinding(binding, *args)
        self._ran.set()
        time.sleep(0.2)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_write_during_a_step_is_kept_or_comes_first(folder):
    x, y = _batch(3)
    new_b1 = np.full(WIDTH, 0.25, np.float32)
    outcomes = []  # b1 after: the step then the write, or the write then the step
    for write_first in (False, True):
        state, module, optimizer = _make(folder)
        if write_first:
            state.parameters["b1"] = new_b1
        module(x, y)
        optimizer.step()
        if not write_first:
            state.parameters["b1"] = new_b1
        outcomes.append(state.parameters["b1"].data)
    assert not np.array_equal(*outcomes)
    state, module, optimizer = _make(folder, fused_step=False)
    module(x, y)
    ran = threading.Event()
    optimizer._session = _SlowRuns(optimizer._session, ran)

    def write():
        assert ran.wait(10)
        state.parameters["b1"] = new_b1

    _together(optimizer.step, write)
    b1 = state.parameters["b1"].data
    assert any(np.array_equal(b1, o) for o in outcomes)
