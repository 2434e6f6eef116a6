"""Plain Python attributes of a wrapped module, recorded at export and compared on every call.

An export bakes every plain Python value the forward reads (a dropout probability, a scale, a
temperature, a flag that picks a branch, a submodule's ``training`` flag) into the graph as a
constant. ORTModule records the scalar attributes of the wrapped module and its submodules right
after each export (after, so that a forward that sets attributes while it is traced does not
look changed on the next call); a call whose values differ from a graph's is served by another
graph, exported for them, as ``torch.compile`` recompiles when a guarded attribute changes.

Only instance attributes holding ``bool``, ``int``, ``float``, ``str``, ``None``, enums or tuples
of those, and lists and dicts of those (up to 64 items: PEFT keeps its merged adapters and
scales so), are recorded, and those of the Hugging Face configs the modules hold (a model reads
``config.output_hidden_states``, ``config.use_cache``, ... in its forward): tensors that are
neither parameters nor buffers, larger or nested containers and other objects are not, nor are
attributes first set after the export.
"""

from __future__ import annotations

import enum
import math
import sys
import weakref
from dataclasses import dataclass

import torch

_SCALARS = (bool, int, float, str, type(None), enum.Enum)
# the pseudo-attributes under which a module's hooks, and the global ones, are recorded
HOOKS = "(hooks)"
GLOBAL_HOOKS = "(global hooks)"
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# what every nn.Module keeps in its __dict__ (hooks, registries); ``training`` is recorded
_MODULE_BOOKKEEPING = frozenset(vars(torch.nn.Module())) - {"training"}
_MISSING = object()
# Hugging Face config fields that describe the checkpoint, not the computation (save_pretrained
# sets architectures and dtype): not recorded, so saving does not make the next call export again
_CONFIG_METADATA = frozenset({"architectures", "_name_or_path", "name_or_path", "transformers_version", "dtype",
                              "torch_dtype", "_commit_hash"})
# lists and dicts of scalars are recorded up to this many items (a copy, compared every call)
_MAX_CONTAINER_ITEMS = 64
# the hook fingerprint of a record's entry that is a Hugging Face config, not a module
_NOT_A_MODULE = object()


def _recordable(value) -> bool:
    if isinstance(value, tuple):
        return all(isinstance(v, _SCALARS) for v in value)
    if isinstance(value, list):  # PEFT's merged_adapters, a list of active adapters
        return len(value) <= _MAX_CONTAINER_ITEMS and all(_recordable(v) and not isinstance(v, list) for v in value)
    if isinstance(value, dict):  # PEFT's scaling per adapter
        return len(value) <= _MAX_CONTAINER_ITEMS and all(
            isinstance(k, (str, int)) and _recordable(v) and not isinstance(v, (list, dict)) for k, v in value.items())
    return isinstance(value, _SCALARS)


def _kept(value):
    """What a record keeps of ``value``: a copy of a list or dict (changed in place, the module's
    own would always look unchanged), the value itself otherwise."""
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value


def _is_config(value) -> bool:
    """Whether ``value`` is a Hugging Face model configuration (only where transformers is loaded)."""
    transformers = sys.modules.get("transformers")
    config = getattr(transformers, "PretrainedConfig", None) if transformers is not None else None
    return config is not None and isinstance(value, config)


def _same(old, new) -> bool:
    """Equal values of the same type (1 and 1.0 export different constants); NaN equals NaN."""
    if old is new:
        return True
    if type(old) is not type(new):
        return False
    if isinstance(old, tuple):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))
    return old == new or (isinstance(old, float) and math.isnan(old) and math.isnan(new))


@dataclass(frozen=True)
class AttributeChange:
    """One recorded attribute whose value differs now."""

    module: str  # qualified name in the wrapped module ("" for the module itself)
    name: str
    recorded: object
    current: object

    @property
    def key(self) -> tuple[str, str]:
        return self.module, self.name

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}" if self.module else self.name

    @property
    def now(self) -> str:
        return "deleted" if self.current is _MISSING else repr(self.current)

    def __str__(self) -> str:
        return f"{self.where}: {self.recorded!r} -> {self.now}"


def _hook_fingerprint(module: torch.nn.Module | None) -> tuple | None:
    """Which forward and backward (pre-)hooks ``module`` has (the global ones for ``None``):
    each dict's length and first and last handle ids, which change with any hook registered
    (ids only grow) or removed; None when there are none."""
    owner = torch.nn.modules.module if module is None else module
    prefix = "_global" if module is None else ""
    dicts = [getattr(owner, prefix + name, None) or {} for name in _HOOK_DICTS]
    if not any(dicts):
        return None
    return tuple((len(d), next(iter(d)), next(reversed(d))) if d else () for d in dicts)


class AttributeRecord:
    """The recordable attributes of ``module``, its submodules and the Hugging Face configs they
    hold, with their values now, and which hooks the modules have (and the global ones): a
    forward hook added or removed after an export changes what the forward computes, a
    backward hook added needs the module in PyTorch.

    Submodules are held by weak reference, so a record does not keep a replaced submodule (and
    its parameters) alive; every attribute of one that is gone counts as deleted. Every
    submodule has a recorded ``training`` flag, so a record notices any of them going.
    """

    def __init__(self, module: torch.nn.Module):
        # (weak reference, qualified name, [(attribute, value), ...], hook fingerprint)
        self._modules = []
        configs: set[int] = set()
        for prefix, sub in module.named_modules(remove_duplicate=False):
            values = [(name, _kept(value)) for name, value in vars(sub).items()
                      if name not in _MODULE_BOOKKEEPING and _recordable(value)]
            self._modules.append((weakref.ref(sub), prefix, values, _hook_fingerprint(sub)))
            for name, value in vars(sub).items():  # a config is shared by many submodules: once
                if _is_config(value) and id(value) not in configs:
                    configs.add(id(value))
                    where = f"{prefix}.{name}" if prefix else name
                    fields = [(field, _kept(v)) for field, v in vars(value).items()
                              if field not in _CONFIG_METADATA and _recordable(v)]
                    self._modules.append((weakref.ref(value), where, fields, _NOT_A_MODULE))
        self._global_hooks = _hook_fingerprint(None)

    def names(self) -> list[tuple[str, str]]:
        """The recorded (submodule name, attribute) pairs."""
        return [(prefix, name) for _, prefix, values, _ in self._modules for name, _ in values]

    def changes(self, ignored: frozenset[tuple[str, str]] | set = frozenset()) -> list[AttributeChange]:
        """The recorded attributes whose values differ now, but for ``ignored`` (module, name) pairs."""
        found = []
        for ref, prefix, values, hooks in self._modules:
            sub = ref()
            current_values = sub.__dict__ if sub is not None else {}
            for name, value in values:
                current = current_values.get(name, _MISSING)
                if current is value:  # the usual case, kept cheap: this runs on every call
                    continue
                if not _same(value, current) and (prefix, name) not in ignored:
                    found.append(AttributeChange(prefix, name, value, current))
            if hooks is not _NOT_A_MODULE and sub is not None and (
                    hooks is not None or sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                    or sub._backward_pre_hooks):  # the usual module has none: kept cheap
                now = _hook_fingerprint(sub)
                if now != hooks and (prefix, HOOKS) not in ignored:
                    found.append(AttributeChange(prefix, HOOKS, hooks, now))
        now = _hook_fingerprint(None)
        if now != self._global_hooks and ("", GLOBAL_HOOKS) not in ignored:
            found.append(AttributeChange("", GLOBAL_HOOKS, self._global_hooks, now))
        return found
