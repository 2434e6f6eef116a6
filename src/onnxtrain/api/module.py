"""Module: run the training and eval models of the artifacts against a CheckpointState.

Mirrors ``onnxruntime.training.api.Module`` on a stock ``InferenceSession``. The graph I/O
contract is docs/artifacts.md: parameters are graph inputs, each trainable parameter has
an accumulation buffer input and an accumulated-gradient output, and ``lazy_reset_grad``
chooses between ``grad`` and ``buffer + grad``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import onnxruntime as ort

from onnxtrain import names
from onnxtrain.api.checkpoint_state import CheckpointState, exclusive
from onnxtrain.errors import CheckpointError, InputMismatchError, ModelError
from onnxtrain.paths import file_path
from onnxtrain.ir import io
from onnxtrain.runtime import fusions
from onnxtrain.runtime.binding import BindingCache
from onnxtrain.runtime.denormals import ask_for_flushing, denormals_flushed, runs_flush_denormals
from onnxtrain.runtime.device import parse_device, providers_for
from onnxtrain.runtime.inputs import gather_inputs, to_ortvalues
from onnxtrain.runtime.session import (IOSpec, create_session, input_specs, is_ort_format, output_specs,
                                       quiet_session_options, run_failure)
from onnxtrain.runtime.values import from_numpy, owned_from_numpy

TRAINING_METADATA_KEY = "onnxtrain.training"
# torch.amp.GradScaler's initial scale, for a loss-scaled training model without metadata
DEFAULT_LOSS_SCALE = 2.0 ** 16


def _declared_ranks(specs: list[IOSpec], path: str) -> list[IOSpec]:
    """``specs`` with the shape of each input the model file declares without one (any rank)
    unknown: onnxruntime reports those as ``[]``, a scalar's shape."""
    if not any(spec.shape == () for spec in specs) or is_ort_format(path):
        return specs
    shapeless = io.inputs_without_shape(path)
    return [dataclasses.replace(spec, shape=None) if spec.name in shapeless else spec for spec in specs]


class _Signature:
    """How a training or eval model's inputs and outputs map onto the state."""

    def __init__(self, session: ort.InferenceSession, state: CheckpointState, training: bool, what: str,
                 path: str):
        inputs, outputs = _declared_ranks(input_specs(session), path), output_specs(session)
        by_name = {s.name: s for s in inputs}
        meta = _training_metadata(session)
        grad_params = [o.name[: -len(names.ACCUMULATION_OUT_SUFFIX)] for o in outputs
                       if o.name.endswith(names.ACCUMULATION_OUT_SUFFIX)]
        declared = set(meta.get("trainable", [])) | set(meta.get("frozen", []))
        param_names = [s.name for s in inputs if s.name in state._slots or s.name in declared]
        missing = [n for n in param_names if n not in state._slots]
        missing += [p for p in grad_params if p not in state._slots and p not in missing]
        if missing:
            raise CheckpointError(f"the {what} takes parameters {missing} that the checkpoint does not hold")
        if training:
            unused = [n for n in state._slots if n not in by_name]
            if unused:
                raise CheckpointError(f"the checkpoint holds parameters {unused} that the {what} does not take")
        for name in param_names:
            _check_param(state, name, by_name[name], grad=name in grad_params, training=training, what=what)
        self.params = param_names
        self.trainable = [n for n in param_names if state._slots[n].requires_grad] if training else []
        if training:
            for p in self.trainable:
                if names.accumulation_buffer_name(p) not in by_name:
                    raise ModelError(f"the {what} has no input {names.accumulation_buffer_name(p)!r} "
                                     f"for trainable parameter {p!r}")
            if names.LAZY_RESET_GRAD not in by_name:
                raise ModelError(f"the {what} has no {names.LAZY_RESET_GRAD!r} input")
        internal = set(param_names) | {names.accumulation_buffer_name(p) for p in self.trainable}
        internal |= {names.LAZY_RESET_GRAD} if training else set()
        # fp16 artifacts: the loss scale comes from the state (CheckpointState.properties)
        self.loss_scaled = training and names.LOSS_SCALE in by_name
        self.initial_loss_scale = float(meta.get("loss_scale", DEFAULT_LOSS_SCALE))
        internal |= {names.LOSS_SCALE} if self.loss_scaled else set()
        self.user_inputs: list[IOSpec] = [s for s in inputs if s.name not in internal]
        output_names = {o.name for o in outputs}
        # training-mode BatchNormalization statistics: output name -> the frozen parameter it updates
        self.buffer_updates: dict[str, str] = {
            out: param for out, param in meta.get("buffer_updates", {}).items()
            if training and out in output_names and param in state._slots
        } if training else {}
        grad_outputs = {names.accumulation_out_name(p) for p in self.trainable}
        # the eval model's outputs of the base model, there for export_model_for_inferencing only
        inference_outputs = set(meta.get("inference_outputs", []))
        self.user_outputs: list[str] = [o.name for o in outputs
                                        if o.name not in grad_outputs and o.name not in self.buffer_updates
                                        and o.name not in inference_outputs]
        self.loss_inputs: list[str] = list(meta.get("loss_inputs", []))


def _check_param(state: CheckpointState, name: str, spec: IOSpec, grad: bool, training: bool, what: str) -> None:
    slot = state._slots[name]
    if training and grad != slot.requires_grad:
        model_says = "trainable" if grad else "frozen"
        ckpt_says = "trainable" if slot.requires_grad else "frozen"
        raise CheckpointError(f"parameter {name!r} is {model_says} in the {what} but {ckpt_says} in the checkpoint")
    if spec.dtype is not None and spec.dtype != slot.dtype:
        raise CheckpointError(f"parameter {name!r} is {slot.dtype} in the checkpoint; the {what} expects "
                              f"{spec.describe()}")
    if spec.shape is not None and (len(spec.shape) != len(slot.shape) or any(
            isinstance(d, int) and d != s for d, s in zip(spec.shape, slot.shape))):
        raise CheckpointError(f"parameter {name!r} has shape {list(slot.shape)} in the checkpoint; the {what} "
                              f"expects {spec.describe()}")


def loss_scale_of(properties: dict) -> tuple[float, int]:
    """fp16 artifacts' dynamic loss scale and its growth tracker, from the state's properties
    (where the Module puts them and the Optimizer updates them), or a CheckpointError."""
    scale, tracker = properties.get(names.LOSS_SCALE), properties.get(names.LOSS_SCALE_GROWTH_TRACKER, 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise CheckpointError(f"property {names.LOSS_SCALE!r} is {scale!r}; fp16 artifacts keep their loss scale "
                              f"there, a positive finite number (the Module sets {DEFAULT_LOSS_SCALE:g} when it is "
                              f"missing as it is created)")
    if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
        raise CheckpointError(f"property {names.LOSS_SCALE_GROWTH_TRACKER!r} is {tracker!r}; expected a count of "
                              f"steps, an integer >= 0")
    return float(scale), tracker


def _training_metadata(session: ort.InferenceSession) -> dict:
    text = session.get_modelmeta().custom_metadata_map.get(TRAINING_METADATA_KEY)
    if not text:
        return {}
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"model metadata {TRAINING_METADATA_KEY!r} is not valid JSON: {exc}") from exc
    return meta if isinstance(meta, dict) else {}


class Module:
    """Runs training and evaluation steps of the training artifacts.

    ``module(*inputs)`` runs the training model when ``module.training`` (accumulating
    gradients into the state until :meth:`lazy_reset_grad`), else the eval model, and returns
    the loss, or a tuple ``(loss, *additional_outputs)`` when the model has more outputs. Inputs
    are numpy arrays (outputs are numpy) or OrtValues (outputs are OrtValues), positional in
    the order of :meth:`input_names`, or by name.

    The models may be the ``.onnx`` files of the artifacts or their ORT format conversions
    (``training_model.ort``..., :func:`onnxtrain.artifacts.convert_to_ort_format`); both train
    alike. An ORT format model is already optimized: the ``graph_optimization_level`` of
    ``session_options`` does not apply to it.

    Args:
        train_model_uri: path to ``training_model.onnx`` (or ``.ort``).
        state: the :class:`CheckpointState` holding the parameters.
        eval_model_uri: path to ``eval_model.onnx`` (or ``.ort``; needed for ``eval()`` and export).
        device: ``"cpu"`` or ``"cuda[:id]"``: where parameters and gradients live.
        session_options: ``onnxruntime.SessionOptions`` for the sessions. Default: onnxruntime's,
            on CPU with denormal floats as zero (``session.set_denormal_as_zero``; set on the
            calling thread for the length of each run only, ``onnxtrain.runtime.denormals``):
            masked attention Softmax runs several times faster; and without onnxruntime's
            memory pattern (``enable_mem_pattern``): about a quarter less peak memory for up to
            ~3% more step time on transformers (pass options with it on for that 3%). Given
            options are used as they are, and their ``session.set_denormal_as_zero`` gets the
            same per-run treatment.
        providers: explicit execution providers (default: from ``device``).

    Example (``artifacts`` is a folder of training artifacts for a model with input ``x``, an
    MSE loss against ``target`` and an extra output ``pred``; ``x``, ``y`` is a batch):
        >>> from onnxtrain.api import CheckpointState, Module, Optimizer
        >>> state = CheckpointState.load_checkpoint(f"{artifacts}/checkpoint")
        >>> module = Module(f"{artifacts}/training_model.onnx", state, f"{artifacts}/eval_model.onnx")
        >>> optimizer = Optimizer(f"{artifacts}/optimizer_model.onnx", module)
        >>> optimizer.set_learning_rate(0.05)
        >>> module.input_names(), module.output_names()
        (['x', 'target'], ['loss', 'pred'])
        >>> for _ in range(3):
        ...     loss, pred = module(x, y)
        ...     optimizer.step()
        ...     module.lazy_reset_grad()
        >>> eval_loss, _ = module.eval()(x, y)
        >>> bool(eval_loss < loss)
        True
    """

    training: bool

    def __init__(self, train_model_uri: str | os.PathLike, state: CheckpointState,
                 eval_model_uri: str | os.PathLike | None = None, device: str = "cpu",
                 session_options: ort.SessionOptions | None = None, providers: list | None = None) -> None:
        if not isinstance(state, CheckpointState):
            raise TypeError(f"state must be a CheckpointState, got {type(state).__name__}")
        self.training = True
        self._state = state
        self._device = parse_device(device)
        self._providers = providers_for(self._device, providers)
        if session_options is None and self._device.type == "cpu":
            session_options = ask_for_flushing(quiet_session_options())
            # No memory pattern (onnxruntime's per-session block planned from the first runs):
            # the arena alone reuses what a run frees. Training peaks drop by a quarter (bench
            # models' fused steps: GPT 418 -> 297 MB, BERT-mini 899 -> 679, MiniLM 1362 -> 1121,
            # CNN 125 -> 84) for at most ~3% of step time (BERT-mini, MiniLM; none on GPT, MLP).
            session_options.enable_mem_pattern = False
        self._session_options = session_options
        self._flush_denormals = runs_flush_denormals(session_options, self._device.type)
        self._train_model_uri = file_path(train_model_uri, "Module train_model_uri")
        self._train_session = create_session(fusions.session_model(train_model_uri, self._providers, gated_add=False),
                                             self._providers, session_options, "training model")
        self._train = _Signature(self._train_session, state, training=True, what="training model",
                                 path=self._train_model_uri)
        self._eval_model_uri = None if eval_model_uri is None else file_path(eval_model_uri, "Module eval_model_uri")
        self._eval_session = self._eval = None
        if eval_model_uri is not None:
            self._eval_session = create_session(fusions.session_model(eval_model_uri, self._providers, gated_add=False),
                                                self._providers, session_options, "eval model")
            self._eval = _Signature(self._eval_session, state, training=False, what="eval model",
                                    path=self._eval_model_uri)
        if self._train.loss_scaled:  # dynamic loss scale state lives in the state's properties
            state._properties.setdefault(names.LOSS_SCALE, self._train.initial_loss_scale)
            state._properties.setdefault(names.LOSS_SCALE_GROWTH_TRACKER, 0)
        state._to_device(self._device)
        state._ensure_grads()
        self._reset_grad = True  # buffers start empty, so the first step must not add to them
        self._runs_since_reset = 0  # training runs that wrote the current gradients
        # the fused step (forward, backward and update in one run) that serves a training step
        # starting from fresh gradients: a FusedStep set by Optimizer(..., fused_step=...)
        self._fused_step = None
        self._flags = {v: from_numpy(np.array(v), self._device) for v in (True, False)}
        self._train_bindings = BindingCache(self._train_session, self._setup_train_binding)
        self._eval_bindings = None if self._eval_session is None else \
            BindingCache(self._eval_session, self._setup_eval_binding)

    # -- running -------------------------------------------------------------------------

    @exclusive
    def __call__(self, *user_inputs, **named_inputs):
        """Run one training step (``training``) or eval step; return the loss (and extra outputs)."""
        training = self.training
        sig = self._signature(training)
        values = gather_inputs(sig.user_inputs, user_inputs, named_inputs)
        feeds, ortvalue_mode = to_ortvalues(sig.user_inputs, values)
        self._state._require_values()
        state = self._state
        fresh = training and self._reset_grad
        strings = any(isinstance(feed, np.ndarray) for feed in feeds)  # no IOBinding takes them
        fused = self._fused_step if fresh and not strings and self._fused_step is not None \
            and self._fused_step.worth_running() else None
        if strings:
            session, binding = (self._train_session if training else self._eval_session), None
        elif fused is not None:
            session, binding = fused.session, fused.binding()
        elif training:
            session = self._train_session
            binding = self._train_bindings.get((state._layout, state._param_phase, state._grad_phase))
            binding.bind_ortvalue_input(names.LAZY_RESET_GRAD, self._flags[self._reset_grad])
            if sig.loss_scaled:
                binding.bind_cpu_input(names.LOSS_SCALE,
                                       np.array(loss_scale_of(state._properties)[0], dtype=np.float32))
        else:
            session = self._eval_session
            binding = self._eval_bindings.get((state._layout, state._param_phase))
        if binding is not None:
            for spec, value in zip(sig.user_inputs, feeds):
                binding.bind_ortvalue_input(spec.name, value)
            for name in [*sig.user_outputs, *sig.buffer_updates]:  # ORT allocates these per run
                binding.bind_output(name, self._device.type, self._device.id)
        try:
            with denormals_flushed(self._flush_denormals):
                if binding is not None:
                    session.run_with_iobinding(binding)
                    outputs = binding.get_outputs()
                else:
                    outputs = self._run_without_binding(session, sig, training, feeds)
        except Exception as exc:  # onnxruntime raises several pybind types
            what = "training step" if training else "eval step"
            raise run_failure(exc, what, [s.name for s in sig.user_inputs
                                          if s.dtype is not None and np.issubdtype(s.dtype, np.integer)]) from exc
        for value, param in zip(outputs[len(sig.user_outputs):], sig.buffer_updates.values()):
            # running statistics are small: copy into the parameter's buffer, which stays bound
            state._value(state._slots[param]).update_inplace(np.ascontiguousarray(value.numpy()))
        # Only now, after a successful run, do the freshly written gradient buffers become current.
        if training:
            state._grad_phase = 1 - state._grad_phase
            state._version += 1
            for p in sig.trainable:
                state._slots[p].has_grad = True
            self._reset_grad = False
            self._runs_since_reset = 1 if fresh else self._runs_since_reset + 1
        if fused is not None:  # its update waits in the spare buffers for optimizer.step()
            fused.done()
        outputs = outputs[: len(sig.user_outputs)]
        results = tuple(outputs) if ortvalue_mode else tuple(o.numpy() for o in outputs)
        return results[0] if len(results) == 1 else results

    def _signature(self, training: bool) -> _Signature:
        if training:
            return self._train
        if self._eval is None:
            raise ModelError("no eval model was given to Module(...): cannot run in eval mode")
        return self._eval

    def _bind_outputs_and_parameters(self, binding: ort.IOBinding) -> None:
        """The training run's user outputs and statistics updates (first, so get_outputs() returns
        them first) and its parameter inputs: shared by the training and the fused step binding."""
        state, sig = self._state, self._train
        for name in [*sig.user_outputs, *sig.buffer_updates]:
            binding.bind_output(name, self._device.type, self._device.id)
        for name in sig.params:
            binding.bind_ortvalue_input(name, state._value(state._slots[name]))

    def _run_without_binding(self, session: ort.InferenceSession, sig: _Signature, training: bool,
                             feeds: list) -> list[ort.OrtValue]:
        """One run through ``session.run`` (string inputs, which no IOBinding takes), fed and
        read as the binding of that run would be: the outputs (user outputs, then statistics
        updates) as OrtValues; a training run's gradients written into the spare buffers."""
        state = self._state
        inputs = {spec.name: value for spec, value in zip(sig.user_inputs, feeds)}
        inputs.update((name, state._value(state._slots[name])) for name in sig.params)
        read = [*sig.user_outputs, *sig.buffer_updates]
        if training:
            inputs[names.LAZY_RESET_GRAD] = self._flags[self._reset_grad]
            if sig.loss_scaled:
                inputs[names.LOSS_SCALE] = np.array(loss_scale_of(state._properties)[0], dtype=np.float32)
            inputs.update((names.accumulation_buffer_name(p), state._grad(state._slots[p])) for p in sig.trainable)
            read += [names.accumulation_out_name(p) for p in sig.trainable]
        results = session.run(read, inputs)
        count = len(sig.user_outputs) + len(sig.buffer_updates)
        for p, grad in zip(sig.trainable if training else (), results[count:]):
            state._spare_grad(state._slots[p]).update_inplace(np.require(grad, requirements="C"))
        # (np.require keeps a 0-d loss 0-d; np.ascontiguousarray makes it 1-d)
        return [ort.OrtValue.ortvalue_from_numpy(np.require(r, requirements="C")) for r in results[:count]]

    def _setup_train_binding(self, binding: ort.IOBinding) -> None:
        state, sig = self._state, self._train
        self._bind_outputs_and_parameters(binding)
        for p in sig.trainable:
            slot = state._slots[p]
            binding.bind_ortvalue_input(names.accumulation_buffer_name(p), state._grad(slot))
            binding.bind_ortvalue_output(names.accumulation_out_name(p), state._spare_grad(slot))

    def _setup_eval_binding(self, binding: ort.IOBinding) -> None:
        state, sig = self._state, self._eval
        for name in sig.user_outputs:
            binding.bind_output(name, self._device.type, self._device.id)
        for name in sig.params:
            binding.bind_ortvalue_input(name, state._value(state._slots[name]))

    # -- modes ---------------------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        """Set training mode (``True``) or evaluation mode (``False``); return self."""
        self.training = bool(mode)
        return self

    def eval(self) -> Module:
        """Set evaluation mode; return self."""
        return self.train(False)

    @exclusive
    def lazy_reset_grad(self) -> None:
        """Make the next training step overwrite the gradients instead of adding to them."""
        self._reset_grad = True

    def input_names(self) -> list[str]:
        """User input names of the current mode's model (for training: model inputs, then loss inputs)."""
        return [s.name for s in self._signature(self.training).user_inputs]

    def output_names(self) -> list[str]:
        """User output names of the current mode's model: the loss, then additional outputs."""
        return list(self._signature(self.training).user_outputs)

    # -- parameters as one buffer --------------------------------------------------------

    def _selected(self, trainable_only: bool) -> list:
        return [self._state._slots[n] for n in self._train.params
                if not trainable_only or self._state._slots[n].requires_grad]

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        """Number of elements in all (or only the trainable) parameters."""
        return sum(slot.size for slot in self._selected(trainable_only))

    @exclusive
    def get_contiguous_parameters(self, trainable_only: bool = False) -> ort.OrtValue:
        """All (or the trainable) parameters flattened into one 1-D OrtValue, in the training
        model's parameter order (trainable first, then frozen)."""
        slots = self._selected(trainable_only)
        dtype = _common_dtype(slots)
        missing = [s.name for s in slots if not s.has_value]
        if missing:
            raise CheckpointError(f"parameters {missing[:8]} have no value (nominal checkpoint)")
        flat = np.concatenate([self._state._value(s).numpy().reshape(-1) for s in slots]) if slots \
            else np.zeros(0, dtype=dtype)
        return owned_from_numpy(flat.astype(dtype, copy=False), self._device)

    @exclusive
    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        """Copy a flat buffer (as from :meth:`get_contiguous_parameters`: an OrtValue, also
        onnxruntime's C-level one that upstream passes, or anything with ``.numpy()``, or an
        array) into the parameters, in the same order."""
        slots = self._selected(trainable_only)
        flat = buffer.numpy() if hasattr(buffer, "numpy") and not isinstance(buffer, np.ndarray) \
            else np.asarray(buffer)
        if flat.dtype == object:
            raise InputMismatchError(f"parameter buffer must be an OrtValue or a numeric array, got "
                                     f"{type(buffer).__name__}")
        expected = sum(s.size for s in slots)
        dtype = _common_dtype(slots)
        if flat.ndim != 1 or flat.size != expected:
            raise InputMismatchError(f"parameter buffer has shape {list(flat.shape)}; expected a 1-D buffer of "
                                     f"{expected} elements ({'trainable' if trainable_only else 'all'} parameters)")
        if flat.dtype != dtype:
            raise InputMismatchError(f"parameter buffer has dtype {flat.dtype}; the parameters are {dtype}")
        offset = 0
        self._state._version += 1
        for slot in slots:
            part = flat[offset: offset + slot.size].reshape(slot.shape)
            self._state._value(slot).update_inplace(np.ascontiguousarray(part))
            slot.has_value = True
            offset += slot.size

    # -- export --------------------------------------------------------------------------

    @exclusive
    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike,
                                     graph_output_names: list[str]) -> None:
        """Write an inference model: the eval model pruned to the nodes that compute
        ``graph_output_names``, without loss inputs, with the current parameter values
        embedded as initializers. It runs in a plain ``onnxruntime.InferenceSession``.

        With an ORT format eval model (``eval_model.ort``) the graph is read from the
        ``eval_model.onnx`` next to it (ModelError when there is none)."""
        from onnxtrain.api._export import export_inference_model

        if self._eval_model_uri is None:
            raise ModelError("exporting an inference model needs the eval model: pass eval_model_uri to Module")
        if isinstance(graph_output_names, str) or not graph_output_names:
            raise ValueError("graph_output_names must be a non-empty list of output names")
        self._state._require_values()
        values = {n: self._state._value(s).numpy() for n, s in self._state._slots.items()}
        export_inference_model(self._onnx_eval_model(), inference_model_uri, list(graph_output_names), values,
                               self._eval.loss_inputs)

    def _onnx_eval_model(self) -> str:
        """The eval graph as an ONNX file: the eval model itself, or for an ORT format eval model
        (``eval_model.ort``) the ``eval_model.onnx`` it was converted from, next to it."""
        path = self._eval_model_uri
        if not os.path.isfile(path) or not is_ort_format(path):
            return path  # an ONNX file, or a missing one (reported when it is read)
        onnx_path = os.path.splitext(path)[0] + ".onnx"
        if not os.path.isfile(onnx_path):
            raise ModelError(f"exporting an inference model needs the eval graph in ONNX format, but the eval "
                             f"model {path!r} is in ORT format (an optimized graph that cannot be edited) and "
                             f"{onnx_path!r} does not exist: keep the eval_model.onnx of the artifacts next to "
                             f"the .ort file")
        from onnxtrain.ir.io import graph_io_names

        session_io = ([a.name for a in self._eval_session.get_inputs()],
                      [a.name for a in self._eval_session.get_outputs()])
        if graph_io_names(onnx_path) != session_io:
            raise ModelError(f"{onnx_path!r} does not have the inputs and outputs of the ORT format eval model "
                             f"{path!r}: it is not the eval model that file was converted from")
        return onnx_path


def _common_dtype(slots) -> np.dtype:
    dtypes = {s.dtype for s in slots}
    if len(dtypes) > 1:
        raise ModelError(f"parameters have different dtypes {sorted(str(d) for d in dtypes)}; a contiguous "
                         f"buffer needs one dtype")
    return dtypes.pop() if dtypes else np.dtype(np.float32)
