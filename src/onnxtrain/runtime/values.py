"""OrtValue helpers: allocate on a device, wrap numpy without copying on CPU, read back."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from onnxtrain.runtime.device import Device


def from_numpy(array: np.ndarray, device: Device) -> ort.OrtValue:
    """An OrtValue holding ``array``. On CPU it shares ``array``'s memory (no copy): the caller
    must not keep writing to ``array`` unless that is the point."""
    array = np.asarray(array, order="C")
    if device.type == "cpu":
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy(array, device.type, device.id)


def owned_from_numpy(array: np.ndarray, device: Device) -> ort.OrtValue:
    """An OrtValue with its own copy of ``array``: for values handed to the user, whose
    ``.numpy()`` views must stay valid however long they live (a view of a :func:`from_numpy`
    value reads freed memory once the OrtValue is dropped: onnxruntime borrows the array)."""
    array = np.asarray(array, order="C")
    value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, device.type, device.id)
    value.update_inplace(array)
    return value


def zeros(shape, dtype, device: Device) -> ort.OrtValue:
    """A zero-filled OrtValue (ORT's own allocations are uninitialized, so start from numpy)."""
    return from_numpy(np.zeros(tuple(shape), dtype=dtype), device)


def to_numpy(value: ort.OrtValue) -> np.ndarray:
    """A numpy copy of ``value`` (on CPU ``OrtValue.numpy()`` aliases the buffer, which we reuse)."""
    return np.array(value.numpy(), copy=True)
