"""Plain Python attributes of a wrapped module, recorded at export and compared on every call.

An export bakes every plain Python value the forward reads (a dropout probability, a scale, a
temperature, a flag that picks a branch, a submodule's ``training`` flag) into the graph as a
constant. ORTModule records the scalar attributes of the wrapped module and its submodules right
after each export (after, so that a forward that sets attributes while it is traced does not
look changed on the next call); a call whose values differ from a graph's is served by another
graph, exported for them, as ``torch.compile`` recompiles when a guarded attribute changes.

Only instance attributes holding ``bool``, ``int``, ``float``, ``str``, ``None``, enums or tuples
of those are recorded, and those of the Hugging Face configs the modules hold (a model reads
``config.output_hidden_states``, ``config.use_cache``, ... in its forward): tensors that are
neither parameters nor buffers, lists, dicts and other objects are not, nor are attributes first
set after the export.
"""

from __future__ import annotations

import enum
import math
import sys
import weakref
from dataclasses import dataclass

import torch

_SCALARS = (bool, int, float, str, type(None), enum.Enum)
# what every nn.Module keeps in its __dict__ (hooks, registries); ``training`` is recorded
_MODULE_BOOKKEEPING = frozenset(vars(torch.nn.Module())) - {"training"}
_MISSING = object()


def _recordable(value) -> bool:
    if isinstance(value, tuple):
        return all(isinstance(v, _SCALARS) for v in value)
    return isinstance(value, _SCALARS)


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


class AttributeRecord:
    """The recordable attributes of ``module``, its submodules and the Hugging Face configs they
    hold, with their values now.

    Submodules are held by weak reference, so a record does not keep a replaced submodule (and
    its parameters) alive; every attribute of one that is gone counts as deleted. Every
    submodule has a recorded ``training`` flag, so a record notices any of them going.
    """

    def __init__(self, module: torch.nn.Module):
        self._modules = []  # (weak reference, qualified name, [(attribute, value), ...])
        configs: set[int] = set()
        for prefix, sub in module.named_modules(remove_duplicate=False):
            values = [(name, value) for name, value in vars(sub).items()
                      if name not in _MODULE_BOOKKEEPING and _recordable(value)]
            if values:
                self._modules.append((weakref.ref(sub), prefix, values))
            for name, value in vars(sub).items():  # a config is shared by many submodules: once
                if _is_config(value) and id(value) not in configs:
                    configs.add(id(value))
                    where = f"{prefix}.{name}" if prefix else name
                    fields = [(field, v) for field, v in vars(value).items() if _recordable(v)]
                    self._modules.append((weakref.ref(value), where, fields))

    def names(self) -> list[tuple[str, str]]:
        """The recorded (submodule name, attribute) pairs."""
        return [(prefix, name) for _, prefix, values in self._modules for name, _ in values]

    def changes(self, ignored: frozenset[tuple[str, str]] | set = frozenset()) -> list[AttributeChange]:
        """The recorded attributes whose values differ now, but for ``ignored`` (module, name) pairs."""
        found = []
        for ref, prefix, values in self._modules:
            sub = ref()
            current_values = sub.__dict__ if sub is not None else {}
            for name, value in values:
                current = current_values.get(name, _MISSING)
                if current is value:  # the usual case, kept cheap: this runs on every call
                    continue
                if not _same(value, current) and (prefix, name) not in ignored:
                    found.append(AttributeChange(prefix, name, value, current))
        return found
