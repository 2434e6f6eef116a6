"""Peak memory of a training step through ORTModule, estimated before training.

:func:`estimate_memory` exports the module for one call's inputs, builds the forward and
backward graphs exactly as :class:`~onnxtrain.torch.ORTModule` would (with the same memory
options), sizes every value for those inputs and simulates two training steps against a
model of ONNX Runtime's CPU arena (a value lives from its producer to its last reader; the
arena's regions and fragmentation decide what becomes resident). Nothing is trained and no
activation is allocated, so a user can try batch sizes against a memory cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from onnxtrain.passes import memory
from onnxtrain.passes.partition import FROM_OUTPUT_GRAD, ForwardBackward
from onnxtrain.torch._export import flatten_call
from onnxtrain.torch.ortmodule import ORTModule, _autocast, _graph_inputs

_MB = 2**20

# Output-sized tensors a typical loss keeps while the step runs: cross entropy keeps its
# log-probabilities, a regression loss its difference.
LOSS_OUTPUT_COPIES = 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training step needs, by kind (all in bytes).

    Attributes:
        parameters: the module's parameters and buffers.
        gradients: one gradient per trainable parameter.
        optimizer_state: ``optimizer_states`` parameter-sized tensors per trainable parameter.
        saved_activations: what the forward keeps for the backward.
        outputs: the module's outputs (the loss reads them; their gradients are as large).
        forward_peak: the most the forward run holds at once (its outputs included).
        backward_peak: the most the backward run holds at once beyond its inputs (gradients included).
        arena_peak: what ONNX Runtime's arena makes resident over two steps (both runs, the
            saved activations held in between): the live bytes plus fragmentation and growth.
        report: the forward/backward cut's :class:`~onnxtrain.passes.partition.MemoryReport`.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    outputs: int
    forward_peak: int
    backward_peak: int
    arena_peak: int
    report: object = None

    @property
    def persistent(self) -> int:
        """What lives across steps: parameters and optimizer state."""
        return self.parameters + self.optimizer_state

    @property
    def step_peak(self) -> int:
        """The most a step adds to :attr:`persistent`: the arena's resident bytes (which hold the
        outputs, the saved activations and both runs' intermediates) plus what PyTorch holds
        during the backward: the loss's own saved tensor and the outputs' gradient, each
        output-sized."""
        return self.arena_peak + (LOSS_OUTPUT_COPIES + 1) * self.outputs

    @property
    def total(self) -> int:
        """Estimated peak of a training step: :attr:`persistent` + :attr:`step_peak`."""
        return self.persistent + self.step_peak

    def explain(self) -> str:
        rows = [("parameters and buffers", self.parameters), ("optimizer state", self.optimizer_state),
                ("saved activations", self.saved_activations), ("module outputs", self.outputs),
                ("forward run peak", self.forward_peak), ("backward run peak (gradients included)", self.backward_peak),
                ("ONNX Runtime arena, resident", self.arena_peak),
                ("step peak above persistent", self.step_peak), ("estimated peak", self.total)]
        return "\n".join(f"{name:40s} {size / _MB:10.1f} MB" for name, size in rows)


def estimate_memory(module: torch.nn.Module, *args, optimizer_states: int = 2, memory_opt_level: int | None = None,
                    memory_budget: int | None = None, dynamic: bool | None = None, **kwargs) -> MemoryEstimate:
    """Estimate the peak memory of training ``module`` on inputs ``args``/``kwargs`` with ORTModule.

    Args:
        module: the ``torch.nn.Module`` to train (in the mode it is in; not changed), or an
            ``ORTModule``, whose memory options and ``dynamic`` apply unless given here.
        *args, **kwargs: one call's inputs (a batch of the size you want to check).
        optimizer_states: parameter-sized state tensors the optimizer keeps per parameter
            (2 for Adam, AdamW, LAMB; 1 for SGD with momentum; 0 for plain SGD).
        memory_opt_level, memory_budget: ORTModule's memory options.
        dynamic: ORTModule's ``dynamic``: estimate the graph exported with dynamic dims (what a
            module serves batches of several sizes with) rather than with this call's shapes.

    Example:
        >>> estimate = estimate_memory(model, torch.zeros(64, 128, dtype=torch.long))
        >>> print(estimate.explain()); estimate.total / 2**30  # GiB
    """
    if isinstance(module, ORTModule):  # its own options, unless given here
        options = module._memory_options
        memory_opt_level = options.level if memory_opt_level is None else memory_opt_level
        memory_budget = options.budget if memory_budget is None else memory_budget
        dynamic = module._dynamic if dynamic is None else dynamic
        module = module.module
    if not (isinstance(optimizer_states, int) and optimizer_states >= 0):
        raise ValueError(f"estimate_memory: optimizer_states must be a whole number >= 0, got {optimizer_states!r}")
    wrapper = ORTModule(module, memory_opt_level=memory_opt_level, memory_budget=memory_budget, dynamic=dynamic)
    call = flatten_call(module, args, kwargs)
    variant = wrapper._variant(call, _autocast(call.tensors))
    inputs, wrt = _graph_inputs(call, variant)
    if not wrt:
        raise ValueError("estimate_memory: nothing in the call requires grad (no parameter, no input)")
    graphs, _ = wrapper._forward_backward(variant, wrt, inputs)
    trainable = {id(p): p for p in module.parameters() if p.requires_grad}
    state = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    parameter_bytes = sum(t.numel() * t.element_size() for t in state.values())
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable.values())
    forward_shapes = {v.name: tuple(t.shape) for v, t in zip(graphs.forward.graph.inputs, inputs)}
    forward_sizes = memory.value_sizes(graphs.forward, forward_shapes)
    forward_peak = memory.live_peak(graphs.forward.graph, forward_sizes)
    backward_sizes = memory.value_sizes(graphs.backward, _backward_shapes(graphs, forward_sizes))
    order = list(graphs.backward.graph)  # the order ORTModule's backward session runs in
    backward_peak = memory.live_peak(graphs.backward.graph, backward_sizes, order)
    outputs = graphs.forward.graph.outputs
    arena_peak = _simulated_arena_peak(graphs, forward_sizes, backward_sizes, order,
                                       shrink=wrapper._memory_options.active)
    return MemoryEstimate(
        parameters=parameter_bytes, gradients=trainable_bytes, optimizer_state=optimizer_states * trainable_bytes,
        saved_activations=sum(forward_sizes.of(v) for v in outputs[graphs.num_model_outputs:]),
        outputs=sum(forward_sizes.of(v) for v in outputs[:graphs.num_model_outputs]),
        forward_peak=forward_peak.bytes, backward_peak=backward_peak.bytes, arena_peak=arena_peak,
        report=graphs.memory)


def _simulated_arena_peak(graphs: ForwardBackward, forward_sizes: memory.ValueSizes,
                          backward_sizes: memory.ValueSizes, backward_order, shrink: bool) -> int:
    """Resident bytes of ONNX Runtime's arena over two training steps from a fresh arena (the
    second step shows what reuse leaves over). The forward's outputs stay allocated until the
    backward has run (PyTorch holds them), the gradients until the optimizer step; with
    ``shrink`` (ORTModule's memory options) each run ends by releasing the free regions."""
    arena = memory.ArenaModel()
    for _ in range(2):
        held = memory.simulate_run(arena, graphs.forward.graph, forward_sizes)
        if shrink:
            arena.shrink()
        gradients = memory.simulate_run(arena, graphs.backward.graph, backward_sizes, backward_order)
        if shrink:
            arena.shrink()
        for chunk in [*held.values(), *gradients.values()]:
            arena.free(chunk)
    return arena.peak


def _backward_shapes(graphs: ForwardBackward, forward_sizes: memory.ValueSizes) -> dict[str, list[int]]:
    """Concrete shapes of the backward inputs: forward values by name, output gradients as their outputs."""
    outputs = graphs.forward.graph.outputs
    shapes = {}
    for value, (source, index) in zip(graphs.backward.graph.inputs, graphs.backward_inputs):
        name = outputs[index].name if source == FROM_OUTPUT_GRAD else value.name
        if name in forward_sizes.shapes:
            shapes[value.name] = forward_sizes.shapes[name]
    return shapes
