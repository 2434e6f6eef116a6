"""Reading onnxruntime-training's checkpoint files, so that a model trained with upstream goes on
training (or is exported) with onnxtrain.

onnxruntime-training saves a checkpoint as one flatbuffer whose file identifier (bytes 4-8) is
``ODTC`` (schema ``ort_training_checkpoint.fbs``; checked against 1.19.2's files): the trainable and frozen
parameters, optionally the optimizer state (one group, ``group0``: its step, its scheduler's
initial learning rate and each parameter's ``momentum0``/``momentum1``) and the user properties. Past
a size threshold upstream writes the tensors' bytes to ``<checkpoint>.data`` and keeps their
offsets in the flatbuffer.

:func:`read_upstream_checkpoint` turns such a file into the same
:class:`~onnxtrain.checkpoint.CheckpointData` that onnxtrain's own checkpoints give, and
:func:`onnxtrain.checkpoint.read_checkpoint` calls it when it meets one, so
``onnxtrain.api.CheckpointState.load_checkpoint`` opens both formats; saving writes onnxtrain's
format. The flatbuffer is read here directly (no generated code, no extra dependency), every
offset checked against the file's size: a truncated file or a corrupt structure raises
:class:`~onnxtrain.errors.CheckpointError` (never an IndexError or a read past the end).

Upstream's nominal checkpoints (``nominal_checkpoint=True``) store names only, without shapes,
so they cannot become a state here: generate onnxtrain's artifacts, whose nominal checkpoint
keeps the shapes.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from onnxtrain.checkpoint import CheckpointData, OptimizerRecord, ParameterRecord
from onnxtrain.errors import CheckpointError

FILE_IDENTIFIER = b"ODTC"
EXTERNAL_DATA_SUFFIX = ".data"
# Checkpoint format versions read here (1.19.2 writes 2; version 1 has the same tables, without
# the nominal and external-data flags, which then read as absent).
SUPPORTED_VERSIONS = (1, 2)
# The learning rate upstream's Optimizer resumes with, whatever the checkpoint holds.
UPSTREAM_LEARNING_RATE = 1e-3

# ONNX TensorProto element type -> numpy type (little-endian on disk), the ones a checkpoint keeps.
_ELEMENT_TYPES = {
    1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
    9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64,
}

# Field slots (declaration order) of the tables read here.
_CHECKPOINT = {"version": 0, "module_state": 1, "optimizer_groups": 2, "property_bag": 3}
_MODULE_STATE = {"requires_grad_params": 0, "frozen_params": 1, "is_nominal_state": 2, "has_external_data": 3}
_TENSOR = {"name": 0, "dims": 2, "data_type": 3, "raw_data": 4, "external_data_offset": 6}
_OPTIMIZER_GROUP = {"group_name": 0, "step": 1, "initial_learning_rate": 2, "optimizer_states": 3}
_PARAMETER_OPTIMIZER_STATE = {"param_name": 0, "momentums": 1}
_PROPERTY_BAG = {"ints": 0, "floats": 1, "strings": 2}
_PROPERTY = {"name": 0, "value": 1}


def is_upstream_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` starts like an onnxruntime-training checkpoint (``ODTC``)."""
    try:
        with open(path, "rb") as f:
            return f.read(8)[4:8] == FILE_IDENTIFIER
    except OSError:
        return False


def read_upstream_checkpoint(path: str | os.PathLike) -> CheckpointData:
    """Read onnxruntime-training's checkpoint at ``path`` (and its ``.data`` file, if any).

    Trainable parameters come first, then the frozen ones, each in the file's order; the
    optimizer state, when saved, becomes the record's step and ``momentum0``/``momentum1``
    tensors, with the learning rate upstream resumes with (its default, 0.001: the file's
    initial learning rate is its scheduler's, which upstream does not restore either); int,
    float and string properties are kept (upstream stores floats as float32).
    """
    path = Path(path)
    where = f"onnxruntime-training checkpoint {str(path)!r}"
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read(_Reader(buf, f, where), path, where)
    except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
        raise CheckpointError(f"cannot read {where}: {exc}") from exc


def _read(reader: _Reader, path: Path, where: str) -> CheckpointData:
    if reader.size < 8 or bytes(reader.buf[4:8]) != FILE_IDENTIFIER:
        raise CheckpointError(f"{where} does not start with the file identifier ODTC")
    root = reader.root()
    version = root.scalar(_CHECKPOINT["version"], "<i", 0)
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(f"{where} has checkpoint format version {version}; onnxtrain reads versions "
                              f"{', '.join(map(str, SUPPORTED_VERSIONS))} (onnxruntime-training 1.19.2 writes 2)")
    module = root.table(_CHECKPOINT["module_state"])
    if module is None:
        raise CheckpointError(f"{where} holds no module state (parameters)")
    if module.scalar(_MODULE_STATE["is_nominal_state"], "<?", False):
        raise CheckpointError(f"{where} is a nominal checkpoint: upstream's store parameter names without "
                              f"shapes or values. Generate the artifacts with onnxtrain.artifacts.generate_artifacts "
                              f"(its checkpoint, or nominal_checkpoint with the shapes), or load a complete checkpoint")
    with contextlib.ExitStack() as stack:
        external = _ExternalData(path, where, stack) \
            if module.scalar(_MODULE_STATE["has_external_data"], "<?", False) else None
        parameters: dict[str, ParameterRecord] = {}
        for field, trainable in (("requires_grad_params", True), ("frozen_params", False)):
            for table in module.tables(_MODULE_STATE[field]):
                name, value = _tensor(table, external, where)
                if name in parameters:
                    raise CheckpointError(f"{where} holds parameter {name!r} twice")
                parameters[name] = ParameterRecord(name, trainable, value.dtype, value.shape, value)
        optimizer = _optimizer(root, parameters, external, where)
    properties = _properties(root.table(_CHECKPOINT["property_bag"]), where)
    return CheckpointData(parameters, False, optimizer, properties)


def _tensor(table: _Table, external: _ExternalData | None, where: str) -> tuple[str, np.ndarray]:
    name = table.string(_TENSOR["name"])
    if not name:
        raise CheckpointError(f"{where} holds a tensor without a name")
    code = table.scalar(_TENSOR["data_type"], "<i", 0)
    dtype = _ELEMENT_TYPES.get(code)
    if dtype is None:
        raise CheckpointError(f"{where}: tensor {name!r} has element type {code} (ONNX TensorProto code), "
                              f"which an onnxtrain checkpoint cannot hold")
    dtype = np.dtype(dtype).newbyteorder("<")
    shape = tuple(int(d) for d in table.scalars(_TENSOR["dims"], "<q"))
    if any(d < 0 for d in shape):
        raise CheckpointError(f"{where}: tensor {name!r} has a negative dimension {list(shape)}")
    count = math.prod(shape)  # Python integers: a corrupt shape cannot overflow into a small size
    nbytes = count * dtype.itemsize
    offset = table.scalar(_TENSOR["external_data_offset"], "<q", -1)
    if offset >= 0:
        if external is None:
            raise CheckpointError(f"{where}: tensor {name!r} refers to external data but the checkpoint "
                                  f"says it has none")
        file, size, what = external.file, external.size, repr(str(external.path))
    else:
        offset, length = table.vector(_TENSOR["raw_data"], 1)
        if length != nbytes:
            raise CheckpointError(f"{where}: tensor {name!r} of shape {list(shape)} and type {dtype.name} needs "
                                  f"{nbytes} bytes, the file holds {length}")
        file, size, what = table.reader.file, table.reader.size, "the checkpoint"
    if offset + nbytes > size:
        raise CheckpointError(f"{where}: tensor {name!r} needs bytes {offset}-{offset + nbytes} of {what}, "
                              f"which has {size}")
    # read straight into the array (not through the mapping): a large checkpoint's bytes are in
    # memory once, as the parameters
    value = np.empty(shape, dtype=dtype.newbyteorder("="))
    file.seek(offset)
    target = memoryview(value.reshape(-1).view(np.uint8))
    if file.readinto(target) != nbytes:
        raise CheckpointError(f"{where}: tensor {name!r}: {what} ended before its bytes did")
    if dtype.newbyteorder("=") != dtype:  # a big-endian host: the file is little-endian
        value.byteswap(inplace=True)
    return name, value


def _optimizer(root: _Table, parameters: dict[str, ParameterRecord], external: _ExternalData | None,
               where: str) -> OptimizerRecord | None:
    groups = root.tables(_CHECKPOINT["optimizer_groups"])
    if not groups:
        return None
    if len(groups) > 1:
        names = [g.string(_OPTIMIZER_GROUP["group_name"]) for g in groups]
        raise CheckpointError(f"{where} holds {len(groups)} optimizer groups {names}; onnxtrain keeps one "
                              f"(upstream's Optimizer writes group0 only)")
    group = groups[0]
    # upstream keeps its scheduler's initial learning rate here and resumes at its default
    # learning rate (0.001) whatever the file says: so does this state
    record = OptimizerRecord(step=group.scalar(_OPTIMIZER_GROUP["step"], "<q", 0), learning_rate=UPSTREAM_LEARNING_RATE)
    for entry in group.tables(_OPTIMIZER_GROUP["optimizer_states"]):
        param = entry.string(_PARAMETER_OPTIMIZER_STATE["param_name"])
        if param not in parameters:
            raise CheckpointError(f"{where} holds optimizer state for {param!r}, which is not a parameter")
        if not parameters[param].requires_grad:
            raise CheckpointError(f"{where} holds optimizer state for the frozen parameter {param!r}")
        if param in record.values:
            raise CheckpointError(f"{where} holds optimizer state for {param!r} twice")
        states = {}
        for table in entry.tables(_PARAMETER_OPTIMIZER_STATE["momentums"]):
            repeated = table.string(_TENSOR["name"])
            if repeated in states:  # before reading its bytes again
                raise CheckpointError(f"{where} holds optimizer state {repeated!r} of {param!r} twice")
            state_name, value = _tensor(table, external, where)
            rec = parameters[param]
            if value.shape != rec.shape or value.dtype != rec.dtype:
                raise CheckpointError(f"{where}: optimizer state {state_name!r} of {param!r} has shape "
                                      f"{list(value.shape)} and type {value.dtype}, the parameter "
                                      f"{list(rec.shape)} and {rec.dtype}")
            states[state_name] = value
        record.values[param] = states
    names = sorted({s for states in record.values.values() for s in states})
    for param, states in record.values.items():
        if sorted(states) != names:
            raise CheckpointError(f"{where}: parameter {param!r} has optimizer states {sorted(states)}, "
                                  f"others have {names}")
    record.states = names
    return record


def _properties(bag: _Table | None, where: str) -> dict[str, int | float | str]:
    properties: dict[str, int | float | str] = {}
    if bag is None:
        return properties
    for field, read in (("ints", lambda t: t.scalar(_PROPERTY["value"], "<q", 0)),
                        ("floats", lambda t: _float32(t.scalar(_PROPERTY["value"], "<f", 0.0))),
                        ("strings", lambda t: t.string(_PROPERTY["value"]) or "")):
        for table in bag.tables(_PROPERTY_BAG[field]):
            name = table.string(_PROPERTY["name"])
            if not name:
                raise CheckpointError(f"{where} holds a property without a name")
            if name in properties:
                raise CheckpointError(f"{where} holds property {name!r} twice")
            properties[name] = read(table)
    return properties


def _float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32: upstream stores float properties
    as float32, so a saved 0.1 reads back as 0.1 (not 0.10000000149011612)."""
    return float(str(np.float32(value)))


class _ExternalData:
    """``<checkpoint>.data``: the tensors' bytes, at the offsets the flatbuffer records (open
    while ``stack`` is)."""

    def __init__(self, checkpoint: Path, where: str, stack: contextlib.ExitStack):
        self.path = Path(str(checkpoint) + EXTERNAL_DATA_SUFFIX)
        try:
            self.file = stack.enter_context(open(self.path, "rb"))  # noqa: SIM115 - the ExitStack closes it
            self.size = os.fstat(self.file.fileno()).st_size
        except OSError as exc:
            raise CheckpointError(f"{where} keeps its tensors in {str(self.path)!r}, which cannot be read: {exc}") \
                from exc


class _Reader:
    """Bounds-checked access to a flatbuffer's bytes."""

    def __init__(self, buf, file, where: str):
        self.buf = buf
        self.file = file
        self.size = len(buf)
        self.where = where

    def unpack(self, fmt: str, pos: int):
        if pos < 0 or pos + struct.calcsize(fmt) > self.size:
            raise CheckpointError(f"{self.where} is truncated or corrupt (an offset points outside the file)")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def root(self) -> _Table:
        return _Table(self, self.unpack("<I", 0))


class _Table:
    """One flatbuffer table: its fields are found through its vtable."""

    def __init__(self, reader: _Reader, pos: int):
        self.reader = reader
        self.pos = pos
        self.vtable = pos - reader.unpack("<i", pos)
        self.vtable_size = reader.unpack("<H", self.vtable)

    def _field(self, slot: int) -> int | None:
        entry = 4 + 2 * slot
        if entry + 2 > self.vtable_size:
            return None
        offset = self.reader.unpack("<H", self.vtable + entry)
        return self.pos + offset if offset else None

    def _target(self, slot: int) -> int | None:
        pos = self._field(slot)
        return None if pos is None else pos + self.reader.unpack("<I", pos)

    def scalar(self, slot: int, fmt: str, default):
        pos = self._field(slot)
        return default if pos is None else self.reader.unpack(fmt, pos)

    def table(self, slot: int) -> _Table | None:
        pos = self._target(slot)
        return None if pos is None else _Table(self.reader, pos)

    def string(self, slot: int) -> str | None:
        found = self.vector_at(self._target(slot), 1)
        if found is None:
            return None
        start, length = found
        try:
            return bytes(self.reader.buf[start:start + length]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.reader.where} holds a name that is not UTF-8: {exc}") from exc

    def vector(self, slot: int, item_size: int) -> tuple[int, int]:
        """``(start, length)`` of a vector field; ``(0, 0)`` when absent."""
        return self.vector_at(self._target(slot), item_size) or (0, 0)

    def vector_at(self, pos: int | None, item_size: int) -> tuple[int, int] | None:
        if pos is None:
            return None
        length = self.reader.unpack("<I", pos)
        start = pos + 4
        if start + length * item_size > self.reader.size:
            raise CheckpointError(f"{self.reader.where} is truncated or corrupt (a vector runs past the file's end)")
        return start, length

    def scalars(self, slot: int, fmt: str) -> list:
        size = struct.calcsize(fmt)
        start, length = self.vector(slot, size)
        return [self.reader.unpack(fmt, start + i * size) for i in range(length)]

    def tables(self, slot: int) -> list[_Table]:
        start, length = self.vector(slot, 4)
        items = []
        for i in range(length):
            pos = start + 4 * i
            items.append(_Table(self.reader, pos + self.reader.unpack("<I", pos)))
        return items
