"""What a module that wraps another (ORTModule, HierarchicalORTModule) shares: the wrapped
module's names, state, attributes and container access, so that code written against the
wrapped module (a parent's ``state_dict``, DDP, an optimizer, ``model.layers[0]``) sees no
difference."""

from __future__ import annotations

import inspect
import warnings

import torch

WRAPPED = "_original_module"


def _load_keys_into_wrapped_module(module, state_dict, prefix, *_):
    """Load-state-dict pre-hook: ``<prefix><name>`` (what the wrapper's ``state_dict`` writes under
    a parent) becomes ``<prefix>_original_module.<name>`` (where ``nn.Module.load_state_dict``
    looks, walking ``_modules``)."""
    inner = prefix + WRAPPED + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def _report_keys_as_written(module, incompatible_keys) -> None:
    """Load-state-dict post-hook: missing and unexpected keys named as ``state_dict`` writes them
    (without the ``_original_module.`` the pre-hook routed them through), for the strict error."""
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [key.replace(WRAPPED + ".", "") for key in keys]


class BoundForward:
    """A wrapper's ``forward`` bound to it, reporting the wrapped module's forward signature to
    ``inspect.signature`` (a bound method can only report its function's ``*args, **kwargs``):
    code that reads it sees what the wrapped module takes (``transformers.Trainer`` keeps only
    the dataset columns the forward names, so it dropped every one)."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function, wrapper: ModuleWrapper):
        self.__func__, self.__self__ = function, wrapper

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__.module.forward)

    def __eq__(self, other) -> bool:  # as bound methods compare
        return isinstance(other, BoundForward) and other.__func__ is self.__func__ and other.__self__ is self.__self__

    def __hash__(self) -> int:
        return hash((self.__func__, id(self.__self__)))

    def __repr__(self) -> str:
        return f"<bound method {type(self.__self__).__name__}.forward of {type(self.__self__.module).__name__}>"


class wrapped_signature:  # noqa: N801 - used as a decorator, like staticmethod
    """Decorates a wrapper's ``forward``: bound, it is a :class:`BoundForward` (on the class, the
    function itself). Not a data descriptor: an instance attribute ``forward`` (set by a tool
    that wraps it) still takes precedence, as with a plain method."""

    def __init__(self, function):
        self.function = function

    def __get__(self, instance, owner=None):
        return self.function if instance is None else BoundForward(self.function, instance)


class ModuleWrapper(torch.nn.Module):
    """A module whose names, state and attributes are those of the module it wraps.

    Subclasses call ``super().__init__(module)`` first and :meth:`_wrapper_ready` at the end of
    their own ``__init__``: from then on, attributes set on the wrapper that it does not own
    (a flag the forward reads, a new parameter or submodule) go to the wrapped module.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._original_module = module
        # a parent's load_state_dict walks _modules: route its keys into the wrapped module
        self._register_load_state_dict_pre_hook(_load_keys_into_wrapped_module, with_module=True)
        self.register_load_state_dict_post_hook(_report_keys_as_written)

    def _wrapper_ready(self) -> None:
        self.__dict__["_wrapper_ready"] = True
        shadowed = self._shadowed_names()
        if shadowed:
            warnings.warn(f"{type(self).__name__} has its own {', '.join(shadowed)}, which hide(s) the wrapped "
                          f"{type(self.module).__name__}'s: reach them as .module.<name>", UserWarning, stacklevel=3)

    def _shadowed_names(self) -> list[str]:
        """Public names of the wrapped module (attributes, submodules, parameters, buffers, its
        class's methods) that this wrapper defines too, so that reading them through it gives
        the wrapper's (as upstream's ORTModule, it says so when made)."""
        wrapped = self.module
        base = {*dir(torch.nn.Module), *vars(torch.nn.Module())}  # every module's (training, ...)
        own = {n for n in (*dir(type(self)), *self.__dict__) if not n.startswith("_") and n not in base}
        theirs = {*wrapped.__dict__, *wrapped._modules, *wrapped._parameters, *wrapped._buffers,
                  *(n for n in dir(type(wrapped)) if n not in base)}
        return sorted(own & theirs)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped ``torch.nn.Module``."""
        return self._original_module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                # protocols (copy's __deepcopy__, pickle's __getstate__) are the wrapper's own: the
                # wrapped module's would copy or pickle it in the wrapper's place
                raise
            return getattr(self._modules[WRAPPED], name)

    def _own_attribute(self, name: str) -> bool:
        """Whether ``name`` belongs to this wrapper (its state, or anything its class defines)
        rather than to the wrapped module."""
        return not self.__dict__.get("_wrapper_ready") or name in self.__dict__ or hasattr(type(self), name)

    def __setattr__(self, name: str, value) -> None:
        # as upstream's ORTModule: attributes set through the wrapper are the wrapped module's
        if self._own_attribute(name):
            super().__setattr__(name, value)
        elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                and name in self._original_module._parameters:
            # torch.func.functional_call swaps a tensor into a parameter's place; for one the wrapped
            # module holds itself it finds no such parameter on the wrapper and sets the attribute
            self._original_module._parameters[name] = value
        else:
            setattr(self._original_module, name, value)

    def __delattr__(self, name: str) -> None:
        if self._own_attribute(name):
            super().__delattr__(name)
        else:
            delattr(self._original_module, name)

    def __getitem__(self, index):
        # a wrapped container (Sequential, ModuleList, ModuleDict) indexes as it did
        return self._original_module[index]

    def __len__(self) -> int:
        return len(self._original_module)

    def __bool__(self) -> bool:  # without it, truth would ask __len__, which only containers have
        return bool(self._original_module)

    def __iter__(self):
        return iter(self._original_module)

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        """Register a buffer on the wrapped module (where ``state_dict()`` and the export see it)."""
        self._original_module.register_buffer(name, tensor, persistent)

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        """Register a parameter on the wrapped module (where ``parameters()`` and the export see it)."""
        self._original_module.register_parameter(name, param)

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        """Add a submodule to the wrapped module.

        The wrapped module's own slot (``_original_module``, which ``named_children()`` lists)
        takes only the module already there: tools that rebuild a tree through
        ``named_children`` and ``add_module`` (``SyncBatchNorm.convert_sync_batchnorm``) put it
        back; wrapping another module needs a new wrapper."""
        if name == WRAPPED:
            if module is not self._original_module:
                raise TypeError(f"{type(self).__name__} cannot swap the module it wraps ({type(module).__name__} for "
                                f"{type(self._original_module).__name__}): wrap the new module in a new "
                                f"{type(self).__name__}")
            return
        self._original_module.add_module(name, module)

    register_module = add_module

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint's hook: the wrapped module's names carry no
        ``_original_module.``, as ``state_dict`` writes them (optimizer state dicts load back)."""
        return {WRAPPED: WRAPPED}

    def _get_name(self) -> str:
        # the wrapped module's class name, where libraries identify a model by it (transformers'
        # Trainer shifts the labels of a causal LM for label smoothing by that name)
        return self._original_module._get_name()

    def __repr__(self) -> str:
        inner = repr(self._original_module).replace("\n", "\n  ")
        return f"{type(self).__name__}(\n  {inner}\n)"

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._original_module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._original_module.named_buffers(prefix, recurse, remove_duplicate)

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        # the wrapped module sits at this module's own prefix, so that a parent (DDP, a
        # Sequential) names parameters as state_dict() does: "module.net.0.weight", not
        # "module._original_module.net.0.weight" (DDP's params_and_buffers_to_ignore)
        if memo is None:
            memo = set()
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        yield from self._original_module.named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)
