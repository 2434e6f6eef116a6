"""Load and save models: the only module that touches ONNX protobuf.

Everything else in onnxtrain works on ``onnx_ir.Model`` (``upgrade``, which brings models of
older opsets and IR versions up for ``load_model``, works on protobuf too).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import numpy as np
import onnx
import onnx_ir as ir

from onnxtrain.errors import ModelError
from onnxtrain.ir.upgrade import upgrade
from onnxtrain.paths import unreadable_file

ModelLike = Union[str, os.PathLike, "onnx.ModelProto", ir.Model]

# The lowest default-domain opset whose gradient graphs we emit directly. Opset 13 moved
# the axes of ReduceSum/Squeeze/Unsqueeze and the splits of Split to inputs; older models
# are upgraded to it by the ONNX version converter.
MIN_OPSET = 13
# Graphs we write must be readable by onnxruntime 1.20+, which accepts IR version <= 10.
MAX_IR_VERSION = 10
# Above this many bytes of tensors a model is saved with external data (protobuf's 2 GB limit).
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def load_model(model: ModelLike) -> ir.Model:
    """Return an ``onnx_ir.Model`` that onnxtrain owns (a copy of an in-memory input)."""
    if isinstance(model, ir.Model):
        proto = ir.to_proto(model)
    elif isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        problem = unreadable_file(path)
        if problem:
            raise ModelError(f"ONNX model file {str(path)!r} {problem}, expected an ONNX model file")
        try:
            proto = onnx.load(str(path))
        except Exception as exc:  # protobuf raises several unrelated types
            raise ModelError(f"could not read ONNX model {str(path)!r}: {exc}") from exc
    else:
        raise ModelError(
            f"expected an ONNX model as a path, onnx.ModelProto or onnx_ir.Model, got {type(model).__name__}"
        )
    proto = upgrade(proto, _default_opset(proto), MIN_OPSET)
    _refuse_non_tensor_outputs(proto)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:
        pass  # shape inference is a help, not a requirement
    return ir.from_proto(proto)


def _refuse_non_tensor_outputs(proto: onnx.ModelProto) -> None:
    """A graph output that is a map or a sequence of maps (scikit-learn classifiers' ZipMap) is
    named with the way out; onnx_ir cannot represent map types."""
    for value in proto.graph.output:
        kind = value.type.WhichOneof("value")
        element, described = value.type, "a "
        while kind == "sequence_type":
            element, described = element.sequence_type.elem_type, described + "sequence of "
            kind = element.WhichOneof("value")
        if kind == "map_type":
            described += "maps" if described != "a " else "map"
            raise ModelError(
                f"model output {value.name!r} is {described}: onnxtrain trains "
                f"models whose outputs are tensors. Remove the output, or convert without it (skl2onnx: "
                f"options={{'zipmap': False}} gives the probabilities as a tensor)")


def _without_tensors(path: str | os.PathLike) -> onnx.ModelProto:
    """The ONNX model file at ``path``, its external tensors not loaded."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types
        raise ModelError(f"could not read ONNX model {str(path)!r}: {exc}") from exc


def graph_io_names(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """The input and output names of the ONNX model file at ``path`` (its tensors are not loaded)."""
    graph = _without_tensors(path).graph
    return [v.name for v in graph.input], [v.name for v in graph.output]


def metadata(path: str | os.PathLike) -> dict[str, str]:
    """The model-level ``metadata_props`` of the ONNX model file at ``path`` (tensors not loaded)."""
    return {entry.key: entry.value for entry in _without_tensors(path).metadata_props}


def inputs_without_shape(path: str | os.PathLike) -> set[str]:
    """The names of the graph inputs the ONNX model file at ``path`` declares without a shape
    (of any rank; its tensors are not loaded)."""
    return {v.name for v in _without_tensors(path).graph.input
            if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")}


def _default_opset(proto: onnx.ModelProto) -> int:
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ModelError("model imports no default-domain (ai.onnx) opset")


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """Serialize to protobuf with an IR version stock onnxruntime accepts."""
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return ir.to_proto(model)


# tensors at least this large go to the data file of a model over EXTERNAL_DATA_THRESHOLD (onnx's own
# default: smaller ones stay inline)
_EXTERNAL_TENSOR_BYTES = 1024


def save_model(model: ir.Model | onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` to ``path`` (external data next to it, ``<name>.data``, when it is large).

    Written in a scratch folder beside ``path`` and renamed into place, data file first: a model
    written again to the same path replaces its data (onnx appends to an existing data file, so
    every export grew it by the whole model), and a failed write leaves the old files whole."""
    proto = model if isinstance(model, onnx.ModelProto) else to_proto(model)
    path = Path(path)
    if path.is_symlink():  # write the file it names (the rename would replace the link itself)
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    large = proto.ByteSize() > EXTERNAL_DATA_THRESHOLD
    if large and proto is model:  # onnx moves the tensors out of the proto it saves: not the caller's
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as scratch:
        written = Path(scratch) / path.name
        if large:
            # the tensors marked by hand, not save_as_external_data=True: onnx then refuses a data
            # file of that name in the current directory (it checks the location against it)
            for tensor in proto.graph.initializer:
                if tensor.HasField("raw_data") and len(tensor.raw_data) >= _EXTERNAL_TENSOR_BYTES:
                    onnx.external_data_helper.set_external_data(tensor, data.name)
        onnx.save_model(proto, str(written))
        written_data = written.with_name(data.name)
        if written_data.exists():
            os.replace(written_data, data)
        elif data.exists():  # an earlier, larger model's data: nothing reads it now
            data.unlink()
        os.replace(written, path)


def serialize(model: ir.Model) -> bytes:
    """Bytes of the model, for creating an InferenceSession without touching disk."""
    return to_proto(model).SerializeToString()


def infer_shapes(model: ir.Model) -> ir.Model:
    """Run ONNX shape inference and return a new model with the inferred types and shapes."""
    proto = to_proto(model)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:
        return model
    return ir.from_proto(proto)


def infer_shapes_from_inputs(model: ir.Model) -> ir.Model:
    """A copy of ``model`` with the shapes ONNX shape inference derives from its graph inputs
    alone: the shapes it declares for its outputs and intermediate values (which an exporter may
    have got wrong) are dropped first. Where inference fails, the copy declares none."""
    proto = to_proto(model)
    del proto.graph.value_info[:]
    for value in proto.graph.output:
        if value.type.HasField("tensor_type"):
            value.type.tensor_type.ClearField("shape")
    _weights_as_inputs(proto.graph)
    try:
        return ir.from_proto(onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True))
    except Exception:  # noqa: BLE001  (onnx raises several types; the copy then declares nothing)
        return ir.from_proto(proto)


# initializers of more elements than this are passed to shape inference as typed inputs: their
# values never decide a shape (shapes are short vectors), and copying them is most of its time
_SHAPE_RELEVANT_ELEMENTS = 64


def _weights_as_inputs(graph: onnx.GraphProto) -> None:
    """Replace the large initializers of ``graph`` by graph inputs of their type and shape."""
    kept = []
    for tensor in graph.initializer:
        if int(np.prod(tensor.dims, dtype=np.int64)) > _SHAPE_RELEVANT_ELEMENTS:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            kept.append(tensor)
    if len(kept) < len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def infer_concrete_shapes(model: ir.Model, input_shapes) -> dict[str, tuple[ir.DataType, list[int]]]:
    """Dtypes and concrete shapes ONNX shape inference derives for ``model``'s values when its
    inputs have ``input_shapes`` (name -> shape); values it cannot derive are left out.
    ``model`` is not changed."""
    proto = to_proto(model)
    graph = proto.graph
    for value in graph.input:
        if value.name in input_shapes:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            for size in input_shapes[value.name]:
                dims.add().dim_value = int(size)
    del graph.value_info[:]
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:
        return {}
    found = {}
    for value in [*proto.graph.value_info, *proto.graph.output]:
        tensor = value.type.tensor_type
        if not tensor.HasField("shape") or not tensor.elem_type:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if all(d is not None for d in dims):
            found[value.name] = (ir.DataType(tensor.elem_type), dims)
    return found


def with_inferred_io_shapes(model: ir.Model, known: Mapping[str, onnx.TypeProto] | None = None) -> onnx.ModelProto:
    """``model`` as protobuf with the shapes onnx infers on its graph inputs and outputs (that
    onnx.checker requires there); inputs without a shape take theirs from ``known`` (name ->
    type) first. Where inference fails (an oversized model, an unknown op), the model as it is."""
    proto = to_proto(model)
    for value in proto.graph.input:
        if value.name in (known or {}) and not value.type.tensor_type.HasField("shape"):
            value.type.CopyFrom(known[value.name])
    try:
        return onnx.shape_inference.infer_shapes(proto)
    except Exception:  # noqa: BLE001  (a debugging aid: the model is written either way)
        return proto


def check_model(model: ir.Model) -> None:
    """Run the ONNX checker (full, with shape inference); raise ModelError on failure."""
    try:
        onnx.checker.check_model(to_proto(model), full_check=False)
    except Exception as exc:
        raise ModelError(f"generated model fails the ONNX checker: {exc}") from exc


def tensor_to_numpy(tensor: "onnx.TensorProto"):
    """The value of an ``onnx.TensorProto`` as a numpy array."""
    return onnx.numpy_helper.to_array(tensor)


def replace_initializers(model: "onnx.ModelProto", values: dict) -> None:
    """Overwrite the initializers of ``model`` named in ``values`` (same shape and dtype required)."""
    from onnxtrain.errors import CheckpointError

    by_name = {init.name: init for init in model.graph.initializer}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise CheckpointError(f"the model has no initializers named {unknown}")
    for name, value in values.items():
        current = onnx.numpy_helper.to_array(by_name[name])
        if current.shape != value.shape or current.dtype != value.dtype:
            raise CheckpointError(f"parameter {name!r} is {value.dtype}{list(value.shape)} in the checkpoint but "
                                  f"{current.dtype}{list(current.shape)} in the model")
        by_name[name].CopyFrom(onnx.numpy_helper.from_array(value, name))
