"""Window functions (``torch.hamming_window``, ``hann_window``, ...) built inside a forward.

torchlib writes ``hamming_window`` as ONNX ``HammingWindow``, whose coefficients are 25/46 and
21/46 where PyTorch's are 0.54 and 0.46: the window was 0.007 off, and every ``torch.stft`` with
it ~0.03. Its other forms (``periodic=False``, custom alpha/beta) and ``bartlett_window`` and
``kaiser_window`` did not export at all (ORTModule ran the module in PyTorch). A window's length
is a Python int in the trace, so the window is a constant: these translations compute it with
PyTorch itself, in the requested type, at export time (bit-identical to eager's).
"""

from __future__ import annotations

import functools

import onnx_ir as ir
from onnxscript import opset18 as op

# ONNX element types of the floating dtypes a window can take
_TORCH_DTYPES = {1: "float32", 11: "float64", 10: "float16", 16: "bfloat16"}


def _constant(make, window_length, dtype):
    """The window ``make(torch_dtype)`` computes, as a Constant of ONNX element type ``dtype``."""
    import torch

    if not isinstance(window_length, int):
        raise NotImplementedError("a window function of a length known only at run time")
    element_type = ir.DataType(1 if dtype in (None, -1) else int(dtype))
    name = _TORCH_DTYPES.get(element_type.value)
    if name is None:
        raise NotImplementedError(f"a window function of element type {element_type.name}")
    window = make(getattr(torch, name))
    # numpy has no bfloat16: through float32, exact for a bfloat16 value
    values = window.float().numpy().astype(element_type.numpy()) if name == "bfloat16" else window.numpy()
    return op.Constant(value=ir.tensor(values))


def hamming_window(window_length, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten.hamming_window``: PyTorch's window (alpha 0.54, beta 0.46), a constant."""
    import torch
    return _constant(lambda t: torch.hamming_window(window_length, dtype=t), window_length, dtype)


def hamming_window_periodic(window_length, periodic, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten.hamming_window.periodic``: as :func:`hamming_window`."""
    import torch
    return _constant(lambda t: torch.hamming_window(window_length, periodic, dtype=t), window_length, dtype)


def hamming_window_periodic_alpha(window_length, periodic, alpha, dtype=None, layout=None, device=None,
                                  pin_memory=None):
    """``aten.hamming_window.periodic_alpha``: as :func:`hamming_window`."""
    import torch
    return _constant(lambda t: torch.hamming_window(window_length, periodic, alpha, dtype=t), window_length, dtype)


def hamming_window_periodic_alpha_beta(window_length, periodic, alpha, beta, dtype=None, layout=None,
                                       device=None, pin_memory=None):
    """``aten.hamming_window.periodic_alpha_beta``: as :func:`hamming_window`."""
    import torch
    return _constant(lambda t: torch.hamming_window(window_length, periodic, alpha, beta, dtype=t),
                     window_length, dtype)


def kaiser_window_beta(window_length, periodic, beta, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten.kaiser_window.beta``: PyTorch's window, a constant."""
    import torch
    return _constant(lambda t: torch.kaiser_window(window_length, periodic, beta, dtype=t), window_length, dtype)


@functools.cache  # the same functions in every table (a registry compares them)
def _simple(function_name: str):
    """Translations of ``aten.<function_name>`` (default and periodic overloads)."""
    import torch
    function = getattr(torch, function_name)

    def default(window_length, dtype=None, layout=None, device=None, pin_memory=None):
        return _constant(lambda t: function(window_length, dtype=t), window_length, dtype)

    def periodic_form(window_length, periodic, dtype=None, layout=None, device=None, pin_memory=None):
        return _constant(lambda t: function(window_length, periodic, dtype=t), window_length, dtype)

    default.__doc__ = f"``aten.{function_name}``: PyTorch's window, a constant."
    periodic_form.__doc__ = f"``aten.{function_name}.periodic``: PyTorch's window, a constant."
    return default, periodic_form


def translations() -> dict:
    """This module's entries of the exporter's ``custom_translation_table``."""
    import torch

    aten = torch.ops.aten
    table = {
        aten.hamming_window.default: hamming_window,
        aten.hamming_window.periodic: hamming_window_periodic,
        aten.hamming_window.periodic_alpha: hamming_window_periodic_alpha,
        aten.hamming_window.periodic_alpha_beta: hamming_window_periodic_alpha_beta,
        aten.kaiser_window.beta: kaiser_window_beta,
    }
    for name in ("hann_window", "blackman_window", "bartlett_window", "kaiser_window"):
        default, periodic_form = _simple(name)
        table[getattr(aten, name).default] = default
        table[getattr(aten, name).periodic] = periodic_form
    return table
