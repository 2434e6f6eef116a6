"""Optimizer: run the optimizer model of the artifacts to update the parameters.

Mirrors ``onnxruntime.training.api.Optimizer``. The optimizer model (docs/artifacts.md)
takes ``learning_rate``, ``step`` and, per trainable parameter ``p``, ``p``, ``p_grad`` and
``p.<state>``; it returns ``p.updated`` and ``p.<state>.updated``. The new values are
written into spare buffers and swapped in after the run, so nothing is copied and a
failed run changes nothing.

Fused step: unless ``fused_step=False``, the Optimizer also builds one session that runs
forward, backward and the update together (:mod:`onnxtrain.fused_step`). A training step
that starts from fresh gradients (``lazy_reset_grad`` before it, or the first step) then
runs that session: it writes this batch's gradients as usual, and this optimizer's update
into the spare buffers. ``step()`` only swaps them in, provided nothing the update depends
on changed in between (parameters, gradients, learning rate, step count, loss scale);
otherwise it runs the optimizer model as without fusion. Results are the same either way.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import onnxruntime as ort

from onnxtrain import names
from onnxtrain.api._fused import FusedStep
from onnxtrain.api.checkpoint_state import _OptimizerState, exclusive
from onnxtrain.api.module import Module, loss_scale_of
from onnxtrain.errors import CheckpointError, ModelError
from onnxtrain.paths import file_path
from onnxtrain.runtime import fusions
from onnxtrain.runtime.binding import BindingCache
from onnxtrain.runtime.denormals import denormals_flushed
from onnxtrain.runtime.session import create_session, input_specs, is_ort_format, output_specs
from onnxtrain.runtime.values import from_numpy, zeros

OPTIMIZER_METADATA_KEY = "onnxtrain.optimizer"


class Optimizer:
    """Updates the parameters of a :class:`Module` from its accumulated gradients.

    Optimizer state (e.g. AdamW's ``momentum0``/``momentum1``) starts at zero unless the
    checkpoint holds it; the step count and learning rate also come from the checkpoint
    when it was saved with ``include_optimizer_state=True``, so training resumes exactly.

    Args:
        optimizer_uri: path to ``optimizer_model.onnx`` (or its ORT format conversion ``.ort``).
        module: the :class:`Module` whose trainable parameters are updated.
        fused_step: run forward, backward and update in one session when a training step
            starts from fresh gradients (see the module docstring). ``None`` (default): when
            the training and optimizer models are ONNX files that can be joined, else not
            (``fused_step_error`` says why); ``True``: required (ModelError if impossible);
            ``False``: never (one session fewer to create and hold).

    Example (``artifacts`` is a folder of training artifacts, ``x``, ``y`` a batch):
        >>> from onnxtrain.api import CheckpointState, Module, Optimizer
        >>> state = CheckpointState.load_checkpoint(f"{artifacts}/checkpoint")
        >>> module = Module(f"{artifacts}/training_model.onnx", state)
        >>> optimizer = Optimizer(f"{artifacts}/optimizer_model.onnx", module)
        >>> optimizer.set_learning_rate(1e-4)
        >>> _ = module(x, y); optimizer.step(); module.lazy_reset_grad()
        >>> optimizer.get_learning_rate(), optimizer.step_count
        (0.0001, 1)
    """

    def __init__(self, optimizer_uri: str | os.PathLike, module: Module, fused_step: bool | None = None):
        if not isinstance(module, Module):
            raise TypeError(f"module must be an onnxtrain.api.Module, got {type(module).__name__}")
        optimizer_uri = file_path(optimizer_uri, "Optimizer optimizer_uri")
        self._module = module
        self._state = state = module._state
        self._session = create_session(fusions.session_model(optimizer_uri, module._providers), module._providers,
                                       module._session_options, "optimizer model")
        self._params = list(module._train.trainable)
        self._states = self._read_signature()

        opt = state._optimizer
        if opt is None:
            opt = state._optimizer = _OptimizerState(states=self._states)
        elif opt.states != self._states and opt.step and any(s not in opt.states for s in self._states):
            # the state the model needs would start from zero while the step count says otherwise
            # (AdamW's bias correction after a plain SGD's steps: updates of half their size)
            missing = [s for s in self._states if s not in opt.states]
            raise CheckpointError(f"the checkpoint holds optimizer state {opt.states} but the optimizer model "
                                  f"uses {self._states}: its {missing} would start from zero after {opt.step} "
                                  f"steps. To start this optimizer afresh, use a checkpoint saved without the "
                                  f"optimizer state (include_optimizer_state=False)")
        elif opt.states != self._states and (opt.pending or opt.buffers):
            unused = [s for s in opt.states if s not in self._states]
            if any(s in self._states for s in opt.states) or not _all_zero(opt, unused):
                raise CheckpointError(f"the checkpoint holds optimizer state {opt.states} but the optimizer model "
                                      f"uses {self._states}")
            # state the model does not use and that holds nothing (onnxruntime-training's SGD saves an
            # all-zero momentum0 per parameter): dropped, the step count kept
            opt.pending, opt.buffers = {}, {}
        opt.states = list(self._states)
        self._opt = opt
        self._adopt_state_buffers()
        state._ensure_spare_values()
        # fp16 dynamic loss scaling: the scale's new value, growth tracker and "all gradients
        # finite" flag come back into these CPU scalars; the scale state lives in
        # state.properties (saved with the checkpoint)
        self._scale_arrays = {
            names.updated_name(names.LOSS_SCALE): np.zeros((), np.float32),
            names.updated_name(names.LOSS_SCALE_GROWTH_TRACKER): np.zeros((), np.int64),
            names.ALL_FINITE: np.zeros((), np.bool_),
        } if self._loss_scaled else {}
        self._scale_outputs = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self._scale_arrays.items()}
        self.last_step_skipped = False
        self._bindings = BindingCache(self._session, self._setup_binding)
        self._fused: FusedStep | None = None
        self.fused_step_error: str | None = "fused_step=False"
        module._fused_step = None  # an earlier Optimizer's fused step no longer applies
        if fused_step is not False:
            self._create_fused_step(optimizer_uri, required=fused_step is True)

    def _read_signature(self) -> list[str]:
        inputs = [s.name for s in input_specs(self._session)]
        outputs = {s.name for s in output_specs(self._session)}
        if inputs[:2] != [names.LEARNING_RATE, names.STEP]:
            raise ModelError(f"the optimizer model's first inputs must be {[names.LEARNING_RATE, names.STEP]}, "
                             f"got {inputs[:2]}")
        meta_text = self._session.get_modelmeta().custom_metadata_map.get(OPTIMIZER_METADATA_KEY)
        meta = json.loads(meta_text) if meta_text else {}
        if "states" in meta:
            states = list(meta["states"])
        else:  # infer from the first parameter's inputs: p, p_grad, p.<state>...
            first = self._params[0] if self._params else ""
            states = [n[len(first) + 1:] for n in inputs if n.startswith(first + ".")]
        expected = [names.LEARNING_RATE, names.STEP]
        self._loss_scaled = names.LOSS_SCALE in inputs
        if self._loss_scaled:
            expected += [names.LOSS_SCALE, names.LOSS_SCALE_GROWTH_TRACKER]
        for p in self._params:
            expected += [p, names.grad_name(p)] + [names.state_name(p, s) for s in states]
        if sorted(inputs) != sorted(expected):
            extra = sorted(set(inputs) - set(expected))
            missing = sorted(set(expected) - set(inputs))
            raise ModelError(f"the optimizer model does not match the training model's trainable parameters: "
                             f"missing inputs {missing[:8]}, unexpected inputs {extra[:8]}")
        wanted = {names.updated_name(p) for p in self._params}
        wanted |= {names.updated_name(names.state_name(p, s)) for p in self._params for s in states}
        if self._loss_scaled:
            wanted |= {names.updated_name(names.LOSS_SCALE), names.updated_name(names.LOSS_SCALE_GROWTH_TRACKER),
                       names.ALL_FINITE}
        if not wanted <= outputs:
            raise ModelError(f"the optimizer model lacks outputs {sorted(wanted - outputs)[:8]}")
        return states

    def _adopt_state_buffers(self) -> None:
        """Two buffers per (parameter, state): the checkpoint's values or zeros, on the module's device."""
        opt, state = self._opt, self._state
        if opt.buffers and all(p in opt.buffers for p in self._params):
            return
        if opt.pending:
            missing = [p for p in self._params if p not in opt.pending]
            if missing:
                raise CheckpointError(f"the checkpoint's optimizer state has no entry for parameters {missing[:8]}")
        for p in self._params:
            slot = state._slots[p]
            per = {}
            for s in self._states:
                value = opt.pending.get(p, {}).get(s)
                first = zeros(slot.shape, slot.dtype, state._device) if value is None else \
                    from_numpy(np.array(value, dtype=slot.dtype, copy=True), state._device)
                per[s] = [first, zeros(slot.shape, slot.dtype, state._device)]
            opt.buffers[p] = per
        opt.pending = {}
        opt.phase = 0
        state._layout += 1

    def _create_fused_step(self, optimizer_uri, required: bool) -> None:
        module = self._module
        paths = (module._train_model_uri, os.fspath(optimizer_uri))
        try:
            if any(is_ort_format(p) for p in paths):
                raise ModelError("the fused step joins the ONNX graphs; ORT format models cannot be joined")
            from onnxtrain.fused_step import build_fused_step_model
            from onnxtrain.ir import io

            model = build_fused_step_model(io.load_model(paths[0]), io.load_model(paths[1]))
            fusions.for_session(model, module._providers, infer_shapes=False)  # both models were loaded by io
            session = create_session(io.serialize(model), module._providers, module._session_options,
                                                 "fused training step")
        except ValueError as exc:  # ModelError, or protobuf refusing a joined model over 2 GB
            if required:
                raise exc if isinstance(exc, ModelError) else ModelError(f"cannot build the fused step: {exc}") from exc
            self.fused_step_error = str(exc)
            return
        self.fused_step_error = None
        state, opt = self._state, self._opt
        self._fused = module._fused_step = FusedStep(
            session, self._setup_fused_binding,
            binding_key=lambda: (state._layout, state._param_phase, state._grad_phase, opt.phase),
            bind_step_inputs=self._bind_step_inputs, step_inputs=self._step_inputs, version=lambda: state._version)

    def _setup_fused_binding(self, binding: ort.IOBinding) -> None:
        """The fused session: the training model's bindings without accumulation, and the optimizer's."""
        state = self._state
        self._module._bind_outputs_and_parameters(binding)
        for p in self._params:
            binding.bind_ortvalue_output(names.accumulation_out_name(p), state._spare_grad(state._slots[p]))
        self._bind_updates(binding)

    def _step_inputs(self) -> tuple:
        """What an update depends on besides parameters, gradients and states."""
        state, opt = self._state, self._opt
        scale = loss_scale_of(state._properties) if self._loss_scaled else ()
        return (state._layout, state._param_phase, opt.phase, opt.learning_rate, opt.step, *scale)

    def _bind_step_inputs(self, binding: ort.IOBinding) -> None:
        state, opt = self._state, self._opt
        binding.bind_cpu_input(names.LEARNING_RATE, np.array(opt.learning_rate, dtype=np.float32))
        # ``step`` is the number of this update (1 for the first): bias corrections use it as a power.
        binding.bind_cpu_input(names.STEP, np.array(opt.step + 1, dtype=np.int64))
        if self._loss_scaled:
            scale, tracker = loss_scale_of(state._properties)
            binding.bind_cpu_input(names.LOSS_SCALE, np.array(scale, dtype=np.float32))
            binding.bind_cpu_input(names.LOSS_SCALE_GROWTH_TRACKER, np.array(tracker, dtype=np.int64))

    def _setup_binding(self, binding: ort.IOBinding) -> None:
        state = self._state
        for p in self._params:
            slot = state._slots[p]
            binding.bind_ortvalue_input(p, state._value(slot))
            binding.bind_ortvalue_input(names.grad_name(p), state._grad(slot))
        self._bind_updates(binding)

    def _bind_updates(self, binding: ort.IOBinding) -> None:
        """Current optimizer states in; new parameters and states into the spare buffers; the loss-scale outputs."""
        state, opt = self._state, self._opt
        for p in self._params:
            binding.bind_ortvalue_output(names.updated_name(p), state._spare_value(state._slots[p]))
            for s in self._states:
                key = names.state_name(p, s)
                binding.bind_ortvalue_input(key, opt.current(p, s))
                binding.bind_ortvalue_output(names.updated_name(key), opt.spare(p, s))
        for name, value in self._scale_outputs.items():
            binding.bind_ortvalue_output(name, value)

    @exclusive
    def step(self) -> None:
        """Update every trainable parameter once from its accumulated gradient.

        With fp16 artifacts (``generate_artifacts(precision="fp16")``) the step is skipped when
        a gradient is inf or NaN (``last_step_skipped``), and the loss scale in
        ``state.properties["loss_scale"]`` is updated as ``torch.amp.GradScaler.update`` does.
        """
        state, opt = self._state, self._opt
        state._require_values()  # an update of the placeholders would count a step
        fused = self._fused
        if fused is None or not fused.take_update():
            if fused is not None and self._module._runs_since_reset == 1:
                fused.would_have_served()
            binding = self._bindings.get((state._layout, state._param_phase, state._grad_phase, opt.phase))
            self._bind_step_inputs(binding)
            with denormals_flushed(self._module._flush_denormals):
                self._session.run_with_iobinding(binding)
        # else the fused run already wrote exactly this update into the spare buffers
        props = state._properties
        state._param_phase = 1 - state._param_phase
        opt.phase = 1 - opt.phase
        if self._loss_scaled:
            out = {name: value.numpy() for name, value in self._scale_outputs.items()}
            props[names.LOSS_SCALE] = float(out[names.updated_name(names.LOSS_SCALE)])
            props[names.LOSS_SCALE_GROWTH_TRACKER] = int(out[names.updated_name(names.LOSS_SCALE_GROWTH_TRACKER)])
            # a skipped step (non-finite gradients) leaves everything as it was, the step count
            # too, as GradScaler.step skips optimizer.step()
            self.last_step_skipped = not bool(out[names.ALL_FINITE])
            if self.last_step_skipped:
                return
        opt.step += 1

    @property
    def step_count(self) -> int:
        """Number of updates done so far (restored from a checkpoint with optimizer state)."""
        return self._opt.step

    def set_learning_rate(self, learning_rate: float) -> None:
        """Set the learning rate used by the following steps (a finite number >= 0)."""
        value = float(learning_rate)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the learning rate must be a finite number >= 0, got {learning_rate!r}")
        self._opt.learning_rate = value

    def get_learning_rate(self) -> float:
        """The learning rate the next step will use."""
        return self._opt.learning_rate


def _all_zero(opt: _OptimizerState, states: list[str]) -> bool:
    """Whether every tensor of ``states`` in ``opt`` (loaded or adopted) is all zeros."""
    values = opt.values()
    return all(not np.any(per[s]) for per in values.values() for s in states if s in per)
