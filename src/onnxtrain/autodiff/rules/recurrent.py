"""Gradient rules: recurrent layers (LSTM, GRU, RNN).

The forward node does not expose what backpropagation through time needs (cell states,
gate activations), so each rule re-runs the recurrence. Per direction:

1. the input projection ``X @ W^T + bias`` of every time step, as one MatMul;
2. a ``Scan`` over the time steps re-computes the recurrence and emits, per step, what the
   backward needs (the previous hidden and cell state, the gate activations, masks);
3. a second ``Scan``, run backwards over the steps, carries the gradients of the hidden (and
   cell) state and emits the gradient of each step's gate pre-activations;
4. dX, dW, dR and the biases' gradients are batched MatMuls (``Gemm`` with ``transA``) and
   ReduceSums over those per-step gradients; the gradients of the initial states are the
   backward Scan's final carried state.

Everything is worked out in *processing order*: a reverse direction is turned into a forward
one by reversing its inputs in time first (``ReverseSequence`` when ``sequence_lens`` is given:
each sequence reverses within its own length), so both Scans only ever run one way. The
Scan bodies are self-contained: the weights they need are carried as loop state (unchanged)
rather than captured from the outer graph, so passes that cut or rewrite the outer graph see
every value the Scan reads among its inputs.

Semantics follow onnxruntime's CPU kernels, which define the forward the gradient is checked
against: ``clip`` bounds every gate pre-activation (peephole terms included), not the cell
state fed to LSTM's ``h``; ``input_forget`` makes LSTM's forget gate ``1 - i``; past a sequence's
length the outputs are zero and the state is held, and a sequence of length 0 gives zero
final states. Activations (any letter case) are onnxruntime's: Sigmoid, Tanh, Relu, Affine,
LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign, Softplus, each taking its
``alpha`` and ``beta`` in turn from ``activation_alpha`` / ``activation_beta`` (onnxruntime's
defaults where the lists run out: LeakyRelu 0.01, HardSigmoid 0.2 and 0.5, Elu 1, the others
0). Each slope is written with the activation's output; where the output cannot tell the
input's side (LeakyRelu or Elu with ``alpha <= 0``, ThresholdedRelu with ``alpha < 0``,
ScaledTanh with ``alpha = 0``) the rule raises :class:`~onnxtrain.errors.UnsupportedOpError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.errors import UnsupportedOpError
from onnxtrain.ir.builder import GraphBuilder

# input positions shared by LSTM, GRU and RNN (initial_c and P are LSTM's alone)
_X, _W, _R, _B, _SEQUENCE_LENS, _INITIAL_H, _INITIAL_C, _P = range(8)
# output positions
_Y, _Y_H, _Y_C = range(3)

_INT64_MIN = np.iinfo(np.int64).min

# onnxruntime's RNN activations by lower-cased name: (the ONNX op computing it, or None where it
# is written with Mul and Add; takes alpha, takes beta, default alpha, default beta). Each one
# that takes alpha (beta) consumes the next activation_alpha (_beta), and passes it to its op.
_ACTIVATION_PARAMETERS = {
    "sigmoid": ("Sigmoid", False, False, 0.0, 0.0), "tanh": ("Tanh", False, False, 0.0, 0.0),
    "relu": ("Relu", False, False, 0.0, 0.0), "affine": (None, True, True, 0.0, 0.0),
    "leakyrelu": ("LeakyRelu", True, False, 0.01, 0.0), "thresholdedrelu": ("ThresholdedRelu", True, False, 0.0, 0.0),
    "scaledtanh": (None, True, True, 0.0, 0.0), "hardsigmoid": ("HardSigmoid", True, True, 0.2, 0.5),
    "elu": ("Elu", True, False, 1.0, 0.0), "softsign": ("Softsign", False, False, 0.0, 0.0),
    "softplus": ("Softplus", False, False, 0.0, 0.0),
}


@dataclass(frozen=True)
class _Activation:
    """One of a layer's activation functions, with its parameters."""

    name: str  # lower case
    alpha: float = 0.0
    beta: float = 0.0

    def problem(self) -> str | None:
        """Why the slope cannot be written with the output, or None."""
        if self.name in ("leakyrelu", "elu") and not self.alpha > 0:
            return f"{self.name} with alpha {self.alpha} (the output does not tell the input's sign)"
        if self.name == "thresholdedrelu" and not self.alpha >= 0:
            return f"thresholdedrelu with alpha {self.alpha} (the output does not tell the input's side)"
        if self.name == "scaledtanh" and self.alpha == 0:
            return "scaledtanh with alpha 0"
        return None


def _activations(ctx: GradContext, names: list[str]) -> list[_Activation]:
    """The activations ``names`` with the parameters onnxruntime gives them."""
    alphas = iter(float(a) for a in (ctx.attr("activation_alpha") or []))
    betas = iter(float(v) for v in (ctx.attr("activation_beta") or []))
    result = []
    for name in names:
        _, takes_alpha, takes_beta, alpha, beta = _ACTIVATION_PARAMETERS[name]
        result.append(_Activation(name, next(alphas, alpha) if takes_alpha else 0.0,
                                  next(betas, beta) if takes_beta else 0.0))
    return result


_DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _unsupported(ctx: GradContext, reason: str) -> UnsupportedOpError:
    return UnsupportedOpError({ctx.node.op_type: [ctx.node.name or "<unnamed>"]}, reason=reason)


# -- what the node's attributes say ---------------------------------------------------
@dataclass(frozen=True)
class _Layer:
    """The attributes of one LSTM/GRU/RNN node, checked and normalized."""

    op_type: str
    reverse: tuple[bool, ...]  # per direction (the num_directions axis): processed last step first
    layout: int
    clip: float | None
    activations: tuple[tuple[_Activation, ...], ...]  # per direction
    linear_before_reset: bool
    input_forget: bool

    @property
    def gates(self) -> int:
        return _GATES[self.op_type]


def _layer(ctx: GradContext) -> _Layer:
    """Read and check the node's attributes; raise UnsupportedOpError for what the rule cannot do."""
    op_type = ctx.node.op_type
    direction = ctx.attr("direction", "forward")
    if isinstance(direction, bytes):
        direction = direction.decode()
    reverse = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}.get(direction)
    if reverse is None:
        raise _unsupported(ctx, f"direction {direction!r}; expected 'forward', 'reverse' or 'bidirectional'")
    layout = int(ctx.attr("layout", 0))
    if layout not in (0, 1):
        raise _unsupported(ctx, f"layout {layout}; expected 0 or 1")

    per_direction = len(_DEFAULT_ACTIVATIONS[op_type])
    names = ctx.attr("activations")
    if not names:
        names = list(_DEFAULT_ACTIVATIONS[op_type]) * len(reverse)
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    if len(names) != per_direction * len(reverse):
        raise _unsupported(ctx, f"{len(names)} activations for {len(reverse)} direction(s); expected "
                                f"{per_direction} per direction")
    unknown = sorted({n for n in names if n.lower() not in _ACTIVATION_PARAMETERS})
    if unknown:
        raise _unsupported(ctx, f"activation(s) {', '.join(unknown)}; expected one of onnxruntime's: Sigmoid, Tanh, "
                                f"Relu, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign, "
                                f"Softplus")
    functions = _activations(ctx, [n.lower() for n in names])
    problems = [p for p in (f.problem() for f in functions) if p is not None]
    if problems:
        raise _unsupported(ctx, "; ".join(problems))
    activations = tuple(tuple(functions[d * per_direction:(d + 1) * per_direction]) for d in range(len(reverse)))

    clip = ctx.attr("clip")
    if clip is not None:
        clip = float(clip)
        if not clip > 0:
            raise _unsupported(ctx, f"clip {clip}; expected a positive threshold")
    return _Layer(op_type=op_type, reverse=reverse, layout=layout, clip=clip, activations=activations,
                  linear_before_reset=bool(ctx.attr("linear_before_reset", 0)),
                  input_forget=bool(ctx.attr("input_forget", 0)))


# -- small graph helpers ----------------------------------------------------------------
def _split(b: GraphBuilder, x: ir.Value, parts: int, axis: int = -1) -> tuple[ir.Value, ...]:
    """``x`` split into ``parts`` equal pieces along ``axis``."""
    if parts == 1:
        return (x,)
    if b.opset >= 18:  # opset 18 wants the number of outputs stated
        return b.op.Split(x, axis=axis, num_outputs=parts, _outputs=parts)
    return b.op.Split(x, axis=axis, _outputs=parts)


def _activate(b: GraphBuilder, f: _Activation, x: ir.Value) -> ir.Value:
    op = b.op
    if f.name == "affine":
        return op.Add(op.Mul(x, b.like(x, f.alpha)), b.like(x, f.beta))
    if f.name == "scaledtanh":
        return op.Mul(op.Tanh(op.Mul(x, b.like(x, f.beta))), b.like(x, f.alpha))
    op_type, takes_alpha, takes_beta, _, _ = _ACTIVATION_PARAMETERS[f.name]
    parameters = {**({"alpha": f.alpha} if takes_alpha else {}), **({"beta": f.beta} if takes_beta else {})}
    return getattr(op, op_type)(x, **parameters)


def _slope(b: GraphBuilder, f: _Activation, y: ir.Value) -> ir.Value:
    """The activation's derivative at its input, written with its output ``y``."""
    op = b.op
    one, zero = b.like(y, 1.0), b.like(y, 0.0)

    def where_positive(then, otherwise):  # a {0, 1} mask: a Mul, not a Where (see docs/ortmodule.md)
        mask = b.cast_to(op.Greater(y, zero), y.dtype)
        return op.Add(op.Mul(mask, op.Sub(then, otherwise)), otherwise)

    if f.name == "sigmoid":
        return op.Mul(y, op.Sub(one, y))
    if f.name == "tanh":
        return op.Sub(one, op.Mul(y, y))
    if f.name in ("relu", "thresholdedrelu"):  # y > 0 exactly where the input passed (alpha >= 0)
        return b.cast_to(op.Greater(y, zero), y.dtype)
    if f.name == "affine":
        return b.like(y, f.alpha)  # broadcast by the product it enters
    if f.name == "leakyrelu":
        return where_positive(one, b.like(y, f.alpha))
    if f.name == "elu":  # below 0: alpha e^x = y + alpha
        return where_positive(one, op.Add(y, b.like(y, f.alpha)))
    if f.name == "scaledtanh":  # alpha beta (1 - tanh^2) = beta (alpha - y^2 / alpha)
        return op.Mul(b.like(y, f.beta), op.Sub(b.like(y, f.alpha), op.Div(op.Mul(y, y), b.like(y, f.alpha))))
    if f.name == "hardsigmoid":  # alpha strictly between the clips
        inside = op.And(op.Greater(y, zero), op.Less(y, one))
        return op.Mul(b.cast_to(inside, y.dtype), b.like(y, f.alpha))
    if f.name == "softsign":  # 1 / (1 + |x|)^2 = (1 - |y|)^2
        rest = op.Sub(one, op.Abs(y))
        return op.Mul(rest, rest)
    # softplus: sigmoid(x) = 1 - e^-y
    return op.Sub(one, op.Exp(op.Neg(y)))


def _clipped(b: GraphBuilder, a: ir.Value, clip: float | None) -> tuple[ir.Value, ir.Value | None]:
    """``a`` clipped to [-clip, clip] and the mask (1 inside, 0 where clipped) that its gradient passes."""
    if clip is None:
        return a, None
    inside = b.op.LessOrEqual(b.op.Abs(a), b.like(a, clip))
    return b.op.Clip(a, b.like(a, -clip), b.like(a, clip)), b.cast_to(inside, a.dtype)


def _masked(b: GraphBuilder, x: ir.Value, mask: ir.Value | None) -> ir.Value:
    return x if mask is None else b.op.Mul(x, mask)


def _concat(b: GraphBuilder, values: Sequence[ir.Value], axis: int) -> ir.Value:
    return values[0] if len(values) == 1 else b.op.Concat(*values, axis=axis)


def _stack(b: GraphBuilder, values: Sequence[ir.Value]) -> ir.Value:
    """Per-direction values stacked on a new leading (num_directions) axis."""
    return _concat(b, [b.unsqueeze(v, [0]) for v in values], axis=0)


def _reverse_time(b: GraphBuilder, x: ir.Value, lengths: ir.Value | None) -> ir.Value:
    """``x`` ([seq, batch, ...]) reversed in time: each sequence within its length when given."""
    if lengths is not None:
        return b.op.ReverseSequence(x, lengths, batch_axis=1, time_axis=0)
    return b.op.Slice(x, b.ints([-1]), b.ints([_INT64_MIN]), b.ints([0]), b.ints([-1]))


def _sum_steps(b: GraphBuilder, x: ir.Value) -> ir.Value:
    """Sum of ``x`` ([seq, batch, k]) over steps and batch: [k]."""
    return b.reduce_sum(x, [0, 1], keepdims=False)


def _outer_sum(b: GraphBuilder, left: ir.Value, right: ir.Value) -> ir.Value:
    """``sum_{t, n} left[t, n]^T right[t, n]`` for [seq, batch, k] and [seq, batch, m]: [k, m]."""
    return b.op.Gemm(b.op.Flatten(left, axis=2), b.op.Flatten(right, axis=2), transA=1)


StepFn = Callable[[GraphBuilder, list, list, dict], tuple[list, dict]]

# the rank of a loop state (a [batch, hidden] hidden or cell state, or its gradient) and of a
# step's slice of a scanned [seq, batch, k] tensor
_STEP_RANK = 2


def _scan(b: GraphBuilder, label: str, states: Sequence[ir.Value], carried: Sequence[tuple[ir.Value, int]],
          scanned: dict[str, ir.Value], step: StepFn, *, backwards: bool = False
          ) -> tuple[list[ir.Value], dict[str, ir.Value]]:
    """Run ``step`` once per slice of the ``scanned`` tensors' leading axis (last first with
    ``backwards``), threading ``states``.

    ``step(sb, states, carried, slices)`` builds one step with the body builder ``sb`` and
    returns ``(next_states, outputs)``; ``carried`` are loop-invariant tensors the body reads,
    each with its rank (passed through as loop state, so the body reads nothing from the outer
    graph). Returns the final states and each output stacked over the steps, in the steps' order.
    Body inputs are declared with their ranks: onnxruntime needs every body output's rank.
    """
    scope = b.fresh_name(label)
    names = list(scanned)

    def body_input(kind: str, k: int, like: ir.Value, rank: int) -> ir.Value:
        return ir.Value(name=f"{scope}/{kind}{k}", type=ir.TensorType(like.dtype), shape=ir.Shape([None] * rank))

    state_in = [body_input("state", k, v, _STEP_RANK) for k, v in enumerate(states)]
    carried_in = [body_input("carried", k, v, rank) for k, (v, rank) in enumerate(carried)]
    slices_in = [body_input(f"{name}_", k, scanned[name], _STEP_RANK) for k, name in enumerate(names)]
    body = ir.Graph([*state_in, *carried_in, *slices_in], [], nodes=[], name=scope)
    sb = GraphBuilder(body, scope=scope, opset=b.opset)
    next_states, outputs = step(sb, state_in, carried_in, dict(zip(names, slices_in)))
    if len(next_states) != len(states):
        raise AssertionError(f"{label}: the step returned {len(next_states)} states for {len(states)}")

    body_outputs = sb.distinct_outputs([*next_states, *carried_in, *outputs.values()])
    ranks = [_STEP_RANK] * len(next_states) + [rank for _, rank in carried] + [_STEP_RANK] * len(outputs)
    for value, rank in zip(body_outputs, ranks):
        if value.shape is None:
            value.shape = ir.Shape([None] * rank)
    body.outputs.extend(body_outputs)

    direction = int(backwards)
    results = b.op.Scan(*states, *(v for v, _ in carried), *scanned.values(), body=body, num_scan_inputs=len(names),
                        scan_input_directions=[direction] * len(names),
                        scan_output_directions=[direction] * len(outputs),
                        _outputs=len(body_outputs))
    results = results if isinstance(results, tuple) else (results,)
    finals = list(results[:len(states)])
    stacked = dict(zip(outputs, results[len(states) + len(carried):]))
    return finals, stacked


# -- one direction ------------------------------------------------------------------------
@dataclass
class _Direction:
    """The inputs of one direction, in processing order (a reverse direction already reversed)."""

    activations: tuple[_Activation, ...]
    x: ir.Value  # [seq, batch, input]
    w: ir.Value  # [gates*hidden, input]
    r: ir.Value  # [gates*hidden, hidden]
    w_bias: ir.Value | None  # [gates*hidden]
    r_bias: ir.Value | None
    peephole: ir.Value | None  # [3*hidden] (LSTM)
    h0: ir.Value  # [batch, hidden]
    c0: ir.Value | None  # (LSTM)
    mask: ir.Value | None  # [seq, batch, 1]: 1 while t < sequence length
    dy: ir.Value | None  # [seq, batch, hidden]
    dy_h: ir.Value | None  # [batch, hidden]
    dy_c: ir.Value | None


@dataclass
class _DirectionGradients:
    """What the backward pass of one direction found, in processing order."""

    da: ir.Value  # [seq, batch, gates*hidden]: gradient of each step's gate pre-activations
    r: ir.Value | None  # [gates*hidden, hidden]
    r_bias: ir.Value | None  # [gates*hidden] (None: the same as the input bias's)
    peephole: ir.Value | None
    h0: ir.Value
    c0: ir.Value | None


def _or_zeros(b: GraphBuilder, value: ir.Value | None, like: ir.Value) -> ir.Value:
    """``value``, or zeros shaped like ``like`` where no gradient flows."""
    return value if value is not None else b.zeros_like(like)


def _add_bias(b: GraphBuilder, x: ir.Value, *biases: ir.Value | None) -> ir.Value:
    for bias in biases:
        if bias is not None:
            x = b.op.Add(x, bias)
    return x


# -- LSTM ---------------------------------------------------------------------------------
def _lstm(b: GraphBuilder, layer: _Layer, d: _Direction, needs_r: bool, needs_p: bool) -> _DirectionGradients:
    """Backpropagate one LSTM direction (gates iofc); ``needs_r``/``needs_p``: compute dR / dP."""
    f_name, g_name, h_name = d.activations
    clip, peep = layer.clip, d.peephole is not None
    xp = _add_bias(b, b.op.MatMul(d.x, b.op.Transpose(d.w, perm=[1, 0])), d.w_bias, d.r_bias)

    def forward_step(sb, states, carried, slices):
        op = sb.op
        h, c = states
        a = op.Add(slices["xp"], op.MatMul(h, carried[0]))
        a_i, a_o, a_f, a_c = _split(sb, a, 4)
        if peep:
            p_i, p_o, p_f = _split(sb, carried[1], 3)
            a_i, a_f = op.Add(a_i, op.Mul(p_i, c)), op.Add(a_f, op.Mul(p_f, c))
        a_i, keep_i = _clipped(sb, a_i, clip)
        i = _activate(sb, f_name, a_i)
        if layer.input_forget:
            f, keep_f = op.Sub(sb.like(i, 1.0), i), keep_i
        else:
            a_f, keep_f = _clipped(sb, a_f, clip)
            f = _activate(sb, f_name, a_f)
        a_c, keep_c = _clipped(sb, a_c, clip)
        g = _activate(sb, g_name, a_c)
        c_new = op.Add(op.Mul(f, c), op.Mul(i, g))
        if peep:
            a_o = op.Add(a_o, op.Mul(p_o, c_new))
        a_o, keep_o = _clipped(sb, a_o, clip)
        o = _activate(sb, f_name, a_o)
        h_of_c = _activate(sb, h_name, c_new)
        h_new = op.Mul(o, h_of_c)
        saved = {"h_prev": h, "c_prev": c, "gates": op.Concat(i, o, f, g, axis=-1), "h_of_c": h_of_c}
        if clip is not None:
            saved["keep"] = op.Concat(keep_i, keep_o, keep_f, keep_c, axis=-1)
        if peep:
            saved["c_new"] = c_new
        mask = slices.get("mask")
        if mask is not None:  # past the sequence's end the state is held
            h_new = op.Add(h, op.Mul(mask, op.Sub(h_new, h)))
            c_new = op.Add(c, op.Mul(mask, op.Sub(c_new, c)))
        return [h_new, c_new], saved

    carried = [(b.op.Transpose(d.r, perm=[1, 0]), 2)] + ([(d.peephole, 1)] if peep else [])
    scanned = {"xp": xp} | ({"mask": d.mask} if d.mask is not None else {})
    _, saved = _scan(b, "lstm_forward", [d.h0, d.c0], carried, scanned, forward_step)

    def backward_step(sb, states, carried, slices):
        op = sb.op
        dh, dc = states
        mask = slices.get("mask")
        dh_new = dh if "dy" not in slices else op.Add(dh, slices["dy"])
        dh_new, dc_new = _masked(sb, dh_new, mask), _masked(sb, dc, mask)
        i, o, f, g = _split(sb, slices["gates"], 4)
        keep_i, keep_o, keep_f, keep_c = _split(sb, slices["keep"], 4) if clip is not None else (None,) * 4
        h_of_c, c_prev = slices["h_of_c"], slices["c_prev"]
        da_o = _masked(sb, op.Mul(op.Mul(dh_new, h_of_c), _slope(sb, f_name, o)), keep_o)
        dc_new = op.Add(dc_new, op.Mul(op.Mul(dh_new, o), _slope(sb, h_name, h_of_c)))
        if peep:
            p_i, p_o, p_f = _split(sb, carried[1], 3)
            dc_new = op.Add(dc_new, op.Mul(da_o, p_o))
        di, df = op.Mul(dc_new, g), op.Mul(dc_new, c_prev)
        da_c = _masked(sb, op.Mul(op.Mul(dc_new, i), _slope(sb, g_name, g)), keep_c)
        dc_prev = op.Mul(dc_new, f)
        if layer.input_forget:  # f = 1 - i
            da_i = _masked(sb, op.Mul(op.Sub(di, df), _slope(sb, f_name, i)), keep_i)
            da_f = sb.zeros_like(da_i)
        else:
            da_i = _masked(sb, op.Mul(di, _slope(sb, f_name, i)), keep_i)
            da_f = _masked(sb, op.Mul(df, _slope(sb, f_name, f)), keep_f)
        if peep:
            dc_prev = op.Add(dc_prev, op.Mul(da_i, p_i))
            if not layer.input_forget:
                dc_prev = op.Add(dc_prev, op.Mul(da_f, p_f))
        da = op.Concat(da_i, da_o, da_f, da_c, axis=-1)
        dh_prev = op.MatMul(da, carried[0])
        if mask is not None:  # the held state's gradient passes the step by
            keep = op.Sub(sb.like(mask, 1.0), mask)
            dh_prev, dc_prev = op.Add(dh_prev, op.Mul(keep, dh)), op.Add(dc_prev, op.Mul(keep, dc))
        return [dh_prev, dc_prev], {"da": da}

    scanned = {name: saved[name] for name in ("gates", "h_of_c", "c_prev")}
    scanned |= {"keep": saved["keep"]} if clip is not None else {}
    scanned |= {"mask": d.mask} if d.mask is not None else {}
    scanned |= {"dy": d.dy} if d.dy is not None else {}
    dh, dc = _or_zeros(b, d.dy_h, d.h0), _or_zeros(b, d.dy_c, d.c0)
    (dh0, dc0), out = _scan(b, "lstm_backward", [dh, dc], [(d.r, 2)] + ([(d.peephole, 1)] if peep else []), scanned,
                            backward_step, backwards=True)
    da = out["da"]
    dr = _outer_sum(b, da, saved["h_prev"]) if needs_r else None
    dp = None
    if needs_p and peep:
        da_i, da_o, da_f, _ = _split(b, da, 4)
        dp = b.op.Concat(_sum_steps(b, b.op.Mul(da_i, saved["c_prev"])),
                         _sum_steps(b, b.op.Mul(da_o, saved["c_new"])),
                         _sum_steps(b, b.op.Mul(da_f, saved["c_prev"])), axis=0)
    return _DirectionGradients(da=da, r=dr, r_bias=None, peephole=dp, h0=dh0, c0=dc0)


# -- GRU ----------------------------------------------------------------------------------
def _gru(b: GraphBuilder, layer: _Layer, d: _Direction, needs_r: bool, needs_p: bool) -> _DirectionGradients:
    """Backpropagate one GRU direction (gates zrh); ``needs_r``: compute dR (GRU has no peepholes).

    With ``linear_before_reset`` the candidate is ``g(x W_h^T + r * (h R_h^T + Rb_h) + Wb_h)``, so
    the recurrent bias's gradient differs from the input bias's; without it ``R_h`` multiplies
    ``r * h``.
    """
    f_name, g_name = d.activations
    clip, before_reset = layer.clip, layer.linear_before_reset
    r_z, r_r, r_h = _split(b, d.r, 3, axis=0)
    xw = b.op.MatMul(d.x, b.op.Transpose(d.w, perm=[1, 0]))
    if before_reset:  # the recurrent bias sits inside r * (...): added in the step
        xp = _add_bias(b, xw, d.w_bias)
        forward_carried = [(b.op.Transpose(d.r, perm=[1, 0]), 2)] + ([(d.r_bias, 1)] if d.r_bias is not None else [])
    else:
        xp = _add_bias(b, xw, d.w_bias, d.r_bias)
        forward_carried = [(b.op.Transpose(b.op.Concat(r_z, r_r, axis=0), perm=[1, 0]), 2),
                           (b.op.Transpose(r_h, perm=[1, 0]), 2)]

    def forward_step(sb, states, carried, slices):
        op = sb.op
        (h,) = states
        x_z, x_r, x_h = _split(sb, slices["xp"], 3)
        if before_reset:
            hr = op.MatMul(h, carried[0])
            if len(carried) > 1:
                hr = op.Add(hr, carried[1])
            h_z, h_r, h_h = _split(sb, hr, 3)
        else:
            h_z, h_r = _split(sb, op.MatMul(h, carried[0]), 2)
        a_z, keep_z = _clipped(sb, op.Add(x_z, h_z), clip)
        a_r, keep_r = _clipped(sb, op.Add(x_r, h_r), clip)
        z, r = _activate(sb, f_name, a_z), _activate(sb, f_name, a_r)
        if before_reset:
            a_h = op.Add(x_h, op.Mul(r, h_h))
        else:
            a_h = op.Add(x_h, op.MatMul(op.Mul(r, h), carried[1]))
        a_h, keep_h = _clipped(sb, a_h, clip)
        candidate = _activate(sb, g_name, a_h)
        h_new = op.Add(candidate, op.Mul(z, op.Sub(h, candidate)))
        saved = {"h_prev": h, "gates": op.Concat(z, r, candidate, axis=-1)}
        if before_reset:
            saved["h_h"] = h_h
        if clip is not None:
            saved["keep"] = op.Concat(keep_z, keep_r, keep_h, axis=-1)
        mask = slices.get("mask")
        if mask is not None:
            h_new = op.Add(h, op.Mul(mask, op.Sub(h_new, h)))
        return [h_new], saved

    scanned = {"xp": xp} | ({"mask": d.mask} if d.mask is not None else {})
    _, saved = _scan(b, "gru_forward", [d.h0], forward_carried, scanned, forward_step)

    def backward_step(sb, states, carried, slices):
        op = sb.op
        (dh,) = states
        mask = slices.get("mask")
        dh_new = dh if "dy" not in slices else op.Add(dh, slices["dy"])
        dh_new = _masked(sb, dh_new, mask)
        z, r, candidate = _split(sb, slices["gates"], 3)
        keep_z, keep_r, keep_h = _split(sb, slices["keep"], 3) if clip is not None else (None,) * 3
        h_prev = slices["h_prev"]
        dz = op.Mul(dh_new, op.Sub(h_prev, candidate))
        dh_prev = op.Mul(dh_new, z)
        da_h = _masked(sb, op.Mul(op.Sub(dh_new, dh_prev), _slope(sb, g_name, candidate)), keep_h)
        if before_reset:
            d_hh = op.Mul(da_h, r)
            dr = op.Mul(da_h, slices["h_h"])
        else:
            d_rh = op.MatMul(da_h, carried[1])
            dr = op.Mul(d_rh, h_prev)
            dh_prev = op.Add(dh_prev, op.Mul(d_rh, r))
        da_z = _masked(sb, op.Mul(dz, _slope(sb, f_name, z)), keep_z)
        da_r = _masked(sb, op.Mul(dr, _slope(sb, f_name, r)), keep_r)
        if before_reset:
            dh_prev = op.Add(dh_prev, op.MatMul(op.Concat(da_z, da_r, d_hh, axis=-1), carried[0]))
        else:
            dh_prev = op.Add(dh_prev, op.MatMul(op.Concat(da_z, da_r, axis=-1), carried[0]))
        if mask is not None:
            dh_prev = op.Add(dh_prev, op.Mul(op.Sub(sb.like(mask, 1.0), mask), dh))
        return [dh_prev], {"da": op.Concat(da_z, da_r, da_h, axis=-1)}

    scanned = {name: saved[name] for name in ("gates", "h_prev")}
    scanned |= {"h_h": saved["h_h"]} if before_reset else {}
    scanned |= {"keep": saved["keep"]} if clip is not None else {}
    scanned |= {"mask": d.mask} if d.mask is not None else {}
    scanned |= {"dy": d.dy} if d.dy is not None else {}
    backward_carried = [(d.r, 2)] if before_reset else [(b.op.Concat(r_z, r_r, axis=0), 2), (r_h, 2)]
    (dh0,), out = _scan(b, "gru_backward", [_or_zeros(b, d.dy_h, d.h0)], backward_carried, scanned,
                        backward_step, backwards=True)
    da = out["da"]
    dr = dr_bias = None
    if before_reset:
        da_z, da_r, da_h = _split(b, da, 3)
        r = _split(b, saved["gates"], 3)[1]
        d_recurrent = b.op.Concat(da_z, da_r, b.op.Mul(da_h, r), axis=-1)  # d(h @ R^T + Rb)
        dr = _outer_sum(b, d_recurrent, saved["h_prev"]) if needs_r else None
        dr_bias = _sum_steps(b, d_recurrent)
    elif needs_r:  # R_h multiplies r * h_prev, R_z and R_r h_prev
        da_z, da_r, da_h = _split(b, da, 3)
        r = _split(b, saved["gates"], 3)[1]
        h_prev = saved["h_prev"]
        dr = b.op.Concat(_outer_sum(b, da_z, h_prev), _outer_sum(b, da_r, h_prev),
                         _outer_sum(b, da_h, b.op.Mul(r, h_prev)), axis=0)
    return _DirectionGradients(da=da, r=dr, r_bias=dr_bias, peephole=None, h0=dh0, c0=None)


def _hidden(b: GraphBuilder, r: ir.Value) -> ir.Value:
    """The hidden size (``R``'s last dim) as a 1-element int64 tensor."""
    return b.op.Gather(b.op.Shape(r), b.ints([-1]), axis=0)


# -- RNN ----------------------------------------------------------------------------------
def _rnn(b: GraphBuilder, layer: _Layer, d: _Direction, needs_r: bool, needs_p: bool) -> _DirectionGradients:
    """Backpropagate one RNN direction; ``needs_r``: compute dR (RNN has no peepholes)."""
    (f_name,) = d.activations
    clip = layer.clip
    xp = _add_bias(b, b.op.MatMul(d.x, b.op.Transpose(d.w, perm=[1, 0])), d.w_bias, d.r_bias)

    def forward_step(sb, states, carried, slices):
        op = sb.op
        (h,) = states
        a, keep = _clipped(sb, op.Add(slices["xp"], op.MatMul(h, carried[0])), clip)
        h_new = _activate(sb, f_name, a)
        saved = {"h_prev": h, "h_new": h_new} | ({"keep": keep} if keep is not None else {})
        mask = slices.get("mask")
        if mask is not None:
            h_new = op.Add(h, op.Mul(mask, op.Sub(h_new, h)))
        return [h_new], saved

    scanned = {"xp": xp} | ({"mask": d.mask} if d.mask is not None else {})
    _, saved = _scan(b, "rnn_forward", [d.h0], [(b.op.Transpose(d.r, perm=[1, 0]), 2)], scanned,
                     forward_step)

    def backward_step(sb, states, carried, slices):
        op = sb.op
        (dh,) = states
        mask = slices.get("mask")
        dh_new = _masked(sb, dh if "dy" not in slices else op.Add(dh, slices["dy"]), mask)
        da = _masked(sb, op.Mul(dh_new, _slope(sb, f_name, slices["h_new"])), slices.get("keep"))
        dh_prev = op.MatMul(da, carried[0])
        if mask is not None:
            dh_prev = op.Add(dh_prev, op.Mul(op.Sub(sb.like(mask, 1.0), mask), dh))
        return [dh_prev], {"da": da}

    scanned = {"h_new": saved["h_new"]}
    scanned |= {"keep": saved["keep"]} if clip is not None else {}
    scanned |= {"mask": d.mask} if d.mask is not None else {}
    scanned |= {"dy": d.dy} if d.dy is not None else {}
    (dh0,), out = _scan(b, "rnn_backward", [_or_zeros(b, d.dy_h, d.h0)], [(d.r, 2)], scanned, backward_step,
                        backwards=True)
    da = out["da"]
    dr = _outer_sum(b, da, saved["h_prev"]) if needs_r else None
    return _DirectionGradients(da=da, r=dr, r_bias=None, peephole=None, h0=dh0, c0=None)


_DIRECTION_GRADIENTS = {"LSTM": _lstm, "GRU": _gru, "RNN": _rnn}


# -- the rule -----------------------------------------------------------------------------
def _input(ctx: GradContext, index: int) -> ir.Value | None:
    inputs = ctx.inputs
    if index >= len(inputs) or inputs[index] is None or not inputs[index].name:
        return None
    return inputs[index]


def _grad_output(ctx: GradContext, index: int) -> ir.Value | None:
    return ctx.grad_outputs[index] if index < len(ctx.grad_outputs) else None


def _recurrent_gradient(ctx: GradContext):
    """Gradients of an LSTM, GRU or RNN node w.r.t. X, W, R, B, initial_h (and initial_c, P)."""
    op_type = ctx.node.op_type
    count = len(ctx.inputs)
    differentiable = [_X, _W, _R, _B, _INITIAL_H] + ([_INITIAL_C, _P] if op_type == "LSTM" else [])
    wanted = {i for i in differentiable if ctx.needs(i) and _input(ctx, i) is not None}
    outputs = [_Y, _Y_H] + ([_Y_C] if op_type == "LSTM" else [])
    if not wanted or all(_grad_output(ctx, k) is None for k in outputs):
        return (None,) * count
    layer = _layer(ctx)
    b, op = ctx.b, ctx.op

    x, w, r = _input(ctx, _X), _input(ctx, _W), _input(ctx, _R)
    bias, lengths = _input(ctx, _B), _input(ctx, _SEQUENCE_LENS)
    h0 = _input(ctx, _INITIAL_H)
    c0 = _input(ctx, _INITIAL_C) if op_type == "LSTM" else None
    peephole = _input(ctx, _P) if op_type == "LSTM" else None
    dy, dy_h = _grad_output(ctx, _Y), _grad_output(ctx, _Y_H)
    dy_c = _grad_output(ctx, _Y_C) if op_type == "LSTM" else None

    # to layout 0: X [seq, batch, input], Y [seq, directions, batch, hidden], states [directions, batch, hidden]
    if layer.layout == 1:
        x = op.Transpose(x, perm=[1, 0, 2])
        dy = op.Transpose(dy, perm=[1, 2, 0, 3]) if dy is not None else None
        h0, c0, dy_h, dy_c = (op.Transpose(v, perm=[1, 0, 2]) if v is not None else None
                              for v in (h0, c0, dy_h, dy_c))

    zero_state = None  # [batch, hidden], for absent initial states
    if h0 is None or (op_type == "LSTM" and c0 is None):
        batch = op.Gather(op.Shape(x), b.ints([1]), axis=0)
        zero_state = op.ConstantOfShape(op.Concat(batch, _hidden(b, r), axis=0),
                                        value=ir.tensor(np.zeros([1], dtype=x.dtype.numpy())))
    mask = alive = None
    if lengths is not None:
        lengths = b.cast_to(lengths, ir.DataType.INT64)
        steps = op.Range(b.scalar_int(0), op.Gather(op.Shape(x), b.scalar_int(0), axis=0), b.scalar_int(1))
        running = op.Less(b.unsqueeze(steps, [1]), b.unsqueeze(lengths, [0]))  # [seq, batch]
        mask = b.unsqueeze(b.cast_to(running, x.dtype), [2])
        # a sequence of length 0 has zero final states
        alive = b.unsqueeze(b.cast_to(op.Greater(lengths, b.scalar_int(0)), x.dtype), [1])

    def direction_input(v: ir.Value | None, d: int, axis: int = 0) -> ir.Value | None:
        return None if v is None else op.Gather(v, b.scalar_int(d), axis=axis)

    def in_processing_order(v: ir.Value | None, reverse: bool) -> ir.Value | None:
        return _reverse_time(b, v, lengths) if v is not None and reverse else v

    per_direction: list[tuple[_Direction, _DirectionGradients]] = []
    for d, reverse in enumerate(layer.reverse):
        b_d = direction_input(bias, d)
        w_bias, r_bias = _split(b, b_d, 2, axis=0) if b_d is not None else (None, None)
        final_h, final_c = direction_input(dy_h, d), direction_input(dy_c, d)
        h0_d, c0_d = direction_input(h0, d), direction_input(c0, d)
        direction = _Direction(
            activations=layer.activations[d],
            x=in_processing_order(x, reverse),
            w=direction_input(w, d), r=direction_input(r, d), w_bias=w_bias, r_bias=r_bias,
            peephole=direction_input(peephole, d),
            h0=h0_d if h0_d is not None else zero_state,
            c0=(c0_d if c0_d is not None else zero_state) if op_type == "LSTM" else None,
            mask=mask,
            dy=in_processing_order(direction_input(dy, d, axis=1), reverse),
            dy_h=_masked(b, final_h, alive) if final_h is not None else None,
            dy_c=_masked(b, final_c, alive) if final_c is not None else None,
        )
        grads = _DIRECTION_GRADIENTS[op_type](b, layer, direction, _R in wanted, _P in wanted)
        per_direction.append((direction, grads))

    results: list[ir.Value | None] = [None] * count
    if _X in wanted:
        dx = None
        for (direction, grads), reverse in zip(per_direction, layer.reverse):
            part = in_processing_order(op.MatMul(grads.da, direction.w), reverse)
            dx = part if dx is None else op.Add(dx, part)
        results[_X] = op.Transpose(dx, perm=[1, 0, 2]) if layer.layout == 1 else dx
    if _W in wanted:
        results[_W] = _stack(b, [_outer_sum(b, g.da, direction.x) for direction, g in per_direction])
    if _R in wanted:
        results[_R] = _stack(b, [g.r for _, g in per_direction])
    if _B in wanted:
        biases = []
        for _, g in per_direction:
            dw_bias = _sum_steps(b, g.da)
            biases.append(op.Concat(dw_bias, g.r_bias if g.r_bias is not None else dw_bias, axis=0))
        results[_B] = _stack(b, biases)
    if _P in wanted and peephole is not None:
        results[_P] = _stack(b, [g.peephole for _, g in per_direction])
    for index, name in ((_INITIAL_H, "h0"), (_INITIAL_C, "c0")):
        if index in wanted:
            state = _stack(b, [getattr(g, name) for _, g in per_direction])
            results[index] = op.Transpose(state, perm=[1, 0, 2]) if layer.layout == 1 else state
    return tuple(results)


for _op_type in ("LSTM", "GRU", "RNN"):
    grad(_op_type, versions=(13, None))(_recurrent_gradient)
