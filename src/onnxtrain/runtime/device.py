"""Device strings (``"cpu"``, ``"cuda"``, ``"cuda:1"``) and the execution providers they imply."""

from __future__ import annotations

from dataclasses import dataclass

import onnxruntime as ort

# device type -> (execution provider, OrtValue device name); names as onnxruntime spells them.
_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "dml": "DmlExecutionProvider",
}


@dataclass(frozen=True)
class Device:
    """Where parameters, gradients and optimizer state live (``type`` as OrtValue names it)."""

    type: str = "cpu"
    id: int = 0

    def __str__(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:{self.id}"


def parse_device(device: str | Device) -> Device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:<id>"`` (upstream's ``Module(device=...)`` strings)."""
    if isinstance(device, Device):
        return device
    kind, _, index = str(device).strip().lower().partition(":")
    if kind not in _PROVIDERS:
        raise ValueError(f"unknown device {device!r}; expected one of {sorted(_PROVIDERS)} (optionally ':<id>')")
    try:
        return Device(kind, int(index) if index else 0)
    except ValueError:
        raise ValueError(f"device {device!r}: the part after ':' must be a device index") from None


def providers_for(device: Device, providers: list | None = None) -> list:
    """The provider list for a session on ``device``: the user's list if given, else the device's
    provider (with its device id) followed by the CPU provider for ops it lacks."""
    if providers is not None:
        return list(providers)
    if device.type == "cpu":
        return [_PROVIDERS["cpu"]]
    name = _PROVIDERS[device.type]
    if name not in ort.get_available_providers():
        raise ValueError(f"device {device} needs {name}, which this onnxruntime build does not provide "
                         f"(available: {ort.get_available_providers()})")
    return [(name, {"device_id": device.id}), _PROVIDERS["cpu"]]
