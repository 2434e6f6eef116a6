"""Hand-built training artifacts that follow docs/artifacts.md exactly.

The model is ``pred = (x @ W + b) * scale`` with an MSE loss against ``target``; ``W`` and
``b`` are trainable, ``scale`` is frozen. The training model computes the gradients in
closed form with standard ops and applies the accumulation contract; the optimizer models
are SGD (``p - lr * g``) and AdamW (upstream's default "transformers" update, with weight
decay). The numpy references below are independent of the graphs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain import names
from onnxtrain.checkpoint import write_checkpoint

OPSET = 17
IN, OUT = 3, 2
ADAM = {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
TRAINING_META = {"trainable": ["W", "b"], "frozen": ["scale"], "user_inputs": ["x"], "loss_inputs": ["target"],
                 "loss_output": "loss", "additional_outputs": ["pred"]}


@dataclass
class Artifacts:
    dir: Path
    training: Path
    eval: Path
    optimizer: Path
    checkpoint: Path
    params: dict  # initial values


def initial_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"W": rng.standard_normal((IN, OUT)).astype(np.float32),
            "b": rng.standard_normal(OUT).astype(np.float32),
            "scale": np.array([1.5, -0.5], np.float32)}


def batch(n: int = 4, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, IN)).astype(np.float32), rng.standard_normal((n, OUT)).astype(np.float32)


# ----------------------------------------------------------------------------- numpy references

def ref_forward(p, x, t):
    pred = (x @ p["W"] + p["b"]) * p["scale"]
    return float(np.mean((pred - t) ** 2)), pred


def ref_grads(p, x, t):
    _, pred = ref_forward(p, x, t)
    dz = 2 * (pred - t) / pred.size * p["scale"]
    return {"W": x.T @ dz, "b": dz.sum(0)}


def ref_sgd(p, g, lr):
    return {k: p[k] - lr * g[k] for k in g}


def ref_adamw(p, g, m, v, lr, t):
    b1, b2 = ADAM["betas"]
    eps, wd = ADAM["eps"], ADAM["weight_decay"]
    new_p, new_m, new_v = {}, {}, {}
    for k in g:
        new_m[k] = b1 * m[k] + (1 - b1) * g[k]
        new_v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
        step_size = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        q = p[k] - step_size * new_m[k] / (np.sqrt(new_v[k]) + eps)
        new_p[k] = q - lr * wd * q
    return new_p, new_m, new_v


# ----------------------------------------------------------------------------- graph builders

def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _const(name, value, dtype=np.float32):
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(value, dtype)))


def _forward_nodes():
    return [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["z"]),
        helper.make_node("Mul", ["z", "scale"], ["pred"]),
        helper.make_node("Sub", ["pred", "target"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]


def _model_inputs():
    return [_f("x", ["batch", IN]), _f("target", ["batch", OUT]), _f("W", [IN, OUT]), _f("b", [OUT]),
            _f("scale", [OUT])]


def _model(nodes, inputs, outputs, name, meta):
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=json.dumps(value))
    onnx.checker.check_model(model, full_check=True)
    return model


def training_model():
    grad_nodes = [
        helper.make_node("Size", ["pred"], ["n_int"]),
        helper.make_node("Cast", ["n_int"], ["n"], to=TensorProto.FLOAT),
        _const("two", 2.0),
        helper.make_node("Mul", ["diff", "two"], ["diff2"]),
        helper.make_node("Div", ["diff2", "n"], ["dpred"]),
        helper.make_node("Mul", ["dpred", "scale"], ["dz"]),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "dz"], ["gW"]),
        _const("axis0", [0], np.int64),
        helper.make_node("ReduceSum", ["dz", "axis0"], ["gb"], keepdims=0),
    ]
    for p, g in (("W", "gW"), ("b", "gb")):
        buf, out = names.accumulation_buffer_name(p), names.accumulation_out_name(p)
        grad_nodes += [helper.make_node("Add", [buf, g], [f"{p}_acc"]),
                       helper.make_node("Where", [names.LAZY_RESET_GRAD, g, f"{p}_acc"], [out])]
    inputs = _model_inputs() + [
        _f(names.accumulation_buffer_name("W"), [IN, OUT]), _f(names.accumulation_buffer_name("b"), [OUT]),
        helper.make_tensor_value_info(names.LAZY_RESET_GRAD, TensorProto.BOOL, [])]
    outputs = [_f("loss", []), _f("pred", ["batch", OUT]),
               _f(names.accumulation_out_name("W"), [IN, OUT]), _f(names.accumulation_out_name("b"), [OUT])]
    return _model(_forward_nodes() + grad_nodes, inputs, outputs, "training",
                  {"onnxtrain.training": TRAINING_META})


def eval_model():
    return _model(_forward_nodes(), _model_inputs(), [_f("loss", []), _f("pred", ["batch", OUT])], "eval",
                  {"onnxtrain.training": TRAINING_META})


def sgd_model():
    nodes, inputs, outputs = [], [_f("learning_rate", []), helper.make_tensor_value_info("step", TensorProto.INT64, [])], []
    for p, shape in (("W", [IN, OUT]), ("b", [OUT])):
        g = names.grad_name(p)
        inputs += [_f(p, shape), _f(g, shape)]
        nodes += [helper.make_node("Mul", ["learning_rate", g], [f"{p}_delta"]),
                  helper.make_node("Sub", [p, f"{p}_delta"], [names.updated_name(p)])]
        outputs.append(_f(names.updated_name(p), shape))
    meta = {"onnxtrain.optimizer": {"type": "SGD", "params": ["W", "b"], "states": [], "hyperparameters": {}}}
    return _model(nodes, inputs, outputs, "sgd", meta)


def adamw_model():
    b1, b2 = ADAM["betas"]
    nodes = [
        helper.make_node("Cast", ["step"], ["t"], to=TensorProto.FLOAT),
        _const("one", 1.0), _const("b1", b1), _const("b2", b2), _const("c1", 1 - b1), _const("c2", 1 - b2),
        _const("eps", ADAM["eps"]), _const("wd", ADAM["weight_decay"]),
        helper.make_node("Pow", ["b1", "t"], ["b1t"]), helper.make_node("Pow", ["b2", "t"], ["b2t"]),
        helper.make_node("Sub", ["one", "b1t"], ["bc1"]), helper.make_node("Sub", ["one", "b2t"], ["bc2"]),
        helper.make_node("Sqrt", ["bc2"], ["sbc2"]),
        helper.make_node("Mul", ["learning_rate", "sbc2"], ["lr_sbc2"]),
        helper.make_node("Div", ["lr_sbc2", "bc1"], ["step_size"]),
        helper.make_node("Mul", ["learning_rate", "wd"], ["lr_wd"]),
    ]
    inputs = [_f("learning_rate", []), helper.make_tensor_value_info("step", TensorProto.INT64, [])]
    outputs = []
    for p, shape in (("W", [IN, OUT]), ("b", [OUT])):
        g, m, v = names.grad_name(p), names.state_name(p, "momentum0"), names.state_name(p, "momentum1")
        inputs += [_f(p, shape), _f(g, shape), _f(m, shape), _f(v, shape)]
        u = lambda s: f"{p}_{s}"  # noqa: E731
        nodes += [
            helper.make_node("Mul", ["b1", m], [u("bm")]), helper.make_node("Mul", ["c1", g], [u("cg")]),
            helper.make_node("Add", [u("bm"), u("cg")], [names.updated_name(m)]),
            helper.make_node("Mul", [g, g], [u("gg")]),
            helper.make_node("Mul", ["b2", v], [u("bv")]), helper.make_node("Mul", ["c2", u("gg")], [u("cgg")]),
            helper.make_node("Add", [u("bv"), u("cgg")], [names.updated_name(v)]),
            helper.make_node("Sqrt", [names.updated_name(v)], [u("sv")]),
            helper.make_node("Add", [u("sv"), "eps"], [u("den")]),
            helper.make_node("Div", [names.updated_name(m), u("den")], [u("ratio")]),
            helper.make_node("Mul", ["step_size", u("ratio")], [u("upd")]),
            helper.make_node("Sub", [p, u("upd")], [u("q")]),
            helper.make_node("Mul", ["lr_wd", u("q")], [u("decay")]),
            helper.make_node("Sub", [u("q"), u("decay")], [names.updated_name(p)]),
        ]
        outputs += [_f(names.updated_name(p), shape), _f(names.updated_name(m), shape),
                    _f(names.updated_name(v), shape)]
    meta = {"onnxtrain.optimizer": {"type": "AdamW", "params": ["W", "b"], "states": ["momentum0", "momentum1"],
                                    "hyperparameters": {"betas": list(ADAM["betas"]), "eps": ADAM["eps"],
                                                        "weight_decay": ADAM["weight_decay"]}}}
    return _model(nodes, inputs, outputs, "adamw", meta)


def make_artifacts(directory: Path, optimizer: str = "sgd", nominal: bool = False, seed: int = 0) -> Artifacts:
    """Write the four artifact files into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {k: directory / f for k, f in (("training", "training_model.onnx"), ("eval", "eval_model.onnx"),
                                            ("optimizer", "optimizer_model.onnx"), ("checkpoint", "checkpoint"))}
    onnx.save(training_model(), paths["training"])
    onnx.save(eval_model(), paths["eval"])
    onnx.save(sgd_model() if optimizer == "sgd" else adamw_model(), paths["optimizer"])
    params = initial_params(seed)
    write_checkpoint(paths["checkpoint"], params, requires_grad={"W", "b"}, nominal=nominal)
    return Artifacts(directory, params=params, **paths)


@pytest.fixture
def artifacts(tmp_path) -> Artifacts:
    return make_artifacts(tmp_path / "sgd", "sgd")


@pytest.fixture
def adamw_artifacts(tmp_path) -> Artifacts:
    return make_artifacts(tmp_path / "adamw", "adamw")
