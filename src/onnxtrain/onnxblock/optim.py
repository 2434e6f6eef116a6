"""Optimizer blocks: build the optimizer model from the trainable parameters.

The optimizer model performs one update of every trainable parameter in one
session run, with standard ONNX ops (no ``com.microsoft`` optimizer kernels, so it
runs on stock onnxruntime). Its inputs and outputs follow docs/artifacts.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain import names
from onnxtrain.errors import ArtifactError
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.onnxblock import loss_scale as scaling
from onnxtrain.onnxblock.blocks import Block
from onnxtrain.passes.dce import RemoveUnusedNodesPass

OPTIMIZER_METADATA_KEY = "onnxtrain.optimizer"


@dataclass(frozen=True)
class ParamSpec:
    """Name, element type and shape of a parameter."""

    name: str
    dtype: ir.DataType
    shape: tuple[int, ...]

    @classmethod
    def of(cls, param) -> "ParamSpec":
        """From an ``onnx.TensorProto``, an ``onnx_ir`` value/tensor, a numpy pair or a ParamSpec."""
        if isinstance(param, ParamSpec):
            return param
        if hasattr(param, "data_type") and hasattr(param, "dims"):  # onnx.TensorProto
            return cls(param.name, ir.DataType(param.data_type), tuple(param.dims))
        if isinstance(param, ir.Value):
            return cls(param.name, param.dtype, tuple(int(d) for d in param.shape))
        if isinstance(param, tuple) and len(param) == 2:  # (name, array)
            arr = np.asarray(param[1])
            return cls(param[0], ir.DataType.from_numpy(arr.dtype), arr.shape)
        raise ArtifactError(f"cannot read a parameter name, type and shape from {type(param).__name__}")


def _trainable(parameters) -> list[ParamSpec]:
    """Accept upstream's ``(trainable, frozen)`` pair or a plain list of trainable parameters."""
    if isinstance(parameters, tuple) and len(parameters) == 2 and isinstance(parameters[0], (list, tuple)) \
            and not isinstance(parameters[0], str):
        parameters = parameters[0]
    specs = [ParamSpec.of(p) for p in parameters]
    if not specs:
        raise ArtifactError("the optimizer needs at least one trainable parameter")
    return specs


# Vectors (1-D parameters: biases, normalization weights) of at most this many elements are
# updated together when the update is elementwise (see _OptimizerBlock._joint_update): for
# tensors this small, each node's fixed cost in onnxruntime (a few microseconds) outweighs its
# arithmetic, and a dozen nodes per parameter add up (~400 nodes in a 4-layer GPT's AdamW).
# Joining costs one copy of each input and output, cheap while the vectors are this short.
JOINT_UPDATE_MAX_ELEMENTS = 4096


class _OptimizerBlock(Block):
    """Common structure: inputs learning_rate, step and per-parameter (p, grad, states)."""

    type_name = ""
    states: tuple[str, ...] = ()
    # whether update() treats every element alike (no per-tensor reductions, as LAMB's norms):
    # then several parameters may be updated as one concatenated vector
    elementwise = True
    clip_grad: "ClipGradNorm | None" = None
    # set for fp16 artifacts (generate_artifacts(precision="fp16")): skip non-finite steps and
    # update the loss scale (onnxblock/loss_scale.py)
    loss_scale: "scaling.DynamicLossScale | None" = None

    def __init__(self):
        super().__init__()
        self._model: ir.Model | None = None

    def hyperparameters(self) -> dict:
        raise NotImplementedError

    def update(self, b: GraphBuilder, shared: dict, p, g, states: list[ir.Value]):
        """Return the new parameter and new states for one parameter."""
        raise NotImplementedError

    def prepare(self, b: GraphBuilder, lr: ir.Value, step: ir.Value) -> dict:
        """Values shared by all parameters (bias corrections, ...)."""
        return {"lr": lr, "step": step}

    def build(self, parameters) -> list[str]:
        specs = _trainable(parameters)
        b = self.context.builder
        graph = self.context.graph
        graph.name = f"{self.type_name} optimizer"
        lr = b.input(names.LEARNING_RATE, ir.DataType.FLOAT, [])
        step = b.input(names.STEP, ir.DataType.INT64, [])
        params, grads, states = [], [], []
        for spec in specs:
            params.append(b.input(spec.name, spec.dtype, spec.shape))
            grads.append(b.input(names.grad_name(spec.name), spec.dtype, spec.shape))
            states.append([b.input(names.state_name(spec.name, s), spec.dtype, spec.shape) for s in self.states])
        scaler = self.loss_scale
        if scaler is not None:
            scale, tracker = scaling.scale_inputs(b)
            finite = scaling.all_finite(b.child("all_finite"), grads)
            before = set(graph)
        if self.clip_grad is not None:
            grads = self.clip_grad.scale(b.child("clip_grad_norm"), grads)
        shared = self.prepare(b, lr, step)
        updates = {}  # parameter index -> (new parameter, new states)
        for members in self._update_groups(specs):
            if len(members) == 1:
                (i,) = members
                updates[i] = self.update(b.child(specs[i].name), shared, params[i], grads[i], states[i])
            else:
                updates.update(self._joint_update(b.child("small_vectors"), shared, members, specs,
                                                  params, grads, states))
        new_values, sources = [], []
        for i, (p, p_states) in enumerate(zip(params, states)):
            new_p, new_states = updates[i]
            new_values += [new_p, *new_states]
            sources += [p, *p_states]
        if scaler is not None:  # the update runs only when every gradient is finite
            update_nodes = [n for n in graph if n not in before]
            new_values = scaling.skip_unless(b.child("skip_non_finite"), finite, update_nodes, new_values,
                                                sources)
        outputs: list[ir.Value] = []
        for value, source in zip(new_values, sources):
            if value is source or value.is_graph_output():
                value = b.op.Identity(value)
            value.name = names.updated_name(source.name)
            value.type, value.shape = source.type, source.shape
            outputs.append(value)
        if scaler is not None:
            new_scale, new_tracker = scaling.update_scale(b.child("loss_scale"), scaler, finite, scale, tracker)
            flag = b.op.Identity(finite)
            for value, name in ((new_scale, names.updated_name(names.LOSS_SCALE)),
                                (new_tracker, names.updated_name(names.LOSS_SCALE_GROWTH_TRACKER)),
                                (flag, names.ALL_FINITE)):
                value.name = name
                value.shape = ir.Shape([])
                outputs.append(value)
        graph.outputs.extend(outputs)
        RemoveUnusedNodesPass()(self.context.ir_model)  # constants an update did not use
        self.context.ir_model.metadata_props[OPTIMIZER_METADATA_KEY] = json.dumps({
            "type": self.type_name,
            "params": [s.name for s in specs],
            "states": list(self.states),
            "hyperparameters": self.hyperparameters(),
            **({"loss_scale": scaler.to_json()} if scaler is not None else {}),
        })
        self._model = self.context.ir_model
        return [o.name for o in outputs]

    def _update_groups(self, specs: list[ParamSpec]) -> list[list[int]]:
        """Parameter indices updated together: the small vectors of each element type (biases,
        normalization weights) in one group when the update is elementwise, every other
        parameter alone."""
        groups: dict[ir.DataType, list[int]] = {}
        alone = []
        for i, spec in enumerate(specs):
            small_vector = len(spec.shape) == 1 and spec.shape[0] <= JOINT_UPDATE_MAX_ELEMENTS
            if self.elementwise and small_vector:
                groups.setdefault(spec.dtype, []).append(i)
            else:
                alone.append([i])
        return alone + list(groups.values())

    def _joint_update(self, b: GraphBuilder, shared: dict, members: list[int], specs: list[ParamSpec],
                      params, grads, states) -> dict[int, tuple]:
        """One update over the concatenation of several vectors, split back per parameter: the
        same elementwise arithmetic in a dozen nodes instead of a dozen per parameter."""
        op = b.op

        def joined(values):
            return op.Concat(*values, axis=0)

        new_p, new_states = self.update(b, shared, joined([params[i] for i in members]),
                                        joined([grads[i] for i in members]),
                                        [joined([states[i][k] for i in members]) for k in range(len(self.states))])
        lengths = b.ints([specs[i].shape[0] for i in members])
        pieces = [op.Split(value, lengths, axis=0, _outputs=len(members)) for value in (new_p, *new_states)]
        return {i: (pieces[0][j], [state[j] for state in pieces[1:]]) for j, i in enumerate(members)}

    def to_model_proto(self):
        """The optimizer model as an ``onnx.ModelProto`` (after the block was called)."""
        if self._model is None:
            raise RuntimeError("call the optimizer block on the parameters before asking for its model")
        return io.to_proto(self._model)

    def to_ir_model(self) -> ir.Model:
        if self._model is None:
            raise RuntimeError("call the optimizer block on the parameters before asking for its model")
        return self._model


class AdamW(_OptimizerBlock):
    """AdamW with upstream's defaults: betas (0.9, 0.999), eps 1e-6, no weight decay, bias correction.

    ``mode="transformers"`` (default, upstream's ``adam_mode=1``): the Hugging Face
    transformers AdamW update — ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``,
    then ``p -= lr * weight_decay * p``. ``mode="torch"`` (upstream's ``adam_mode=0``): exactly
    ``torch.optim.AdamW`` — ``p *= 1 - lr * weight_decay`` first, then
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    ``clip_grad`` (a :class:`ClipGradNorm`) clips the global gradient norm first.

    Example:
        >>> from onnxtrain import onnxblock
        >>> with onnxblock.empty_base():
        ...     outputs = onnxblock.optim.AdamW(mode="torch")([("w", [[1.0, 2.0]])])
        >>> outputs
        ['w.updated', 'w.momentum0.updated', 'w.momentum1.updated']
    """

    type_name = "AdamW"
    states = (names.FIRST_MOMENT, names.SECOND_MOMENT)
    MODES = ("transformers", "torch")

    def __init__(self, bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, clip_grad: "ClipGradNorm | None" = None, mode: str = "transformers"):
        super().__init__()
        if mode not in self.MODES:
            raise ArtifactError(f"AdamW mode must be one of {self.MODES}, got {mode!r}")
        self.bias_correction, self.betas, self.eps = bias_correction, tuple(betas), eps
        self.weight_decay, self.clip_grad, self.mode = weight_decay, clip_grad, mode

    def hyperparameters(self) -> dict:
        return {"bias_correction": self.bias_correction, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "mode": self.mode,
                "max_norm": None if self.clip_grad is None else self.clip_grad.max_norm}

    def prepare(self, b, lr, step):
        op = b.op
        shared = {"lr": lr, "step": step}
        t = op.Cast(step, to=int(ir.DataType.FLOAT))
        one = b.like(lr, 1.0)
        if self.bias_correction:
            shared["bc1"] = _one_minus_power(b, self.betas[0], t)
            shared["bc2"] = _one_minus_power(b, self.betas[1], t)
        else:
            shared["bc1"] = shared["bc2"] = one
        shared["sqrt_bc2"] = op.Sqrt(shared["bc2"])
        return shared

    def update(self, b, shared, p, g, states):
        op = b.op
        m, v = states
        beta1, beta2 = self.betas
        lr = b.cast_to(shared["lr"], p.dtype)
        bc1, sqrt_bc2 = b.cast_to(shared["bc1"], p.dtype), b.cast_to(shared["sqrt_bc2"], p.dtype)
        new_m = op.Add(op.Mul(b.like(m, beta1), m), op.Mul(b.like(g, 1 - beta1), g))
        new_v = op.Add(op.Mul(b.like(v, beta2), v), op.Mul(b.like(g, 1 - beta2), op.Mul(g, g)))
        if self.mode == "torch":
            if self.weight_decay:
                p = op.Mul(p, op.Sub(b.like(p, 1.0), op.Mul(lr, b.like(p, self.weight_decay))))
            denom = op.Add(op.Div(op.Sqrt(new_v), sqrt_bc2), b.like(v, self.eps))
            new_p = op.Sub(p, op.Mul(op.Div(lr, bc1), op.Div(new_m, denom)))
        else:
            denom = op.Add(op.Sqrt(new_v), b.like(v, self.eps))
            step_size = op.Div(op.Mul(lr, sqrt_bc2), bc1)
            new_p = op.Sub(p, op.Mul(step_size, op.Div(new_m, denom)))
            if self.weight_decay:  # p -= lr * wd * p, as one scaling pass: p *= 1 - lr * wd
                new_p = op.Mul(new_p, op.Sub(b.like(p, 1.0), op.Mul(lr, b.like(p, self.weight_decay))))
        return new_p, [new_m, new_v]

def _one_minus_power(b: GraphBuilder, base: float, t: ir.Value) -> ir.Value:
    """``1 - base**t`` for a float32 ``t``, accurate to ~4e-7 relative in float32 alone.

    Written as ``1 - Pow(base, t)`` it loses ~1.3e-5 at ``base = 0.999, t = 1`` (0.999 rounds
    to float32, and the subtraction cancels), where PyTorch and upstream compute AdamW's bias
    corrections in float64. float64 ops are no way out: onnxruntime-web and mobile builds lack
    them. So ``-expm1(x)`` with ``x = t * log(base)`` (the logarithm taken here in float64), and
    ``expm1(x) = 2u / (1 - u)`` with ``u = tanh(x / 2)``, which keeps its relative accuracy near
    0: five scalar ops."""
    op = b.op
    half_log = np.array(math.log(base) / 2 if base > 0 else -math.inf, np.float32)
    u = op.Tanh(op.Mul(t, b.const(half_log)))
    return op.Div(op.Add(u, u), op.Sub(u, b.const(np.array(1.0, np.float32))))  # -2u / (1 - u)


class SGD(_OptimizerBlock):
    """Stochastic gradient descent with ``torch.optim.SGD``'s semantics.

    Upstream's ``SGD(clip_grad=None)`` is plain ``p -= lr * grad`` (the default here too, with the
    same first argument); the keyword arguments ``momentum``, ``dampening``, ``weight_decay`` and
    ``nesterov`` follow PyTorch (the momentum buffer starts as the first gradient).
    """

    type_name = "SGD"

    def __init__(self, clip_grad: "ClipGradNorm | None" = None, *, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__()
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ArtifactError("nesterov momentum needs momentum > 0 and dampening = 0")
        if clip_grad is not None and not isinstance(clip_grad, ClipGradNorm):
            raise ArtifactError(f"SGD clip_grad must be an optim.ClipGradNorm or None, got {clip_grad!r} "
                                f"(as upstream, clip_grad comes first; momentum and the others are keywords)")
        self.momentum, self.dampening, self.weight_decay, self.nesterov = momentum, dampening, weight_decay, nesterov
        self.clip_grad = clip_grad
        self.states = (names.MOMENTUM_BUFFER,) if momentum else ()

    def hyperparameters(self) -> dict:
        return {"momentum": self.momentum, "dampening": self.dampening, "weight_decay": self.weight_decay,
                "nesterov": self.nesterov, "max_norm": None if self.clip_grad is None else self.clip_grad.max_norm}

    def prepare(self, b, lr, step):
        shared = {"lr": lr, "step": step}
        if self.momentum:
            shared["first_step"] = b.op.Equal(step, b.const(np.array(1, dtype=np.int64)))
        return shared

    def update(self, b, shared, p, g, states):
        op = b.op
        lr = b.cast_to(shared["lr"], p.dtype)
        if self.weight_decay:
            g = op.Add(g, op.Mul(b.like(p, self.weight_decay), p))
        new_states = []
        if self.momentum:
            (buf,) = states
            running = op.Add(op.Mul(b.like(buf, self.momentum), buf), op.Mul(b.like(g, 1 - self.dampening), g))
            buf = op.Where(shared["first_step"], g, running)
            new_states.append(buf)
            g = op.Add(g, op.Mul(b.like(buf, self.momentum), buf)) if self.nesterov else buf
        return op.Sub(p, op.Mul(lr, g)), new_states

class ClipGradNorm:
    """Scale all gradients by ``min(1, max_norm / (global_l2_norm + 1e-6))`` before the update.

    The global norm is over all trainable parameters' gradients together, as
    ``torch.nn.utils.clip_grad_norm_``.
    """

    EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds 1e-6 to the norm

    def __init__(self, max_norm: float):
        self.max_norm = float(max_norm)

    def scale(self, b: GraphBuilder, grads: Sequence[ir.Value]) -> list[ir.Value]:
        op = b.op
        squares = [b.cast_to(op.ReduceSum(op.Mul(g, g), keepdims=0), ir.DataType.FLOAT) for g in grads]
        norm = op.Sqrt(squares[0] if len(squares) == 1 else op.Sum(*squares))
        coef = op.Div(b.like(norm, self.max_norm), op.Add(norm, b.like(norm, self.EPS)))
        coef = op.Min(coef, b.like(coef, 1.0))
        return [op.Mul(g, b.cast_to(coef, g.dtype)) for g in grads]
