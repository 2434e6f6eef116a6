""":class:`HierarchicalORTModule`: ORTModule on every part of a model that ONNX Runtime can train.

One op ORTModule cannot export or differentiate sends the whole module back to PyTorch (its
fallback). ``HierarchicalORTModule`` (upstream's experimental class of the same name) instead
finds, on its first call, the largest submodules that do build and wraps each in an
:class:`~onnxtrain.torch.ORTModule`; the rest, between them, runs in PyTorch, and autograd
joins the two as usual.
"""

from __future__ import annotations

import logging

import torch
from torch.utils import _pytree as pytree

from onnxtrain.errors import OnnxTrainError
from onnxtrain.torch._export import flatten_call, module_state_kept
from onnxtrain.torch._wrapper import WRAPPED, ModuleWrapper, wrapped_signature
from onnxtrain.torch.ortmodule import DebugOptions, ORTModule

logger = logging.getLogger(__name__)


class HierarchicalORTModule(ModuleWrapper):
    """Wrap, top-down, each submodule of ``module`` that ORTModule can run as an ORTModule.

    The first call runs ``module`` once in PyTorch to record every submodule's arguments
    (on copies of the call's tensors; buffers such as BatchNorm's running statistics,
    parameters the forward changes in place and the random generators are restored afterwards;
    Python-side effects of the forward, a counter or a forward hook, do happen twice), then
    builds, from the root down, ORTModule's graphs and sessions for each called submodule
    with the arguments it was called with, for training (with grad, whatever the first call's grad
    mode): a submodule that builds for all of its calls is
    replaced by an ORTModule (which keeps what it built); one that does not is searched in
    its children. Submodules without parameters or children (activations, dropout) are left
    to PyTorch: a session call costs more than such an op. Then every call, the first one
    included, runs the model with its parts in ONNX Runtime.

    ``module`` is changed in place (its children replaced by ORTModules, as upstream's class
    does); parameters, buffers and ``state_dict()`` keys stay those of ``module``, so
    optimizers and checkpoints see no difference. :attr:`wrapped` names the submodules that
    run in ONNX Runtime, :attr:`unsupported` those that could not, with the reason.

    Args:
        module: the model.
        debug_options: :class:`DebugOptions` for every ORTModule made (``fallback`` applies
            to later calls of a wrapped submodule that need a new build and fail).
        **ortmodule_options: keyword arguments of :class:`ORTModule` (``memory_opt_level``,
            ``dynamic``, ...) for every ORTModule made.

    Example:
        >>> model = HierarchicalORTModule(net)
        >>> loss = model(x).sum(); loss.backward()   # first call: records, builds, runs
        >>> model.wrapped                             # e.g. ['encoder', 'head']
    """

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None, **ortmodule_options):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"HierarchicalORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        super().__init__(module)
        self._debug = debug_options or DebugOptions()
        self._ortmodule_options = ortmodule_options
        self._initialized = False
        self._parts: dict[str, ORTModule] = {}  # the submodules wrapped, by qualified name
        self._refused: dict[str, str] = {}  # the submodules that could not be, with the reason
        self._wrapper_ready()  # from here on, new attributes go to the wrapped model

    @property
    def wrapped(self) -> list[str]:
        """The submodules that run in ONNX Runtime (a part that fell back since is not)."""
        return [name for name, part in self._parts.items() if part.fallback_reason is None]

    @property
    def unsupported(self) -> dict[str, str]:
        """The submodules that could not run in ONNX Runtime, with the reason: those refused
        on the first call, then the parts that fell back on a later one."""
        fallen = {name: f"fell back on a later call: {part.fallback_reason}" for name, part in self._parts.items()
                  if part.fallback_reason is not None}
        return {**self._refused, **fallen}

    @wrapped_signature
    def forward(self, *args, **kwargs):
        if not self._initialized:
            self._initialize(args, kwargs)
        return self._original_module(*args, **kwargs)

    # -- the first call ----------------------------------------------------------
    def _initialize(self, args: tuple, kwargs: dict) -> None:
        # the parts are chosen for training (with grad), whatever the first call's grad mode:
        # a validation pass first must not choose a part that has no gradient
        with torch.enable_grad():
            calls = self._record_calls(args, kwargs)
            built: dict[int, torch.nn.Module] = {}  # a submodule used in several places gets one ORTModule
            root = self._wrap("", self._original_module, calls, built)
        if root is not self._original_module:
            self._modules[WRAPPED] = root
        self._initialized = True
        logger.info("HierarchicalORTModule: %d part(s) in ONNX Runtime (%s); %d not (%s)", len(self.wrapped),
                    ", ".join(self.wrapped) or "none", len(self.unsupported),
                    "; ".join(f"{name or '<root>'}: {why}" for name, why in self.unsupported.items()) or "none")

    def _record_calls(self, args: tuple, kwargs: dict) -> dict[int, list[tuple[tuple, dict]]]:
        """Run the model once and return each called submodule's ``(args, kwargs)`` per call
        (detached tensors that keep ``requires_grad``), by ``id`` of the submodule."""
        module = self._original_module
        calls: dict[int, list[tuple[tuple, dict]]] = {}

        def record(submodule, call_args, call_kwargs):
            calls.setdefault(id(submodule), []).append(pytree.tree_map(_detached, (call_args, call_kwargs)))

        handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in module.modules()]
        try:
            with module_state_kept(module):
                module(*pytree.tree_map(_copied, args), **pytree.tree_map(_copied, kwargs))
        finally:
            for handle in handles:
                handle.remove()
        return calls

    def _wrap(self, name: str, module: torch.nn.Module, calls: dict, built: dict) -> torch.nn.Module:
        """``module`` as an ORTModule if it builds for all its recorded calls, else ``module``
        with its children wrapped the same way."""
        if id(module) in built:
            return built[id(module)]
        if isinstance(module, ORTModule):  # wrapped by the user already
            return module
        worth_it = any(True for _ in module.parameters()) or bool(module._modules)
        module_calls = calls.get(id(module))
        if module_calls and worth_it:
            wrapper, reason = self._try_build(module, module_calls)
            if wrapper is not None:
                built[id(module)] = wrapper
                self._parts[name] = wrapper
                return wrapper
            self._refused[name] = reason
        for child_name, child in list(module._modules.items()):
            if child is None:
                continue
            replacement = self._wrap(f"{name}.{child_name}" if name else child_name, child, calls, built)
            if replacement is not child:
                module._modules[child_name] = replacement
        built[id(module)] = module
        return module

    def _try_build(self, module: torch.nn.Module, module_calls) -> tuple[ORTModule | None, str]:
        """An ORTModule of ``module`` that has built what each recorded call runs, or why not."""
        wrapper = ORTModule(module, self._debug, **self._ortmodule_options)
        try:
            for call_args, call_kwargs in module_calls:
                wrapper._prepare(flatten_call(module, call_args, call_kwargs))  # raises, whatever fallback says
        except OnnxTrainError as exc:
            text = " ".join(str(exc).split())
            return None, f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
        return wrapper, ""


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
    return value


def _copied(value):
    return value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value
