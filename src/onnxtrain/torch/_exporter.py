"""Run ``torch.onnx``'s dynamo exporter with its op registry built once per process.

``torch.onnx.export(dynamo=True)`` rebuilds its table of ATen-to-ONNX functions (the torchlib
registry) on every call. In torch 2.13 with onnxscript's torchlib that costs ~0.45 s, most of
it spent re-parsing the source of every traced torchlib function only to read its ONNX
domain, a value the registry never uses. For ORTModule that is a large part of the first
step and the whole of the registry cost of every later export (eval mode, a new shape).

:func:`export_program` builds the table once from the same sources, in the same way but
without that parse (:func:`torchlib_functions`, cached per opset), and infers a function's
signature only when an export first dispatches to it (most of the rest of the cost); it copies
the table for each export, registers the custom translations on the copy and calls the
exporter's core with it: the same graph ``torch.onnx.export`` produces. Where torch's internal
exporter API is not the one this module was written against, it falls back to
``torch.onnx.export``.

The module is captured here, with the exporter's first capture strategy
(``torch.export.export(strict=False)``, :func:`capture`), and its program handed to the
exporter: between the two, :func:`mark_gradient_cuts` makes the forward's ``torch.no_grad()``
regions explicit, which the exporter's decomposition would otherwise inline and forget.

Importing torchlib itself (~0.3 s) is mostly onnxscript compiling ~60 scripted functions from
their source; when this module is the first to import it, each is compiled when an export first
uses it (:func:`scripting_deferred`): the bench MLP's first ORTModule step 1.83 -> 1.64 s.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import operator
import sys
import threading
from collections.abc import Callable, Iterator, Mapping

import torch
from torch._subclasses.fake_tensor import is_fake

_LOG = logging.getLogger(__name__)
# the keyword arguments export_program passes to the exporter's core
_CORE_EXPORT_PARAMETERS = {"registry", "optimize", "verbose", "opset_version"}


def _torchlib_entries(table, target, overloads) -> None:
    """Register a torchlib op's overloads for ``target`` in ``table``, their signatures inferred
    when an export first dispatches to them (see :func:`_lazy_registry_class`)."""
    from torch.onnx._internal.exporter import _registration

    for function, is_complex in [(f, False) for f in overloads.overloads] + [(f, True) for f in overloads.complex]:
        meta = _registration.OnnxDecompMeta(onnx_function=function, fx_target=target, signature=None,
                                            is_custom=False, is_complex=is_complex, skip_signature_inference=True)
        meta.signature_deferred = True
        table._register(target, meta)


def _table(opset_version: int, entries, torch_metas=()) -> dict:
    """``ONNXRegistry`` functions of ``torch_metas`` (torch's own torchlib entries) and of torchlib
    ``entries`` (``(target, overloads)`` pairs), cleaned up for ``opset_version`` as torch does."""
    from torch.onnx._internal.exporter import _registration

    table = _registration.ONNXRegistry()
    table._opset_version = opset_version
    for meta in torch_metas:
        table._register(meta.fx_target, meta)
    for target, overloads in entries:
        _torchlib_entries(table, target, overloads)
    table._cleanup_registry_based_on_opset_version()
    return {target: tuple(metas) for target, metas in table.functions.items()}


@functools.lru_cache(maxsize=4)
def _torchlib_table(opset_version: int) -> tuple[Mapping[object, tuple], tuple]:
    """The torchlib functions whose ops torch has registered (see :func:`torchlib_functions`),
    and the ``(qualified name, overloads)`` of those it has not (yet)."""
    with scripting_deferred():
        from onnxscript.function_libs.torch_lib import ops as _load_torchlib  # noqa: F401  (registers the ops)
    from onnxscript.function_libs.torch_lib import registration as torchlib
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    resolved, unresolved = [], []
    for qualified_name, overloads in torchlib.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue  # torchlib's own helpers, not ATen ops
        target = _registration._get_overload(qualified_name)
        if target is None:
            unresolved.append((qualified_name, overloads))
        else:
            resolved.append((target, overloads))
    return _table(opset_version, resolved, _torchlib_registry.get_torchlib_ops()), tuple(unresolved)


def torchlib_functions(opset_version: int) -> Mapping[object, tuple]:
    """The torchlib registry's functions for ``opset_version``: a read-only mapping from an op
    (qualified name or Python callable) to its ``OnnxDecompMeta`` entries, as
    ``ONNXRegistry.from_torchlib(opset_version).functions`` holds them.

    Built once per opset and process (the sources are the installed torch and onnxscript);
    :func:`registry` copies it for each export. torchlib's scripted functions are compiled when
    first used (:func:`scripting_deferred`). Ops that torch registers after that (the
    ``quantized_decomposed`` ones, when torch.ao's quantization is imported) are added once
    they resolve, as torch.onnx's own registry, built per export, would have them.
    """
    from torch.onnx._internal.exporter import _registration

    functions, unresolved = _torchlib_table(opset_version)
    late = [(target, overloads) for name, overloads in unresolved
            if (target := _registration._get_overload(name)) is not None]
    return {**functions, **_table(opset_version, late)} if late else functions


TORCHLIB_OPS_MODULE = "onnxscript.function_libs.torch_lib.ops"


@functools.cache
def _deferred_function_class():
    """``onnxscript.OnnxFunction`` that compiles its Python function on first use.

    Importing torchlib compiles ~60 functions with ``onnxscript.script`` (parsing their source
    and translating it: ~0.2 s of the ~0.3 s import), though an export calls a handful of them
    at most. An instance of this class stands in for the compiled function: it is an
    ``OnnxFunction`` (``isinstance`` holds), carries the Python function's name and docstring,
    and the first attribute it does not have yet (``function_ir``, ``name``, ``op_signature``,
    ...) compiles it with the original decorator and takes on the compiled function's
    attributes: from then on it is that function, attribute for attribute.
    """
    import onnxscript

    class DeferredOnnxFunction(onnxscript.OnnxFunction):
        def __init__(self, python_function: Callable, compile_function: Callable[[Callable], object]):
            # no OnnxFunction.__init__: that is the compilation being deferred
            self.__dict__["_compile_deferred"] = lambda: compile_function(python_function)
            # exports in two threads may first use the same function together: one compiles it
            self.__dict__["_compile_lock"] = threading.RLock()
            functools.update_wrapper(self, python_function)

        def __getattr__(self, name: str):
            lock = self.__dict__.get("_compile_lock")
            if lock is not None:
                with lock:
                    compile_deferred = self.__dict__.pop("_compile_deferred", None)
                    if compile_deferred is not None:
                        try:
                            compiled = compile_deferred()
                        except BaseException:
                            self.__dict__["_compile_deferred"] = compile_deferred  # raise again on the next use
                            raise
                        self.__dict__.update(compiled.__dict__)
            try:  # not getattr: an attribute the compiled function lacks must not come back here
                return object.__getattribute__(self, name)
            except AttributeError:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    return DeferredOnnxFunction


@contextlib.contextmanager
def scripting_deferred() -> Iterator[None]:
    """While torchlib's op modules are first imported, ``onnxscript.script(...)(function)``
    returns a :func:`_deferred_function_class` instance instead of compiling ``function``.

    ``onnxscript.script`` is swapped for the length of that import only; once torchlib is
    imported (by this process, the exporter or the user) this does nothing. If onnxscript's
    ``script`` or ``OnnxFunction`` are not what this was written against, torchlib is
    imported as it is.
    """
    import onnxscript

    original = getattr(onnxscript, "script", None)
    if TORCHLIB_OPS_MODULE in sys.modules or not callable(original) or \
            not isinstance(getattr(onnxscript, "OnnxFunction", None), type):
        yield
        return
    deferred_class = _deferred_function_class()

    def deferred_script(*args, **kwargs):
        decorate = original(*args, **kwargs)  # checks its arguments now, as the original does
        return lambda function: deferred_class(function, decorate)

    onnxscript.script = deferred_script
    try:
        yield
    finally:
        onnxscript.script = original


def _infer_signature(meta) -> None:
    """What ``OnnxDecompMeta.__post_init__`` does for a torchlib function, deferred to its first
    dispatch: the function's ONNX signature, on the meta and on the function (where the graph
    builder reads it)."""
    if meta.signature is not None:
        return
    import onnxscript
    from torch.onnx._internal.exporter import _schemas

    function = meta.onnx_function
    if isinstance(function, onnxscript.OnnxFunction):
        signature = _schemas.op_signature_from_function(function, function.function_ir.domain, function.name,
                                                        since_version=function.opset.version)
    else:
        signature = _schemas.op_signature_from_function(function, "__traced", function.__name__)
    meta.signature = signature
    function._pt_onnx_signature = signature


@functools.cache
def _lazy_registry_class():
    """``ONNXRegistry`` whose torchlib entries get their signatures when an export dispatches to
    them: inferring all ~560 up front is most of the cost of building the table (~0.2 s)."""
    from torch.onnx._internal.exporter import _registration

    class LazyRegistry(_registration.ONNXRegistry):
        def get_decomps(self, target):
            decomps = super().get_decomps(target)
            for meta in decomps:
                # only torchlib's entries built above: torch's own may be registered without a
                # signature on purpose (the higher-order ops', e.g. torch.cond's, whose arguments
                # include subgraphs)
                if getattr(meta, "signature_deferred", False):
                    _infer_signature(meta)
            return decomps

    return LazyRegistry


def registry(opset_version: int, custom_translations: Mapping[Callable, Callable],
             complex_translations: Mapping[Callable, Callable] = {}):  # noqa: B006  (read only)
    """A fresh ``ONNXRegistry`` for one export: the cached torchlib functions plus
    ``custom_translations`` (registered first, as ``torch.onnx.export`` does) and
    ``complex_translations``, which the exporter dispatches to for complex arguments (as real
    tensors with a last axis of 2, torchlib's representation; ``torch.onnx.export``'s
    ``custom_translation_table`` cannot take them)."""
    fresh = _lazy_registry_class()()
    fresh._opset_version = opset_version
    fresh.functions = {target: list(metas) for target, metas in torchlib_functions(opset_version).items()}
    for op, function in custom_translations.items():
        fresh.register_op(op, function, is_complex=False)
    for op, function in complex_translations.items():
        fresh.register_op(op, function, is_complex=True)
    return fresh


def _internal_export():
    """The exporter's core ``export`` and its default opset, or None when this torch's internal
    API differs from the one :func:`registry` builds for."""
    try:
        from torch.onnx import _constants
        from torch.onnx._internal.exporter import _core, _registration
        from torch.onnx._internal.exporter._torchlib import _torchlib_registry
    except ImportError:
        return None
    needed = (hasattr(_registration.ONNXRegistry, "_register")
              and hasattr(_registration.ONNXRegistry, "_cleanup_registry_based_on_opset_version")
              and hasattr(_registration, "_get_overload") and hasattr(_torchlib_registry, "get_torchlib_ops")
              and "skip_signature_inference" in getattr(_registration.OnnxDecompMeta, "__dataclass_fields__", {})
              and _CORE_EXPORT_PARAMETERS <= set(inspect.signature(_core.export).parameters))
    return (_core.export, _constants.ONNX_DEFAULT_OPSET) if needed else None


_INHERITED = object()  # _replaced: the attribute was not the owner's own


@contextlib.contextmanager
def _replaced(*replacements: tuple[object, str, object]):
    """Each ``(owner, name, value)``: ``owner.name`` is ``value`` inside the block, and as it was
    after it (an attribute ``owner`` only inherited is inherited again)."""
    saved = [(owner, name, vars(owner).get(name, _INHERITED)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, before in reversed(saved):
            if before is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


@contextlib.contextmanager
def _causal_masks_taken_as_given():
    """nn.Transformer and its decoder compare a given target mask with a causal one (a
    data-dependent ``torch.equal``, which the capture cannot trace) only to pick a faster kernel
    for the same result: while capturing, a mask is taken as given (``is_causal`` as passed, else
    False), so the mask itself is applied."""
    from torch.nn.modules import transformer

    detect = getattr(transformer, "_detect_is_causal_mask", None)
    if detect is None:
        yield
        return

    def as_given(mask, is_causal=None, size=None):
        return bool(is_causal) if is_causal is not None else False

    with _replaced((transformer, "_detect_is_causal_mask", as_given)):
        yield


@contextlib.contextmanager
def _distributions_unvalidated():
    """``torch.distributions`` check their arguments (by default, as ``__debug__`` is) with
    data-dependent branches (``if not valid.all(): raise ValueError``), which the capture cannot
    trace, so any module using a distribution would run in PyTorch. While capturing, the default
    is off: a distribution built with ``validate_args=None`` computes as PyTorch does for valid
    arguments, and gives NaN instead of an error for invalid ones (as upstream ORTModule's traced
    export did); one built with ``validate_args=True`` still checks, so its module runs in PyTorch."""
    from torch.distributions import Distribution as distribution

    default = distribution._validate_args
    distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        distribution.set_default_validate_args(default)


@contextlib.contextmanager
def _linalg_without_error_checks():
    """``torch.linalg.inv``, ``torch.inverse`` (and ``Tensor.inverse``), ``torch.linalg.solve`` and
    ``torch.linalg.cholesky`` (``torch.cholesky``, ``Tensor.cholesky``) raise on a singular or
    indefinite matrix through an effectful check (``aten._linalg_check_errors``) that the exporter
    cannot translate. While capturing they compute as their ``_ex`` forms (the same values, no
    check): the graph cannot raise, and such a matrix gives non-finite values."""
    linalg = torch.linalg
    checked_inv, checked_solve, checked_cholesky = linalg.inv, linalg.solve, linalg.cholesky

    def inv(matrix, *, out=None):
        if out is not None:
            return checked_inv(matrix, out=out)
        return linalg.inv_ex(matrix).inverse

    def solve(matrix, other, *, left=True, out=None):
        if out is not None:
            return checked_solve(matrix, other, left=left, out=out)
        return linalg.solve_ex(matrix, other, left=left).result

    def cholesky(matrix, upper=False, *, out=None):
        if out is not None:
            return checked_cholesky(matrix, upper=upper, out=out)
        return linalg.cholesky_ex(matrix, upper=upper).L

    with _replaced((linalg, "inv", inv), (torch, "inverse", inv), (torch.Tensor, "inverse", inv),
                   (linalg, "solve", solve), (linalg, "cholesky", cholesky), (torch, "cholesky", cholesky),
                   (torch.Tensor, "cholesky", cholesky)):
        yield


def _gaussian_nll_loss(input, target, var, full: bool = False, eps: float = 1e-6, reduction: str = "mean"):
    """``F.gaussian_nll_loss`` as the capture traces it: ``(log v + (input - target)² / v) / 2``
    (``+ log(2π) / 2`` with ``full``) with ``v = max(var, eps)`` in value and the gradient of
    ``var`` itself (PyTorch clamps a copy under ``no_grad``), ``var`` shaped like ``input``, or
    with one axis less, or its last axis 1. PyTorch's check for a negative ``var`` (a branch on
    the data, which the capture cannot trace) is left out: the graph cannot raise."""
    if var.shape != input.shape:
        if input.shape[:-1] == var.shape:
            var = var.unsqueeze(-1)
        elif not (input.shape[:-1] == var.shape[:-1] and var.shape[-1] == 1):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    clamped = var.clamp(min=eps).detach() + (var - var.detach())  # the clamped value, var's gradient
    loss = 0.5 * (torch.log(clamped) + (input - target) ** 2 / clamped)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


@contextlib.contextmanager
def _gaussian_nll_unchecked():
    """While capturing, ``F.gaussian_nll_loss`` (and ``nn.GaussianNLLLoss``, which calls it) is
    :func:`_gaussian_nll_loss`: the same loss and gradients without the data-dependent check."""
    with _replaced((torch.nn.functional, "gaussian_nll_loss", _gaussian_nll_loss)):
        yield


@contextlib.contextmanager
def _ctc_loss_scanned():
    """While capturing, ``F.ctc_loss`` (and ``nn.CTCLoss``, which calls it) is
    :func:`onnxtrain.torch._ctc.ctc_loss`: the same loss and gradients as a ``scan`` over the
    frames, where PyTorch's op has an output shape the capture cannot know."""
    from onnxtrain.torch._ctc import ctc_loss

    with _replaced((torch.nn.functional, "ctc_loss", ctc_loss)):
        yield


@contextlib.contextmanager
def _statistics_unchecked():
    """While capturing, ``torch.cov``/``torch.corrcoef`` (and the ``Tensor`` methods) are
    :mod:`onnxtrain.torch._statistics`' own: the same ops without their kernels' branch on the data."""
    from onnxtrain.torch._statistics import corrcoef, cov

    with _replaced((torch, "cov", cov), (torch, "corrcoef", corrcoef),
                   (torch.Tensor, "cov", cov), (torch.Tensor, "corrcoef", corrcoef)):
        yield


def _hugging_face_ctc_loss(logits, labels, logit_lengths, blank_token_id: int, reduction: str = "mean",
                           zero_infinity: bool = False, ignore_index: int = -100, **kwargs):
    """transformers' ``ForCTCLoss`` (the loss of Wav2Vec2, HuBERT, WavLM, ... ``ForCTC``) with its
    targets as a padded batch: each row's labels first, in order, then blanks. Its own
    ``labels.masked_select(mask)`` concatenates them into a tensor whose length depends on the
    labels' values, which the CTC loss's capture cannot take; PyTorch's loss is the same for both
    layouts."""
    labels = labels.to(logits.device)
    kept = (labels != ignore_index) & (labels != blank_token_id)
    lengths = kept.sum(-1)
    order = torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices  # kept labels first, in order
    places = torch.arange(labels.shape[-1], device=labels.device)
    targets = torch.where(places < lengths.unsqueeze(-1), labels.gather(-1, order), blank_token_id)
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    with torch.backends.cudnn.flags(enabled=False):
        return torch.nn.functional.ctc_loss(log_probs, targets, logit_lengths, lengths, blank=blank_token_id,
                                            reduction=reduction, zero_infinity=zero_infinity)


@contextlib.contextmanager
def _hugging_face_ctc_padded():
    """While capturing, transformers' ``ForCTC`` loss (where transformers is imported) is
    :func:`_hugging_face_ctc_loss`: the ``ForCTC`` heads' training steps run in ONNX Runtime."""
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    mapping = getattr(loss_utils, "LOSS_MAPPING", None)
    if not isinstance(mapping, dict) or "ForCTC" not in mapping:
        yield
        return
    original = mapping["ForCTC"]
    mapping["ForCTC"] = _hugging_face_ctc_loss
    try:
        yield
    finally:
        mapping["ForCTC"] = original


def _packed_sequences_padded(module: torch.nn.Module):
    """While capturing, packed sequences stay padded batches (:mod:`onnxtrain.torch._packed`)."""
    from onnxtrain.torch._packed import packed_sequences_padded

    return packed_sequences_padded(module)


def _projected_lstm_forward(lstm: torch.nn.LSTM, input, hx=None):
    """``nn.LSTM.forward`` for an LSTM with ``proj_size`` as torch's own decomposition of the op
    computes it: per layer, the input product for all steps, then one cell per step (products
    and pointwise ops; the steps unrolled, so the sequence length is the traced one)."""
    from torch._decomp import decompositions
    from torch.nn.utils.rnn import PackedSequence

    if isinstance(input, PackedSequence):
        raise NotImplementedError("nn.LSTM(proj_size=...) on a PackedSequence is not supported")
    batched = input.dim() == 3
    batch_dim = 0 if lstm.batch_first else 1
    if not batched:
        input = input.unsqueeze(batch_dim)
        hx = None if hx is None else tuple(h.unsqueeze(1) for h in hx)
    if hx is None:
        layers = lstm.num_layers * (2 if lstm.bidirectional else 1)
        batch = input.shape[batch_dim]
        hx = (input.new_zeros(layers, batch, lstm.proj_size), input.new_zeros(layers, batch, lstm.hidden_size))
    # by attribute, not the module's cached list of the same tensors: the capture sees parameters
    # it reads through the module as such (the cached list would be traced as constants)
    weights = [getattr(lstm, name) for name in lstm._flat_weights_names]
    params = decompositions.gather_params(weights, lstm.bias, True)
    out, finals = decompositions._rnn_helper(input, list(zip(hx[0], hx[1])), params, lstm.bias, lstm.num_layers,
                                             lstm.dropout, lstm.training, lstm.bidirectional, lstm.batch_first,
                                             decompositions.one_layer_lstm)
    finals = list(zip(*finals))
    h, c = torch.stack(finals[0], 0), torch.stack(finals[1], 0)
    if not batched:
        return out.squeeze(batch_dim), (h.squeeze(1), c.squeeze(1))
    return out, (h, c)


@contextlib.contextmanager
def _forwards_replaced(modules: list[torch.nn.Module], forward):
    """While in the ``with``: each of ``modules`` runs ``forward(module, *args)`` as its forward."""
    for sub in modules:
        sub.forward = functools.partial(forward, sub)
    try:
        yield
    finally:
        for sub in modules:
            del sub.forward


def projected_lstms_decomposed(module: torch.nn.Module):
    """While capturing: every ``nn.LSTM`` with ``proj_size`` in ``module`` computes with torch's
    decomposition of the op (:func:`_projected_lstm_forward`). ONNX's LSTM has no output
    projection, and torch.onnx's translation of the op drops ``weight_hr``."""
    lstms = [sub for sub in module.modules() if isinstance(sub, torch.nn.LSTM) and sub.proj_size > 0]
    return _forwards_replaced(lstms, _projected_lstm_forward)


def _adaptive_softmax_forward(adaptive: torch.nn.AdaptiveLogSoftmaxWithLoss, input_: torch.Tensor,
                              target_: torch.Tensor):
    """``nn.AdaptiveLogSoftmaxWithLoss.forward`` without its branches on the data: PyTorch picks
    each cluster's rows (``nonzero``, a size the capture cannot know) and runs the cluster's
    tail on them only; here every tail runs on every row and each row keeps its own cluster's
    log-probability (``where``): the same values and gradients. Whether a cluster has rows at
    all, and whether a target is out of range, are branches on the data, which the capture
    answers: a batch without some cluster's targets runs in PyTorch (whose tail then gets no
    gradient, as eager leaves it), an out-of-range target raises as PyTorch's does."""
    if target_.dim() == 1:
        if input_.size(0) != target_.size(0):
            raise RuntimeError("Input and target should have the same size in the batch dimension.")
        if input_.dim() != 2:
            raise RuntimeError("1D target tensor expects 2D input tensors, but found inputs with size",
                               input_.size())
    elif target_.dim() == 0:
        if input_.dim() != 1:
            raise RuntimeError("0D target tensor expects 1D input tensors, but found inputs with size",
                               input_.size())
    else:
        raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
    batched = target_.dim() > 0
    input = input_ if batched else input_.unsqueeze(0)
    target = target_ if batched else target_.unsqueeze(0)
    if ((target < 0) | (target >= adaptive.n_classes)).any():
        raise RuntimeError(f"Target values should be in [0, {adaptive.n_classes - 1}], but values in range "
                           f"[{target.min().item()}, {target.max().item()}] were found. ")
    output = input.new_zeros(target.shape[0])
    gather_inds = target
    bounds = [0, *adaptive.cutoffs]
    for i in range(1, len(bounds) - 1):
        low, high = bounds[i], bounds[i + 1]
        in_cluster = (target >= low) & (target < high)
        if (~in_cluster).all():  # (answered no: a batch without this cluster's targets runs in PyTorch,
            continue             # whose tail then gets no gradient)
        cluster_logprob = torch.nn.functional.log_softmax(adaptive.tail[i - 1](input), dim=1)
        relative = (target - low).clamp(0, high - low - 1)
        output = torch.where(in_cluster, cluster_logprob.gather(1, relative.unsqueeze(1)).squeeze(1), output)
        gather_inds = torch.where(in_cluster, adaptive.shortlist_size + i - 1, gather_inds)
    head_logprob = torch.nn.functional.log_softmax(adaptive.head(input), dim=1)
    output = output + head_logprob.gather(1, gather_inds.unsqueeze(1)).squeeze(1)
    loss = (-output).mean()
    if not batched:
        output = output.squeeze(0)
    return torch.nn.modules.adaptive._ASMoutput(output, loss)


def adaptive_softmaxes_dense(module: torch.nn.Module):
    """While capturing: every ``nn.AdaptiveLogSoftmaxWithLoss`` of ``module`` computes its
    forward by :func:`_adaptive_softmax_forward`."""
    adaptives = [sub for sub in module.modules() if isinstance(sub, torch.nn.AdaptiveLogSoftmaxWithLoss)]
    return _forwards_replaced(adaptives, _adaptive_softmax_forward)


def _cumulative_batch_norm_forward(norm: torch.nn.modules.batchnorm._BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """``norm(input)`` in training with ``momentum=None`` (the cumulative moving average that
    ``torch.optim.swa_utils.update_bn`` asks for): PyTorch computes the factor
    ``1 / num_batches_tracked`` as a Python number, which a capture cannot; here it is a
    tensor, and the running statistics are updated in place with it."""
    norm._check_input_dim(input)
    norm.num_batches_tracked.add_(1)
    factor = 1.0 / norm.num_batches_tracked.to(input.dtype)
    out = torch.nn.functional.batch_norm(input, norm.running_mean, norm.running_var, norm.weight, norm.bias,
                                         training=True, momentum=0.0, eps=norm.eps)  # statistics unchanged
    with torch.no_grad():
        axes = [d for d in range(input.dim()) if d != 1]
        _weigh_in(norm.running_mean, norm.running_var, input.mean(axes), input.var(axes, correction=1), factor)
    return out


def _weigh_in(running_mean, running_var, mean, variance, factor) -> None:
    """Running statistics updated in place (the caller's ``no_grad``): ``(1 - f) running + f new``."""
    running_mean.mul_(1.0 - factor).add_(mean * factor)
    running_var.mul_(1.0 - factor).add_(variance * factor)


def is_cumulative_batch_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a batch norm that trains with running statistics and ``momentum=None``
    (their cumulative average over the batches)."""
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training \
        and module.track_running_stats and module.running_mean is not None and module.momentum is None


def cumulative_batch_norms(module: torch.nn.Module):
    """While capturing: every cumulative-average batch norm of ``module`` (not SyncBatchNorm)
    updates its running statistics by :func:`_cumulative_batch_norm_forward`."""
    norms = [sub for sub in module.modules()
             if is_cumulative_batch_norm(sub) and not isinstance(sub, torch.nn.SyncBatchNorm)]
    return _forwards_replaced(norms, _cumulative_batch_norm_forward)


@contextlib.contextmanager
def _data_as_detach():
    """While capturing, ``t.data`` of a traced (fake) tensor is ``t.detach()``: the same values
    without history, which the capture records as a ``detach`` (a stop-gradient), where it
    failed on ``.data`` ("a fake tensor in the exported program constant's list"). Older code
    reads ``.data`` in forwards (``mask = h.data.gt(0)``, ``weight.data.clamp_(...)``); an
    in-place change through it changes the tensor, as ``.data``'s does. Real tensors (another
    thread's) get PyTorch's own ``.data``; assigning ``t.data = ...`` is PyTorch's too."""
    original = torch._C.TensorBase.__dict__["data"]

    def data(tensor):
        return tensor.detach() if is_fake(tensor) else original.__get__(tensor)

    def set_data(tensor, value):
        original.__set__(tensor, value)

    with _replaced((torch.Tensor, "data", property(data, set_data, doc=original.__doc__))):
        yield


@contextlib.contextmanager
def _instance_norms_with_running_statistics():
    """While capturing, ``F.instance_norm`` (which ``nn.InstanceNorm*d`` calls) with batch
    statistics and running ones (``track_running_stats=True`` in training) normalizes by the
    batch's statistics, then updates the running statistics in place under ``no_grad`` as
    PyTorch's kernel does: each channel's per-sample mean and unbiased variance, averaged over
    the batch, weighed in with ``momentum``. The op's translation cannot give that update back,
    so such modules ran in PyTorch. Other calls are ``F.instance_norm``'s own."""
    functional = torch.nn.functional.instance_norm

    def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                      use_input_stats: bool = True, momentum: float = 0.1, eps: float = 1e-5):
        if not (use_input_stats and running_mean is not None and running_var is not None):
            return functional(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
        out = functional(input, None, None, weight, bias, True, momentum, eps)
        with torch.no_grad():
            axes = list(range(2, input.dim()))
            _weigh_in(running_mean, running_var, input.mean(axes).mean(0), input.var(axes, correction=1).mean(0),
                      momentum)
        return out

    with _replaced((torch.nn.functional, "instance_norm", instance_norm)):
        yield


def _softshrink(input: torch.Tensor, lambd: float = 0.5) -> torch.Tensor:
    """``F.softshrink`` as PyTorch's kernel computes it: 0 inside ``[-lambd, lambd]``, ``x -+ lambd``
    outside (NaN stays NaN), and a gradient that is exactly 0 inside whatever reaches it."""
    if not 0 <= lambd:
        raise RuntimeError(f"lambda must be greater or equal to 0, but found to be {lambd}.")
    inside = (input >= -lambd) & (input <= lambd)
    return torch.where(inside, 0.0, input - input.sign() * lambd)


@contextlib.contextmanager
def _softshrink_exact():
    """While capturing, ``F.softshrink`` (``nn.Softshrink``) is :func:`_softshrink`. The capture
    would trace PyTorch's decomposition, which writes the inside as ``x * 0``: its gradient there
    is ``dy * 0``, NaN where ``dy`` is infinite (``sqrt(softshrink(x).abs())``), where PyTorch's
    kernel gives 0."""
    with _replaced((torch.nn.functional, "softshrink", _softshrink)):
        yield


@contextlib.contextmanager
def _reflected_scalar_operations_promoted():
    """While capturing, a number minus a traced integer tensor (``1.0 - attention_mask``, XLNet's;
    ``torch.rsub(t, 1.0)``) reads the tensor in the result's type first: the exporter's
    decomposition writes that promotion as a ``sub`` whose first argument is the number, which no
    overload takes, so the module ran in PyTorch. A number floor-divided by a traced tensor
    (``2.0 // t``) divides a 0-d tensor of the number, where the exporter's translation failed on
    the number. The same values and types; other operands are PyTorch's own."""
    rsub, rfloordiv, function_rsub = torch.Tensor.__rsub__, torch.Tensor.__rfloordiv__, torch.rsub

    def traced_with_number(tensor, other) -> bool:
        return isinstance(tensor, torch.Tensor) and isinstance(other, (int, float)) and is_fake(tensor)

    def subtracted_from(operation):
        def reflected(tensor, other, *args, **kwargs):
            if traced_with_number(tensor, other):
                tensor = tensor.to(torch.result_type(tensor, other))
            return operation(tensor, other, *args, **kwargs)
        return reflected

    def floor_divided(tensor, other):
        if not traced_with_number(tensor, other):
            return rfloordiv(tensor, other)
        dtype = torch.result_type(tensor, other)
        return torch.floor_divide(torch.scalar_tensor(other, dtype=dtype, device=tensor.device), tensor.to(dtype))

    with _replaced((torch.Tensor, "__rsub__", subtracted_from(rsub)), (torch, "rsub", subtracted_from(function_rsub)),
                   (torch.Tensor, "__rfloordiv__", floor_divided)):
        yield


def _real_index(index) -> tuple:
    """``index`` of a complex tensor as the index of its real view (``torch.view_as_real``: one
    more axis, of size 2, last): the same elements, both parts."""
    index = index if isinstance(index, tuple) else (index,)
    return (*index, slice(None)) if any(part is Ellipsis for part in index) else (*index, Ellipsis, slice(None))


@contextlib.contextmanager
def _complex_assignments_real():
    """While capturing, ``z[index] = value`` into a traced complex tensor (a Fourier layer's
    ``out_ft[:, :, :modes] = ...``) assigns into a real copy of ``z``'s parts and copies the
    result into ``z`` whole: the exporter's decomposition traces PyTorch's ``slice_scatter``,
    which has no complex derivative (so such a module ran in PyTorch), while the real one has.
    The same values and gradients. Real tensors, and untraced ones, are PyTorch's own."""
    original = torch._C.TensorBase.__setitem__

    def setitem(tensor, index, value):
        if not (is_fake(tensor) and tensor.is_complex()):
            return original(tensor, index, value)
        parts = torch.view_as_real(tensor).clone()
        value = torch.as_tensor(value, device=tensor.device).to(tensor.dtype)
        parts[_real_index(index)] = torch.view_as_real(value)
        tensor.copy_(torch.view_as_complex(parts))
        return None

    with _replaced((torch.Tensor, "__setitem__", setitem)):
        yield


@contextlib.contextmanager
def _parametrizations_uncached():
    """Capture with ``torch.nn.utils.parametrize.cached()`` off, whatever the caller has on: a
    cache filled before would hand the trace its real weights as constants (a graph that keeps
    them), and the trace would leave its fake ones in the cache for the caller's next read. The
    caller's cache is as it was afterwards."""
    from torch.nn.utils import parametrize

    enabled, cache = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 0, {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = enabled, cache


# torch.export and torch.onnx.export keep process-wide state while they run (dispatch-mode slots,
# a global patcher, the module hierarchy being traced): two exports in two threads at once break
# each other (both fail). Every capture-and-export holds this lock; re-entrant, for a forward that
# exports another module while it is captured.
EXPORT_LOCK = threading.RLock()


def capture(module: torch.nn.Module, args: tuple, dynamic_shapes) -> torch.export.ExportedProgram:
    """``module(*args)`` as the exporter's first capture strategy captures it: non-strict
    ``torch.export.export`` with the exporter's flags, ``torch.onnx.is_in_onnx_export()`` true."""
    try:
        from torch.onnx._internal.exporter import _capture_strategies, _flags
    except ImportError:  # another internal layout: the plain capture
        _capture_strategies = _flags = None
    prefer_asserts = getattr(_flags, "PREFER_DEFERRED_RUNTIME_ASSERTS_OVER_GUARDS", False)
    patch_rnn = getattr(_capture_strategies, "_patch_dynamic_shape_rnn_decompositions", None)

    def run() -> torch.export.ExportedProgram:
        with (patch_rnn(dynamic_shapes) if patch_rnn is not None else contextlib.nullcontext(),
              torch.fx.experimental._config.patch(backed_size_oblivious=True), _causal_masks_taken_as_given(),
              _distributions_unvalidated(), _linalg_without_error_checks(), _gaussian_nll_unchecked(),
              _ctc_loss_scanned(), projected_lstms_decomposed(module), _packed_sequences_padded(module),
              cumulative_batch_norms(module), adaptive_softmaxes_dense(module), _parametrizations_uncached(),
              _statistics_unchecked(), _softshrink_exact(), _reflected_scalar_operations_promoted(),
              _data_as_detach(), _instance_norms_with_running_statistics(), _complex_assignments_real(),
              _hugging_face_ctc_padded()):
            return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False,
                                       prefer_deferred_runtime_asserts_over_guards=prefer_asserts)

    return as_onnx_export(run)


def as_onnx_export(run: Callable[[], torch.export.ExportedProgram]) -> torch.export.ExportedProgram:
    """``run()`` with ``torch.onnx.is_in_onnx_export()`` true, as the exporter's own capture runs
    (a model that branches on it takes its export path)."""
    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:  # another internal layout
        return run()
    exporting = getattr(_flags, "set_onnx_exporting_flag", None)
    return exporting(run)() if exporting is not None else run()


def _region_frames(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> list[str]:
    """The stack traces of the call nodes inside a region (nested regions included)."""
    body = getattr(graph_module, node.args[1].target, None) if isinstance(node.args[1], torch.fx.Node) else None
    if not isinstance(body, torch.fx.GraphModule):
        return []
    frames = []
    for inner in body.graph.nodes:
        if inner.op == "call_function":
            if inner.meta.get("stack_trace"):
                frames.append(inner.meta["stack_trace"])
            if inner.target is getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None):
                frames.extend(_region_frames(body, inner))
    return frames


def _functional_detaches(graph: torch.fx.Graph) -> int:
    """``t.detach_()`` as ``aten.detach`` (whose translation stops gradients) read by every later
    user of ``t``: the exporter's decomposition would drop the in-place detach altogether."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.detach_.default:
            continue
        node.target = torch.ops.aten.detach.default
        source = node.args[0]
        for user in list(source.users):
            if user is not node and order.get(user, -1) > order[node]:
                user.replace_input_with(source, node)
        count += 1
    return count


def _detached_scalar_reads(graph: torch.fx.Graph) -> int:
    """``t.item()`` reads ``detach(t)``: in eager PyTorch the Python number it returns carries
    no gradient, while the captured graph keeps it a value the gradient would flow through."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.item.default,
                                                              torch.ops.aten._local_scalar_dense.default):
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or source.target is torch.ops.aten.detach.default:
            continue
        with graph.inserting_before(node):
            cut = graph.call_function(torch.ops.aten.detach.default, (source,))
        cut.meta.update(source.meta)
        node.replace_input_with(source, cut)
        count += 1
    return count


def _no_grad_regions(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The ``wrap_with_set_grad_enabled(False, ...)`` nodes of ``graph`` (not nested ones)."""
    region = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    return [node for node in graph.nodes
            if node.op == "call_function" and node.target is region and node.args[0] is False]


def _is_checkpoint_region(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether the region ``node``'s ops were traced from inside ``torch/utils/checkpoint.py``
    (a reentrant checkpoint's function)."""
    from torch.utils import checkpoint as checkpoint_module
    checkpoint_frame = f'{checkpoint_module.__file__}", line'
    return any(checkpoint_frame in frame for frame in _region_frames(graph_module, node))


def traced_requires_grad(program: torch.export.ExportedProgram) -> bool:
    """Whether the traced call's ``requires_grad`` flags are eager PyTorch's: not where the
    capture ran a higher-order op other than a grad-mode or autocast region (torch's ``scan``,
    ``cond``, ``while_loop``), whose outputs it traces without autograd."""
    faithful = {getattr(torch.ops.higher_order, name, None) for name in ("wrap_with_set_grad_enabled",
                                                                          "wrap_with_autocast")}
    return not any(isinstance(node.target, torch._ops.HigherOrderOperator) and node.target not in faithful
                   for graph_module in program.graph_module.modules() if isinstance(graph_module, torch.fx.GraphModule)
                   for node in graph_module.graph.nodes if node.op == "call_function")


def has_checkpoint_region(program: torch.export.ExportedProgram) -> bool:
    """Whether a reentrant ``torch.utils.checkpoint`` ran in the captured forward (its function
    runs in a no-grad region, see :func:`mark_gradient_cuts`)."""
    graph_module = program.graph_module
    return any(_is_checkpoint_region(graph_module, node) for node in _no_grad_regions(graph_module.graph))


def mark_gradient_cuts(program: torch.export.ExportedProgram, regions: bool = True) -> int:
    """Put an ``aten.detach`` on every output of the forward's no-grad regions (``with
    torch.no_grad():`` is captured as a ``wrap_with_set_grad_enabled(False, ...)`` region, which
    the exporter's decomposition inlines, grad mode and all), and make ``detach_()`` a
    ``detach``, and ``t.item()`` read ``detach(t)``; the translation table marks detaches as
    stop-gradients. A reentrant
    ``torch.utils.checkpoint`` runs its function in such a region too, and its backward
    recomputes it with grad: a region whose ops were traced from inside
    ``torch/utils/checkpoint.py`` is left alone. ``regions=False`` leaves every region alone.
    Returns how many region outputs were cut."""
    graph_module = program.graph_module
    graph = graph_module.graph
    detached = _functional_detaches(graph) + _detached_scalar_reads(graph)
    cuts = 0
    for node in _no_grad_regions(graph) if regions else ():
        if _is_checkpoint_region(graph_module, node):
            continue
        outputs = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem] \
            if isinstance(node.meta.get("val"), (tuple, list)) else [node]
        for output in outputs:
            if not isinstance(output.meta.get("val"), torch.Tensor):
                continue
            with graph.inserting_after(output):
                cut = graph.call_function(torch.ops.aten.detach.default, (output,))
            cut.meta.update(output.meta)
            output.replace_all_uses_with(cut, delete_user_cb=lambda user, cut=cut: user is not cut)
            cuts += 1
    if cuts or detached:
        graph_module.recompile()
    return cuts


def _mutated_through(node: torch.fx.Node) -> bool:
    """Whether an in-place op writes ``node``'s output, directly or through views of it."""
    pending, seen = [node], set()
    while pending:
        value = pending.pop()
        for user in value.users:
            if user in seen or user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
                continue
            seen.add(user)
            schema = user.target._schema
            if schema.is_mutable:
                return True
            if any(r.alias_info is not None for r in schema.returns):  # a view: follow it
                pending.append(user)
    return False


def contiguous_as_clone(program: torch.export.ExportedProgram) -> int:
    """Make each ``aten.contiguous`` whose result nothing writes in place an ``aten.clone`` to the
    contiguous format: the same values, and ONNX has no strides. The exporter's decomposition
    re-traces ``contiguous`` with strides of its own, and where they differ from the capture's
    (the tensor looked contiguous already) it drops the copy and a later ``view`` fails: Hugging
    Face T5 and Swin attention (``transpose(1, 2).contiguous().view(...)`` after SDPA) do not export
    otherwise. Returns how many were rewritten."""
    graph_module = program.graph_module
    count = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.contiguous.default \
                and node.kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format \
                and not _mutated_through(node):
            node.target = torch.ops.aten.clone.default
            node.kwargs = {"memory_format": torch.contiguous_format}
            count += 1
    if count:
        graph_module.recompile()
    return count


def attention_outputs_contiguous(program: torch.export.ExportedProgram) -> int:
    """Follow each ``aten.scaled_dot_product_attention`` with a copy to the contiguous format (an
    Identity in ONNX, which has no strides). PyTorch's shape function gives the attention's
    output other strides than its decomposition computes, so a later ``reshape`` the capture
    took as a view fails when the exporter decomposes the program ("Cannot view a tensor with
    shape ... and strides ..."): timm's BEiT and MaxViT (a learned attention bias, then
    ``transpose(1, 2).reshape(...)``) do not export otherwise. Returns how many were copied."""
    graph = program.graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.scaled_dot_product_attention.default:
            continue
        with graph.inserting_after(node):
            copy = graph.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
        node.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
        value = node.meta.get("val")
        copy.meta = {**node.meta, "val": value.clone(memory_format=torch.contiguous_format)} \
            if isinstance(value, torch.Tensor) else dict(node.meta)
        count += 1
    if count:
        program.graph_module.recompile()
    return count


def fx_argument(node: torch.fx.Node, position: int, name: str, default):
    """An FX call's argument, given by position or by name, else its default."""
    return node.kwargs.get(name, node.args[position] if len(node.args) > position else default)


def splits_with_sizes(program: torch.export.ExportedProgram) -> int:
    """Make each ``aten.split.Tensor`` and ``aten.chunk`` along a symbolic dim an
    ``aten.split_with_sizes``: the trace fixed how many pieces there are (its guards hold it), and
    their sizes are computed from the dim's size (``chunk``: pieces of ``ceil(size / chunks)``,
    the last one the rest). The exporter writes a split of a scalar size computed at run time as
    a ``SplitToSequence`` whose pieces no rule differentiates; a list of as many sizes as pieces it
    writes as a ``Split``. Returns how many were rewritten."""
    graph_module = program.graph_module
    graph = graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.split.Tensor, torch.ops.aten.chunk.default):
            continue
        source, pieces = node.args[0], node.meta.get("val")
        dim = fx_argument(node, 2, "dim", 0)
        shape = source.meta["val"].shape if isinstance(source, torch.fx.Node) and "val" in source.meta else None
        if shape is None or not isinstance(pieces, (list, tuple)) or isinstance(shape[dim], int):
            continue
        number = len(pieces)
        with graph.inserting_before(node):
            size = graph.call_function(torch.ops.aten.sym_size.int, (source, dim % len(shape)))
            size.meta["val"] = shape[dim]
            piece = node.args[1]
            if node.target is torch.ops.aten.chunk.default:  # ceil(size / chunks)
                chunks = piece
                summed = graph.call_function(operator.add, (size, chunks - 1))
                summed.meta["val"] = shape[dim] + chunks - 1
                piece = graph.call_function(operator.floordiv, (summed, chunks))
                piece.meta["val"] = summed.meta["val"] // chunks
            piece_value = piece.meta["val"] if isinstance(piece, torch.fx.Node) else piece
            taken = graph.call_function(operator.mul, (piece, number - 1))
            taken.meta["val"] = piece_value * (number - 1)
            rest = graph.call_function(operator.sub, (size, taken))
            rest.meta["val"] = shape[dim] - taken.meta["val"]
            split = graph.call_function(torch.ops.aten.split_with_sizes.default,
                                        (source, [piece] * (number - 1) + [rest], dim))
            split.meta.update(node.meta)
        node.replace_all_uses_with(split)
        graph.erase_node(node)
        count += 1
    if count:
        graph_module.recompile()
    return count


def export_program(program: torch.export.ExportedProgram, custom_translations: Mapping[Callable, Callable],
                   complex_translations: Mapping[Callable, Callable] = {}):  # noqa: B006  (read only)
    """``torch.onnx.export(program, dynamo=True, optimize=False,
    custom_translation_table=custom_translations)`` with the cached registry (and
    ``complex_translations``, see :func:`registry`); returns the ``ONNXProgram``."""
    internal = _internal_export()
    if internal is not None:
        core_export, opset_version = internal
        try:
            table = registry(opset_version, custom_translations, complex_translations)
        except Exception:  # noqa: BLE001  (the internal API changed: use the public path)
            _LOG.debug("building the export registry failed; using torch.onnx.export", exc_info=True)
        else:
            return core_export(program, (), None, registry=table, optimize=False, verbose=False,
                               opset_version=opset_version)
    return torch.onnx.export(program, (), dynamo=True, optimize=False, verbose=False,
                             custom_translation_table=dict(custom_translations))
