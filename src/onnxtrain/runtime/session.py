"""Create sessions once, read their input/output signatures."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from onnxtrain.errors import ModelError, RunError
from onnxtrain.paths import unreadable_file
from onnxtrain.runtime.denormals import creating_thread_kept

# onnxruntime type strings -> numpy dtypes (bfloat16 has no numpy dtype and is left out).
_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int8)": np.int8, "tensor(int16)": np.int16, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_, "tensor(string)": np.str_,
}


@dataclass(frozen=True)
class IOSpec:
    """A session input or output: name, numpy dtype (None if unknown) and shape.

    ``shape`` holds ints for static dims and strings (or None) for symbolic ones; it is None
    when the model does not declare a rank.
    """

    name: str
    dtype: np.dtype | None
    shape: tuple | None
    type_str: str

    def describe(self) -> str:
        dims = "?" if self.shape is None else "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"
        return f"{self.type_str} with shape {dims}"


def _spec(arg) -> IOSpec:
    dtype = _ORT_TYPES.get(arg.type)
    shape = None if arg.shape is None else tuple(d if isinstance(d, int) and d >= 0 else (d or None)
                                                 for d in arg.shape)
    return IOSpec(arg.name, None if dtype is None else np.dtype(dtype), shape, arg.type)


def input_specs(session: ort.InferenceSession) -> list[IOSpec]:
    return [_spec(a) for a in session.get_inputs()]


def output_specs(session: ort.InferenceSession) -> list[IOSpec]:
    return [_spec(a) for a in session.get_outputs()]


def list_for_default_order(graph: onnx.GraphProto) -> None:
    """Relist ``graph``'s nodes (in place) so that ONNX Runtime's default execution order runs
    them in the order they are listed now (a topological order).

    That order (``ExecutionOrder.DEFAULT``) is a depth-first walk from the graph's leaves (nodes
    nothing reads) that visits a node's highest-indexed producer first and emits a node after
    its producers: on a reversed node list it follows the list. On a backward graph listed in
    topological order the walk would otherwise start from the first layer's gradient, pull in
    the whole chain of input gradients, and run every weight gradient (a leaf of its own) at
    the end, keeping every layer's output gradient alive through the whole run. The result is
    not topologically sorted, which ONNX Runtime accepts: use it for sessions only.
    """
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(reversed(nodes))


# what onnxruntime's Gather, GatherElements, ScatterElements and friends say about an index
_INDEX_OUT_OF_RANGE = ("out of range", "out of data bounds", "out of bounds")


def run_failure(exc: Exception, what: str, integer_inputs: list[str]) -> RunError:
    """The :class:`RunError` for onnxruntime's failure ``exc`` of a run of ``what``; an index
    out of range names the integer inputs it may have come from."""
    message = f"{what}: onnxruntime failed the run: {exc}"
    if integer_inputs and any(words in str(exc).lower() for words in _INDEX_OUT_OF_RANGE):
        message += (f"\nAn index was out of range: check the integer inputs {integer_inputs} (class labels lie in "
                    f"[0, classes) or equal the loss's ignore_index, token ids in [0, vocabulary); negative ones "
                    f"are out of range too)")
    return RunError(message)


def quiet_session_options() -> ort.SessionOptions:
    """onnxruntime's default session options with its own log quiet: failed runs reach the
    caller as exceptions."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return options


def create_session(model: str | os.PathLike | bytes, providers: list,
                   session_options: ort.SessionOptions | None = None, what: str = "model",
                   disabled_optimizers: list[str] | None = None) -> ort.InferenceSession:
    """An InferenceSession for ``model`` (a path or serialized bytes); ModelError if ORT rejects it.

    ``disabled_optimizers``: names of onnxruntime graph transformers to leave out for this session.
    The calling thread's denormal flags are as before afterwards, whatever ``session_options``
    ask (``onnxtrain.runtime.denormals``).
    """
    if isinstance(model, (str, os.PathLike)):
        model = os.fspath(model)
        problem = unreadable_file(model)
        if problem:
            raise ModelError(f"{what} file {model!r} {problem}, expected an ONNX model file")
    if session_options is None:
        session_options = quiet_session_options()
    try:
        with creating_thread_kept():
            return ort.InferenceSession(model, sess_options=session_options, providers=providers,
                                        disabled_optimizers=disabled_optimizers)
    except Exception as exc:  # ORT raises several pybind exception types
        label = model if isinstance(model, str) else "<bytes>"
        raise ModelError(f"onnxruntime could not load the {what} {label!r}: {exc}"
                         f"{_upstream_training_graph_hint(model)}") from exc


# Ops of onnxruntime-training's training build that its artifacts use and stock onnxruntime
# lacks (besides every com.microsoft op named *Grad): accumulators, optimizers, its cross entropy.
_UPSTREAM_TRAINING_OPS = frozenset({
    "InPlaceAccumulator", "InPlaceAccumulatorV2", "ZeroGradient", "AdamOptimizer", "AdamWOptimizer",
    "SGDOptimizer", "SGDOptimizerV2", "LambOptimizer", "InplaceClipGradNorm", "ReduceAllL2",
    "SoftmaxCrossEntropyLossInternal", "YieldOp", "PythonOp", "ConcatTraining", "SplitTraining",
    "BroadcastGradientArgs", "MixedPrecisionScale", "IsAllFinite", "PassThrough",
})


def _upstream_training_graph_hint(model: str | bytes) -> str:
    """When ``model`` uses ops of onnxruntime-training's training build, a sentence that says so
    and what to do; else ''."""
    try:
        proto = onnx.load(model, load_external_data=False) if isinstance(model, str) else \
            onnx.load_from_string(model)
    except Exception:  # noqa: BLE001 - only a hint: a model onnx cannot parse gets none
        return ""
    found = sorted({node.op_type for node in proto.graph.node if node.domain == "com.microsoft"
                    and (node.op_type in _UPSTREAM_TRAINING_OPS or node.op_type.endswith("Grad"))})
    if not found:
        return ""
    return (f". It was generated by onnxruntime-training: it uses ops of its training build "
            f"({', '.join(found[:6])}{', ...' if len(found) > 6 else ''}), which stock onnxruntime does not "
            f"have. Generate the artifacts again with onnxtrain.artifacts.generate_artifacts from the same "
            f"model; a checkpoint upstream saved loads as it is (CheckpointState.load_checkpoint)")


# ORT format models are flatbuffers whose file identifier (bytes 4 to 8) is "ORTM".
_ORT_FORMAT_IDENTIFIER = b"ORTM"


def is_ort_format(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` is an ORT format model (not an ONNX protobuf)."""
    with open(path, "rb") as file:
        head = file.read(8)
    return head[4:8] == _ORT_FORMAT_IDENTIFIER


@functools.cache
def register_shared_cpu_arena() -> None:
    """Register one CPU arena allocator in ONNX Runtime's process-wide environment.

    Sessions created with ``session.use_env_allocators=1`` then draw from this one arena
    instead of one arena each, so memory a forward session frees at the end of its run is
    reused by the backward session's run (and by other models' sessions). ORT keeps the
    registration for the life of the process; it is done once.
    """
    memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, -1, -1, -1))
