"""The checkpoint file: safetensors tensors plus JSON metadata, written atomically.

Format (docs/artifacts.md): one safetensors file. Tensors are ``param/<name>`` for
each parameter and ``optimizer/<param>/<state>`` for optimizer state; the header
metadata holds ``format`` = ``onnxtrain.checkpoint``, ``version`` = ``1`` and ``state``,
a JSON object with the parameter list (name, requires_grad, dtype, shape), ``nominal``,
the optional ``optimizer`` section (step, learning_rate, states) and ``properties`` (an inf or
nan float is null there, and its value, ``"inf"``, ``"-inf"`` or ``"nan"``, is in
``nonfinite_properties``: JSON has no such numbers).

Public functions:

``write_checkpoint(path, parameters, requires_grad, nominal=False, *, properties=None, optimizer=None)``
    What the artifact generator calls. ``parameters`` maps name -> array (numpy, or anything
    ``np.asarray`` accepts such as an ``onnx_ir`` tensor; when ``nominal`` any object with
    ``shape`` and ``dtype``), in the order the checkpoint keeps;
    ``requires_grad`` is the set of trainable names; ``optimizer`` an :class:`OptimizerRecord`.

``save_checkpoint_data(path, data)`` / ``read_checkpoint(path) -> CheckpointData``
    The full record, used by ``onnxtrain.api.CheckpointState``.

Writes go to a temporary file in the destination folder, which is flushed and fsynced
and then renamed over the destination (``os.replace``), so a crash mid-write leaves the
previous checkpoint intact. Every read problem (missing file, truncated or garbage bytes,
wrong format tag, inconsistent metadata) raises :class:`~onnxtrain.errors.CheckpointError`.

Example:
    >>> import numpy as np, tempfile, os
    >>> from onnxtrain.checkpoint import read_checkpoint, write_checkpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "checkpoint")
    >>> write_checkpoint(path, {"w": np.ones((2, 3), np.float32)}, requires_grad={"w"})
    >>> data = read_checkpoint(path)
    >>> data.parameters["w"].value.shape, data.parameters["w"].requires_grad
    ((2, 3), True)
"""

from __future__ import annotations

import json
import math
import os
import secrets
import stat
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxtrain.errors import CheckpointError
from onnxtrain.paths import unreadable_file

FORMAT = "onnxtrain.checkpoint"
VERSION = 1
PARAM_PREFIX = "param/"
OPTIMIZER_PREFIX = "optimizer/"

# Tensor bytes are written in slices of this size: bounded syscall sizes, and a natural
# point at which an interrupted write stops (the atomic-write tests simulate that).
WRITE_CHUNK_BYTES = 64 * 1024 * 1024

# How an inf or nan float property is written in "nonfinite_properties" (Python's repr).
_NONFINITE = frozenset({"inf", "-inf", "nan"})

# numpy dtype name <-> safetensors dtype tag (little-endian on disk).
_SAFETENSORS_DTYPES = {
    "float16": "F16", "float32": "F32", "float64": "F64",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "bool": "BOOL",
}



@dataclass
class ParameterRecord:
    """One parameter: name, trainability, element type, shape and (unless nominal) value."""

    name: str
    requires_grad: bool
    dtype: np.dtype
    shape: tuple[int, ...]
    value: np.ndarray | None = None


@dataclass
class OptimizerRecord:
    """Optimizer state: update count, learning rate and per-parameter state tensors.

    ``values[param][state]`` is the tensor of state ``state`` (e.g. ``momentum0``) of ``param``.
    """

    step: int = 0
    learning_rate: float = 1e-3
    states: list[str] = field(default_factory=list)
    values: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


@dataclass
class CheckpointData:
    """Everything a checkpoint file holds."""

    parameters: dict[str, ParameterRecord]
    nominal: bool = False
    optimizer: OptimizerRecord | None = None
    properties: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- writing

def write_checkpoint(path: str | os.PathLike, parameters: Mapping[str, Any], requires_grad: Iterable[str],
                     nominal: bool = False, *, properties: Mapping[str, Any] | None = None,
                     optimizer: OptimizerRecord | None = None) -> None:
    """Write a checkpoint for ``parameters`` (name -> array, in order) atomically to ``path``.

    ``requires_grad`` names the trainable parameters (each must be in ``parameters``).
    With ``nominal=True`` only names, shapes and dtypes are stored.
    """
    trainable = set(requires_grad)
    unknown = sorted(trainable - set(parameters))
    if unknown:
        raise CheckpointError(f"requires_grad names parameters that are not in the checkpoint: {unknown}")
    records = {}
    for name, value in parameters.items():
        if nominal:
            dtype, shape, array = _numpy_dtype(value), tuple(int(d) for d in value.shape), None
        else:
            array = np.asarray(value)
            dtype, shape = array.dtype, array.shape
        records[name] = ParameterRecord(name, name in trainable, dtype, shape, array)
    save_checkpoint_data(path, CheckpointData(records, nominal, optimizer, dict(properties or {})))


def save_checkpoint_data(path: str | os.PathLike, data: CheckpointData) -> None:
    """Serialize ``data`` to ``path`` atomically (see the module docstring)."""
    tensors: list[tuple[str, np.ndarray]] = []
    params_meta = []
    for name, rec in data.parameters.items():
        dtype = np.dtype(rec.dtype)
        _safetensors_dtype(dtype, f"parameter {name!r}")
        params_meta.append({"name": name, "requires_grad": bool(rec.requires_grad), "dtype": dtype.name,
                            "shape": [int(d) for d in rec.shape]})
        if data.nominal:
            continue
        if rec.value is None:
            raise CheckpointError(f"parameter {name!r} has no value; save it as a nominal checkpoint instead")
        value = np.asarray(rec.value)
        if value.shape != tuple(rec.shape) or value.dtype != dtype:
            raise CheckpointError(f"parameter {name!r}: value has shape {list(value.shape)} and dtype "
                                  f"{value.dtype}, the record says {list(rec.shape)} and {dtype}")
        tensors.append((PARAM_PREFIX + name, value))
    state: dict[str, Any] = {"parameters": params_meta, "nominal": bool(data.nominal)}
    if data.optimizer is not None:
        opt = data.optimizer
        state["optimizer"] = {"step": int(opt.step), "learning_rate": float(opt.learning_rate),
                              "states": list(opt.states)}
        for param, per_state in opt.values.items():
            for state_name, value in per_state.items():
                tensors.append((f"{OPTIMIZER_PREFIX}{param}/{state_name}", np.asarray(value)))
    properties = {k: _check_property(k, v) for k, v in data.properties.items()}
    # JSON has no inf or nan: such a float is null in "properties" (keeping the order) and its
    # value, as text, in "nonfinite_properties"
    nonfinite = {k: repr(v) for k, v in properties.items() if isinstance(v, float) and not math.isfinite(v)}
    state["properties"] = {k: None if k in nonfinite else v for k, v in properties.items()}
    if nonfinite:
        state["nonfinite_properties"] = nonfinite
    metadata = {"format": FORMAT, "version": str(VERSION), "state": json.dumps(state, allow_nan=False)}
    _atomic_write(Path(path), lambda f: _write_safetensors(f, tensors, metadata))


def _check_property(name: str, value: Any) -> int | float | str:
    """Properties are int, float or str (as upstream); numpy scalars are converted."""
    if isinstance(value, (bool, np.bool_)):
        raise CheckpointError(f"property {name!r}: bool is not a property type (use int, float or str)")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    raise CheckpointError(f"property {name!r} must be int, float or str, got {type(value).__name__}")


def check_storable(parameters: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming the first of ``parameters`` (name -> array or onnx_ir value)
    whose element type a checkpoint cannot store."""
    for name, value in parameters.items():
        _safetensors_dtype(_numpy_dtype(value), f"parameter {name!r}")


def _numpy_dtype(value) -> np.dtype:
    """The numpy element type of an array or of an onnx_ir value (whose ``dtype`` is a DataType)."""
    return np.dtype(value.dtype.numpy() if hasattr(value.dtype, "numpy") else value.dtype)


def _safetensors_dtype(dtype: np.dtype, what: str) -> str:
    tag = _SAFETENSORS_DTYPES.get(np.dtype(dtype).name)
    if tag is None:
        raise CheckpointError(f"{what}: dtype {dtype} cannot be stored in a checkpoint "
                              f"(supported: {', '.join(_SAFETENSORS_DTYPES)})")
    return tag


def _write_safetensors(f, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """Stream a safetensors file: 8-byte header length, JSON header, then the raw tensor bytes.

    Written by hand (not ``safetensors.numpy.save``) so that tensors go to disk one by one
    instead of being assembled into one bytes object first; ``safetensors`` reads it back.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    arrays = []
    offset = 0
    for key, value in tensors:
        tag = _safetensors_dtype(value.dtype, f"tensor {key!r}")
        array = np.asarray(value, dtype=value.dtype.newbyteorder("<"), order="C")  # keeps 0-d shapes
        header[key] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the format pads the header with spaces to 8-byte alignment
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for array in arrays:
        _write_chunks(f, array.reshape(-1).view(np.uint8))


def _write_chunks(f, data: np.ndarray) -> None:
    for start in range(0, data.size, WRITE_CHUNK_BYTES):
        f.write(memoryview(data[start:start + WRITE_CHUNK_BYTES]))


def _atomic_write(path: Path, write) -> None:
    if path.is_symlink():  # write the file it names (the rename would replace the link itself)
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is a directory; give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # created as open() creates files (mode 0666 less the umask), not mkstemp's 0600; a file
        # written over keeps its mode
        tmp = folder / f".{path.name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):  # a full disk, a failed fsync: the old checkpoint is intact
            raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {exc}") from exc
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable too (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading

def read_checkpoint(path: str | os.PathLike) -> CheckpointData:
    """Read and validate the checkpoint at ``path``; raise CheckpointError if it is unusable.

    A checkpoint onnxruntime-training saved (file identifier ``ODTC``) is read too
    (:mod:`onnxtrain.upstream_checkpoint`)."""
    from safetensors import safe_open

    path = Path(path)
    problem = unreadable_file(path)
    if problem:
        raise CheckpointError(f"checkpoint {str(path)!r} {problem}, expected a checkpoint file")
    from onnxtrain import upstream_checkpoint

    if upstream_checkpoint.is_upstream_checkpoint(path):
        return upstream_checkpoint.read_upstream_checkpoint(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            keys = set(f.keys())
            _check_header(path, metadata)
            state = _parse_state(path, metadata["state"])
            tensors = {key: f.get_tensor(key) for key in keys}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error type and OSError/ValueError
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or not a safetensors file: {exc}") from exc
    return _build(path, state, tensors)


def _check_header(path: Path, metadata: Mapping[str, str]) -> None:
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is a safetensors file but not an onnxtrain checkpoint "
                              f"(metadata format={metadata.get('format')!r}, expected {FORMAT!r})")
    try:
        version = int(metadata.get("version", ""))
    except ValueError:
        version = None
    if version != VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {metadata.get('version')!r}; "
                              f"this onnxtrain reads version {VERSION}")
    if "state" not in metadata:
        raise CheckpointError(f"checkpoint {str(path)!r} has no 'state' metadata")


def _parse_state(path: Path, text: str) -> dict:
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: the 'state' metadata is not valid JSON: {exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("parameters"), list):
        raise CheckpointError(f"checkpoint {str(path)!r}: the 'state' metadata has no parameter list")
    return state


def _build(path: Path, state: dict, tensors: dict[str, np.ndarray]) -> CheckpointData:
    where = f"checkpoint {str(path)!r}"
    nominal = bool(state.get("nominal", False))
    params: dict[str, ParameterRecord] = {}
    try:
        for entry in state["parameters"]:
            name, requires_grad, dtype, shape = entry["name"], entry["requires_grad"], entry["dtype"], entry["shape"]
            if not isinstance(name, str) or not isinstance(requires_grad, bool) or dtype not in _SAFETENSORS_DTYPES \
                    or not isinstance(shape, list) or not all(_is_count(d) for d in shape):
                raise CheckpointError(f"{where}: malformed parameter entry in the metadata: {_short(entry)} (expected "
                                      f"a str name, a bool requires_grad, one of the dtypes {list(_SAFETENSORS_DTYPES)} "
                                      f"and a list of dims >= 0)")
            if name in params:
                raise CheckpointError(f"{where} lists parameter {name!r} twice")
            params[name] = ParameterRecord(name, requires_grad, np.dtype(dtype), tuple(shape))
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}: malformed parameter entry in the metadata: {exc!r}") from exc

    used = set()
    if not nominal:
        for name, rec in params.items():
            key = PARAM_PREFIX + name
            if key not in tensors:
                raise CheckpointError(f"{where} lists parameter {name!r} but holds no tensor {key!r}")
            rec.value = _checked(where, key, tensors[key], rec.shape, rec.dtype)
            used.add(key)

    optimizer = None
    if state.get("optimizer") is not None:
        opt = state["optimizer"]
        try:
            step, learning_rate, states = opt["step"], opt["learning_rate"], opt["states"]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{where}: malformed optimizer metadata: {exc!r}") from exc
        if not _is_count(step) or isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) \
                or not math.isfinite(learning_rate) or learning_rate < 0 or not isinstance(states, list) \
                or not all(isinstance(n, str) for n in states) or len(set(states)) != len(states):
            raise CheckpointError(f"{where}: malformed optimizer metadata: {_short(opt)} (expected an int step >= 0, "
                                  f"a finite learning_rate >= 0 and a list of distinct state names)")
        optimizer = OptimizerRecord(step, float(learning_rate), list(states))
        for key in tensors:
            if not key.startswith(OPTIMIZER_PREFIX):
                continue
            param, _, state_name = key[len(OPTIMIZER_PREFIX):].rpartition("/")
            if param not in params or state_name not in optimizer.states:
                raise CheckpointError(f"{where} holds optimizer tensor {key!r} for an unknown parameter or state")
            rec = params[param]
            optimizer.values.setdefault(param, {})[state_name] = _checked(
                where, key, tensors[key], rec.shape, rec.dtype)
            used.add(key)
        for param, per_state in optimizer.values.items():
            missing = [s for s in optimizer.states if s not in per_state]
            if missing:
                raise CheckpointError(f"{where}: optimizer state {missing} of parameter {param!r} is missing")
        if optimizer.step > 0 and optimizer.states and not optimizer.values:
            raise CheckpointError(f"{where}: the optimizer took {optimizer.step} steps with states {optimizer.states}, "
                                  f"but the checkpoint holds none of their tensors")

    extra = sorted(set(tensors) - used)
    if extra:
        raise CheckpointError(f"{where} holds tensors its metadata does not describe: {extra[:8]}")
    properties = state.get("properties") or {}
    nonfinite = state.get("nonfinite_properties") or {}
    if not isinstance(properties, dict) or not isinstance(nonfinite, dict):
        raise CheckpointError(f"{where}: 'properties' and 'nonfinite_properties' must be JSON objects")
    properties = dict(properties)
    for name, text in nonfinite.items():
        if properties.get(name, 0) is not None or text not in _NONFINITE:
            raise CheckpointError(f"{where}: nonfinite property {name!r} = {text!r} is not one of {sorted(_NONFINITE)} "
                                  f"with a null in 'properties'")
        properties[name] = float(text)
    missing = [name for name, value in properties.items() if value is None]
    if missing:
        raise CheckpointError(f"{where}: properties {missing} are null without a nonfinite value")
    wrong = [name for name, value in properties.items()
             if isinstance(value, bool) or not isinstance(value, (int, float, str))
             or (isinstance(value, float) and not math.isfinite(value) and name not in nonfinite)]
    if wrong:
        raise CheckpointError(f"{where}: properties {wrong[:8]} are not int, float or str values")
    return CheckpointData(params, nominal, optimizer, properties)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(entry) -> str:
    text = repr(entry)
    return text if len(text) <= 200 else text[:200] + "..."


def _checked(where: str, key: str, value: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise CheckpointError(f"{where}: tensor {key!r} has shape {list(value.shape)} and dtype {value.dtype}, "
                              f"the metadata says {list(shape)} and {dtype}")
    return value
