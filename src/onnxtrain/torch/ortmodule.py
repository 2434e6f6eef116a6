"""ORTModule: run a torch module's forward and backward through ONNX Runtime."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import numbers
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime as ort
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from onnxtrain.errors import ExportError, OnnxTrainError, RunError
from onnxtrain.ir import io
from onnxtrain.logs import LogLevel, as_log_level
from onnxtrain.passes import pipeline
from onnxtrain.autodiff.builder import inputs_with_gradient
from onnxtrain.passes.partition import MemoryOptions, MemoryReport, build_forward_backward
from onnxtrain.passes.precision import PrecisionConfig
from onnxtrain.runtime.denormals import ask_for_flushing
from onnxtrain.runtime.session import register_shared_cpu_arena
from onnxtrain.torch._attributes import AttributeChange, AttributeRecord
from onnxtrain.torch._wrapper import ModuleWrapper, wrapped_signature
from onnxtrain.torch._environment import FALLBACK_POLICY_ENV, IgnoredSettingWarning, read_environment
from onnxtrain.torch._bridge import ORTFunction, SessionRunner, TrainingPrograms, device_of
from onnxtrain.torch._exporter import EXPORT_LOCK
from onnxtrain.torch._export import (CallSchema, ExportedGraph, constant_argument_names, export_call, flatten_call,
                                     positions_requiring_grad)

logger = logging.getLogger(__name__)


# torch.autocast dtypes and the precision pass's names for them
_AUTOCAST_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _has_lazy_parameters(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds parameters or buffers a lazy module (``nn.LazyLinear``, ...) has not
    given a shape yet: they take it from the first call's inputs, which the export cannot do."""
    return any(isinstance(t, torch.nn.parameter.UninitializedTensorMixin)
               for t in itertools.chain(module.parameters(), module.buffers()))


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """A saved-tensor pack hook that keeps the tensor without its autograd history: the export's
    trace never runs backward, and a tensor an op saves of its own output, kept as is, made a
    reference cycle through C++ that gc cannot break (every export's fake autograd graph and
    fake tensor mode stayed alive for good: pytorch/pytorch#115255)."""
    return tensor.detach()


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    """A saved-tensor unpack hook that gives the tensor back as it was packed."""
    return tensor


def _autocast(tensors) -> tuple[str, str] | None:
    """``(device type, "bf16"|"fp16")`` when ``torch.autocast`` is on for the inputs' device."""
    device = device_of(tensors).type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if dtype not in _AUTOCAST_PRECISION:
        raise OnnxTrainError(f"torch.autocast with dtype {dtype} is not supported; expected bfloat16 or float16")
    return device, _AUTOCAST_PRECISION[dtype]


def _low_precision_on_cpu(call) -> tuple[str, str] | None:
    """``("cpu", "bf16"|"fp16")`` for a call on the CPU whose inputs or parameters are bfloat16 or
    float16 (``model.to(torch.bfloat16)``): onnxruntime's CPU provider has no arithmetic in those
    types, so the graph gets the precision pass autocast's does (its ops in float32 between casts,
    every low-precision value still rounded as eager rounds it)."""
    tensors = [*call.tensors, *call.state.values()]
    if not tensors or device_of(tensors).type != "cpu":
        return None
    dtypes = {t.dtype for t in tensors}
    low = [dtype for dtype in _AUTOCAST_PRECISION if dtype in dtypes]
    return ("cpu", _AUTOCAST_PRECISION[low[0]]) if low else None


def _graph_inputs(call, variant: "_Variant") -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """The tensors a variant's graphs take for ``call`` (call tensors, then parameters and
    buffers), and the positions of those that receive gradients. A complex tensor is taken as
    its real view (``torch.view_as_real``: real and imaginary parts along a last axis of 2, as
    the exported graph holds it), through which autograd hands its gradient back as PyTorch's
    complex one."""
    inputs = [torch.view_as_real(t) if t.is_complex() else t
              for t in (*call.tensors, *(call.state[n] for n in variant.graph.state_names))]
    return inputs, positions_requiring_grad(inputs)


def _whole_number(value) -> bool:
    """An integer (Python's or numpy's), not a bool, a float or a string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _inline_functions(value) -> frozenset[type] | bool:
    """``inline_autograd_functions`` checked: True, or the frozenset of Function classes (False: none)."""
    if isinstance(value, bool):
        return value or frozenset()
    try:
        classes = frozenset(value)
    except TypeError:
        raise TypeError(f"ORTModule inline_autograd_functions must be True, False or torch.autograd.Function "
                        f"subclasses, got {value!r}") from None
    wrong = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.autograd.Function))]
    if wrong:
        raise TypeError(f"ORTModule inline_autograd_functions takes torch.autograd.Function subclasses, "
                        f"got {', '.join(map(repr, wrong))}")
    return classes


class ORTModuleFallbackWarning(UserWarning):
    """ORTModule could not run a module through ONNX Runtime and runs it in PyTorch instead."""


# How many new values an attribute that changes the graph may take (each exported for, each
# export keeping its graphs) before ORTModule runs the module in PyTorch instead, as
# torch.compile falls back to eager past its recompile limit.
ATTRIBUTE_EXPORT_LIMIT = 4


class MemoryOptionsError(OnnxTrainError, ValueError):
    """ORTModule's memory options are out of range."""


# Where save_onnx writes when no save_path is given (upstream's variable; default: the cwd).


@dataclass
class DebugOptions:
    """Debugging switches of :class:`ORTModule` (upstream's ``DebugOptions``, plus ``fallback``).

    Args:
        log_level: onnxruntime's log severity for our sessions (default: errors only,
            since failures reach the caller as exceptions anyway; INFO is onnxruntime's
            WARNING, as upstream's: ``LogLevel.onnxruntime_severity``).
        save_onnx: write the graphs of every export to ``save_path``: the exporter's graph
            (``<prefix>_<mode>_exported.onnx``, mode ``training`` or ``inference``), the
            graph after our passes (``_optimized``), and the ``_forward``/``_backward``
            (gradient) or ``_inference`` (forward-only) graphs that run.
        onnx_prefix: file name prefix for ``save_onnx``.
        save_path: folder for ``save_onnx`` (created if missing); default
            the current directory. ``$ORTMODULE_SAVE_ONNX_PATH``, read when an ORTModule is
            made, wins over it, as upstream's did.
        fallback: if export or gradient building fails, warn once with the reason and run
            the original module in PyTorch from then on. ``False`` raises the error instead
            (e.g. an ``UnsupportedOpError`` listing the ops without a gradient rule).
        session_options: ``onnxruntime.SessionOptions`` for every session (threads, ...);
            overrides ``log_level`` and ``flush_denormals``.
        flush_denormals: onnxruntime's CPU runs treat denormal floats (below ~1.2e-38) as
            zero: masked attention Softmax runs several times faster. Set on the calling
            thread for the length of each run only, never for PyTorch's own arithmetic
            (``onnxtrain.runtime.denormals``); ``False`` leaves denormals to the CPU's default.

    Example:
        >>> model = ORTModule(net, DebugOptions(save_onnx=True, onnx_prefix="net", fallback=False))
    """

    log_level: LogLevel = LogLevel.ERROR
    save_onnx: bool = False
    onnx_prefix: str = "ortmodule"
    save_path: str | os.PathLike | None = None
    fallback: bool = True
    session_options: ort.SessionOptions | None = field(default=None, repr=False)
    flush_denormals: bool = True

    def __post_init__(self):
        self.log_level = as_log_level(self.log_level, "DebugOptions log_level")
        if not isinstance(self.onnx_prefix, str):
            raise TypeError(f"DebugOptions onnx_prefix must be a str (the saved files' name prefix), got "
                            f"{type(self.onnx_prefix).__name__}")
        if self.save_onnx and not self.onnx_prefix.strip():  # as upstream's: the files need a name
            raise ValueError("DebugOptions onnx_prefix must not be empty when save_onnx is set")

    def __deepcopy__(self, memo):
        # a SessionOptions cannot be copied: copies share it (sessions only read it)
        return dataclasses.replace(self, save_path=copy.deepcopy(self.save_path, memo))

    def __getstate__(self):
        # nor pickled: an unpickled DebugOptions has session_options=None
        return {**self.__dict__, "session_options": None}

    def resolved_session_options(self) -> ort.SessionOptions:
        if self.session_options is not None:
            return self.session_options
        options = ort.SessionOptions()
        options.log_severity_level = self.log_level.onnxruntime_severity
        # ORT's pool threads spin while a run lasts (fast hand-off between a run's parallel
        # ops) but stop as soon as it returns: between the forward and the backward, and during
        # the optimizer step, PyTorch's own threads need those cores. Measured (bench, 2 cores)
        # against no spinning at all: GPT step 164-169 -> 150-153 ms, CNN 47-48 -> 42-44 ms,
        # MLP 2.55 -> 2.15 ms.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        # the forward and backward sessions share one CPU arena: what one run frees, the other
        # reuses (with an arena each, both keep their peak). A per-session preallocated block
        # (memory pattern) would only add to that peak.
        register_shared_cpu_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
        options.enable_mem_pattern = False
        if self.flush_denormals:
            ask_for_flushing(options)
        return options

    def resolved_save_path(self) -> Path:
        return Path(self.save_path if self.save_path is not None else ".")


# calls in a row that take the same other branches on the data than a graph was traced along
# before the next call exports along them (once per graph): a rare batch does not turn the graph
_OFF_BRANCH_STREAK = 3
# the most calls in a row that run in PyTorch without first running a graph whose branches the data
# keeps leaving (after each such run, one call runs the graph to see whether the data came back)
_LONGEST_SKIP = 64


@dataclass
class _Variant:
    """One export of the module and the sessions built from it."""

    graph: ExportedGraph
    precision: PrecisionConfig | None = None  # the autocast state it was exported under
    dynamic: bool = False  # exported with dynamic dims (Dim.AUTO) rather than the call's own shapes
    dynamic_tried: bool = False  # a dynamic export was attempted for it (it failed if not dynamic)
    inference: SessionRunner | None = None
    training: dict[tuple, TrainingPrograms] = field(default_factory=dict)
    memory: dict[tuple, MemoryReport] = field(default_factory=dict)
    # the wrapped module's plain attributes right after the export (what the graph baked in)
    attributes: AttributeRecord | None = None
    # a dynamic export whose graphs could not be built (an op it has only with symbolic dims):
    # kept (its dynamic_tried steers later exports to static ones) but used for no call
    unusable: bool = False
    # where calls' data took other branches than the graph's answers (ExportedGraph.assumptions):
    # the branches' values the last ones saw and how many calls in a row saw them, those to
    # export along next, and whether this graph came from (or already tried) such an export
    off_branch: tuple[tuple[bool, ...], int] = ((), 0)
    observed_answers: tuple[bool, ...] | None = None
    reanswered: bool = False
    # whether a call's data took the graph's answers: until one has, they are the capture's guesses
    answers_taken: bool = False
    # calls to run in PyTorch without running this graph first: the data keeps to branches it was
    # not traced along and no export along them is left to try
    calls_to_skip: int = 0


def _hashable(value):
    """``value``, or a stand-in that is hashable where it is not (a list that replaced a number)."""
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    return value


def _fsdp_obstacle(module: torch.nn.Module) -> str | None:
    """Why the way FSDP holds ``module`` keeps it from being exported, or None (FSDP not in use)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # never imported: no FSDP anywhere
        return None
    from torch.distributed.fsdp._flat_param import FlatParameter

    kinds = tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, name))
    units = [name or "the module itself" for name, sub in module.named_modules() if isinstance(sub, kinds)]
    if units:
        return (f"it holds FSDP units ({', '.join(units[:4])}): an export would run FSDP's unsharding under the "
                f"exporter's fake tensors and leave FSDP's state broken. Shard the ORTModule instead: "
                f"fully_shard(ORTModule(model)) (FSDP2, per block too)")
    for sub in module.modules():
        for value in (*sub._parameters.values(), *vars(sub).values()):
            if isinstance(value, torch.Tensor) and not torch.nn.parameter.is_lazy(value) \
                    and isinstance(value._base if value._is_view() else value, FlatParameter):
                return ("FullyShardedDataParallel (FSDP1) around it replaced its parameters by views of a flat "
                        "parameter, which an export cannot take; FSDP2 shards an ORTModule's own parameters: "
                        "fully_shard(ORTModule(model))")
    return None


def _ddp_obstacle(module: torch.nn.Module) -> str | None:
    """Why DistributedDataParallel inside ``module`` keeps it from being exported, or None: DDP's
    forward disables the compiler (the export fails) and its gradient hooks belong outside."""
    units = [name or "the module itself" for name, sub in module.named_modules()
             if isinstance(sub, torch.nn.parallel.DistributedDataParallel)]
    if not units:
        return None
    return (f"it holds DistributedDataParallel ({', '.join(units[:4])}), whose forward an export cannot trace; "
            f"wrap the other way: DistributedDataParallel(ORTModule(model))")


def _dtensor_obstacle(module: torch.nn.Module) -> str | None:
    """Why ``module``'s DTensor parameters or buffers (tensor parallelism) keep it from being
    exported, or None. FSDP2 around an ORTModule gives its forward plain unsharded parameters."""
    dtensors = sys.modules.get("torch.distributed.tensor")
    if dtensors is None:  # never imported: no DTensor anywhere
        return None
    names = [name for name, value in (*module.named_parameters(), *module.named_buffers())
             if isinstance(value, dtensors.DTensor)]
    if not names:
        return None
    return (f"its parameters or buffers are DTensors ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): "
            "tensor parallelism (parallelize_module, distribute_tensor) shards them in a way the export cannot "
            "take. FSDP2 shards an ORTModule's own parameters: fully_shard(ORTModule(model))")


def _traced_here() -> bool:
    """Whether an export is tracing this thread's call (an outer ORTModule's, torch.export of a
    model holding this one). ``torch.compiler.is_exporting()`` is process-wide: a call from another
    thread while one exports saw it set and ran the module in PyTorch, whose parameters the
    export had swapped for fake tensors. The trace's modes are this thread's own."""
    return torch.compiler.is_exporting() and (torch._C._len_torch_function_stack() > 0
                                              or len(_get_current_dispatch_mode_stack()) > 0)


def _with_tangents(args: tuple, kwargs: dict) -> bool:
    """Whether a call's tensors carry forward-mode AD tangents (inside ``forward_ad.dual_level()``)."""
    forward_ad = torch.autograd.forward_ad
    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level open: no tangents anywhere
        return False
    return any(isinstance(leaf, torch.Tensor) and forward_ad.unpack_dual(leaf).tangent is not None
               for leaf in torch.utils._pytree.tree_leaves((args, kwargs)))


def _export_obstacle(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot be exported as it is held now, found before an export tries (whose
    error would name the tracer's internals, or leave FSDP's state broken), or None."""
    return (_fsdp_obstacle(module) or _ddp_obstacle(module) or _script_obstacle(module)
            or _packed_weights_obstacle(module) or _dtensor_obstacle(module))


def _script_obstacle(module: torch.nn.Module) -> str | None:
    """Why ``module``'s TorchScript submodules (``torch.jit.script``/``trace``) keep it from being
    exported, or None: torch.export cannot trace into them."""
    if isinstance(module, torch.jit.ScriptModule):
        return ("it is a TorchScript module, which the exporter cannot trace into: wrap the module as it was "
                "before torch.jit.script or torch.jit.trace")
    found = {name: sub for name, sub in module.named_modules() if isinstance(sub, torch.jit.ScriptModule)}
    # the outermost ones (a scripted module's submodules are scripted too)
    scripted = [f"{name} ({type(sub).__name__})" for name, sub in found.items()
                if not any(other != name and name.startswith(f"{other}.") for other in found)]
    if not scripted:
        return None
    return (f"it holds TorchScript modules ({', '.join(scripted[:4])}{', ...' if len(scripted) > 4 else ''}), which "
            f"the exporter cannot trace into: use the modules as they were before torch.jit.script or "
            f"torch.jit.trace")


_QUANTIZED = "torch.ao.nn.quantized"  # the modules torch.ao.quantization.convert writes
# (dtypes, not Tensor.is_quantized: a call that waits for another thread's build reads the
# module's tensors while that export may have put fake ones in their places, and metadata
# needs no dispatch)
_QUANTIZED_DTYPES = frozenset(getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                              if hasattr(torch, name))


def _packed_weights_obstacle(module: torch.nn.Module) -> str | None:
    """Why ``module``'s quantized (packed) weights keep it from being exported, or None: the
    modules ``torch.ao.quantization.convert`` writes keep their weights in TorchScript objects
    (``LinearPackedParamsBase``, ...) or quantized tensors, which the exporter cannot trace."""
    held = {}
    for name, sub in module.named_modules():
        tensors = (*sub._parameters.values(), *sub._buffers.values())
        if any(isinstance(v, torch.ScriptObject) for v in vars(sub).values()) \
                or any(t is not None and t.dtype in _QUANTIZED_DTYPES for t in tensors):
            # named by its outermost quantized module (a quantized Linear, not its _packed_params)
            parts = name.split(".") if name else []
            owner = next((".".join(parts[:k]) for k in range(len(parts) + 1)
                          if type(module.get_submodule(".".join(parts[:k]))).__module__.startswith(_QUANTIZED)), name)
            kind = type(module.get_submodule(owner))
            held[owner] = f"{owner or 'the module itself'} ({kind.__module__}.{kind.__qualname__})"
    held = list(held.values())
    if not held:
        return None
    return (f"it holds quantized modules whose weights are packed ({', '.join(held[:4])}"
            f"{', ...' if len(held) > 4 else ''}), which the exporter cannot trace: a model converted by "
            "torch.ao.quantization.convert is for inference. Train the prepared model (prepare_qat: its fake "
            "quantization trains in ONNX Runtime) and convert it after training")


def _parameters_swapped(module: torch.nn.Module) -> bool:
    """Whether a parameter's place holds a plain tensor (``torch.func.functional_call``'s doing)."""
    return any(p is not None and not isinstance(p, torch.nn.Parameter)
               for sub in module.modules() for p in sub._parameters.values())


def _replace_state(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Set the buffer (or parameter) ``name`` of ``module`` to ``value`` of another shape or dtype,
    as the forward's ``self.name = tensor`` did in PyTorch."""
    owner_name, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if attribute in owner._buffers:
        owner._buffers[attribute] = value
    else:
        owner._parameters[attribute].data = value


class ORTModule(ModuleWrapper):
    """Wrap a ``torch.nn.Module`` so that its forward and backward run in ONNX Runtime.

    The rest of the training script stays as it is: the same optimizer on
    ``model.parameters()``, the same loss, ``loss.backward()``, ``optimizer.step()``.
    The module is exported on its first call (``torch.onnx.export(..., dynamo=True)``) with
    parameters and buffers as graph inputs, so weights update without a re-export.
    Shapes work as in ``torch.compile``: by default (``dynamic=None``) the first export
    uses the call's own shapes (static: several times faster to export than symbolic
    shapes); the first call whose shapes that graph cannot serve re-exports once with
    dynamic dims (``torch.export.Dim.AUTO``), and that graph serves later batch and sequence
    sizes. ``dynamic=True`` exports dynamic dims from the first call, ``dynamic=False``
    exports once per distinct shape. Other new exports happen only when the call's schema
    changes (dtypes, ranks, non-tensor arguments, train/eval mode) — ``export_count``
    counts them all.

    In training, one gradient graph is built and cut into a forward and a backward graph
    that run inside a ``torch.autograd.Function``; parameters (and inputs) that require
    grad receive their gradients in ``.grad`` as usual. Without grad (``torch.no_grad()``,
    or nothing requires grad) a forward-only graph runs. Buffers that the forward updates
    (BatchNorm running statistics) are written back into the module's buffers, and tensor
    arguments it changes in place into the caller's tensors (one that requires grad makes the
    module run in PyTorch).

    Python attributes: an export bakes the plain values the forward reads (a dropout
    probability, a scale, a flag that picks a branch, a submodule's ``training`` flag) into the
    graph. The scalar attributes (bool, int, float, str, None, enums, tuples of those) of the
    module, its submodules and the Hugging Face configs they hold (``config.output_hidden_states``,
    ``config.use_cache``, ...) are recorded at each export and compared on every call; a call
    whose values differ runs a graph exported for them (exported once per set of values, so
    switching back reuses the earlier graph). An attribute whose new value exports the same
    graph (one the forward does not read, such as a value a training loop stores on a module) is
    no longer watched after that one export. One that changes the graph and takes more than
    ``ATTRIBUTE_EXPORT_LIMIT`` new values (a schedule stepped every call) makes the module run
    in PyTorch, as a fallback does (or raise ``ExportError`` without fallback): register it as
    a buffer or pass it as a tensor to make it a graph input instead. Lists and dicts of such
    values (up to 64 items; PEFT's adapter state) are watched by a copy; hooks added or removed
    are noticed the same way. Other objects (tensors that are neither parameters nor buffers,
    larger or nested containers) and attributes set after the export are not watched: changing
    what the forward reads there needs a new ORTModule.

    Custom ``torch.autograd.Function``s: the export traces through their forward, and ONNX
    Runtime cannot call their own backward, so a module whose forward runs one on tensors that
    require grad (a straight-through estimator, a gradient reversal) runs in PyTorch, as a
    fallback does (or raises ``ExportError`` without fallback), rather than train with the
    gradient of the forward. ``inline_autograd_functions`` lists those whose backward is the
    exact gradient of their forward (a memory-saving or fused reimplementation; ``True``: all
    of them), which then run in ONNX Runtime; torch's reentrant checkpoint is one already.
    Functions are found in the autograd graph the export traces, so a parameter unfrozen
    after the export makes the next training call export again to look along its paths.
    Functions inside a reentrant checkpoint (whose forward runs without grad) are not seen.
    Backward hooks on the module or its submodules (``register_full_backward_hook`` and the
    like) cannot run in ONNX Runtime's backward either: such a module runs in PyTorch too.

    ``detach()`` and ``torch.no_grad()`` regions in the forward stop gradients, as in eager
    (regions only in a forward where no custom Function switches grad mode: docs/ortmodule.md);
    parameters that only such paths reach keep ``.grad`` None.

    Dropout runs ONNX Runtime's random generator, not PyTorch's: masks differ from eager
    PyTorch for the same ``torch.manual_seed`` (the distribution is the same).

    Parameter names, ``state_dict()`` keys and ``load_state_dict()`` are those of the
    wrapped module, so checkpoints move freely between the two.

    Memory: what the forward saves for the backward is chosen when the gradient graph is
    built, for the input shapes of that first training call. ``memory_opt_level`` (upstream's
    levels, default ``$ORTMODULE_MEMORY_OPT_LEVEL`` or 0: see
    :class:`~onnxtrain.passes.partition.MemoryOptLevel`) or ``memory_budget`` (bytes the saved
    activations may take: the least recompute within it is chosen by a min cut) make the
    backward graph recompute forward values instead; :meth:`explain_memory` reports what is
    saved and what is recomputed.

    Example:
        >>> model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 2)))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loss = model(torch.randn(8, 4)).square().mean()
        >>> loss.backward(); optimizer.step()
    """

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None, *,
                 memory_opt_level: int | None = None, memory_budget: int | None = None,
                 dynamic: bool | None = None, inline_autograd_functions: bool | Iterable[type] = ()):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        obstacle = _fsdp_obstacle(module) or _ddp_obstacle(module)
        if isinstance(module, torch.jit.ScriptModule):  # (not even PyTorch's fallback could hold it)
            obstacle = _script_obstacle(module)
        if obstacle is not None:
            raise OnnxTrainError(f"ORTModule cannot wrap {type(module).__name__}: {obstacle}")
        inline_functions = _inline_functions(inline_autograd_functions)
        if dynamic not in (None, True, False):
            raise TypeError(f"ORTModule dynamic must be None (automatic), True or False, got {dynamic!r}")
        if memory_budget is not None:
            if not _whole_number(memory_budget) or memory_budget < 0:
                raise MemoryOptionsError(f"ORTModule memory_budget must be a whole number of bytes >= 0, got "
                                         f"{memory_budget!r}")
            memory_budget = int(memory_budget)  # numpy's integers too
        if memory_opt_level is not None and (not _whole_number(memory_opt_level) or memory_opt_level not in (0, 1, 2)):
            raise MemoryOptionsError(f"ORTModule memory_opt_level must be 0, 1 or 2, got {memory_opt_level!r}")
        environment = read_environment()
        for name, why in environment.ignored.items():
            warnings.warn(f"{name} is set: upstream ORTModule's setting has no effect in onnxtrain ({why})",
                          IgnoredSettingWarning, stacklevel=2)
        debug_options = debug_options or DebugOptions()
        if environment.fallback is not None:  # upstream's variables win over its DebugOptions
            debug_options = dataclasses.replace(debug_options, fallback=environment.fallback)
        if environment.log_level is not None:
            debug_options = dataclasses.replace(debug_options, log_level=environment.log_level)
        if environment.save_path is not None:
            debug_options = dataclasses.replace(debug_options, save_path=environment.save_path)
        super().__init__(module)
        self._debug = debug_options
        self._dynamic = dynamic
        self._inline_functions = inline_functions
        try:  # $ORTMODULE_MEMORY_OPT_LEVEL is read here, once (as upstream), not at every export
            level = int(MemoryOptions(memory_opt_level, memory_budget).resolved_level())
        except ValueError as exc:
            raise MemoryOptionsError(f"ORTModule: {exc}") from None
        self._memory_options = MemoryOptions(level, memory_budget)
        self._last_memory_report: MemoryReport | None = None
        # keyed on the call's schema, the autocast state (see _autocast) and grad mode
        self._variants: dict[tuple[CallSchema, tuple | None, bool], list[_Variant]] = {}
        self._fallback_reason: str | None = None
        self._warned_off_branch = False  # a call left the branches on the data its graph took
        if environment.force_torch:
            self._fall_back(ExportError(f"{FALLBACK_POLICY_ENV}={os.environ[FALLBACK_POLICY_ENV]!r} asks for "
                                        f"PyTorch's forward and backward"), stacklevel=2)
        self.export_count = 0
        # the new values each (submodule name, attribute) took, and those no longer watched
        self._attribute_values: dict[tuple[str, str], set] = {}
        self._unwatched_attributes: set[tuple[str, str]] = set()
        # the values each non-tensor argument (by its place among them) took, where it changed
        self._argument_values: dict[int, set] = {}
        # one call at a time builds (exports, gradient graphs, sessions): a first call in two
        # threads at once builds once, and the other uses what it built
        self._building = threading.RLock()
        self._wrapper_ready()  # from here on, new attributes go to the wrapped module

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_variants"] = {}  # sessions are rebuilt on the next call
        del state["_building"]  # a lock neither pickles nor copies: each copy gets its own
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        # pickled before ORTModule watched attributes
        self.__dict__.setdefault("_attribute_values", {})
        self.__dict__.setdefault("_unwatched_attributes", set())
        # pickled before ORTModule looked for custom autograd Functions
        self.__dict__.setdefault("_inline_functions", frozenset())
        # pickled before ORTModule answered branches on the data
        self.__dict__.setdefault("_warned_off_branch", False)
        self.__dict__["_building"] = threading.RLock()
        self.__dict__["_wrapper_ready"] = True

    def __deepcopy__(self, memo):
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__getstate__().items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        clone.__dict__["_building"] = threading.RLock()
        return clone

    def explain_memory(self) -> str:
        """What the forward saves for the backward (largest first) and which forward nodes the
        backward recomputes, with their sizes for the shapes of the call that built the
        gradient graph. Raises ``RuntimeError`` before the first training call."""
        if self._last_memory_report is None:
            raise RuntimeError("ORTModule.explain_memory: no gradient graph yet; call the module in training first")
        return self._last_memory_report.explain()

    @property
    def memory_report(self) -> MemoryReport | None:
        """The :class:`~onnxtrain.passes.partition.MemoryReport` of the latest gradient graph built."""
        return self._last_memory_report

    @property
    def fallback_reason(self) -> str | None:
        """Why the module runs in PyTorch (None while it runs in ONNX Runtime)."""
        return self._fallback_reason

    # -- calls -------------------------------------------------------------------
    # torch.compile over an ORTModule (or a model holding one) runs this call as it is, ONNX
    # Runtime's sessions and all, rather than tracing into the export machinery
    @wrapped_signature
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        module = self._original_module
        if self._fallback_reason is not None or (not self.export_count and _has_lazy_parameters(module)):
            # a lazy module's first call, in PyTorch, gives its parameters their shapes; the next is exported
            return module(*args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return self._in_pytorch_this_time(module, args, kwargs, "inside a torch.func transform (grad, vmap, "
                                              "jacrev, ...)", "outside the transform")
        if _with_tangents(args, kwargs):
            return self._in_pytorch_this_time(module, args, kwargs, "with forward-mode AD's dual tensors "
                                              "(torch.autograd.forward_ad)", "with plain tensors")
        if _traced_here() or torch.jit.is_tracing():
            # an export (an outer ORTModule's) or torch.jit.trace is tracing a model that holds
            # this ORTModule: the traced forward is the module's own, part of the outer graph
            return module(*args, **kwargs)
        # the module's state is read under the build lock and the export lock: another thread's
        # export may be tracing the module, or another model sharing its submodules, with fake
        # tensors in their parameters' places (an uncontended read takes ~0.2 us more)
        with self._building, EXPORT_LOCK:
            # before the first export: FSDP's state must not be traced
            obstacle = _export_obstacle(module) if not self.export_count else None
            call = flatten_call(module, args, kwargs) if obstacle is None else None
        if obstacle is not None:
            if not self._debug.fallback:
                raise ExportError(f"{type(module).__name__} cannot run in ONNX Runtime: {obstacle}")
            self._fall_back(ExportError(obstacle))
            return module(*args, **kwargs)
        state = call.state
        try:  # building: export, gradient graph, sessions; a failure here may fall back
            # the export's own tracing saves tensors for autograd: not under the caller's saved-tensor
            # hooks (non-reentrant activation checkpointing counts what a forward saves, and the
            # recomputed forward, with the graphs built, would save fewer)
            with self._building, torch.autograd.graph.saved_tensors_hooks(_detached, _as_is):
                variant, inputs, training, runner = self._prepare(call)
        except OnnxTrainError as exc:
            if not self._debug.fallback:
                raise
            if _parameters_swapped(module):
                # torch.func.functional_call put plain tensors in the parameters' places: the
                # export cannot take them, but the module's own parameters still can
                warnings.warn(
                    f"ORTModule runs this call of {type(module).__name__} in PyTorch: its parameters are "
                    f"replaced by plain tensors (torch.func.functional_call), which cannot be exported; calls "
                    f"with its own parameters still run in ONNX Runtime", ORTModuleFallbackWarning, stacklevel=2)
                return module(*args, **kwargs)
            # the call in PyTorch first: an error the module raises there (a batch of one through a
            # training BatchNorm, a wrong feature size) is the caller's, for this call only (eager
            # raises it too), and the next calls still run in ONNX Runtime
            result = module(*args, **kwargs)
            self._fall_back(exc)
            return result
        graph = variant.graph
        if variant.calls_to_skip:
            # the data keeps to branches this graph cannot run, and none exports: running the
            # graph would only find that again (Longformer's global attention uses numbers read
            # with .item() as sizes)
            variant.calls_to_skip -= 1
            return module(*args, **kwargs)
        try:
            outputs = ORTFunction.apply(runner, *inputs) if training else runner.run(inputs)
        except RunError:
            if not graph.assumptions or not self._debug.fallback:  # (without fallback: the run's own error)
                raise
            # values a check would have refused (a label out of range) may fail the run first
            self._off_the_traced_branches(module, "onnxruntime failed this call, whose values may take another")
            return module(*args, **kwargs)
        observed = tuple(bool(value) for value in outputs[len(outputs) - len(graph.assumptions):]) \
            if graph.assumptions else ()
        if observed != graph.assumptions and not variant.answers_taken and not variant.reanswered:
            # the graph's answers were the capture's guesses, and the first call to run it took
            # other branches (data that always takes them, as a head that always marks a global
            # token): this call exports along the branches it took and runs that graph (where
            # that export fails, it keeps this graph and runs in PyTorch, below)
            variant.observed_answers, variant.unusable = observed, True
            return self.forward(*args, **kwargs)
        if observed != graph.assumptions:
            # the forward branches on the data, and this call's data takes a branch the graph was
            # not traced along (a check that raises, a rare path): PyTorch runs it, as written.
            # Once per graph, the next call exports along the branches this one took (data that
            # always takes them would otherwise run twice, here and in PyTorch)
            self._off_the_traced_branches(module, "this call's values take another")
            result = module(*args, **kwargs)  # (a check's branch raises here: nothing to export along)
            seen, streak = variant.off_branch
            variant.off_branch = (observed, streak + 1 if seen == observed else 1)
            streak = variant.off_branch[1]
            if streak >= _OFF_BRANCH_STREAK and not variant.reanswered:
                variant.observed_answers, variant.unusable = observed, True
            elif streak >= _OFF_BRANCH_STREAK:  # tried: the next calls skip the graph, more each time
                variant.calls_to_skip = min(2 ** (streak - _OFF_BRANCH_STREAK), _LONGEST_SKIP)
            return result
        if graph.assumptions:
            variant.off_branch, variant.answers_taken = ((), 0), True
        with torch.no_grad():
            updates = iter(outputs[graph.num_user_outputs:])
            for name, value in zip(graph.buffer_updates, updates):
                if state[name].is_complex() and not value.is_complex():  # (its real view, as the graph holds it)
                    value = torch.view_as_complex(value)
                if value.shape == state[name].shape and value.dtype == state[name].dtype:
                    state[name].copy_(value)
                else:  # the forward set a new tensor (a cache grown with the sequence)
                    _replace_state(module, name, value)
            for position, value in zip(graph.input_updates, updates):  # as the forward changed them in place
                target = call.tensors[position]
                target.copy_(torch.view_as_complex(value) if target.is_complex() and not value.is_complex() else value)
        return graph.rebuild_output(outputs[:graph.num_user_outputs])

    def _off_the_traced_branches(self, module, how: str) -> None:
        """Say (once per ORTModule) that a call left the branches on the data its graph was
        traced along (``how``), so that it runs in PyTorch; with ``fallback=False``, raise instead."""
        reason = (f"{type(module).__name__}'s forward branches on the data (an `if` on a tensor's value or on a "
                  f"size it decides), and {how} branch than its graph was traced along")
        if not self._debug.fallback:
            raise ExportError(reason)
        if not self._warned_off_branch:
            self._warned_off_branch = True
            warnings.warn(f"ORTModule runs this call in PyTorch: {reason}; calls along the traced branches still "
                          f"run in ONNX Runtime", ORTModuleFallbackWarning, stacklevel=3)

    def _in_pytorch_this_time(self, module, args, kwargs, how: str, others: str):
        """A call ``how`` (inside a torch.func transform, whose tensors are the transform's
        wrappers; with forward-mode AD's dual tensors, whose tangents no graph carries), which
        neither an export nor ONNX Runtime can take. It runs in PyTorch; calls ``others`` still
        run in ONNX Runtime."""
        reason = f"{type(module).__name__} is called {how}, whose tensors cannot run in ONNX Runtime"
        if not self._debug.fallback:
            raise ExportError(reason)
        warnings.warn(f"ORTModule runs this call in PyTorch: {reason}; calls {others} still run in ONNX Runtime",
                      ORTModuleFallbackWarning, stacklevel=3)
        return module(*args, **kwargs)

    def _prepare(self, call) -> tuple[_Variant, list[torch.Tensor], bool, SessionRunner | TrainingPrograms]:
        """Build what ``call`` runs (export, gradient graph, sessions; each kept for later
        calls): ``(variant, inputs, training, runner)``. Runs nothing; an OnnxTrainError says
        why the call cannot run in ONNX Runtime. In automatic mode a dynamic export whose graphs
        cannot be built (``chunk`` along a symbolic dim exports as a SplitToSequence, which has
        no gradient) gives way to one static export per shape, as a failed dynamic export does."""
        variant = self._variant(call, _autocast(call.tensors))
        try:
            return self._prepare_variant(call, variant)
        except OnnxTrainError as exc:
            if not variant.dynamic or self._dynamic is not None:
                raise
            logger.info("%s's graph with dynamic shapes cannot be built (%s); exporting each shape",
                        type(self._original_module).__name__, exc)
            variant.unusable = True
            variant.inference, variant.training = None, {}
            return self._prepare_variant(call, self._variant(call, _autocast(call.tensors)))

    def _prepare_variant(self, call, variant: _Variant):
        """:meth:`_prepare` for the variant that serves ``call``."""
        inputs, wrt = _graph_inputs(call, variant)
        training = torch.is_grad_enabled() and bool(wrt)
        if training and not variant.graph.traced_grads.issuperset(wrt):
            self._trace_new_gradients(call, variant)
        changed = variant.graph.input_updates
        requiring = [i for i in changed if call.tensors[i].requires_grad]
        if requiring:
            raise ExportError(f"{type(self._original_module).__name__} changes its tensor argument "
                              f"{', '.join(map(str, requiring))} in place, and it requires grad: ORTModule "
                              f"cannot give autograd that history")
        shared = sorted(call.aliased.intersection(changed))
        if shared:
            raise ExportError(f"{type(self._original_module).__name__} changes its tensor argument "
                              f"{', '.join(map(str, shared))} in place, and it shares memory with another argument "
                              f"(a view of it, or the same tensor): the write would not show through the other as "
                              f"in PyTorch; pass separate tensors")
        # arguments and buffers the call changes in place (written back after the run): the runs
        # read, and the backward keeps, the values from before, not tensors the write-back changes
        state_names = variant.graph.state_names
        updated = {*changed, *(len(call.tensors) + state_names.index(name)
                               for name in variant.graph.buffer_updates if name in state_names)}
        if training and updated:
            inputs = [t.clone() if i in updated else t for i, t in enumerate(inputs)]
        runner = self._training_programs(variant, wrt, inputs) if training else \
            self._inference_runner(variant, inputs)
        return variant, inputs, training, runner

    def _fall_back(self, exc: Exception, stacklevel: int = 3) -> None:
        self._fallback_reason = f"{type(exc).__name__}: {exc}"
        self._variants.clear()  # their graphs and sessions serve no call any more
        warnings.warn(
            f"ORTModule runs {type(self._original_module).__name__} in PyTorch: {self._fallback_reason}",
            ORTModuleFallbackWarning, stacklevel=stacklevel + 1,
        )

    def _count_attribute_values(self, changes: list[AttributeChange]) -> None:
        """Note the new values of changed attributes; ``ExportError`` (fallback to PyTorch, where
        allowed) once one has taken more than ``ATTRIBUTE_EXPORT_LIMIT``."""
        for change in changes:
            self._attribute_values.setdefault(change.key, set()).add(_hashable(change.current))
        churning = [c for c in changes if len(self._attribute_values[c.key]) > ATTRIBUTE_EXPORT_LIMIT]
        if churning:
            what = ", ".join(f"{c.where} (now {c.now})" for c in churning)
            raise ExportError(
                f"{type(self._original_module).__name__}'s {what} took more than {ATTRIBUTE_EXPORT_LIMIT} "
                f"new values, each changing the exported graph; register it as a buffer or pass it as a "
                f"tensor argument to make it a graph input")
        logger.info("exporting %s again: %s", type(self._original_module).__name__, "; ".join(map(str, changes)))

    def _count_argument_values(self, call, key: tuple) -> None:
        """Note the new values of non-tensor arguments (each value its own graph) against the
        graphs exported for calls that differ only in them; ``ExportError`` (fallback to
        PyTorch, where allowed) once one has taken more than ``ATTRIBUTE_EXPORT_LIMIT``."""
        schema, rest = call.schema, key[1:]
        bare = dataclasses.replace(schema, constants=())
        for other, *other_rest in self._variants:
            if other_rest != list(rest) or len(other.constants) != len(schema.constants) \
                    or dataclasses.replace(other, constants=()) != bare:
                continue
            for place, (before, now) in enumerate(zip(other.constants, schema.constants)):
                if before != now:
                    self._argument_values.setdefault(place, {before}).add(now)
        # the first value and up to the limit's count of new ones, as for attributes
        churning = [place for place, values in self._argument_values.items()
                    if len(values) > ATTRIBUTE_EXPORT_LIMIT + 1]
        if churning:
            names = constant_argument_names(call)
            what = ", ".join(f"{names[place]} (now {schema.constants[place][1]!r})" for place in churning)
            raise ExportError(
                f"{type(self._original_module).__name__}'s {what}, not a tensor, took more than "
                f"{ATTRIBUTE_EXPORT_LIMIT} new values, each exported as a graph of its own; pass it as a tensor "
                f"(torch.tensor(value)) to make it a graph input that one graph serves for every value")

    def _variant(self, call, autocast: tuple[str, str] | None) -> _Variant:
        # grad mode is part of the key: a forward may branch on it (nn.TransformerEncoder's fast
        # path runs only without grad), and only a graph traced with grad shows its custom
        # autograd Functions and gradient cuts
        key = (call.schema, autocast, torch.is_grad_enabled())
        if key not in self._variants:
            self._count_argument_values(call, key)
        variants = self._variants.setdefault(key, [])
        stale: _Variant | None = None  # a graph for these shapes, exported with other attribute values
        stale_changes: list[AttributeChange] = []
        for variant in variants:
            if variant.unusable and variant.observed_answers is not None and variant.graph.accepts(call.tensors):
                # a call took other branches on the data: export along them, once
                answers, variant.observed_answers, variant.reanswered = variant.observed_answers, None, True
                began = time.perf_counter()
                try:
                    answered = self._export(call, variants, like=variant, answers=answers)
                except OnnxTrainError as exc:  # (the other branches do not export: keep this graph)
                    logger.info("%s does not export along the branches a call took (%s)",
                                type(self._original_module).__name__, exc)
                    variant.unusable = False
                    return variant
                answered.reanswered = True
                return self._adopt(call, variants, answered, autocast, began=began)
            if not variant.unusable and variant.graph.accepts(call.tensors):
                changes = variant.attributes.changes(self._unwatched_attributes)
                if not changes:
                    return variant
                if stale is None or (variant.dynamic and not stale.dynamic):  # one export for every shape
                    stale, stale_changes = variant, changes
        if stale is not None:
            self._count_attribute_values(stale_changes)
        began = time.perf_counter()
        # the branches on the data that calls of other shapes took: the likeliest for this one too
        taken = next((v.graph.assumptions for v in reversed(variants) if v.answers_taken), ())
        variant = self._export(call, variants, like=stale, answers=taken)
        return self._adopt(call, variants, variant, autocast, stale, stale_changes, began=began)

    def _adopt(self, call, variants: list[_Variant], variant: _Variant, autocast: tuple[str, str] | None,
               stale: _Variant | None = None, stale_changes: Sequence[AttributeChange] = (), *,
               began: float) -> _Variant:
        """Finish a fresh export ``variant`` for ``call`` (begun at ``began``: its attribute
        record, mixed precision) and add it to ``variants``; or, where it is the same graph as
        ``stale``'s (the forward does not read the attributes that changed), keep ``stale``."""
        variant.attributes = AttributeRecord(self._original_module)
        graph = variant.graph
        self.export_count += 1
        logger.info("exported %s (%s, %s shapes, export #%d) in %.1f s: %d nodes", type(self._original_module).__name__,
                    self._mode(), "dynamic" if variant.dynamic else "static", self.export_count,
                    time.perf_counter() - began, len(graph.model.graph))
        low_precision = autocast if autocast is not None else _low_precision_on_cpu(call)
        if low_precision is not None:
            # under torch.autocast the export traces autocast's casts: the graph computes what eager
            # autocast computes, with its output dtypes; the precision pass then moves the ops the
            # execution provider cannot run in low precision (and the sensitive ones) to fp32 (the
            # same for a model converted to bf16/fp16 on the CPU)
            variant.precision = PrecisionConfig(low_precision[1], device=low_precision[0])
            pipeline.run(graph.model, pipeline.mixed_precision(variant.precision))
        if stale is not None and io.serialize(graph.model) == io.serialize(stale.graph.model):
            # the forward does not read what changed: stop watching it, keep the graph built already
            self._unwatched_attributes.update(c.key for c in stale_changes)
            logger.info("%s's graph does not depend on %s: no longer watched", type(self._original_module).__name__,
                        ", ".join(c.where for c in stale_changes))
            return stale
        variants.append(variant)
        self._save(graph.exported, "exported")
        graph.exported = None  # saved: no need to hold a second copy of the model
        self._save(graph.model, "optimized")
        return variant

    def _trace_new_gradients(self, call, variant: _Variant) -> None:
        """Export ``variant``'s call again where gradients now flow through inputs or parameters
        that did not require grad when it was exported (unfrozen since): custom autograd
        Functions on those paths were not in the traced autograd graph. The same graph (the
        usual case) only updates what was traced; ``ExportError`` if such a Function is found."""
        began = time.perf_counter()
        graph = self._export(call, [], like=variant).graph
        self.export_count += 1
        if variant.precision is not None:
            pipeline.run(graph.model, pipeline.mixed_precision(variant.precision))
        logger.info("exported %s again (export #%d) in %.1f s: gradients now flow through inputs that did not "
                    "require grad at its export", type(self._original_module).__name__, self.export_count,
                    time.perf_counter() - began)
        if io.serialize(graph.model) != io.serialize(variant.graph.model):
            variant.inference, variant.training, variant.memory = None, {}, {}
            graph.exported = None
            variant.graph = graph
        variant.graph.traced_grads = graph.traced_grads
        variant.graph.output = graph.output  # which outputs require grad, now that more inputs do

    def _export(self, call, variants: list[_Variant], like: _Variant | None = None,
                answers: Sequence[bool] = ()) -> _Variant:
        """Export for a call that none of its schema's ``variants`` accepts. Automatic mode
        (``dynamic=None``): static for the schema's first export; dynamic for the first call
        that needs another shape; static again (one graph per shape) once a dynamic export was
        tried, or when the dynamic export fails. With ``like`` (a graph for the call's shapes
        whose attribute values changed), shapes as ``like``'s. ``answers``: those to try first for
        the forward's branches on the data."""
        def export(dynamic: bool) -> ExportedGraph:
            return export_call(self._original_module, call, keep_exported=self._debug.save_onnx, dynamic=dynamic,
                               inline_functions=self._inline_functions, answers=answers)

        if like is not None:
            graph = export(like.dynamic)
            return _Variant(graph, dynamic=like.dynamic, dynamic_tried=like.dynamic_tried)
        if self._dynamic is False:
            return _Variant(export(False))
        if self._dynamic:
            try:
                return _Variant(export(True), dynamic=True, dynamic_tried=True)
            except ExportError as exc:
                # a shape the model's code decides on (transformers' attention takes
                # ``is_causal = length > 1``): this call gets a graph of its own shapes, later
                # calls of other shapes still a dynamic one
                logger.info("%s does not export with dynamic shapes for this call (%s); exporting its shapes",
                            type(self._original_module).__name__, exc)
                return _Variant(export(False), dynamic_tried=True)
        if not variants or any(v.dynamic_tried for v in variants):
            return _Variant(export(False))
        try:
            graph = export(True)
            return _Variant(graph, dynamic=True, dynamic_tried=True)
        except ExportError as exc:
            logger.info("%s does not export with dynamic shapes (%s); exporting this call's shapes",
                        type(self._original_module).__name__, exc)
            graph = export(False)
            return _Variant(graph, dynamic_tried=True)

    def _mode(self) -> str:
        return "training" if self._original_module.training else "inference"

    def _save(self, model, stage: str) -> None:
        if not self._debug.save_onnx or model is None:
            return
        folder = self._debug.resolved_save_path()
        folder.mkdir(parents=True, exist_ok=True)
        io.save_model(model, folder / f"{self._debug.onnx_prefix}_{self._mode()}_{stage}.onnx")

    def _inference_runner(self, variant: _Variant, inputs) -> SessionRunner:
        if variant.inference is None:
            variant.inference = SessionRunner(variant.graph.model, device_of(inputs),
                                              self._debug.resolved_session_options(), "inference graph")
            self._save(variant.graph.model, "inference")
        return variant.inference

    def _forward_backward(self, variant: _Variant, wrt: tuple, inputs):
        """The forward and backward graphs for these requires-grad inputs, planned for these
        shapes, and the positions of those the backward returns gradients for: the inputs
        (parameters) that reach an output only through ``torch.no_grad()`` or ``detach()``, or
        not at all, get none, and their ``.grad`` stays None, as in PyTorch."""
        model = io.load_model(variant.graph.model)
        graph = variant.graph
        # buffer and argument updates, and the outputs PyTorch gives no gradient: outputs without one
        no_grad_outputs = {*graph.output.outputs_without_grad(), *range(graph.num_user_outputs,
                                                                        len(model.graph.outputs))}
        values = list(model.graph.inputs)
        outputs = [o for i, o in enumerate(model.graph.outputs) if i not in no_grad_outputs]
        reached = set(inputs_with_gradient(list(model.graph), [values[i] for i in wrt], outputs))
        wrt = tuple(i for i in wrt if values[i] in reached) or wrt  # none reached: zeros for all
        names = [values[i].name for i in wrt]
        shapes = {v.name: tuple(t.shape) for v, t in zip(model.graph.inputs, inputs)}
        graphs = build_forward_backward(model, names, no_grad_outputs=sorted(no_grad_outputs),
                                        memory_options=self._memory_options, input_shapes=shapes)
        if variant.precision is not None:  # the gradient graph adds low-precision ops of its own
            for part in (graphs.forward, graphs.backward):
                pipeline.run(part, pipeline.mixed_precision(variant.precision))
        return graphs, wrt

    def _training_programs(self, variant: _Variant, wrt: tuple, inputs) -> TrainingPrograms:
        programs = variant.training.get(wrt)
        if programs is None:
            began = time.perf_counter()
            graphs, reached = self._forward_backward(variant, wrt, inputs)
            if logger.isEnabledFor(logging.INFO):  # the memory summary is only worth building to be shown
                logger.info("built the forward (%d nodes) and backward (%d nodes) graphs in %.1f s; %s",
                            len(graphs.forward.graph), len(graphs.backward.graph), time.perf_counter() - began,
                            graphs.memory.explain(limit=0).splitlines()[0] if graphs.memory is not None else "")
            variant.memory[wrt] = graphs.memory
            if self._debug.save_onnx:  # the values passed between them carry the forward's inferred shapes
                forward = io.with_inferred_io_shapes(graphs.forward)
                self._save(forward, "forward")
                self._save(io.with_inferred_io_shapes(graphs.backward, {v.name: v.type for v in forward.graph.output}),
                           "backward")
            # memory options trade speed for memory: the arena also gives back what a run freed
            programs = TrainingPrograms.build(graphs, list(reached), device_of(inputs),
                                              self._debug.resolved_session_options(),
                                              shrink_arena=self._memory_options.active)
            variant.training[wrt] = programs
        self._last_memory_report = variant.memory.get(wrt)
        return programs
