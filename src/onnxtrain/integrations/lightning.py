"""PyTorch Lightning: train a ``LightningModule``'s submodules with :class:`~onnxtrain.torch.ORTModule`.

``ORTModule`` already composes with Lightning when a ``LightningModule`` builds it itself
(``self.model = ORTModule(Net())``): ``Trainer`` on CPU with one process or DDP (gloo),
validation under ``torch.inference_mode``, ``precision="bf16-mixed"`` (Lightning's
``torch.autocast``, which ORTModule exports under) and checkpoints all work, because ORTModule
names parameters and ``state_dict`` keys as the wrapped module does. This module adds what
keeps a ``LightningModule`` free of onnxtrain:

- :class:`ORTModuleCallback` wraps chosen submodules in ``ORTModule`` when the ``Trainer``
  sets the module up, passing ORTModule's options through, including submodules built in
  ``configure_model``;
- :func:`wrap_modules` / :func:`unwrap_modules` do the same by hand.

Checkpoints that Lightning saves from a wrapped module have the plain module's keys, so they
load into the unwrapped ``LightningModule`` (``LitModel.load_from_checkpoint(path)``) and
back into a wrapped one (``trainer.fit(..., ckpt_path=path)``).

This module imports Lightning (``import onnxtrain`` does not import this module): install
the ``lightning`` extra.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import lightning.pytorch as pl
import torch

from onnxtrain.errors import OnnxTrainError
from onnxtrain.torch import DebugOptions, ORTModule


class LightningIntegrationError(OnnxTrainError, ValueError):
    """The modules to wrap in ORTModule cannot be found in the ``LightningModule``."""


def _has_trainable_parameters(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _resolve(root: torch.nn.Module, dotted: str) -> tuple[torch.nn.Module, str, torch.nn.Module | None]:
    """``(parent, attribute, module)`` for ``"a.b.c"`` under ``root``; module is None if absent."""
    parent = root
    parts = dotted.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = getattr(parent, part, None)
        if isinstance(child, ORTModule):
            raise LightningIntegrationError(
                f"cannot wrap {dotted!r} in ORTModule: it is inside {'.'.join(parts[:depth + 1])!r}, "
                "already an ORTModule (ORTModules do not nest)")
        if not isinstance(child, torch.nn.Module):
            return parent, part, None
        parent = child
    module = getattr(parent, parts[-1], None)
    return parent, parts[-1], module if isinstance(module, torch.nn.Module) else None


def _runs_forward(module: torch.nn.Module) -> bool:
    """Whether the module can be called (containers such as ModuleList and ModuleDict cannot)."""
    return type(module).forward is not torch.nn.Module.forward


def _default_names(root: torch.nn.Module) -> list[str]:
    """Direct children that hold trainable parameters (loss modules and metrics hold none) or,
    in a model frozen for inference, any parameters; a container without a forward
    (ModuleList, ModuleDict) stands for its elements."""
    trainable = _has_trainable_parameters(root)
    names = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if not any(p.requires_grad or not trainable for p in child.parameters()):
                continue
            if _runs_forward(child):
                names.append(prefix + name)
            else:
                walk(child, f"{prefix}{name}.")

    walk(root, "")
    return names


def wrap_modules(root: torch.nn.Module, names: str | Sequence[str] | None = None, *,
                 debug_options: DebugOptions | None = None, memory_opt_level: int | None = None,
                 memory_budget: int | None = None, missing_ok: bool = False) -> list[str]:
    """Replace submodules of ``root`` (a ``LightningModule`` or any ``nn.Module``) by
    ``ORTModule(submodule, ...)``, in place; returns the names wrapped by this call.

    Args:
        root: the module whose submodules to wrap; ``root`` itself is never wrapped (Lightning
            calls its ``training_step``, not only its ``forward``).
        names: attribute paths (``"model"``, ``"backbone.encoder"``, ``"layers.0"``) of the
            submodules, or None for every direct child that has trainable parameters (any
            parameters, in a model frozen for inference), with the elements of a ``ModuleList``
            or ``ModuleDict`` child in its place (containers have no forward to run). ORTModules
            do not nest: a module inside or around one that is wrapped already is refused.
        debug_options, memory_opt_level, memory_budget: passed to each ``ORTModule``.
        missing_ok: skip names that do not exist (yet) instead of raising.

    Modules that already are ``ORTModule`` are left as they are, so calling it twice is safe.
    Every name is checked before any module is replaced: on an error nothing changes.
    Parameters stay the same tensors: an optimizer built before keeps working.

    Raises:
        LightningIntegrationError: a name is missing, is not a module or is a container
            without a forward, wrapping it would nest ORTModules, or ``names`` is None and
            ``root`` has no child module with parameters.

    Example:
        >>> wrap_modules(lit_model, "model", memory_opt_level=1)
        ['model']
    """
    if names is None:
        targets = _default_names(root)
        if not targets and not missing_ok:
            raise LightningIntegrationError(
                f"{type(root).__name__} has no child module with parameters to wrap in "
                f"ORTModule; name the submodules (children: {[n for n, _ in root.named_children()]})")
    else:
        targets = [names] if isinstance(names, str) else list(names)
    planned = {}  # id(module) -> (parent, attribute, name, ORTModule): all checked before any is set
    for name in targets:
        parent, attribute, module = _resolve(root, name)
        if module is None:
            if missing_ok:
                continue
            raise LightningIntegrationError(
                f"{type(root).__name__} has no submodule {name!r} to wrap in ORTModule "
                f"(children: {[n for n, _ in root.named_children()]})")
        if isinstance(module, ORTModule) or id(module) in planned:
            continue
        if not _runs_forward(module):
            raise LightningIntegrationError(
                f"cannot wrap {name!r} ({type(module).__name__}) in ORTModule: it has no forward of its own, the "
                f"code around it calls its elements; name those (e.g. {name}.0) or the module that uses them")
        inner = [n for n, m in module.named_modules() if isinstance(m, ORTModule)]
        if inner:
            raise LightningIntegrationError(
                f"cannot wrap {name!r} in ORTModule: it contains ORTModule {name}.{inner[0]} "
                "(ORTModules do not nest)")
        # one DebugOptions per ORTModule (a SessionOptions in it is shared: sessions only read it)
        options = None if debug_options is None else copy.deepcopy(debug_options)
        wrapper = ORTModule(module, options, memory_opt_level=memory_opt_level, memory_budget=memory_budget)
        planned[id(module)] = (parent, attribute, name, wrapper)
    names_of = {key: name for key, (_, _, name, _) in planned.items()}
    for key, (_, _, name, wrapper) in planned.items():
        inside = [names_of[id(m)] for m in wrapper.module.modules() if id(m) in names_of and id(m) != key]
        if inside:
            raise LightningIntegrationError(
                f"cannot wrap both {name!r} and {inside[0]!r} in ORTModule: {inside[0]!r} is inside {name!r} "
                "(ORTModules do not nest)")
    for parent, attribute, _, wrapper in planned.values():
        setattr(parent, attribute, wrapper)
    return [name for _, _, name, _ in planned.values()]


def unwrap_modules(root: torch.nn.Module) -> list[str]:
    """Replace every ``ORTModule`` under ``root`` by the module it wraps, in place; returns
    their names. For saving the whole module object (``torch.save(model)``) or exporting it
    after training; checkpoints (``state_dict``) do not need it.

    Example:
        >>> unwrap_modules(lit_model)
        ['model']
    """
    names = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, ORTModule):
                setattr(module, name, child.module)
                names.append(prefix + name)
                child = child.module
            walk(child, f"{prefix}{name}.")

    walk(root, "")
    return names


class ORTModuleCallback(pl.Callback):
    """A Lightning callback that runs chosen submodules of the ``LightningModule`` in ONNX
    Runtime by wrapping them in :class:`~onnxtrain.torch.ORTModule`.

    The submodules are wrapped in the ``setup`` hook, before Lightning restores a checkpoint,
    moves the module to its device, wraps it in DDP and builds the optimizers; submodules that
    do not exist then (built in ``configure_model``) are wrapped when the stage starts
    (``on_fit_start``, ``on_validation_start``, ``on_test_start``, ``on_predict_start``).
    They stay wrapped after the run (a later ``trainer.validate`` reuses the exports); use
    :func:`unwrap_modules` to get the plain modules back.

    Args:
        modules: attribute paths of the submodules (``"model"``, ``["encoder", "head"]``), or
            None for every direct child with trainable parameters.
        debug_options, memory_opt_level, memory_budget: ``ORTModule``'s options, for each.

    Works with ``precision="32-true"`` and ``"bf16-mixed"`` (autocast; ``"16-mixed"`` takes the
    same path; Lightning turns it into bf16 on CPU). With ``"bf16-true"``/``"16-true"`` the
    parameters themselves are low precision: ORTModule runs them as any model converted to
    low precision (docs/ortmodule.md: computed in float32 where onnxruntime's CPU provider has
    no low-precision kernels, rounded where PyTorch rounds).

    Example:
        >>> trainer = lightning.Trainer(max_steps=100, callbacks=[ORTModuleCallback("model")])
        >>> trainer.fit(lit_model, train_loader)
    """

    def __init__(self, modules: str | Sequence[str] | None = None, *, debug_options: DebugOptions | None = None,
                 memory_opt_level: int | None = None, memory_budget: int | None = None):
        self.modules = None if modules is None else ([modules] if isinstance(modules, str) else list(modules))
        self._options = dict(debug_options=debug_options, memory_opt_level=memory_opt_level,
                             memory_budget=memory_budget)
        self.wrapped: list[str] = []  # names wrapped so far, in order

    @property
    def state_key(self) -> str:
        return self._generate_state_key(modules=self.modules)

    def _wrap(self, pl_module, missing_ok: bool) -> None:
        self.wrapped += wrap_modules(pl_module, self.modules, missing_ok=missing_ok, **self._options)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._wrap(pl_module, missing_ok=True)  # configure_model may build the rest

    def _on_stage_start(self, trainer, pl_module) -> None:
        self._wrap(pl_module, missing_ok=False)

    on_fit_start = on_validation_start = on_test_start = on_predict_start = _on_stage_start

