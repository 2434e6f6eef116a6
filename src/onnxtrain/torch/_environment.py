"""Upstream ORTModule's environment variables, read when an ORTModule is made.

Migrated training scripts and job configurations set ``ORTMODULE_*`` variables. The ones with
a meaning here take effect, as upstream's did (the variable wins over ``DebugOptions``):

- ``ORTMODULE_FALLBACK_POLICY``: upstream's ``_FallbackPolicy`` names, joined with ``|``.
  ``FALLBACK_DISABLE`` raises instead of falling back to PyTorch; ``FALLBACK_FORCE_TORCH_FORWARD``
  or ``FALLBACK_FORCE_TORCH_BACKWARD`` run the module in PyTorch from the first call (a
  side-by-side check against eager); the ``FALLBACK_UNSUPPORTED_*`` and
  ``FALLBACK_BAD_INITIALIZATION`` names allow the fallback (onnxtrain's covers every failure
  to build, without upstream's categories).
- ``ORTMODULE_LOG_LEVEL``: ``VERBOSE``, ``DEVINFO``, ``INFO``, ``WARNING``, ``ERROR`` or ``FATAL``,
  onnxruntime's log severity for the module's sessions.
- ``ORTMODULE_SAVE_ONNX_PATH``: the folder ``DebugOptions(save_onnx=True)`` writes to.
- ``ORTMODULE_MEMORY_OPT_LEVEL`` is read where it applies (``MemoryOptions``).

The others upstream documented configure parts of its training build that onnxtrain does not
have; when one is set, :func:`read_environment` says so (an :class:`IgnoredSettingWarning`
naming it and what to use instead) rather than leave the script's author believing it acts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from onnxtrain.errors import OnnxTrainError
from onnxtrain.logs import LogLevel

FALLBACK_POLICY_ENV = "ORTMODULE_FALLBACK_POLICY"
LOG_LEVEL_ENV = "ORTMODULE_LOG_LEVEL"
SAVE_PATH_ENV = "ORTMODULE_SAVE_ONNX_PATH"

_FORCE_TORCH = frozenset({"FALLBACK_FORCE_TORCH_FORWARD", "FALLBACK_FORCE_TORCH_BACKWARD"})
_ALLOW_FALLBACK = frozenset({"FALLBACK_UNSUPPORTED_DEVICE", "FALLBACK_UNSUPPORTED_DATA",
                             "FALLBACK_UNSUPPORTED_TORCH_MODEL", "FALLBACK_UNSUPPORTED_ONNX_MODEL",
                             "FALLBACK_BAD_INITIALIZATION"})
_POLICIES = frozenset({"FALLBACK_DISABLE"}) | _FORCE_TORCH | _ALLOW_FALLBACK
# upstream's names, DEVINFO among them (LogLevel's alias of INFO)
_LOG_LEVELS = dict(LogLevel.__members__)

_WITHOUT_EFFECT = {
    "ORTMODULE_ONNX_OPSET_VERSION": "onnxtrain exports at the opset of torch.onnx's (dynamo) exporter",
    "ORTMODULE_FALLBACK_RETRY": "a fallback lasts; a module that changes retries on its own export",
    "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "a graph transformer of upstream's training build",
    "ORTMODULE_ENABLE_SPARSE_OPTIMIZER": "a graph transformer of upstream's training build",
    "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER": "a graph transformer of upstream's training build",
    "ORTMODULE_USE_EFFICIENT_ATTENTION": "an ATen fallback of upstream's training build",
    "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "a PythonOp of upstream's training build",
    "ORTMODULE_USE_FLASH_ATTENTION": "upstream's Triton flash attention (CUDA training build)",
    "ORTMODULE_USE_TRITON": "upstream's Triton code generation (CUDA training build)",
    "ORTMODULE_TRITON_DEBUG": "upstream's Triton code generation (CUDA training build)",
    "ORTMODULE_CONV_ALGO_SEARCH": "a cuDNN convolution search of upstream's CUDA provider",
    "ORTMODULE_SKIPCHECK_POLICY": "every call checks what it must (no checks to skip)",
    "ORTMODULE_MEMORY_OPT_PROBE_RECOMPUTE_LEVEL": "use ORTModule(..., memory_opt_level=...) or memory_budget=... "
                                                  "(explain_memory() shows what is recomputed)",
    "ORTMODULE_TRITON_CONFIG_FILE": "upstream's Triton code generation (CUDA training build)",
    "ORTMODULE_ENABLE_TUNING": "upstream's kernel tuning (CUDA/ROCm training build)",
    "ORTMODULE_MAX_TUNING_DURATION_MS": "upstream's kernel tuning (CUDA/ROCm training build)",
    "ORTMODULE_TUNING_RESULTS_PATH": "upstream's kernel tuning (CUDA/ROCm training build)",
    "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "custom autograd Functions run in PyTorch unless exact: pass "
                                        "ORTModule(..., inline_autograd_functions=...)",
    "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "torch.utils.checkpoint regions are exported as ordinary code; for "
                                           "recompute use ORTModule(..., memory_opt_level=...)",
    "ORTMODULE_MEMORY_OPT_CONFIG": "use ORTModule(..., memory_opt_level=...) or memory_budget=... "
                                   "(explain_memory() shows what is recomputed)",
    "ORTMODULE_PRINT_MEMORY_STATS": "model.explain_memory() reports what the forward saves",
    "ORTMODULE_PRINT_INPUT_DENSITY": "upstream's input sparsity inspector (training build)",
    "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT": "onnxtrain exports without copying the module",
    "ORTMODULE_CACHE_DIR": "exports are not cached across processes",
    "ORTMODULE_ENABLE_ZERO_STAGE3": "ZeRO stage 3 is not supported; stage 1 is onnxtrain.torch.optim.zero",
}


class ORTModuleEnvironmentError(OnnxTrainError, ValueError):
    """An ``ORTMODULE_*`` environment variable has a value ORTModule does not know."""


class IgnoredSettingWarning(UserWarning):
    """An upstream ``ORTMODULE_*`` setting is set and has no effect in onnxtrain."""


@dataclass(frozen=True)
class EnvironmentSettings:
    """What upstream's environment variables ask of a new ORTModule.

    ``fallback``: None when the environment says nothing, else whether a failure to build
    falls back to PyTorch; ``force_torch``: run in PyTorch from the first call;
    ``log_level``: onnxruntime's severity for the sessions, or None; ``save_path``: the folder
    for saved graphs, or None; ``ignored``: the variables set that have no effect, each with why.
    """

    fallback: bool | None = None
    force_torch: bool = False
    log_level: LogLevel | None = None
    save_path: str | None = None
    ignored: dict[str, str] = field(default_factory=dict)


def read_environment(environ: Mapping[str, str] | None = None) -> EnvironmentSettings:
    """The upstream settings in ``environ`` (default ``os.environ``); ``ORTModuleEnvironmentError``
    for a value upstream did not accept either."""
    environ = os.environ if environ is None else environ
    fallback, force_torch = _fallback_policy(environ.get(FALLBACK_POLICY_ENV))
    log_level = None
    if environ.get(LOG_LEVEL_ENV, "").strip():
        name = environ[LOG_LEVEL_ENV].strip().upper()
        if name not in _LOG_LEVELS:
            raise ORTModuleEnvironmentError(f"{LOG_LEVEL_ENV}={environ[LOG_LEVEL_ENV]!r}: expected one of "
                                            f"{', '.join(_LOG_LEVELS)}")
        log_level = _LOG_LEVELS[name]
    save_path = environ.get(SAVE_PATH_ENV, "").strip() or None
    ignored = {name: why for name, why in _WITHOUT_EFFECT.items() if environ.get(name, "").strip()}
    return EnvironmentSettings(fallback, force_torch, log_level, save_path, ignored)


def _fallback_policy(value: str | None) -> tuple[bool | None, bool]:
    """``(fallback, force_torch)`` for upstream's policy names joined with ``|``."""
    if value is None or not value.strip():
        return None, False
    names = {part.strip().upper() for part in value.split("|") if part.strip()}
    unknown = sorted(names - _POLICIES)
    if unknown:
        raise ORTModuleEnvironmentError(f"{FALLBACK_POLICY_ENV}={value!r}: unknown policy {', '.join(unknown)}; "
                                        f"expected upstream's names ({', '.join(sorted(_POLICIES))}) joined with |")
    if "FALLBACK_DISABLE" in names:  # as upstream: disabling wins over every other policy
        return False, False
    return True, bool(names & _FORCE_TORCH)
