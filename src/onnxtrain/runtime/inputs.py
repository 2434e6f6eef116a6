"""Check user inputs against a session's signature before running it.

A mismatch raises InputMismatchError naming the input and what the model expects, instead
of an onnxruntime error from deep inside a kernel (or, worse, a silent broadcast).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from onnxtrain.errors import InputMismatchError
from onnxtrain.runtime.session import IOSpec


def gather_inputs(specs: Sequence[IOSpec], args: Sequence, kwargs: Mapping[str, object]) -> list:
    """Match positional and named user inputs to ``specs`` (in order); return them in spec order."""
    names = [s.name for s in specs]
    if len(args) > len(specs):
        raise InputMismatchError(f"got {len(args)} positional inputs, the model takes {len(specs)}: {names}")
    values: dict[str, object] = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names:
            raise InputMismatchError(f"unknown input {name!r}; the model's inputs are {names}")
        if name in values:
            raise InputMismatchError(f"input {name!r} was given both by position and by name")
        values[name] = value
    missing = [n for n in names if n not in values]
    if missing:
        raise InputMismatchError(f"got {len(values)} inputs, the model takes {len(specs)}: {names}; "
                                 f"missing {missing}")
    return [values[n] for n in names]


def to_ortvalues(specs: Sequence[IOSpec], values: Sequence) -> tuple[list[ort.OrtValue | np.ndarray], bool]:
    """Validate ``values`` against ``specs`` and wrap them as CPU OrtValues (numpy memory is
    shared, not copied; ORT moves them to the session's device). String inputs stay object
    arrays of str (onnxruntime's Python API makes no OrtValue of strings).

    Returns the OrtValues and whether every input already was an OrtValue (then the caller
    returns OrtValues, as upstream does).
    """
    result, all_ortvalues = [], True
    symbols: dict[str, tuple[int, str]] = {}
    for spec, value in zip(specs, values):
        if spec.type_str == "tensor(string)":
            # onnxruntime's Python API makes no OrtValue of strings: the array itself, which a
            # session's run() takes (the caller runs without IOBinding)
            all_ortvalues = False
            array = _strings(spec, value)
            _check_shape(spec, array.shape, symbols)
            result.append(array)
            continue
        if isinstance(value, ort.OrtValue):
            if spec.type_str != value.data_type():
                if value.device_name().lower() != "cpu" or not (_integer_type(value.data_type())
                                                                  and _integer_type(spec.type_str)):
                    _fail(spec, f"is an OrtValue of {value.data_type()}")
                # integers of another integer type (int64 labels, as onnxruntime-training 1.19.2's
                # artifacts took them): converted as arrays are, where every value fits
                value = ort.OrtValue.ortvalue_from_numpy(_integers_converted(spec, value.numpy()))
            _check_shape(spec, tuple(value.shape()), symbols)
            result.append(value)
            continue
        all_ortvalues = False
        array = as_input_array(spec, value)
        _check_shape(spec, array.shape, symbols)
        result.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array)))
    return result, all_ortvalues


def as_input_array(spec: IOSpec, value) -> np.ndarray:
    """``value`` as an array for the input ``spec``: its dtype, or integers of another integer
    type converted where every value fits; ``InputMismatchError`` naming the input otherwise."""
    if isinstance(value, np.ndarray) or hasattr(value, "__array__") or hasattr(value, "__dlpack__"):
        array = value if isinstance(value, np.ndarray) else np.asarray(value)  # e.g. a torch tensor
        if spec.dtype is not None and array.dtype != spec.dtype:
            return _integers_converted(spec, array)
        return array
    # Python scalars and nested lists carry no dtype of their own: the model's, where their
    # values have it (floats for a float input; integers that fit for an integer one)
    try:
        natural = np.asarray(value)
        if spec.dtype is not None and np.dtype(spec.dtype).kind in "iu" and natural.dtype.kind in "iub":
            return _integers_converted(spec, natural.astype(np.int64) if natural.dtype.kind == "b" else natural)
        if spec.dtype is not None and np.dtype(spec.dtype).kind in "iu" and natural.size:
            _fail(spec, f"holds {natural.dtype.name} values, not integers")
        return natural if spec.dtype is None else natural.astype(spec.dtype, copy=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputMismatchError(f"input {spec.name!r} cannot be converted to the model's "
                                 f"{spec.describe()}: {exc}") from exc


def _strings(spec: IOSpec, value) -> np.ndarray:
    """``value`` (an array of str, an object array of str, nested lists of str) as an object
    array of str for the string input ``spec``; ``InputMismatchError`` naming it otherwise."""
    if isinstance(value, ort.OrtValue):
        _fail(spec, f"is an OrtValue of {value.data_type()}")
    array = np.asarray(value, dtype=object) if not isinstance(value, np.ndarray) else value
    if array.dtype.kind == "U" or (array.dtype == object and all(isinstance(v, str) for v in array.flat)):
        return np.ascontiguousarray(array, dtype=object)
    _fail(spec, f"holds {array.dtype.name} values, not strings")


def _integer_type(type_str: str) -> bool:
    """Whether an onnxruntime type name (``tensor(int64)``) is an integer tensor type."""
    return type_str.startswith(("tensor(int", "tensor(uint"))


def _integers_converted(spec: IOSpec, array: np.ndarray) -> np.ndarray:
    """An integer array for an input of another integer type, converted where every value fits
    (int64 class labels for an int32 labels input, as onnxruntime-training 1.19.2's
    artifacts took, or the reverse); any other dtype mismatch is an error."""
    target = np.dtype(spec.dtype)
    if array.dtype.kind not in "iu" or target.kind not in "iu":
        _fail(spec, f"has dtype {array.dtype}")
    if not np.can_cast(array.dtype, target, "safe") and array.size:
        limits = np.iinfo(target)
        low, high = int(array.min()), int(array.max())
        if low < limits.min or high > limits.max:
            _fail(spec, f"has dtype {array.dtype} with values in [{low}, {high}], outside {target}'s range")
    return array.astype(target)


def _check_shape(spec: IOSpec, shape: tuple[int, ...], symbols: dict[str, tuple[int, str]]) -> None:
    if spec.shape is None:
        return
    if len(shape) != len(spec.shape):
        _fail(spec, f"has shape {list(shape)} (rank {len(shape)})")
    for axis, (dim, expected) in enumerate(zip(shape, spec.shape)):
        if isinstance(expected, int):
            if dim != expected:
                _fail(spec, f"has shape {list(shape)} (dim {axis} is {dim}, expected {expected})")
        elif isinstance(expected, str):
            # A named symbolic dim must take the same size in every input that uses it.
            seen = symbols.setdefault(expected, (dim, spec.name))
            if seen[0] != dim:
                _fail(spec, f"has shape {list(shape)}: dim {axis} ({expected!r}) is {dim} but input "
                            f"{seen[1]!r} gave {expected!r} = {seen[0]}")


def _fail(spec: IOSpec, what: str):
    raise InputMismatchError(f"input {spec.name!r} {what}; the model expects {spec.describe()}")
