"""onnxruntime-training checkpoints (ODTC flatbuffers) with their tensors in ``<checkpoint>.data``,
built in upstream's layout with the flatbuffers package (onnxruntime's dependency): each tensor
not kept inline at an absolute offset of the data file, aligned to its element size, dims and
type in the flatbuffer, raw_data absent (what onnxruntime-training 1.19.2 writes past ~1.8 GB).
Used by tests/test_upstream_checkpoint.py and the JavaScript fixtures (tests/js/fixtures.py).
"""

from __future__ import annotations

import numpy as np


# ONNX TensorProto element type codes
_CODES = {np.dtype(np.float32): 1, np.dtype(np.int8): 3, np.dtype(np.int64): 7, np.dtype(np.bool_): 9,
          np.dtype(np.float16): 10, np.dtype(np.float64): 11}


def odtc_bytes(trainable: dict, frozen: dict, inline: set[str]) -> tuple[bytes, bytes]:
    """An ODTC checkpoint (version 2) and its .data bytes: tensors not in ``inline`` go to the
    data file in order, each aligned to its element size."""
    import flatbuffers

    data = bytearray()
    offsets = {}
    for name, array in [*trainable.items(), *frozen.items()]:
        if name not in inline:
            data += bytes(-len(data) % array.dtype.itemsize)
            offsets[name] = len(data)
            data += array.astype(array.dtype.newbyteorder("<")).tobytes()
    b = flatbuffers.Builder(1024)

    def tensor(name, array):
        name_offset = b.CreateString(name)
        b.StartVector(8, array.ndim, 8)
        for d in reversed(array.shape):
            b.PrependInt64(d)
        dims = _end_vector(b, array.ndim)
        raw = b.CreateByteVector(array.tobytes()) if name in inline else None
        b.StartObject(7)
        b.PrependUOffsetTRelativeSlot(0, name_offset, 0)
        b.PrependUOffsetTRelativeSlot(2, dims, 0)
        b.PrependInt32Slot(3, _CODES[array.dtype], 0)
        if raw is not None:
            b.PrependUOffsetTRelativeSlot(4, raw, 0)
        else:
            b.PrependInt64Slot(6, offsets[name], -1)
        return b.EndObject()

    def table_vector(items):
        b.StartVector(4, len(items), 4)
        for item in reversed(items):
            b.PrependUOffsetTRelative(item)
        return _end_vector(b, len(items))

    requires_grad = table_vector([tensor(n, a) for n, a in trainable.items()])
    frozen_params = table_vector([tensor(n, a) for n, a in frozen.items()])
    b.StartObject(4)
    b.PrependUOffsetTRelativeSlot(0, requires_grad, 0)
    b.PrependUOffsetTRelativeSlot(1, frozen_params, 0)
    b.PrependBoolSlot(3, True, False)
    module_state = b.EndObject()
    b.StartObject(4)
    b.PrependInt32Slot(0, 2, 0)
    b.PrependUOffsetTRelativeSlot(1, module_state, 0)
    b.Finish(b.EndObject(), file_identifier=b"ODTC")
    return bytes(b.Output()), bytes(data)


def _end_vector(builder, count: int):
    try:
        return builder.EndVector()  # flatbuffers >= 2
    except TypeError:
        return builder.EndVector(count)


def external_fixture() -> tuple[dict, dict]:
    """Trainable and frozen tensors of six element types, so that the data file needs padding
    before the float64 (after int8) and exercises every alignment."""
    rng = np.random.default_rng(3)
    trainable = {"w": rng.standard_normal((5, 7)).astype(np.float32), "b": np.arange(3, dtype=np.float32),
                 "codes": np.arange(-2, 3, dtype=np.int8), "scale": rng.standard_normal(3)}
    frozen = {"ids": np.array([[1, 2**40], [-3, 4]], np.int64), "tail": rng.standard_normal((2, 9)).astype(np.float32),
              "half": np.array([[0.5, -2.0], [65504.0, 1e-3]], np.float16), "mask": np.array([True, False, True])}
    return trainable, frozen


def repeated_momentum_bytes(value: np.ndarray, references: int) -> bytes:
    """An ODTC checkpoint with one trainable float32 parameter ``w`` (inline) whose optimizer
    ``momentums`` vector points ``references`` times at one ``momentum0`` tensor table: a file
    a few bytes long per reference that a reader must refuse before re-reading the tensor."""
    import flatbuffers

    b = flatbuffers.Builder(1024)

    def tensor(name: str, array: np.ndarray) -> int:
        name_offset, raw = b.CreateString(name), b.CreateByteVector(array.astype("<f4").tobytes())
        b.StartVector(8, array.ndim, 8)
        for d in reversed(array.shape):
            b.PrependInt64(d)
        dims = _end_vector(b, array.ndim)
        b.StartObject(7)
        b.PrependUOffsetTRelativeSlot(0, name_offset, 0)
        b.PrependUOffsetTRelativeSlot(2, dims, 0)
        b.PrependInt32Slot(3, _CODES[np.dtype(np.float32)], 0)
        b.PrependUOffsetTRelativeSlot(4, raw, 0)
        return b.EndObject()

    def tables(items: list[int]) -> int:
        b.StartVector(4, len(items), 4)
        for item in reversed(items):
            b.PrependUOffsetTRelative(item)
        return _end_vector(b, len(items))

    parameter = tensor("w", value)
    momentums = tables([tensor("momentum0", np.zeros_like(value))] * references)
    param_name = b.CreateString("w")
    b.StartObject(2)
    b.PrependUOffsetTRelativeSlot(0, param_name, 0)
    b.PrependUOffsetTRelativeSlot(1, momentums, 0)
    states = tables([b.EndObject()])
    group_name = b.CreateString("group0")
    b.StartObject(4)
    b.PrependUOffsetTRelativeSlot(0, group_name, 0)
    b.PrependInt64Slot(1, 1, 0)
    b.PrependFloat32Slot(2, 0.001, 0.0)
    b.PrependUOffsetTRelativeSlot(3, states, 0)
    groups = tables([b.EndObject()])
    trainable = tables([parameter])
    b.StartObject(4)
    b.PrependUOffsetTRelativeSlot(0, trainable, 0)
    module_state = b.EndObject()
    b.StartObject(4)
    b.PrependInt32Slot(0, 2, 0)
    b.PrependUOffsetTRelativeSlot(1, module_state, 0)
    b.PrependUOffsetTRelativeSlot(2, groups, 0)
    b.Finish(b.EndObject(), file_identifier=b"ODTC")
    return bytes(b.Output())
