"""LSTM, GRU and RNN gradients against a float64 PyTorch transcription of the ONNX semantics.

The gradient table (rows/recurrent.py) checks the rules against finite differences through
onnxruntime's forward kernels, in float32. Here the vector-Jacobian product of the rule (run by
onnxruntime, the forward node itself pruned away, so also for what onnxruntime's CPU kernels do
not run: ``layout`` 1) is compared with PyTorch autograd through a step-by-step transcription
of the ops (as onnxruntime computes them: ``clip`` bounds the gate pre-activations,
``input_forget`` makes ``f = 1 - i``, outputs past a sequence's length are zero and its state
held, an empty sequence has zero final states). It also covers omitted outputs and the errors
for what the rules do not support.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.errors import UnsupportedOpError
from onnxtrain.ir import io

torch = pytest.importorskip("torch")

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
INPUT_NAMES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
OUTPUT_NAMES = ["Y", "Y_h", "Y_c"]
# onnxruntime's activations: (takes alpha, takes beta, default alpha, default beta), and the function
ACTIVATION_PARAMETERS = {"affine": (True, True, 0.0, 0.0), "leakyrelu": (True, False, 0.01, 0.0),
                         "thresholdedrelu": (True, False, 0.0, 0.0), "scaledtanh": (True, True, 0.0, 0.0),
                         "hardsigmoid": (True, True, 0.2, 0.5), "elu": (True, False, 1.0, 0.0)}


def _activation(name, a, b):
    return {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu,
            "affine": lambda x: a * x + b, "leakyrelu": lambda x: torch.where(x >= 0, x, a * x),
            "thresholdedrelu": lambda x: torch.where(x >= a, x, torch.zeros_like(x)),
            "scaledtanh": lambda x: a * torch.tanh(b * x), "hardsigmoid": lambda x: (a * x + b).clamp(0, 1),
            "elu": lambda x: torch.where(x >= 0, x, a * torch.expm1(x)), "softsign": lambda x: x / (1 + x.abs()),
            "softplus": lambda x: torch.log1p(torch.exp(x))}[name]


def activations(attrs, names):
    """The functions ``names`` with their alpha and beta taken in turn from the attributes."""
    alphas, betas = iter(attrs.get("activation_alpha", [])), iter(attrs.get("activation_beta", []))
    functions = []
    for name in names:
        takes_alpha, takes_beta, alpha, beta = ACTIVATION_PARAMETERS.get(name, (False, False, 0.0, 0.0))
        functions.append(_activation(name, next(alphas, alpha) if takes_alpha else 0.0,
                                     next(betas, beta) if takes_beta else 0.0))
    return functions
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}


# -- the reference --------------------------------------------------------------------------
def _step(op_type, attrs, acts, x, h, c, w, r, wb, rb, p):
    """One time step of one sequence: (h, c) after it."""
    clip = attrs.get("clip")

    def gate(function, a):
        return function(a.clamp(-clip, clip) if clip is not None else a)

    if op_type == "RNN":
        return gate(acts[0], x @ w.T + h @ r.T + wb + rb), None
    if op_type == "GRU":
        (wz, wr, wh), (rz, rr, rh) = w.chunk(3), r.chunk(3)
        (wbz, wbr, wbh), (rbz, rbr, rbh) = wb.chunk(3), rb.chunk(3)
        z = gate(acts[0], x @ wz.T + h @ rz.T + wbz + rbz)
        reset = gate(acts[0], x @ wr.T + h @ rr.T + wbr + rbr)
        if attrs.get("linear_before_reset", 0):
            candidate = gate(acts[1], x @ wh.T + reset * (h @ rh.T + rbh) + wbh)
        else:
            candidate = gate(acts[1], x @ wh.T + (reset * h) @ rh.T + rbh + wbh)
        return (1 - z) * candidate + z * h, None
    a_i, a_o, a_f, a_c = (x @ w.T + h @ r.T + wb + rb).chunk(4)
    p_i, p_o, p_f = p.chunk(3)
    i = gate(acts[0], a_i + p_i * c)
    f = 1 - i if attrs.get("input_forget", 0) else gate(acts[0], a_f + p_f * c)
    c_new = f * c + i * gate(acts[1], a_c)
    o = gate(acts[0], a_o + p_o * c_new)
    return o * acts[2](c_new), c_new


def reference(op_type, attrs, values, outputs):
    """The node's outputs (torch float64) for input tensors ``values`` (None where omitted)."""
    x, w, r, bias, lengths, h0, c0, peephole = (list(values) + [None] * 8)[:8]
    layout = attrs.get("layout", 0)
    if layout:
        x = x.transpose(0, 1)
        h0, c0 = (v.transpose(0, 1) if v is not None else None for v in (h0, c0))
    steps, batch, hidden = x.shape[0], x.shape[1], r.shape[-1]
    direction = attrs.get("direction", "forward")
    reverse = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]
    names = activations(attrs, [a.lower() for a in attrs.get("activations",
                                                              DEFAULT_ACTIVATIONS[op_type] * len(reverse))])
    per = len(DEFAULT_ACTIVATIONS[op_type])
    zeros = torch.zeros(hidden, dtype=x.dtype)
    ys, y_hs, y_cs = [], [], []
    for d, backwards in enumerate(reverse):
        acts = names[d * per:(d + 1) * per]
        wb, rb = bias[d].chunk(2) if bias is not None else (torch.zeros(w.shape[1], dtype=x.dtype),) * 2
        p = peephole[d] if peephole is not None else torch.zeros(3 * hidden, dtype=x.dtype)
        columns, finals_h, finals_c = [], [], []
        for n in range(batch):
            length = int(lengths[n]) if lengths is not None else steps
            h = h0[d, n] if h0 is not None else zeros
            c = c0[d, n] if c0 is not None else zeros
            out = [zeros] * steps
            for t in (reversed(range(length)) if backwards else range(length)):
                h, c = _step(op_type, attrs, acts, x[t, n], h, c, w[d], r[d], wb, rb, p)
                out[t] = h
            columns.append(torch.stack(out))
            finals_h.append(h if length else zeros)
            finals_c.append(c if length and c is not None else zeros)
        ys.append(torch.stack(columns, 1))
        y_hs.append(torch.stack(finals_h))
        y_cs.append(torch.stack(finals_c))
    y, y_h, y_c = torch.stack(ys, 1), torch.stack(y_hs), torch.stack(y_cs)
    if layout:
        y, y_h, y_c = y.permute(2, 0, 1, 3), y_h.transpose(0, 1), y_c.transpose(0, 1)
    return [v for v, name in zip((y, y_h, y_c), OUTPUT_NAMES) if name in outputs]


# -- the rule, run by onnxruntime --------------------------------------------------------------
def rule_vjp(op_type, attrs, arrays, outputs, cotangents):
    """The rule's gradients w.r.t. every float input, for output cotangents ``cotangents``."""
    names = [INPUT_NAMES[i] if a is not None else "" for i, a in enumerate(arrays)]
    while names and not names[-1]:
        names.pop()
    node_outputs = [name if name in outputs else "" for name in OUTPUT_NAMES[:3 if op_type == "LSTM" else 2]]
    while not node_outputs[-1]:
        node_outputs.pop()
    dtypes = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.int32): onnx.TensorProto.INT32}
    graph_inputs = [helper.make_tensor_value_info(n, dtypes[a.dtype], a.shape) for n, a in zip(names, arrays) if n]
    graph = helper.make_graph([helper.make_node(op_type, names, node_outputs, **attrs)], "g", graph_inputs,
                              [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8))
    graph = model.graph
    values = {v.name: v for v in graph.inputs}
    seeds = []
    for name in outputs:
        seed = ir.Value(name=f"d{name}", type=ir.TensorType(ir.DataType.FLOAT))
        graph.inputs.append(seed)
        seeds.append(seed)
    wrt = [values[n] for n, a in zip(names, arrays) if n and a.dtype == np.float32]
    grads = build_gradients(graph, list(graph.outputs), wrt, loss_grad=seeds)
    graph.outputs.clear()
    for value in wrt:
        identity = ir.node("Identity", [grads[value]], name=f"grad_{value.name}")
        identity.outputs[0].name = f"grad_{value.name}"
        identity.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        graph.append(identity)
        graph.outputs.append(identity.outputs[0])
    RemoveUnusedNodesPass()(model)  # the forward node (layout 1 does not run on onnxruntime's CPU)
    assert not any(n.op_type == op_type for n in graph), "the gradient should not need the forward node"
    session = ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"])
    feeds = {n: a for n, a in zip(names, arrays) if n} | {f"d{o}": c for o, c in zip(outputs, cotangents)}
    return dict(zip([v.name for v in wrt], session.run(None, feeds)))


def _inputs(op_type, rng, *, steps=4, batch=3, size=2, hidden=3, directions=1, layout=0, bias=True,
            lengths=None, initial=True, peepholes=False):
    gates = GATES[op_type]

    def uniform(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float32)

    x = uniform(batch, steps, size) if layout else uniform(steps, batch, size)
    state = (batch, directions, hidden) if layout else (directions, batch, hidden)
    arrays = [x, uniform(directions, gates * hidden, size), uniform(directions, gates * hidden, hidden),
              uniform(directions, 2 * gates * hidden) if bias else None,
              np.array(lengths, np.int32) if lengths is not None else None,
              uniform(*state) if initial else None]
    if op_type == "LSTM":
        arrays += [uniform(*state) if initial else None, uniform(directions, 3 * hidden) if peepholes else None]
    while arrays[-1] is None:
        arrays.pop()
    return arrays


def check_against_reference(op_type, attrs, arrays, outputs, seed=0):
    rng = np.random.default_rng(seed)
    tensors = [torch.tensor(a.astype(np.float64) if a.dtype == np.float32 else a, requires_grad=a.dtype == np.float32)
               if a is not None else None for a in arrays]
    expected_outputs = reference(op_type, attrs, tensors, outputs)
    cotangents = [rng.standard_normal(tuple(v.shape)).astype(np.float32) for v in expected_outputs]
    loss = sum((v * torch.tensor(c, dtype=torch.float64)).sum() for v, c in zip(expected_outputs, cotangents))
    differentiable = [(INPUT_NAMES[i], t) for i, t in enumerate(tensors) if t is not None and t.requires_grad]
    expected = torch.autograd.grad(loss, [t for _, t in differentiable], allow_unused=True)
    actual = rule_vjp(op_type, attrs, arrays, outputs, cotangents)
    for (name, tensor), want in zip(differentiable, expected):
        want = np.zeros(tuple(tensor.shape)) if want is None else want.numpy()
        np.testing.assert_allclose(actual[name], want, rtol=2e-4, atol=2e-5, err_msg=f"{op_type}: gradient of {name}")


CASES = {
    # id: (op, attrs, input options, outputs receiving a gradient)
    "lstm-forward": ("LSTM", {}, {}, ["Y", "Y_h", "Y_c"]),
    "lstm-bidirectional-layout1": ("LSTM", {"direction": "bidirectional", "layout": 1}, {"directions": 2, "layout": 1},
                                   ["Y", "Y_h", "Y_c"]),
    "lstm-reverse-layout1-peepholes-lengths": ("LSTM", {"direction": "reverse", "layout": 1},
                                               {"layout": 1, "peepholes": True, "lengths": [4, 2, 3]},
                                               ["Y", "Y_h", "Y_c"]),
    "lstm-clip-peepholes": ("LSTM", {"clip": 0.6}, {"peepholes": True}, ["Y", "Y_c"]),
    "lstm-input-forget-clip": ("LSTM", {"input_forget": 1, "clip": 0.8}, {"peepholes": True}, ["Y", "Y_h"]),
    "lstm-lengths-with-empty": ("LSTM", {"direction": "bidirectional"}, {"directions": 2, "lengths": [0, 4, 2]},
                                ["Y", "Y_h", "Y_c"]),
    "lstm-final-cell-only": ("LSTM", {}, {"bias": False}, ["Y_c"]),
    "lstm-final-hidden-only-no-initial": ("LSTM", {"direction": "reverse"}, {"initial": False}, ["Y_h"]),
    "lstm-activations": ("LSTM", {"activations": ["Tanh", "Relu", "Sigmoid"]}, {}, ["Y", "Y_c"]),
    "gru-forward": ("GRU", {}, {}, ["Y", "Y_h"]),
    "gru-linear-before-reset-layout1": ("GRU", {"linear_before_reset": 1, "layout": 1, "direction": "bidirectional"},
                                        {"layout": 1, "directions": 2}, ["Y", "Y_h"]),
    "gru-linear-before-reset-no-bias": ("GRU", {"linear_before_reset": 1}, {"bias": False}, ["Y_h"]),
    "gru-clip-lengths": ("GRU", {"clip": 0.5, "direction": "reverse"}, {"lengths": [3, 1, 4]}, ["Y", "Y_h"]),
    "gru-clip-lengths-before-reset": ("GRU", {"clip": 0.5, "linear_before_reset": 1, "direction": "bidirectional",
                                              "activations": ["Relu", "Tanh", "Sigmoid", "Relu"]},
                                      {"directions": 2, "lengths": [2, 4, 0]}, ["Y", "Y_h"]),
    "rnn-forward": ("RNN", {}, {}, ["Y", "Y_h"]),
    "rnn-bidirectional-layout1-lengths": ("RNN", {"direction": "bidirectional", "layout": 1},
                                          {"directions": 2, "layout": 1, "lengths": [1, 4, 3]}, ["Y", "Y_h"]),
    "rnn-relu-clip": ("RNN", {"activations": ["Relu"], "clip": 0.5}, {}, ["Y"]),
    # the rest of onnxruntime's activations, parameters from the lists or its defaults (older
    # Keras GRUs and LSTMs exported with HardSigmoid gates)
    "gru-hard-sigmoid": ("GRU", {"activations": ["HardSigmoid", "Tanh"]}, {}, ["Y", "Y_h"]),
    "lstm-hard-sigmoid-parameters": ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Tanh"] * 2,
                                              "activation_alpha": [0.25, 0.3], "activation_beta": [0.4, 0.6],
                                              "direction": "bidirectional"}, {"directions": 2}, ["Y", "Y_c"]),
    "lstm-softsign-elu-leaky": ("LSTM", {"activations": ["Sigmoid", "Softsign", "Elu"]}, {}, ["Y", "Y_h"]),
    "lstm-leaky-affine": ("LSTM", {"activations": ["Sigmoid", "LeakyRelu", "Affine"],
                                   "activation_alpha": [0.2, 0.7], "activation_beta": [0.1]}, {}, ["Y"]),
    "gru-scaled-tanh-softplus": ("GRU", {"activations": ["Sigmoid", "ScaledTanh", "Softplus", "ScaledTanh"],
                                         "activation_alpha": [1.5, 0.8], "activation_beta": [0.7, 1.2],
                                         "direction": "bidirectional"}, {"directions": 2}, ["Y", "Y_h"]),
    "rnn-thresholded-relu": ("RNN", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.1]}, {}, ["Y"]),
    "rnn-elu-clip": ("RNN", {"activations": ["Elu"], "activation_alpha": [0.6], "clip": 0.9}, {}, ["Y", "Y_h"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vjp_matches_reference(case):
    op_type, attrs, options, outputs = CASES[case]
    rng = np.random.default_rng(len(case))
    arrays = _inputs(op_type, rng, **options)
    check_against_reference(op_type, {"hidden_size": 3, **attrs}, arrays, outputs)


@pytest.mark.parametrize("attrs, message", [
    ({"activations": ["Sigmoid", "Tanh", "Swish"]}, "Swish"),
    ({"activations": ["Sigmoid", "LeakyRelu", "Tanh"], "activation_alpha": [-0.5]}, "leakyrelu with alpha -0.5"),
    ({"activations": ["Sigmoid", "Tanh"]}, "2 activations for 1 direction"),
    ({"direction": "sideways"}, "direction 'sideways'"),
])
def test_unsupported_variants_raise(attrs, message):
    arrays = _inputs("LSTM", np.random.default_rng(0))
    with pytest.raises(UnsupportedOpError, match=message) as info:
        rule_vjp("LSTM", {"hidden_size": 3, **attrs}, arrays, ["Y"], [np.zeros((4, 1, 3, 3), np.float32)])
    assert info.value.reason is not None and "LSTM" in str(info.value)
