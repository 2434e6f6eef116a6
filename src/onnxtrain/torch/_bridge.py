"""Run ONNX Runtime sessions on torch tensors without copies, inside torch autograd.

Inputs reach ORT through DLPack (``OrtValue.from_dlpack`` shares the tensor's memory, on
CPU or CUDA); outputs are allocated by ORT on the inputs' device and handed to torch
through DLPack the same way. A training call is one ``torch.autograd.Function``: its
forward runs the forward session and keeps the saved activations, its backward runs the
backward session.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnxruntime.capi import _pybind_state as ort_c
from torch._C import _from_dlpack

from onnxtrain.errors import ModelError, OnnxTrainError
from onnxtrain.ir import io
from onnxtrain.passes.partition import FROM_FORWARD_OUTPUT, FROM_INPUT, FROM_OUTPUT_GRAD, ForwardBackward
from onnxtrain.runtime import fusions
from onnxtrain.runtime.denormals import denormals_flushed, runs_flush_denormals
from onnxtrain.runtime.device import Device, providers_for
from onnxtrain.runtime.session import create_session, list_for_default_order, run_failure
from onnxtrain.torch._openmp import release_torch_openmp_threads


# CPU runs at least this long (judged by the previous run) start by releasing PyTorch's OpenMP
# threads (see onnxtrain.torch._openmp): measured on 2 cores, the CNN's (10-30 ms runs) and
# GPT's (60-130 ms) steps got 5-8% faster, the MLP's (~1 ms runs) 3% slower.
RELEASE_OPENMP_FOR_RUNS_S = 0.004
# A runner that released before its last run keeps releasing while its runs take at least this
# fraction of the threshold. A released run is the faster one, so judging it by the bare
# threshold flips the decision back and forth: the bench CNN's forward (4.0-4.3 ms released,
# 8 ms with PyTorch's threads still spinning) alternated between the two, step after step.
KEEP_RELEASING_FRACTION = 0.5


def device_of(tensors: Sequence[torch.Tensor]) -> Device:
    for t in tensors:
        if t.device.type != "cpu":
            return Device(t.device.type, t.device.index or 0)
    return Device("cpu")


# the element types a CPU run hands to onnxruntime in one batch (``OrtValueVector.push_back_batch``
# takes numpy's): a call with any other input (bfloat16, complex), or an empty one (no data
# pointer to wrap), binds its inputs one by one
_BATCHED_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
                   torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
                   torch.uint8: np.uint8, torch.bool: np.bool_}


def _to_ort(tensor: torch.Tensor) -> ort.OrtValue:
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return ort.OrtValue.from_dlpack(tensor)


# onnxruntime's MatMulAddFusion turns a MatMul + Add on 3-D activations into Reshape, Gemm and
# Reshape; when the result is one the backward keeps (a forward output), onnxruntime copies it
# out of the final Reshape. Measured on CPU, the bench's GPT forward graph (2 threads): 42.5 ->
# 39.8 ms without the fusion (bench/ANALYSIS.md). Training sessions only: an inference graph
# hands over no such values (its GPT run measured the same either way, within the host's ±1 ms).
# Not on CUDA, where it was not measured.
# Its NchwcTransformer too: onnxtrain's own pass already runs the Convs with run-time weights (all
# of a training graph's but the Conv weight gradients' patch gathers) in the blocked layout;
# onnxruntime's adds reorders around the rest. Bench CNN, 3 alternating rounds of 60 steps: 14.3-15.1
# ms without it against 15.1-15.3 with it, peak RSS 487 MB against 502.
TRAINING_CPU_DISABLED_ORT_OPTIMIZERS = ["MatMulAddFusion", "NchwcTransformer"]


def _session_bytes(model: ir.Model, providers: list, in_listed_order: bool = False) -> bytes:
    """The model's bytes for a session on ``providers``: on the CPU provider, with the Conv weight
    gradients' patches gathered by a grouped Conv and the Convs in onnxruntime's blocked layout
    (``onnxtrain.runtime.fusions``), in a copy (the graph ORTModule keeps, saves and estimates
    stays in standard ops). With ``in_listed_order``, listed so that onnxruntime runs the
    nodes in the graph's order (:func:`onnxtrain.runtime.session.list_for_default_order`)."""
    if fusions.rewrites(model, providers):
        model = ir.from_proto(io.to_proto(model))
        fusions.for_session(model, providers, gated_add=False, runtime_fills=False)
    proto = io.to_proto(model)
    if in_listed_order:
        list_for_default_order(proto.graph)
    return proto.SerializeToString()


class SessionRunner:
    """One InferenceSession and the names of its inputs and outputs, run on torch tensors."""

    def __init__(self, model, device: Device, session_options: ort.SessionOptions | None, what: str,
                 shrink_arena: bool = False, training: bool = False, in_listed_order: bool = False):
        self.device = device
        # With ``shrink_arena`` each run ends by handing the arena's free regions back to the
        # system, so the memory a run's intermediates took is not held while PyTorch computes
        # the loss and its gradient (between the forward and backward runs): a lower peak for
        # some time spent reallocating.
        self.run_options = None
        if shrink_arena:
            self.run_options = ort.RunOptions()
            self.run_options.add_run_config_entry(
                "memory.enable_memory_arena_shrinkage", f"{'gpu' if device.type == 'cuda' else 'cpu'}:{device.id or 0}")
        try:
            providers = providers_for(device)
        except ValueError as exc:  # e.g. CUDA tensors with the CPU-only onnxruntime package
            raise ModelError(f"cannot run the {what} on {device}: {exc}") from exc
        disabled = TRAINING_CPU_DISABLED_ORT_OPTIMIZERS if training and device.type == "cpu" else []
        # onnxruntime drops a Dropout whose mask nothing reads as if the session were inference:
        # a forward-only run of a module in train() mode (under torch.no_grad()) must still drop
        disabled = [*disabled, "EliminateDropout"]
        # denormals as zero (onnxtrain.runtime.denormals): onnxruntime sets the flags on its pool
        # threads and on this one; create_session gives this thread its own back, and the runs
        # set them for their length only
        self._flush_denormals = runs_flush_denormals(session_options, device.type)
        self.session = create_session(_session_bytes(model, providers, in_listed_order), providers, session_options,
                                      what=what, disabled_optimizers=disabled)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        # per input position: (parameter, data_ptr, shape, OrtValue) of the last call.
        # Parameters come back as the same tensors with the same storage every step
        # (optimizers update them in place): their OrtValues are reused instead of rebuilt
        # through DLPack. Only parameters: caching activations would keep them alive.
        self._last: list[tuple | None] = [None] * len(self.input_names)
        self._last_run_s = float("inf")
        self._releasing = False  # whether the last run started by releasing PyTorch's OpenMP threads
        if device.type == "cpu":  # what a batched run passes (see run)
            cpu = ort_c.OrtDevice(ort_c.OrtDevice.cpu(), ort_c.OrtDevice.default_memory(), 0)
            self._input_devices = [cpu] * len(self.input_names)
            self._output_devices = [cpu] * len(self.output_names)
            self._batched_run_options = self.run_options or ort.RunOptions()

    def _ort_value(self, position: int, tensor: torch.Tensor) -> ort.OrtValue:
        if not isinstance(tensor, torch.nn.Parameter):
            return _to_ort(tensor)
        last = self._last[position]
        if (last is not None and last[0] is tensor and last[1] == tensor.data_ptr() and last[2] == tensor.shape
                and tensor.is_contiguous()):
            return last[3]
        value = _to_ort(tensor)
        self._last[position] = (tensor, tensor.data_ptr(), tensor.shape, value)
        return value

    def _releases_openmp(self) -> bool:
        """Whether this CPU run starts by releasing PyTorch's OpenMP threads: the last run took at
        least RELEASE_OPENMP_FOR_RUNS_S, or KEEP_RELEASING_FRACTION of it if that run released."""
        bar = RELEASE_OPENMP_FOR_RUNS_S * (KEEP_RELEASING_FRACTION if self._releasing else 1.0)
        self._releasing = self._last_run_s >= bar
        return self._releasing

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.device.type == "cpu" and all(t.dtype in _BATCHED_DTYPES and t.numel() for t in inputs):
            return self._run_batched(inputs)
        binding = self.session.io_binding()
        for position, (name, tensor) in enumerate(zip(self.input_names, inputs)):
            binding.bind_ortvalue_input(name, self._ort_value(position, tensor))
        for name in self.output_names:
            binding.bind_output(name, self.device.type, self.device.id)
        if self.device.type == "cuda":
            # ORT's CUDA provider runs on its own stream: let torch's queued work on the
            # inputs finish first
            torch.cuda.current_stream(self.device.id).synchronize()
        if self.device.type != "cpu":
            binding.synchronize_inputs()
        self._timed(lambda: self.session.run_with_iobinding(binding, self.run_options), inputs)
        if self.device.type != "cpu":
            binding.synchronize_outputs()
        return [torch.from_dlpack(v) for v in binding.get_outputs()]

    def _run_batched(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A CPU run whose inputs onnxruntime wraps in one call and whose outputs come back in one
        (``OrtValueVector``): per run ~10 us where binding each value through Python took ~60
        (7 inputs, 4 outputs), more with a backward's dozens of saved activations."""
        held = [t if t.is_contiguous() else t.contiguous() for t in inputs]  # alive until the run ends
        feeds = ort_c.OrtValueVector()
        feeds.reserve(len(held))
        feeds.push_back_batch(held, [t.data_ptr() for t in held], [_BATCHED_DTYPES[t.dtype] for t in held],
                              [t.shape for t in held], self._input_devices)
        fetches = ort_c.OrtValueVector()
        self._timed(lambda: self.session._sess.run_with_ortvaluevector(
            self._batched_run_options, self.input_names, feeds, self.output_names, fetches, self._output_devices),
            inputs)
        return fetches.to_dlpacks(_from_dlpack)

    def _timed(self, execute, inputs: Sequence[torch.Tensor]) -> None:
        """``execute()`` (the session's run), timed, with denormals flushed as asked and, for a
        long CPU run, PyTorch's OpenMP threads released first; onnxruntime's errors as RunError."""
        if self.device.type == "cpu" and self._releases_openmp():
            # PyTorch's spinning OpenMP threads would hold the cores this run is about to use;
            # for short runs restarting them afterwards costs more than it saves
            release_torch_openmp_threads()
        started = time.perf_counter()
        try:
            with denormals_flushed(self._flush_denormals):
                execute()
        except Exception as exc:  # onnxruntime raises several pybind types
            # the graph names the call's tensors tensors_0, tensors_1, ... (their order in the call)
            integer = [re.sub(r"^tensors_(\d+)$", r"tensor \1 of the call", name) +
                       f" ({str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)})"
                       for name, tensor in zip(self.input_names, inputs)
                       if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)]
            raise run_failure(exc, "ORTModule", integer) from exc
        self._last_run_s = time.perf_counter() - started


@dataclass
class TrainingPrograms:
    """The forward and backward sessions of one graph for one set of requires-grad inputs."""

    graphs: ForwardBackward
    forward: SessionRunner
    backward: SessionRunner
    wrt_positions: list[int]   # input positions the backward graph returns gradients for
    non_differentiable: list[int]  # forward outputs (of the model's) that carry no gradient
    # per backward output: the model outputs whose gradient it reads
    grad_sources: list[frozenset[int]]

    @classmethod
    def build(cls, graphs: ForwardBackward, wrt_positions: list[int], device: Device,
              session_options: ort.SessionOptions | None, shrink_arena: bool = False) -> "TrainingPrograms":
        num = graphs.num_model_outputs
        non_diff = [i for i in range(num) if i not in graphs.differentiable_outputs]
        return cls(graphs, SessionRunner(graphs.forward, device, session_options, "forward graph", shrink_arena,
                                         training=True),
                   # each layer's weight gradients as soon as its output gradient is there (and
                   # recomputed forward values right before their use): the graph's own order
                   SessionRunner(graphs.backward, device, session_options, "backward graph", shrink_arena,
                                 training=True, in_listed_order=True),
                   wrt_positions, non_diff, graphs.output_grads_reaching())


class ORTFunction(torch.autograd.Function):
    """``apply(programs, *inputs)`` -> the model outputs; gradients flow to the requires-grad inputs."""

    @staticmethod
    def forward(ctx, programs: TrainingPrograms, *inputs):
        outputs = programs.forward.run(inputs)
        graphs = programs.graphs
        num = graphs.num_model_outputs
        ctx.programs = programs
        ctx.num_inputs = len(inputs)
        # keep exactly what the backward graph reads: saved activations, outputs, inputs
        kept = []
        for source, index in graphs.backward_inputs:
            if source == FROM_FORWARD_OUTPUT:
                kept.append(outputs[index])
            elif source == FROM_INPUT:
                kept.append(inputs[index])
        ctx.save_for_backward(*kept)
        model_outputs = outputs[:num]
        ctx.mark_non_differentiable(*[model_outputs[i] for i in programs.non_differentiable])
        # an output the loss does not use gets None, not zeros: parameters only it reaches keep
        # .grad None, as in eager (an optimizer then leaves them alone)
        ctx.set_materialize_grads(False)
        ctx.output_specs = [(o.shape, o.dtype, o.device) for o in model_outputs]
        return tuple(model_outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # create_graph=True: a gradient that must itself be differentiable
            raise OnnxTrainError(
                "ORTModule's backward runs in ONNX Runtime and cannot be differentiated again "
                "(torch.autograd.grad(..., create_graph=True), a gradient penalty): run that module in PyTorch")
        # vmapped: torch.func's transforms, or the legacy vmap of is_grads_batched (its key has no
        # name in torch._C.DispatchKey)
        if torch._C._functorch.peek_interpreter_stack() is not None or any(
                g is not None and "Batched" in str(torch._C._dispatch_keys(g)) for g in grad_outputs):
            raise OnnxTrainError(
                "ORTModule's backward runs in ONNX Runtime and cannot be vmapped (torch.autograd.grad(..., "
                "is_grads_batched=True), torch.autograd.functional.jacobian(..., vectorize=True)): compute the "
                "rows one at a time (vectorize=False), or run that module in PyTorch")
        return ORTFunction._backward(ctx, grad_outputs)

    @staticmethod
    def _backward(ctx, grad_outputs):
        programs: TrainingPrograms = ctx.programs
        try:
            kept = iter(ctx.saved_tensors)
        except RuntimeError as exc:
            if "inplace" in str(exc) or "in-place" in str(exc):  # autograd's own words fit
                raise
            # freed by an earlier backward without retain_graph=True
            raise OnnxTrainError(
                "a backward through an ORTModule call whose saved tensors an earlier backward freed: the "
                "outputs of one call share one backward (ONNX Runtime runs it for all of them at once), so "
                "backpropagate them together ((loss_a + loss_b).backward()), or pass retain_graph=True to "
                f"the first backward. PyTorch: {exc}") from exc
        feeds = []
        for source, index in programs.graphs.backward_inputs:
            if source != FROM_OUTPUT_GRAD:
                feeds.append(next(kept))
            elif grad_outputs[index] is not None:
                feeds.append(grad_outputs[index])
            else:
                shape, dtype, device = ctx.output_specs[index]
                feeds.append(torch.zeros(shape, dtype=dtype, device=device))
        grads = programs.backward.run(feeds)
        missing = {i for i, g in enumerate(grad_outputs) if g is None}
        result: list[torch.Tensor | None] = [None] * (1 + ctx.num_inputs)
        for position, g, sources in zip(programs.wrt_positions, grads, programs.grad_sources):
            if not (missing and sources and sources <= missing):
                result[1 + position] = g
        return tuple(result)
