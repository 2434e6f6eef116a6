"""Export a torch module call to an ONNX graph whose parameters and buffers are inputs.

A call ``module(*args, **kwargs)`` is flattened (``torch.utils._pytree``): its tensor
leaves become graph inputs, every other leaf (ints, flags, None, strings) is baked into
the graph and becomes part of the cache key. Parameters and buffers are lifted from
initializers to graph inputs, so the graph reads the module's current weights on every
run and an optimizer step never needs a re-export. Buffers a training-mode forward
mutates (BatchNorm running statistics, counters) come back as extra outputs.

Custom ``torch.autograd.Function``s: the exporter traces through their forward, and the
gradient graph would differentiate that forward instead of running their own backward (a
straight-through estimator, a gradient reversal). An export with grad enabled (the only kind
gradients are built from) traces with autograd on, and the autograd graph of the traced
outputs names every Function the forward ran on tensors that require grad; an export whose
Functions are not known to be exact (``inline_functions``, and torch's reentrant checkpoint)
raises ``ExportError``.

What a graph cannot reproduce also raises ``ExportError`` (ORTModule then runs the module in
PyTorch): tensors stored on modules by the forward, numbers returned that were computed from
the tensors, tensors inside argument or output objects that pytree does not flatten. Forward
hooks run once, while traced (``ForwardHookWarning``).

Gradient cuts: ``detach()`` and the outputs of ``torch.no_grad()`` regions in the forward stop
gradients, as in PyTorch (marked stop-gradient Identities, see ``_translations.detach`` and
``_exporter.mark_gradient_cuts``). Regions are cut only in a forward that runs no custom
Function: one that sets grad mode inside its forward (a reentrant checkpoint) leaves the capture
with grad mode wrong after it. Every export then checks that each parameter (and input) a
gradient reaches in autograd's own graph of the traced call has a gradient path in the exported
graph, else ``ExportError``.

A call is exported with its own shapes (static) or with every tensor dim ``Dim.AUTO``:
dynamic where the model allows it, static where it does not (ORTModule chooses, see its
``dynamic`` argument). A later call is served by the same graph when its shapes fit: static
dims equal, symbolic dims consistent across inputs and within the ranges the exporter
derived.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import os
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from onnxtrain.autodiff.builder import inputs_with_gradient
from onnxtrain.errors import ExportError, InputMismatchError
from onnxtrain.ir.nodes import RANDOM_OPS, subgraphs, upstream_nodes
from onnxtrain.names import STOP_GRADIENT_METADATA
from onnxtrain.passes import pipeline
from onnxtrain.torch._exporter import (EXPORT_LOCK, attention_outputs_contiguous, capture, contiguous_as_clone, export_program, has_checkpoint_region,
                                       mark_gradient_cuts, splits_with_sizes, traced_requires_grad)
from onnxtrain.torch._translations import complex_translation_table, per_sample_losses_as_own_ops, translation_table

# The wrapper's attribute holding the user's module: the exporter names its parameters
# "<prefix><fqn>"; the prefix is stripped from graph input names.
_MODULE_ATTR = "module"
_PREFIX = _MODULE_ATTR + "."
# Loggers of the exporter that report environment facts (e.g. "torchvision is not
# installed") as warnings on every export; quieted during our exports. The capture's fake tensors
# log, at ERROR, a traceback of every op the module's own code gets wrong (a wrong feature size:
# hundreds of lines), which the error raised from the call says again.
_NOISY_LOGGERS = {"torch.onnx._internal.exporter._registration": logging.ERROR,
                  "torch.onnx._internal.exporter._core": logging.ERROR,
                  "torch._subclasses.fake_tensor": logging.CRITICAL,
                  # a capture that fails on a number read from the data logs the graph traced so
                  # far ("Unable to find user code corresponding to {u0}"); the capture is retried
                  # with the numbers (_capture_reading_numbers), and a failure raises its own error
                  "torch.fx.experimental.symbolic_shapes": logging.ERROR}


@contextlib.contextmanager
def quiet_exporter():
    """Silence the exporter's environment warnings (loggers and ``warnings``) for one export;
    the loggers' levels are restored afterwards."""
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    try:
        for lg, quiet in zip(loggers, _NOISY_LOGGERS.values()):
            lg.setLevel(quiet)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _freeze(leaf, depth: int = 3) -> Hashable:
    """A hashable stand-in for a non-tensor argument, for the cache key. An object that hashes by
    identity (a plain options object) is keyed by its attributes too: the graph baked in what
    the forward read from them, and the caller may change them between calls."""
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf).__name__, repr(leaf))
    if type(leaf).__hash__ is object.__hash__ and depth and isinstance(getattr(leaf, "__dict__", None), dict):
        state = tuple(sorted((str(name), _freeze(value, depth - 1)) for name, value in vars(leaf).items()))
        return (type(leaf).__name__, leaf, state)
    return (type(leaf).__name__, leaf)


@dataclass(frozen=True)
class CallSchema:
    """What about a call decides its graph, other than shapes covered by dynamic dims."""

    tree: Hashable
    constants: tuple           # frozen non-tensor leaves, in leaf order
    tensors: tuple             # (leaf position, dtype, rank, device) per tensor leaf
    training: bool
    parameters: tuple          # (name, dtype, device, shape) of every parameter and buffer
    # (name, name of the first place holding the same tensor) for every tied parameter or buffer:
    # tied places are one graph input, so tying or untying them (an LM head's weight) exports again
    ties: tuple
    # the identity of every submodule: one replaced by another (an activation swapped, with no
    # parameter names to change) runs a graph exported for the new one
    modules: tuple


@dataclass
class FlatCall:
    """A flattened call: the tensor leaves and how to rebuild the call from them."""

    tensors: list[torch.Tensor]
    leaves: list
    positions: list[int]
    spec: pytree.TreeSpec
    schema: CallSchema
    state: dict[str, torch.Tensor]  # the module's parameters and buffers by qualified name
    # positions (in ``tensors``) of arguments that share memory with another argument (x[:1] and
    # x): each but the first is a copy, which the export can take, but an in-place write to one
    # would not show through the others as in PyTorch
    aliased: frozenset[int] = frozenset()

    def rebuild(self, tensors: Sequence[torch.Tensor]):
        leaves = list(self.leaves)
        for pos, t in zip(self.positions, tensors):
            leaves[pos] = t
        return pytree.tree_unflatten(leaves, self.spec)


def _reject_arrays(leaves: list, args: tuple, kwargs: dict) -> None:
    """Raise ``InputMismatchError`` naming the first numpy array among a call's leaves.

    A non-tensor argument is baked into the graph as a constant and keys the graph cache by
    its value, which for an array means stale results (its repr, the key, elides the middle
    of large arrays) or an export per batch: data must come as torch tensors.
    """
    if not any(isinstance(leaf, np.ndarray) for leaf in leaves):
        return
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, np.ndarray):
            where = pytree.keystr(path[1:])
            what = f"positional argument {where}" if path[0].idx == 0 else f"keyword argument {where}"
            raise InputMismatchError(
                f"ORTModule's inputs must be torch tensors: {what} is a numpy.ndarray "
                f"(shape {list(leaf.shape)}, {leaf.dtype}); pass torch.from_numpy(array)")


def flatten_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> FlatCall:
    """The call ``module(*args, **kwargs)`` flattened; ``InputMismatchError`` for numpy arrays."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    _reject_arrays(leaves, args, kwargs)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    state, modules = _named_state(module)
    # a view of the module's own parameter or buffer (m(x, m.weight[:2])) as an argument: torch's
    # export cannot take an input that aliases the module's state; a copy (autograd carries its
    # gradient back to the parameter) can
    state_ids = {id(t) for t in state.values()}
    tensors = [leaves[i].clone() if leaves[i]._base is not None and id(leaves[i]._base) in state_ids else leaves[i]
               for i in positions]
    aliased = _copy_aliased_arguments(tensors) if len(tensors) > 1 else frozenset()
    tensor_positions = set(positions)
    constants = tuple(_freeze(leaf) for i, leaf in enumerate(leaves) if i not in tensor_positions)
    schema = CallSchema(
        tree=str(spec),
        constants=constants,
        tensors=tuple((i, t.dtype, t.dim(), t.device) for i, t in zip(positions, tensors)),
        training=module.training,
        parameters=tuple((n, p.dtype, p.device, p.shape) for n, p in state.items()),
        ties=_ties(state),
        modules=modules,
    )
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return FlatCall(tensors, template, positions, spec, schema, state, aliased)


def _copy_aliased_arguments(tensors: list[torch.Tensor]) -> frozenset[int]:
    """Replace (in place) every argument that shares memory with an earlier one (``x[:1]`` and
    ``x``, ``h`` and ``h[:, 0]``) by a copy: torch's export cannot take inputs that alias each
    other. Returns the positions of every argument in such a group, the first ones too."""
    first: dict[int, int] = {}
    aliased = set()
    for k, tensor in enumerate(tensors):
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            continue
        address = tensor.untyped_storage().data_ptr()
        if not address:  # no memory (an empty tensor)
            continue
        earlier = first.setdefault(address, k)
        if earlier != k:
            tensors[k] = tensor.clone()
            aliased.update((earlier, k))
    return frozenset(aliased)


def _ties(state: dict[str, torch.Tensor]) -> tuple[tuple[str, str], ...]:
    """``(name, first name of the same tensor)`` for every place that holds a tensor an earlier
    place holds too."""
    first: dict[int, str] = {}
    return tuple((name, owner) for name, tensor in state.items()
                 if (owner := first.setdefault(id(tensor), name)) != name)


def constant_argument_names(call: FlatCall) -> list[str]:
    """Readable names of a call's non-tensor leaves, in their order (``CallSchema.constants``):
    ``argument 'temperature'``, ``positional argument 1``, with the path inside containers."""
    indices = pytree.tree_unflatten(list(range(len(call.leaves))), call.spec)
    tensor_places = set(call.positions)
    names = []
    for path, index in pytree.tree_flatten_with_path(indices)[0]:
        if index in tensor_places:
            continue
        where, first, rest = path[0], path[1], path[2:]
        base = f"positional argument {first.idx}" if where.idx == 0 else f"argument {first.key!r}"
        names.append(base + pytree.keystr(rest))
    return names


def _named_state(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """Parameters then buffers by qualified name, as ``named_parameters`` + ``named_buffers``
    (duplicates kept) give them, and the ``id`` of every submodule in walk order, in one walk
    over the submodules (this runs on every call)."""
    parameters: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    modules = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        modules.append(id(sub))
        dot = prefix + "." if prefix else ""
        for name, p in sub._parameters.items():
            if p is not None:
                parameters[dot + name] = p
        for name, b in sub._buffers.items():
            if b is not None:
                buffers[dot + name] = b
    parameters.update(buffers)
    # a submodule garbage-collected after an export may leave its id to a new one: the export's
    # attribute record (ortmodule) then finds the old one gone and does not match
    return parameters, tuple(modules)


@dataclass
class TracedOutput:
    """The structure of a traced call's output: its tree, its non-tensor leaves (None at the
    tensors' places, which ``positions`` lists: a None among the leaves is an output too), the
    places of complex tensors (the ONNX graph gives each as real and imaginary parts along a
    last axis of 2), and those of the floating-point tensors that did not require grad in the
    traced call although something did: ``torch.rand_like(y)``, the statistics outputs of
    ``aten.native_layer_norm``, a custom Function's ``mark_non_differentiable`` outputs. Such
    an output gets no gradient even where the graph computes it from a parameter."""

    spec: pytree.TreeSpec
    leaves: list
    positions: list[int]
    complex_positions: frozenset[int] = frozenset()
    without_grad: frozenset[int] = frozenset()

    def outputs_without_grad(self) -> list[int]:
        """The graph's user outputs (indices in graph order) that PyTorch gives no gradient."""
        return [k for k, position in enumerate(self.positions) if position in self.without_grad]


class _Recorder(list):
    """Collects (output spec, output leaves) of traced calls. The exporter traces a copy of
    the wrapper, so the recorder is shared by copies instead of copied."""

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


# custom Functions of libraries whose backward is the gradient of their forward, by module and
# name (looked up only where the library is imported already): BLOOM's tanh GELU, whose backward
# is the forward's derivative with its constants multiplied out
_EXACT_LIBRARY_FUNCTIONS = (("transformers.models.bloom.modeling_bloom", "GeLUFunction"),)


def _exact_torch_functions() -> frozenset[type]:
    """Autograd Functions whose backward is the gradient of their forward: torch's reentrant
    checkpoint (its backward reruns its forward and differentiates it) and known library ones."""
    from torch.utils.checkpoint import CheckpointFunction
    exact = {CheckpointFunction}
    for module_name, name in _EXACT_LIBRARY_FUNCTIONS:
        function = getattr(sys.modules.get(module_name), name, None)
        if function is not None:
            exact.add(function)
    return frozenset(exact)


# custom ops (torch.library) with an autograd registration whose forward onnxtrain translates
# (torch.onnx's table in onnxtrain.torch._translations), so that the gradient graph differentiates
# the op itself: transformers' grouped product of mixture-of-experts layers
_TRANSLATED_CUSTOM_OPS = frozenset({"GeneratedBackwardFor_transformers_grouped_mm_fallback_default"})


def _is_translated_custom_op_function(cls: type) -> bool:
    """Whether ``cls`` is the autograd Function torch generates for a custom op onnxtrain
    translates (its registered backward is the gradient of the op)."""
    return cls.__module__ == "torch._library.autograd" and cls.__name__ in _TRANSLATED_CUSTOM_OPS


def _is_higher_order_op_function(cls: type) -> bool:
    """Whether ``cls`` is the autograd Function of one of torch's higher-order ops (``torch.cond``,
    ``torch._higher_order_ops.while_loop``, ...): its backward differentiates the op's subgraphs,
    which is what the exported control flow (If, Loop, Scan) gets from onnxtrain's rules."""
    return cls.__module__.startswith("torch._higher_order_ops.")


@dataclass
class AutogradGraph:
    """What the autograd graph of some tensors holds: the custom Functions with a backward
    node there (each once, in the order met) and the leaf tensors gradients accumulate into."""

    functions: list[type]
    leaves: list[torch.Tensor]


def autograd_graph(tensors: Sequence, inputs: Sequence = ()) -> AutogradGraph:
    """Walk the autograd graph of ``tensors`` (other leaves are skipped). The walk stops at
    the tensors ``inputs`` that are not leaves (a call's arguments computed earlier), which count
    as leaves: what produced them is not the call's.

    Inside a capture the walk is not traced: reading the ``grad_fn`` of a view whose base was
    written in place afterwards (``y = linear(x3d); y[:, 1:3] = ...``) makes autograd replay the
    view, and a traced replay leaves a fake tensor among the exported program's constants."""
    with disable_proxy_modes_tracing():
        return _walk_autograd_graph(tensors, inputs)


def _walk_autograd_graph(tensors: Sequence, inputs: Sequence) -> AutogradGraph:
    functions: dict[type, None] = {}
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    boundary = {id(t.grad_fn): t for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    pending = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in boundary:
            leaves.setdefault(id(boundary[id(node)]), boundary[id(node)])
            continue
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            functions.setdefault(node._forward_cls)
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(leaf, torch.Tensor):
            leaves.setdefault(id(leaf), leaf)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return AutogradGraph(list(functions), list(leaves.values()))


def autograd_functions(tensors: Sequence) -> list[type]:
    """The ``torch.autograd.Function`` classes with a backward node in the autograd graph of
    ``tensors``, each once, in the order met."""
    return autograd_graph(tensors).functions


def _function_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _tensor_attributes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain attributes of ``module`` and its submodules that hold tensors (not parameters
    or buffers, which live in their own dicts), by qualified name."""
    return {f"{prefix}.{name}" if prefix else name: value for prefix, sub in module.named_modules()
            for name, value in vars(sub).items() if isinstance(value, torch.Tensor)}


def _unregistered_tensor_names(module: torch.nn.Module) -> dict[int, str]:
    """id -> qualified name of the tensors ``module``'s submodules hold outside their parameters
    and buffers: plain tensor attributes, and those in plain lists, tuples and dicts (of tensors
    or of modules, whose parameters are then not the wrapped module's)."""
    names: dict[int, str] = {}
    for prefix, sub in module.named_modules():
        for attribute, value in vars(sub).items():
            if attribute in ("_parameters", "_buffers", "_modules"):
                continue  # registered
            base = f"{prefix}.{attribute}" if prefix else attribute
            items = value.items() if isinstance(value, dict) else enumerate(value) \
                if isinstance(value, (list, tuple)) else [(None, value)]
            for key, item in items:
                name = base if key is None else f"{base}[{key!r}]"
                if isinstance(item, torch.Tensor):
                    names.setdefault(id(item), name)
                elif isinstance(item, torch.nn.Module) and key is not None:
                    for inner, tensor in itertools.chain(item.named_parameters(), item.named_buffers()):
                        names.setdefault(id(tensor), f"{name}.{inner}")
    return names


def _depends_on_data(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a traced one-element tensor whose value the capture does not know."""
    return is_fake(tensor) and getattr(tensor, "constant", None) is None and tensor.numel() == 1


# how a forward reads an integer out of a one-element tensor
_INTEGER_READS = frozenset({torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__})


def _holds_integer(value) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
        and value.dtype != torch.bool


class _NumberRecorder(torch.overrides.TorchFunctionMode):
    """Notes, in order, each integer a forward run in PyTorch reads from a tensor (``.item()``,
    ``int()``, as an index): the ``numbers`` a capture of the same call gives those reads."""

    def __init__(self):
        super().__init__()
        self.numbers: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _INTEGER_READS and _holds_integer(args[0]):
            self.numbers.append(int(result))
        return result


def numbers_read_by(module: torch.nn.Module, call: FlatCall) -> list[int]:
    """The integers ``module``'s forward reads from tensors when called as ``call`` in PyTorch
    (:class:`_NumberRecorder`), in a run that leaves the module, the call's objects and torch's
    random generators as they were."""
    copied = dataclasses.replace(call, leaves=[_copied_object(leaf) for leaf in call.leaves])
    args, kwargs = copied.rebuild(copied.tensors)
    with module_state_kept(module), torch.no_grad(), _NumberRecorder() as recorder:
        module(*args, **kwargs)
    return recorder.numbers


class _ForwardWatch(torch.overrides.TorchFunctionMode):
    """Notes what the traced forward does that the capture cannot follow.

    Grad mode: the capture follows it through Python's ``torch._C._set_grad_enabled`` calls; a
    custom Function's apply switches it in C++ around its forward, so a ``torch.no_grad()``
    inside that forward (a reentrant checkpoint's) leaves the capture believing grad is off
    after the Function returns, and the ops after it in a no-grad region of their own.
    ``hidden`` is set where the real mode at such a call, or at the end, is not the one the
    calls so far set.

    Gradient hooks: ``tensor_hooks`` names each hook the forward registers on a tensor
    (``Tensor.register_hook``, ``torch.autograd.graph.register_multi_grad_hook``). The capture
    drops them, so a graph's backward would silently skip what they do to the gradients.

    Gradients: ``gradient_calls`` names each ``torch.autograd.grad`` or ``Tensor.backward`` the
    forward runs (a physics-informed network's derivatives), which the capture cannot trace.

    Branches on the data: ``if labels.max() >= vocab: raise ...`` asks for the truth of a traced
    one-element tensor, which the capture cannot know. Each such ``bool(tensor)`` (or ``.item()``
    of a boolean one: ``if mask.any().item():``) is answered
    from ``plan`` (False where it says nothing) and kept in ``assumptions`` as (tensor, answer):
    the graph computes each tensor as an extra output, and a call whose values differ from the
    answers runs in PyTorch instead (``ExportedGraph.assumptions``).

    Branches on sizes the data decides: ``if (labels >= 0).nonzero().size(0) > 0:`` (DeBERTa's
    classification loss), ``if idx.numel() == 0: continue``, ``if loss.item() > 0:`` ask for the
    truth of a condition on a size or number the capture cannot know (an unbacked symbol), which
    PyTorch's tracer refuses
    (``GuardOnDataDependentSymNode``). Each is answered from ``plan``, else as PyTorch's own
    size-oblivious reasoning decides it (such a size taken as neither 0 nor 1: the nonempty
    branch), else False; the tracer is told the answer (``torch._check``) and the condition is
    kept as a tensor among the ``assumptions``, as above.

    Integers read from the data: ``n = int(lengths.max())`` then ``x[:, :n]``, ``range(n)``,
    ``torch.zeros(n)`` need a number the capture cannot know, and ``int()`` of PyTorch's
    symbol for it fails (``GuardOnDataDependentSymNode``). Where ``numbers`` is given (each
    integer the forward read with ``.item()``, ``int()`` or as an index, in order, from a run in
    PyTorch on the call's own values: :func:`numbers_read_by`), each such read of a traced
    tensor gives that number, and ``tensor == number`` is kept among the ``assumptions`` (True):
    the graph is the one for those numbers, and a call whose values read others runs in PyTorch."""

    def __init__(self, plan: Sequence[bool] = (), numbers: Sequence[int] | None = None):
        super().__init__()
        self.numbers = numbers
        self.numbers_read = 0
        self.believed = torch.is_grad_enabled()
        self.hidden = False
        self.tensor_hooks: list[str] = []
        self.gradient_calls: list[str] = []
        self.plan = list(plan)
        self.assumptions: list[tuple[torch.Tensor, bool]] = []
        self.branch_lines: list[str] = []  # where each branch is, in the user's code

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._set_grad_enabled:
            self.hidden |= torch.is_grad_enabled() != self.believed
            self.believed = bool(args[0] if args else kwargs["enabled"])
        elif func is torch.Tensor.register_hook:
            hook = args[1] if len(args) > 1 else (kwargs or {}).get("hook")
            self.tensor_hooks.append(getattr(hook, "__qualname__", None) or type(hook).__name__)
        elif func is torch.autograd.grad or func is torch.Tensor.backward:
            self.gradient_calls.append("torch.autograd.grad" if func is torch.autograd.grad else "Tensor.backward")
        elif (func is torch.Tensor.__bool__ or func is torch.Tensor.item and args[0].dtype == torch.bool) \
                and _depends_on_data(args[0]):
            answer = self.plan[len(self.assumptions)] if len(self.assumptions) < len(self.plan) else False
            return self._answer(args[0], answer)
        elif func is torch._assert and isinstance(args[0], torch.Tensor) and _depends_on_data(args[0]):
            self._answer(args[0], True)  # (its own truth test runs where this mode is off: answered here, held)
            return None
        elif self.numbers is not None and func in _INTEGER_READS and _holds_integer(args[0]):
            position, self.numbers_read = self.numbers_read, self.numbers_read + 1
            if _depends_on_data(args[0]) and position < len(self.numbers):
                number = self.numbers[position]
                self._answer(torch.eq(args[0], number), True)
                return number
        return func(*args, **(kwargs or {}))

    def _answer(self, condition: torch.Tensor, answer: bool) -> bool:
        self.assumptions.append((condition, answer))
        self.branch_lines.append(_user_frame(traceback.extract_stack()) or "")
        return answer

    def _answer_size_condition(self, condition: torch.SymBool) -> bool:
        """The truth of a condition on sizes the data decides, which the tracer refused."""
        if len(self.assumptions) < len(self.plan):
            answer = self.plan[len(self.assumptions)]
        else:
            try:  # (a private method of PyTorch's shape environment: False where it is missing)
                oblivious = condition.node.shape_env._maybe_evaluate_static(condition.node.expr, size_oblivious=True)
            except (AttributeError, TypeError):
                oblivious = None
            answer = bool(oblivious) if oblivious is not None else False
        torch._check(condition if answer else torch.sym_not(condition))
        return self._answer(torch.scalar_tensor(condition, dtype=torch.bool), answer)

    def __enter__(self):
        truth_of, watch, thread = torch.SymBool.__bool__, self, threading.get_ident()

        def answered_truth(condition: torch.SymBool) -> bool:
            try:
                return truth_of(condition)
            except GuardOnDataDependentSymNode:
                if threading.get_ident() != thread:  # (another thread's trace)
                    raise
                return watch._answer_size_condition(condition)

        self._symbolic_truth = truth_of
        torch.SymBool.__bool__ = answered_truth
        return super().__enter__()

    def __exit__(self, *exc):
        torch.SymBool.__bool__ = self._symbolic_truth
        self.hidden |= torch.is_grad_enabled() != self.believed
        return super().__exit__(*exc)


class _FlatModule(torch.nn.Module):
    """Calls the user's module from flat tensors; returns flat output tensors, then all buffers,
    then the flat tensors themselves (as the forward left them)."""

    def __init__(self, module: torch.nn.Module, call: FlatCall, buffer_names: list[str]):
        super().__init__()
        setattr(self, _MODULE_ATTR, module)
        self._call = call
        self._buffer_names = buffer_names
        self.traced_outputs = _Recorder()
        self.autograd_functions = _Recorder()  # the custom Functions the traced forward ran
        # whether grad mode changed where the capture could not follow it (_ForwardWatch)
        self.hidden_grad_switches = _Recorder()
        # the gradient hooks the traced forward registered on tensors, and the gradients it
        # computed (_ForwardWatch)
        self.tensor_hooks = _Recorder()
        self.gradient_calls = _Recorder()
        # the call's tensors (positions) and parameters (names) a gradient reaches in autograd's
        # own graph of the traced call: what the exported graph's gradients must reach too
        self.gradient_reaches = _Recorder()
        # module attributes the traced forward set to tensors (which the graph cannot set)
        self.stored_tensors = _Recorder()
        # tensors that require grad, reached by the traced call's gradients, that are neither
        # the call's tensors nor the module's parameters (the graph would hold them as constants)
        self.foreign_leaves = _Recorder()
        # per traced call, the positions of the call's tensors the forward wrote to (their
        # version counters moved): an output the graph gives for another one is an alias
        self.written_inputs = _Recorder()
        # the answers to the forward's branches on the data (_ForwardWatch): given for the next
        # capture, taken per traced call, and those of a traced call that raised
        self.assumption_plan: list[bool] = []
        # the integers the forward reads from the data, from a run in PyTorch (None: not read;
        # the capture then leaves them to PyTorch's symbols, see _ForwardWatch)
        self.numbers: list[int] | None = None
        self.assumptions = _Recorder()
        self.branch_lines = _Recorder()
        self.raised_after = _Recorder()

    def forward(self, *tensors):
        args, kwargs = self._call.rebuild(tensors)
        module = getattr(self, _MODULE_ATTR)
        before = _tensor_attributes(module)
        versions = [None if t.is_inference() else t._version for t in tensors]  # inference tensors have none
        tracked = torch.is_grad_enabled()  # (off: no output requires grad, which says nothing)
        with _ForwardWatch(self.assumption_plan, self.numbers) as watch:
            try:
                out = module(*args, **kwargs)
            except GuardOnDataDependentSymNode as exc:
                if self.numbers is not None:
                    raise
                # a number read from the data, used where the capture needs its value: the
                # capture is retried with the numbers (_capture_reading_numbers). (Under its own
                # type, whose message torch.fx does not answer by printing the graph so far.)
                raise _NumberUnknown("a number read from the data is needed as a value") from exc
            except Exception as exc:
                # a raise of the forward's own code on a path an answer chose (a check, an
                # assertion): the next capture tries another answer
                if watch.assumptions and _raised_by_user_code(exc):
                    self.raised_after.append([answer for _, answer in watch.assumptions])
                raise
        self.assumptions.append([answer for _, answer in watch.assumptions])
        self.branch_lines.append(watch.branch_lines)
        self.written_inputs.append({i for i, (t, v) in enumerate(zip(tensors, versions))
                                    if v is None or t._version != v})  # (None: the graph decides)
        if watch.hidden:
            self.hidden_grad_switches.append(True)
        self.tensor_hooks.extend(watch.tensor_hooks)
        self.gradient_calls.extend(watch.gradient_calls)
        self.stored_tensors.extend(key for key, value in _tensor_attributes(module).items()
                                   if before.get(key) is not value)
        leaves, spec = pytree.tree_flatten(out)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.traced_outputs.append(TracedOutput(
            spec, [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], positions,
            frozenset(i for i in positions if leaves[i].is_complex()),
            frozenset(i for i in positions if tracked and not leaves[i].requires_grad
                      and (leaves[i].is_floating_point() or leaves[i].is_complex()))))
        traced = autograd_graph(leaves, tensors)
        self.autograd_functions.extend(traced.functions)
        keys = {id(t): i for i, t in enumerate(tensors)}
        keys.update((id(p), name) for name, p in module.named_parameters(remove_duplicate=False))
        self.gradient_reaches.extend(keys[id(t)] for t in traced.leaves if id(t) in keys)
        # (a leaf the forward itself made, as Wav2Vec2's feature encoder sets requires_grad on a
        # view of its input, is one of the capture's fake tensors: its gradient goes nowhere)
        foreign = [t for t in traced.leaves if id(t) not in keys and t.requires_grad and not is_fake(t)]
        if foreign:
            names = _unregistered_tensor_names(module)
            self.foreign_leaves.extend(names.get(id(t), f"a {str(t.dtype).removeprefix('torch.')} tensor of shape "
                                                        f"{list(t.shape)}") for t in foreign)
        # then the call's own tensors: one the forward changed in place comes out changed
        return (*[leaf for leaf in leaves if isinstance(leaf, torch.Tensor)],
                *[_state_tensor(module, n) for n in self._buffer_names], *tensors,
                *[tensor.reshape(()).to(torch.bool) for tensor, _ in watch.assumptions])


def _state_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The buffer or parameter ``name`` of ``module``."""
    try:
        return module.get_buffer(name)
    except AttributeError:
        return module.get_parameter(name)


@dataclass
class ExportedGraph:
    """A module call as an ONNX graph (parameters and buffers as inputs).

    Graph inputs: the call's tensors (``num_user_inputs``), then the module state named in
    ``state_names``. Graph outputs: the call's output tensors (``num_user_outputs``), then
    the new values of the buffers in ``buffer_updates``, then those of the call's tensors the
    forward changed in place (positions in ``input_updates``).
    """

    model: ir.Model
    num_user_inputs: int
    state_names: list[str]
    num_user_outputs: int
    buffer_updates: list[str]
    output: TracedOutput
    input_shapes: list[tuple]                 # per user input: ints and symbol names
    dim_ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    exported: ir.Model | None = None          # the exporter's graph, for DebugOptions.save_onnx
    # the graph inputs (positions, as ``num_user_inputs`` then ``state_names``) that required
    # grad in the traced call: where custom autograd Functions were looked for
    traced_grads: frozenset[int] = frozenset()
    input_updates: list[int] = field(default_factory=list)
    # the exporter's guards on the symbolic dims (sympy expressions over the input dims' names)
    shape_guards: list = field(default_factory=list)
    # the answers the capture took for the forward's branches on the data (_ForwardWatch): the
    # graph's last outputs are those conditions' values, and a call they differ for runs in PyTorch
    assumptions: tuple[bool, ...] = ()
    _guard_results: dict = field(default_factory=dict, repr=False)

    def accepts(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether this graph computes a call with these input shapes (same schema assumed)."""
        bound: dict[str, int] = {}
        for t, dims in zip(tensors, self.input_shapes):
            if t.dim() != len(dims):
                return False
            for size, dim in zip(t.shape, dims):
                if isinstance(dim, int):
                    if size != dim:
                        return False
                    continue
                if bound.setdefault(dim, size) != size:
                    return False
                low, high = self.dim_ranges.get(dim, (0, None))
                # the capture traces symbolic dims as at least 2 (backed_size_oblivious): a size of
                # 0 or 1 takes other paths (squeeze() drops it, broadcasting stretches it) and gets
                # a graph of its own
                if size < max(low, 2) or (high is not None and size > high):
                    return False
        return not self.shape_guards or self._guards_hold(bound)

    def _guards_hold(self, sizes: dict[str, int]) -> bool:
        """Whether the exporter's shape guards hold for these sizes of the symbolic dims (the
        forward's Python code branched or computed on shapes: ``x.shape[0] % 2``, a product of
        dims that must match a layer's width); once per distinct set of sizes."""
        key = tuple(sorted(sizes.items()))
        held = self._guard_results.get(key)
        if held is None:
            held = all(_guard_holds(guard, sizes) for guard in self.shape_guards)
            self._guard_results[key] = held
        return held

    def rebuild_output(self, tensors: Sequence[torch.Tensor]):
        leaves = list(self.output.leaves)
        for position, tensor in zip(self.output.positions, tensors):
            leaves[position] = torch.view_as_complex(tensor) if position in self.output.complex_positions else tensor
        return pytree.tree_unflatten(leaves, self.output.spec)


def positions_requiring_grad(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The positions of the float tensors that require grad: those that receive gradients."""
    return tuple(i for i, t in enumerate(tensors) if t.requires_grad and t.is_floating_point())


def _guard_holds(guard, sizes: dict[str, int]) -> bool:
    """A sympy guard evaluated at these dim sizes; False where it does not reduce to a truth value."""
    values = {symbol: sizes[symbol.name] for symbol in guard.free_symbols if symbol.name in sizes}
    try:
        return bool(guard.xreplace(values))
    except TypeError:
        return False


def _only_unbacked(expr) -> bool:
    """Whether ``expr`` is about values the graph computes only (unbacked symbols: a data-dependent
    size, a loop's counter), a runtime assert no input shape decides."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    symbols = getattr(expr, "free_symbols", set())
    return bool(symbols) and free_unbacked_symbols(expr) == symbols


def _shape_guards(program, input_dims: set[str]) -> list:
    """The guards (and deferred runtime asserts) of the capture's shape environment that still
    depend on a symbolic dim, in the graph inputs' dim names; ``ExportError`` for one that
    depends on a symbol the inputs do not show (the graph could not be checked for a call)."""
    fake = next((n.meta["val"] for n in program.graph.nodes
                 if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)), None)
    env = getattr(getattr(fake, "fake_mode", None), "shape_env", None)
    if env is None:
        return []
    exprs = [guard.expr for guard in env.guards]
    exprs += [run_assert.expr for asserts in env.deferred_runtime_asserts.values() for run_assert in asserts]
    guards = []
    for expr in exprs:
        expr = env.replace(expr)
        symbols = {symbol.name for symbol in getattr(expr, "free_symbols", ())}
        if not symbols or _only_unbacked(expr):
            continue
        if not symbols <= input_dims:
            raise ExportError(f"the capture's shape guard {expr} depends on dims the graph's inputs do not show")
        guards.append(expr)
    return guards


def _bound(value) -> int | None:
    """An int bound of a sympy range, None when unbounded (sympy or torch infinity)."""
    if getattr(value, "is_finite", True) is False or "oo" in str(value):
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _dim_ranges(exported_program) -> dict[str, tuple[int, int | None]]:
    ranges = {}
    for symbol, value_range in exported_program.range_constraints.items():
        ranges[str(symbol)] = (_bound(value_range.lower) or 0, _bound(value_range.upper))
    return ranges


def _refusal(exc: BaseException | None) -> NotImplementedError | None:
    """The NotImplementedError among ``exc``'s causes: a translation refusing what it cannot
    train (onnxtrain.torch._translations), whose message names the reason."""
    return _cause_of_kind(exc, NotImplementedError)


_TERMINAL_COLOR = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_CLASS = re.compile(r"^<class '(?:[\w.]+\.)?(\w+)'>:\s*")


def _exporter_summary(text: str) -> str | None:
    """The first entry of ``torch.onnx.export``'s "Exception summary" (the innermost error, e.g.
    ``DispatchError: No ONNX function found for <OpOverload(op='aten.randperm', ...)>``): its
    first line only says which of its steps failed."""
    lines = text.splitlines()
    try:
        start = lines.index("## Exception summary") + 1
    except ValueError:
        return None
    entry = next((line.strip() for line in lines[start:] if line.strip()), None)
    return _EXCEPTION_CLASS.sub(lambda m: f"{m.group(1)}: ", entry) if entry else None


def export_failure(what: str, exc: Exception) -> ExportError:
    """``ExportError`` saying ``what`` failed, with the first line of the exporter's reason, its
    exception summary's first entry, and a translation's refusal found among its causes."""
    text = _TERMINAL_COLOR.sub("", str(exc)).strip()
    first_line = text.splitlines()[0].removesuffix("Next steps:").strip() if text else type(exc).__name__
    details = []
    constraints = _constraint_details(text)
    if constraints:
        details.append(constraints)
    where = _raising_call(text, exc)
    if where is not None:
        details.append(where)
    summary = _exporter_summary(text)
    if summary is not None:
        details.append(summary)
    refusal = _refusal(exc)
    if refusal is not None and refusal is not exc and str(refusal):
        details.append(str(refusal))
    detail = "".join(f" ({d})" for d in details)
    return ExportError(f"{what}: {type(exc).__name__}: {first_line}{detail}")


def _raising_call(text: str, exc: BaseException) -> str | None:
    """Where in the user's code the capture failed, as torch reports it after "The following call
    raised this error:" (a Python branch on a tensor's value, ...): "at <file>:<line> (<code>)"."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "The following call raised this error" in line), None)
    if start is None:
        return None
    frame = re.search(r'File "([^"]+)", line (\d+)', " ".join(lines[start + 1:start + 2]))
    if frame is None:
        return None
    if frame.group(1) == __file__:
        # the call torch names is _ForwardWatch's: the user's is the innermost frame of the
        # raising traceback outside torch and onnxtrain
        return _innermost_user_line(exc)
    code = lines[start + 2].strip() if start + 2 < len(lines) else ""
    return f"at {frame.group(1)}:{frame.group(2)}" + (f": {code}" if code else "")


def _user_frame(frames) -> str | None:
    """"at <file>:<line>: <code>" for the innermost of ``frames`` (``traceback.FrameSummary``s,
    outermost first) that is neither torch's nor onnxtrain's."""
    libraries = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["onnxtrain"]))
    user = [f for f in frames if not f.filename.startswith(libraries)]
    if not user:
        return None
    return f"at {user[-1].filename}:{user[-1].lineno}" + (f": {user[-1].line}" if user[-1].line else "")


def _raised_by_user_code(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by code that is neither torch's nor onnxtrain's (a ``raise`` or
    ``assert`` of the model's), not by the capture's machinery."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and _user_frame(frames[-1:]) is not None


def _innermost_user_line(exc: BaseException) -> str | None:
    """"at <file>:<line>: <code>" for the innermost frame of ``exc``'s traceback (or its causes')
    that is neither torch's nor onnxtrain's."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        where = _user_frame(traceback.extract_tb(exc.__traceback__))
        if where is not None:
            return where
        exc = exc.__cause__ or exc.__context__
    return None


def _constraint_details(text: str, most: int = 4) -> str | None:
    """For torch.export's "Constraints violated" (a dynamic dim the model does not allow over
    its whole range): the violated guards and torch's suggested fixes, which say which range
    would export."""
    if "Constraints violated" not in text:
        return None
    lines = text.splitlines()
    guards = [line.strip().removeprefix("- ") for line in lines if line.strip().startswith("- Not all values")]
    fixes: list[str] = []
    if "Suggested fixes:" in text:
        start = next(i for i, line in enumerate(lines) if "Suggested fixes:" in line) + 1
        for line in lines[start:start + most]:
            if not line.strip():
                break  # the block ends at a blank line
            fixes.append(line.strip())
    parts = guards[:most] + ([f"suggested fixes: {'; '.join(fixes)}"] if fixes else [])
    return "; ".join(parts) if parts else None


def _check_functions(module: torch.nn.Module, found: Sequence[type], inline: frozenset[type] | bool,
                     option: str = "ORTModule(..., inline_autograd_functions=[...])") -> None:
    """``ExportError`` naming the custom Functions in ``found`` whose own backward the gradient
    graph would not run: all but torch's exact ones and ``inline``'s (none if ``inline`` is
    True). Backward hooks, which run as such a Function too, are refused before the export
    (:func:`_check_module_hooks`)."""
    found = list(dict.fromkeys(found))
    if inline is True:
        return
    exact = _exact_torch_functions() | inline
    custom = [cls for cls in found if cls not in exact and not _is_higher_order_op_function(cls)
              and not _is_translated_custom_op_function(cls)]
    if custom:
        names = ", ".join(_function_name(cls) for cls in custom)
        raise ExportError(
            f"{type(module).__name__} runs custom torch.autograd.Function {names}: the exported graph traces "
            f"their forward, so ONNX Runtime would differentiate that instead of running their own backward. "
            f"If their backward is the exact gradient of their forward, pass them in {option}")


class ForwardHookWarning(UserWarning):
    """A module ORTModule exports has forward hooks: they run once, while it is traced."""


# a forward hook with this attribute set computes only what the graph holds (no side effects):
# ORTModule traces it without a ForwardHookWarning (ORTTrainer's NEFTune noise)
PURE_HOOK_ATTRIBUTE = "_onnxtrain_pure_hook"


def _hooked(module: torch.nn.Module, kind: str) -> str:
    """Where ``kind`` ("forward" or "backward") hooks are registered: on ``module``, its
    submodules (by name, the first 8) or globally; "" where none is. Hooks marked with
    ``PURE_HOOK_ATTRIBUTE`` are left out."""
    from torch.nn.modules import module as module_globals

    def impure(hooks) -> bool:
        return any(not getattr(hook, PURE_HOOK_ATTRIBUTE, False) for hook in hooks.values())

    hooked = [name or "the module itself" for name, sub in module.named_modules()
              if impure(getattr(sub, f"_{kind}_hooks")) or impure(getattr(sub, f"_{kind}_pre_hooks"))]
    if getattr(module_globals, f"_global_{kind}_hooks", None) or getattr(module_globals, f"_global_{kind}_pre_hooks",
                                                                         None):
        hooked.append(f"every module (a global {kind} hook)")
    return ", ".join(hooked[:8]) + (", ..." if len(hooked) > 8 else "")


def _warn_forward_hooks(module: torch.nn.Module) -> None:
    hooked = _hooked(module, "forward")
    if hooked:
        warnings.warn(
            f"ORTModule exports {type(module).__name__} with forward hooks on {hooked}: they run once, while the "
            f"forward is traced, and what they compute is part of the graph; their side effects (recording "
            f"activations, counting calls) do not happen on later calls", ForwardHookWarning, stacklevel=4)


def _check_module_hooks(module: torch.nn.Module) -> None:
    """``ExportError`` if a backward hook is registered on ``module``, a submodule or globally
    (``register_full_backward_hook``, its pre-hook, or the legacy ``register_backward_hook``):
    the export would trace the forward without them and ONNX Runtime's backward not call them."""
    hooked = _hooked(module, "backward")
    if hooked:
        raise ExportError(f"{type(module).__name__} has backward hooks ({hooked}): ONNX Runtime's backward cannot "
                          f"call them")


def _check_output_leaves(module: torch.nn.Module, output: TracedOutput) -> None:
    """``ExportError`` for outputs a graph cannot give: numbers computed from the traced tensors'
    shapes (a dynamic export) or values (``.item()``), or tensors inside other objects."""
    symbolic = [type(leaf).__name__ for leaf in output.leaves
                if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool))]
    if symbolic:
        raise ExportError(f"{type(module).__name__} returns Python numbers computed from its tensors "
                          f"({', '.join(symbolic)}): an exported graph cannot return them for other inputs")
    hidden = [i for i, leaf in enumerate(output.leaves) if _holds_tensors(leaf)]  # None at the tensors' places
    if hidden:
        # the trace's object holds the exporter's placeholder tensors: returned as it is, it would
        # hand the caller FakeTensors (a Hugging Face model's DynamicCache with use_cache=True)
        kinds = ", ".join(sorted({type(output.leaves[i]).__name__ for i in hidden}))
        how = ("register the type as a pytree node: torch.utils._pytree.register_dataclass for a dataclass, "
               "register_pytree_node for another class")
        if not output.positions:  # nothing else: a graph without outputs
            raise ExportError(f"{type(module).__name__} returns a {kinds} holding tensors inside an object "
                              f"torch.utils._pytree does not flatten, which an exported graph cannot return: {how}")
        warnings.warn(f"ORTModule returns None in place of the {kinds} in {type(module).__name__}'s output: it holds "
                      f"tensors inside objects torch.utils._pytree does not flatten, which an exported graph cannot "
                      f"return (for a Hugging Face cache pass use_cache=False; or {how})",
                      DroppedOutputWarning, stacklevel=5)
        for i in hidden:
            output.leaves[i] = None


@contextlib.contextmanager
def module_state_kept(module: torch.nn.Module):
    """A run of ``module`` inside leaves it as it found it: its buffers (BatchNorm's statistics,
    which batch_norm updates without bumping their version counters) and parameters (a momentum
    encoder's, updated under torch.no_grad()) are put back, and so are torch's random generators
    (CPU, and the CUDA devices the module is on): a probing run does not count as a step.
    Yields a function that names the buffers and parameters the run has changed so far (in
    place, or replaced by another tensor)."""
    named = [*module.named_buffers(), *module.named_parameters()]
    state = [t for _, t in named]
    saved = [t.detach().clone() for t in state]
    devices = sorted({t.device.index or 0 for t in state if t.is_cuda})

    def changed() -> list[str]:
        now = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        return [name for (name, tensor), value in zip(named, saved)
                if now.get(name) is not tensor or not torch.equal(tensor.detach(), value)]

    try:
        with torch.random.fork_rng(devices=devices):
            yield changed
    finally:
        with torch.no_grad():
            for tensor, value in zip(state, saved):
                if tensor.shape == value.shape:
                    tensor.copy_(value)


@contextlib.contextmanager
def _dynamo_marks_kept(tensors: Sequence[torch.Tensor]):
    """The call's tensors leave the capture with the dynamo dim markings they came with: a
    dynamic capture marks its example tensors (``_dynamo_dynamic_indices``, ...), and a static
    retry on the same tensors after a failed dynamic one would be traced dynamically again."""
    before = [{k: v for k, v in vars(t).items() if "dynamo" in k} for t in tensors]
    try:
        yield
    finally:
        for tensor, marks in zip(tensors, before):
            for key in [k for k in vars(tensor) if "dynamo" in k and k not in marks]:
                delattr(tensor, key)
            for key, value in marks.items():
                setattr(tensor, key, value)


def _copied_object(leaf):
    """A deep copy of a call's object argument (``leaf`` itself for plain values, or where it
    cannot be copied)."""
    if leaf is None or isinstance(leaf, (str, bytes, int, float, bool, complex, type, torch.nn.Module, torch.dtype,
                                         torch.device, slice, range, Ellipsis.__class__)):
        return leaf
    if getattr(leaf, "__dict__", None) is None and not isinstance(leaf, (list, dict, set)):
        return leaf
    try:
        return copy.deepcopy(leaf)
    except Exception:  # noqa: BLE001 - an object that does not copy is traced as it is
        return leaf


class DroppedOutputWarning(UserWarning):
    """Part of a module's output ORTModule cannot return (tensors inside objects that
    torch.utils._pytree does not flatten) comes back as None."""


def _holds_tensors(value, depth: int = 4, seen: set[int] | None = None) -> bool:
    """Whether a plain object keeps tensors among its attributes, in lists, tuples or dicts of
    them, or in objects it holds (``depth`` levels down: a DynamicCache's layers hold its tensors)."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0 or isinstance(value, (torch.nn.Module, type, str, bytes, int, float, bool)) or value is None:
        return False
    seen = set() if seen is None else seen
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            return False
        items = list(attributes.values())
    return any(_holds_tensors(item, depth - 1, seen) for item in items)


def _unchanged(value: ir.Value) -> bool:
    """Whether a graph output is a graph input passed through (directly or by Identities)."""
    while value.producer() is not None and value.producer().op_type == "Identity":
        value = value.producer().inputs[0]
    return value.is_graph_input() or value.producer() is None


def _drawn(value: ir.Value) -> bool:
    """Whether ``value`` is computed from a random draw (a random op upstream, or inside a
    subgraph upstream)."""
    return any(node.op_type in RANDOM_OPS or any(inner.op_type in RANDOM_OPS for graph in subgraphs(node)
                                                 for inner in ir.traversal.RecursiveGraphIterator(graph))
               for node in upstream_nodes(value))


# how many other answers a capture tries for a forward that raised on a path its answers to
# branches on the data chose (``assert (x >= 0).all()`` raises where the answer is False)
_ANSWER_RETRIES = 4


def _capture_answering(wrapper: _FlatModule, tensors: tuple, dynamic_shapes) -> torch.export.ExportedProgram:
    """:func:`capture` of ``wrapper``, answering the forward's branches on the data False at
    first; where the forward then raises (a check's raise, an assertion's failure) the last False
    answer becomes True and the capture runs again, so the answers are those of the path that
    does not raise."""
    for _ in range(_ANSWER_RETRIES):
        raised = len(wrapper.raised_after)
        try:
            return capture(wrapper, tensors, dynamic_shapes)
        except Exception:
            if len(wrapper.raised_after) == raised or False not in wrapper.raised_after[-1]:
                raise
            answers = wrapper.raised_after[-1]
            last_false = len(answers) - 1 - answers[::-1].index(False)
            wrapper.assumption_plan = [*answers[:last_false], True]
    return capture(wrapper, tensors, dynamic_shapes)


def _capture_reading_numbers(module: torch.nn.Module, call: FlatCall, wrapper: _FlatModule,
                             dynamic_shapes) -> torch.export.ExportedProgram:
    """:func:`_capture_answering` of the call; where that fails on a number the forward reads
    from the data (``int(lengths.max())`` as a size or a count, which PyTorch's symbol for it
    cannot give), once more with the integers a run in PyTorch reads from this call's values
    (:func:`numbers_read_by`): the graph for those numbers, checked on every call."""
    tensors = tuple(call.tensors)
    try:
        return _capture_answering(wrapper, tensors, dynamic_shapes)
    except Exception as exc:
        unknown = _cause_of_kind(exc, _NumberUnknown)
        if unknown is None:
            raise
        guard = unknown.__cause__  # PyTorch's own error, which names the number and the line
        try:
            numbers = numbers_read_by(module, call)
        except Exception:  # noqa: BLE001  (the forward fails in PyTorch too: the capture's own error says more)
            raise guard from None
        if not numbers:  # not a number read with .item() (a size the data decides): nothing to retry with
            raise guard from None
        wrapper.numbers = numbers
    return _capture_answering(wrapper, tensors, dynamic_shapes)


class _NumberUnknown(RuntimeError):
    """A capture met a number read from the data where it needed its value."""


def _cause_of_kind(exc: BaseException | None, kind: type) -> BaseException | None:
    """``exc``, or the first exception it was raised from or during, that is a ``kind``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _straight_through(graph: ir.Graph, parameter: ir.Value, changed: ir.Value, outputs: list[ir.Value]) -> None:
    """Where the forward changes a trained parameter in place (under ``torch.no_grad()``, as
    ``nn.Embedding(max_norm=...)`` renormalizes its rows), the ops after the change read
    ``changed``, which the graph computes from ``parameter`` through a stop-gradient. PyTorch's
    autograd sees one leaf, so their gradients are the parameter's: they now read
    ``changed + (parameter - StopGradient(parameter))``, the same value (an exact zero added)
    with the identity as its derivative to ``parameter``. ``outputs`` (the user outputs, so far)
    that are ``changed`` are replaced too."""
    stopped = ir.node("Identity", [parameter], metadata_props={STOP_GRADIENT_METADATA: "1"})
    carrier = ir.node("Sub", [parameter, stopped.outputs[0]])
    passed = ir.node("Add", [changed, carrier.outputs[0]])
    for node in (stopped, carrier, passed):
        node.outputs[0].type, node.outputs[0].shape = changed.type, changed.shape
    users = [(node, index) for node, index in changed.uses() if node is not passed]
    if changed.producer() is None:
        graph.insert_before(graph[0], [stopped, carrier, passed])
    else:
        graph.insert_after(changed.producer(), [stopped, carrier, passed])
    for node, index in users:
        node.replace_input_with(index, passed.outputs[0])
    for position, output in enumerate(outputs):
        if output is changed:
            outputs[position] = passed.outputs[0]


def _new_output(graph: ir.Graph, value: ir.Value, name: str, outputs: list[ir.Value]) -> ir.Value:
    """``value`` named ``name``, as a graph output of its own (an Identity of it if it is one already)."""
    if value in outputs or value.is_graph_input():
        copy = ir.node("Identity", [value])
        graph.append(copy)
        copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
        value = copy.outputs[0]
    value.name = name
    return value


def check_gradient_paths(module: torch.nn.Module, graph: ir.Graph, reached: dict[str, ir.Value | None],
                         outputs: Sequence[ir.Value], why: str) -> None:
    """``ExportError`` if a value of ``reached`` (a label for the error -> the graph input or
    initializer it became; None if it is not in the graph), each something PyTorch's autograd
    reaches from the outputs, has no gradient path from ``outputs`` in the exported graph:
    training would silently leave it without gradient. ``why`` says what cuts such paths."""
    found = set(inputs_with_gradient(list(graph), [v for v in reached.values() if v is not None], outputs))
    missing = [label for label, value in reached.items() if value is None or value not in found]
    if missing:
        raise ExportError(
            f"the exported graph of {type(module).__name__} gives no gradient to {', '.join(missing[:8])}"
            f"{', ...' if len(missing) > 8 else ''}, which PyTorch's autograd reaches ({why})")


def export_call(module: torch.nn.Module, call: FlatCall, keep_exported: bool = False,
                dynamic: bool = True, inline_functions: frozenset[type] | bool = frozenset(),
                answers: Sequence[bool] = ()) -> ExportedGraph:
    """Export ``module`` called as ``call`` (see the module docstring): with every dim
    ``Dim.AUTO`` (``dynamic``) or with the call's own shapes (a static export traces without
    symbolic shapes: several times faster). ``keep_exported`` keeps a copy of the exporter's own
    graph in ``ExportedGraph.exported`` (for saving it). ``inline_functions``: the custom
    autograd Functions (True: all) whose backward is the gradient of their forward; any other
    that the forward runs on tensors requiring grad raises ``ExportError``."""
    _check_module_hooks(module)
    _warn_forward_hooks(module)
    if not call.tensors and not call.state:
        raise ExportError(f"{type(module).__name__} is called without tensors and holds no parameters or buffers: an "
                          f"exported graph would take nothing")
    hidden = [type(leaf).__name__ for leaf in call.leaves if _holds_tensors(leaf)]
    if hidden:
        raise ExportError(f"{type(module).__name__} is called with tensors inside {', '.join(hidden)} objects, which "
                          f"torch.utils._pytree does not flatten (the export would bake them in as constants): "
                          f"pass the tensors as arguments, or register the type as a pytree node")
    # what the forward may change in place: its buffers, and its parameters (a momentum encoder's
    # frozen ones, updated under torch.no_grad(); a trained one renormalized or clipped, as
    # nn.Embedding(max_norm=...) does); unchanged ones drop out of the graph below
    buffer_names = [*dict(module.named_buffers()), *dict(module.named_parameters())]
    # the trace calls the forward with copies of the call's objects: a forward that writes into
    # one (a Hugging Face cache given as an argument) must not leave the exporter's placeholder
    # tensors in the caller's object, and what it writes there, a graph cannot write
    objects = {i: copied for i, leaf in enumerate(call.leaves)
               if (copied := _copied_object(leaf)) is not leaf}
    traced_call = dataclasses.replace(call, leaves=[objects.get(i, leaf) for i, leaf in enumerate(call.leaves)])
    wrapper = _FlatModule(module, traced_call, buffer_names)
    wrapper.assumption_plan = list(answers)  # the answers to the forward's branches on the data to try first
    # dims of size 0 or 1 stay static: traced as symbolic they would take the paths of sizes >= 2
    # (backed_size_oblivious), see ExportedGraph.accepts
    dynamic_shapes = (tuple({d: torch.export.Dim.AUTO for d in range(t.dim()) if t.shape[d] >= 2}
                            for t in call.tensors),) if dynamic else None
    try:
        # in the call's grad mode (ORTModule keys graphs on it): with grad, the traced outputs'
        # autograd graph shows which custom Functions the forward runs
        with EXPORT_LOCK, quiet_exporter(), _dynamo_marks_kept(call.tensors):
            captured = _capture_reading_numbers(module, call, wrapper, dynamic_shapes)
            # the forward's no-grad regions stop gradients; but a Function (a reentrant
            # checkpoint) that sets grad mode inside its forward leaves the capture believing grad
            # is still off after it returns, so regions are only cut where none did so
            cuts = mark_gradient_cuts(captured, regions=not wrapper.hidden_grad_switches)
            # a reentrant checkpoint of tensors none of which requires grad gives its function's
            # parameters no gradient in eager (it warns so); its region cannot be cut alone here
            checkpoint_without_grad = (torch.is_grad_enabled() and has_checkpoint_region(captured)
                                       and CheckpointFunction not in wrapper.autograd_functions)
            requires_grad_traced = traced_requires_grad(captured) and not wrapper.hidden_grad_switches
            contiguous_as_clone(captured)
            attention_outputs_contiguous(captured)
            splits_with_sizes(captured)
            per_sample_losses_as_own_ops(captured)
            program = export_program(captured, translation_table(), complex_translation_table())
    except Exception as exc:  # the exporter raises many types; the reason is in the message
        if wrapper.gradient_calls:  # what the capture then fails on says nothing of it
            calls = ", ".join(dict.fromkeys(wrapper.gradient_calls))
            raise ExportError(f"{type(module).__name__}'s forward computes gradients ({calls}), which torch.onnx.export "
                              f"cannot capture") from exc
        raise export_failure(f"torch.onnx.export could not export {type(module).__name__}", exc) from exc

    if checkpoint_without_grad:
        raise ExportError(f"{type(module).__name__}'s forward runs a reentrant torch.utils.checkpoint on tensors none "
                          f"of which requires grad, whose function's parameters PyTorch leaves without gradient "
                          f"(use_reentrant=False, or inputs that require grad, train them)")
    if wrapper.tensor_hooks:
        hooks = ", ".join(dict.fromkeys(wrapper.tensor_hooks))
        raise ExportError(f"{type(module).__name__}'s forward registers gradient hooks on its tensors ({hooks}; "
                          f"Tensor.register_hook): ONNX Runtime's backward cannot call them, and an exported graph "
                          f"would compute the gradients without what they do")
    if not wrapper.traced_outputs:
        # the exporter got its graph without running the forward as written (one of its fallback
        # capture strategies): its inputs and outputs cannot be matched to the call's
        raise ExportError(f"torch.onnx.export did not trace {type(module).__name__}'s forward for this call "
                          f"({len(call.tensors)} tensor arguments)")
    _check_functions(module, wrapper.autograd_functions, inline_functions)
    written = sorted({type(copied).__name__ for copied in objects.values() if _holds_tensors(copied)})
    if written:
        raise ExportError(f"{type(module).__name__}'s forward stores tensors in its {', '.join(written)} argument: an "
                          f"exported graph cannot (for a Hugging Face cache pass use_cache=False)")
    traced_output = wrapper.traced_outputs[-1]
    if not requires_grad_traced:  # the graph decides which outputs get gradients
        traced_output = dataclasses.replace(traced_output, without_grad=frozenset())
    _check_output_leaves(module, traced_output)
    if wrapper.foreign_leaves:
        names = ", ".join(dict.fromkeys(wrapper.foreign_leaves))
        raise ExportError(f"{type(module).__name__}'s forward reads tensors that require grad but are not its "
                          f"parameters ({names}): an exported graph would hold them as constants, without "
                          f"gradients. Register them as parameters (nn.Parameter; nn.ModuleList or nn.ParameterList "
                          f"for lists)")
    if wrapper.stored_tensors:
        names = ", ".join(dict.fromkeys(wrapper.stored_tensors))
        raise ExportError(f"{type(module).__name__}'s forward stores tensors on modules ({names}): an exported "
                          f"graph computes them once, while traced, and never sets them again")
    model = program.model
    exported_copy = ir.from_proto(ir.to_proto(model)) if keep_exported else None
    graph = model.graph
    num_user_inputs = len(graph.inputs)
    if num_user_inputs != len(call.tensors):
        raise ExportError(f"the exported graph has {num_user_inputs} inputs for {len(call.tensors)} tensors")
    # a dim the capture specialized may keep a symbolic dim named by its value ("6")
    input_shapes = [tuple(d if isinstance(d, int) else int(str(d)) if str(d).isdigit() else str(d) for d in v.shape)
                    for v in graph.inputs]
    guards = _shape_guards(captured, {d for dims in input_shapes for d in dims if isinstance(d, str)})

    state = call.state
    state_names = []
    for name, value in list(graph.initializers.items()):
        fqn = name[len(_PREFIX):] if name.startswith(_PREFIX) else None
        if fqn is None or fqn not in state:
            continue  # an exporter constant
        graph.initializers.pop(name)
        value.const_value = None
        value.name = fqn
        graph.inputs.append(value)
        state_names.append(fqn)

    answers = tuple(wrapper.assumptions[-1]) if wrapper.assumptions else ()
    num_user_outputs = len(graph.outputs) - len(buffer_names) - num_user_inputs - len(answers)
    buffer_values = graph.outputs[num_user_outputs:num_user_outputs + len(buffer_names)]
    input_values = graph.outputs[num_user_outputs + len(buffer_names):len(graph.outputs) - len(answers)]
    condition_values = graph.outputs[len(graph.outputs) - len(answers):]
    updates = []
    kept = list(graph.outputs[:num_user_outputs])
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    for name, value in zip(buffer_names, buffer_values):
        if _unchanged(value):
            continue  # the forward did not change this buffer
        if name in trained and name in state_names:  # (one the graph never reads gets no gradient)
            _straight_through(graph, graph.inputs[num_user_inputs + state_names.index(name)], value, kept)
        kept.append(_new_output(graph, value, f"{name}.updated", kept))
        updates.append(name)
    input_updates = []
    for position, value in enumerate(input_values):
        # (torch.hstack returns its 2-D arguments themselves: the graph's value for the argument is
        # then its SequenceAt; the version counter tells that nothing wrote to it)
        if _unchanged(value) or position not in wrapper.written_inputs[-1]:
            continue
        kept.append(_new_output(graph, value, f"{graph.inputs[position].name}.updated", kept))
        input_updates.append(position)
    for index, value in enumerate(condition_values):  # last: the branch conditions' values
        if _drawn(value):  # a call in PyTorch would draw again: the branch's odds would change
            where = wrapper.branch_lines[-1][index]
            raise ExportError(f"{type(module).__name__}'s forward branches on a random draw{' ' + where if where else ''}: "
                              f"a graph takes one branch, and a call sent to PyTorch for the other would draw again")
        kept.append(_new_output(graph, value, f"branch_condition_{index}", kept))
    if not kept:
        leaves = ", ".join(type(leaf).__name__ for leaf in traced_output.leaves) or "nothing"
        raise ExportError(f"{type(module).__name__} returns no tensor ({leaves}) and changes no buffer or argument "
                          f"for this call: an exported graph would compute nothing")
    graph.outputs.clear()
    graph.outputs.extend(kept)
    pipeline.run(model, pipeline.before_autodiff())
    # a gradient cut the capture placed wrong would leave a call tensor or parameter without one
    keys = [*range(num_user_inputs), *state_names]
    reaches = set(wrapper.gradient_reaches)
    check_gradient_paths(module, graph, {f"input {key}" if isinstance(key, int) else key: value
                                         for value, key in zip(graph.inputs, keys) if key in reaches},
                         list(graph.outputs[:num_user_outputs]), f"{cuts} outputs of torch.no_grad() regions were cut")
    return ExportedGraph(
        model=model, num_user_inputs=num_user_inputs, state_names=state_names,
        num_user_outputs=num_user_outputs, buffer_updates=updates, input_updates=input_updates,
        output=traced_output,
        input_shapes=input_shapes, dim_ranges=_dim_ranges(program.exported_program),
        exported=exported_copy,
        traced_grads=frozenset(positions_requiring_grad([*call.tensors, *(state[name] for name in state_names)])),
        shape_guards=guards,
        assumptions=answers,
    )
