"""Session plumbing shared by the on-device API: devices and providers, sessions, OrtValues.

Everything here is a thin, typed layer over a stock ``onnxruntime.InferenceSession``.
"""

from onnxtrain.runtime.device import Device, parse_device, providers_for
from onnxtrain.runtime.session import IOSpec, create_session, input_specs, output_specs
from onnxtrain.runtime.values import from_numpy, to_numpy, zeros

__all__ = [
    "Device", "parse_device", "providers_for",
    "IOSpec", "create_session", "input_specs", "output_specs",
    "from_numpy", "to_numpy", "zeros",
]
