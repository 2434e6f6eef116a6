"""Export a trained torch module, called with named tensors, as a plain ONNX inference model.

The graph takes the call's tensors as inputs (named as the keywords) and returns the
module's output tensors (named as the fields of a Hugging Face ``ModelOutput``, or
``output_<i>``); the weights are initializers. Every dim is exported as
``torch.export.Dim.AUTO``, so batch size and sequence length stay dynamic where the
model allows it; a model that cannot be captured with dynamic dims for this sample (a
length-1 sample through transformers' attention) is exported with the sample's shapes, with
a warning. The result runs in a stock ``onnxruntime.InferenceSession``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch

from onnxtrain.errors import ExportError, InputMismatchError
from onnxtrain.ir import io
from onnxtrain.torch._export import export_failure, quiet_exporter
from onnxtrain.torch._exporter import as_onnx_export, attention_outputs_contiguous, contiguous_as_clone

logger = logging.getLogger(__name__)


def _output_tensors(out) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors of a forward's result (ModelOutput / dict, tuple, or one tensor)."""
    if isinstance(out, torch.Tensor):
        return ["output_0"], [out]
    if isinstance(out, Mapping):
        pairs = [(k, v) for k, v in out.items() if isinstance(v, torch.Tensor)]
        return [k for k, _ in pairs], [v for _, v in pairs]
    if isinstance(out, Sequence):
        tensors = [v for v in out if isinstance(v, torch.Tensor)]
        return [f"output_{i}" for i in range(len(tensors))], tensors
    raise ExportError(f"cannot export a module whose forward returns {type(out).__name__}; "
                      "expected a tensor, a tuple of tensors or a ModelOutput/dict")


def _capture(module: torch.nn.Module, tensors: tuple, dynamic) -> torch.export.ExportedProgram:
    """The exporter's capture (non-strict ``torch.export``), with each ``contiguous`` a clone:
    the exporter's own decomposition of it drops the copy in Hugging Face T5's attention."""
    program = as_onnx_export(lambda: torch.export.export(module, tensors, dynamic_shapes=dynamic, strict=False))
    contiguous_as_clone(program)
    attention_outputs_contiguous(program)
    return program


class _KeywordCall(torch.nn.Module):
    """Calls ``module(**dict(zip(names, tensors)))`` and returns its output tensors as a tuple."""

    def __init__(self, module: torch.nn.Module, names: Sequence[str]):
        super().__init__()
        self.module = module
        self.names = list(names)

    def forward(self, *tensors):
        return tuple(_output_tensors(self.module(**dict(zip(self.names, tensors))))[1])


def export_inference_onnx(module: torch.nn.Module, inputs: Mapping[str, torch.Tensor],
                          path: str | os.PathLike, *, optimize: bool = True) -> list[str]:
    """Export ``module(**inputs)`` in eval mode to ``path``; return the output names.

    ``inputs`` is a sample call (its shapes seed the export; dims stay dynamic where the model
    allows). ``optimize`` runs the exporter's graph optimizer (constant folding, fusions; about
    half the export time on MiniLM); ONNX Runtime optimizes the graph again when it loads it.
    The module's train/eval mode is restored afterwards. Raises ``InputMismatchError``
    for inputs that are not tensors and ``ExportError`` if ``torch.onnx.export`` fails or an
    output has an input's name.

    Example:
        >>> names = export_inference_onnx(model, {"input_ids": ids, "attention_mask": mask}, "model.onnx")
        >>> session = onnxruntime.InferenceSession("model.onnx")
        >>> logits = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    """
    bad = [k for k, v in inputs.items() if not isinstance(v, torch.Tensor)]
    if not inputs or bad:
        raise InputMismatchError(f"export needs a non-empty mapping of input name -> torch.Tensor; "
                                 f"not tensors: {bad}")
    names = list(inputs)
    tensors = tuple(inputs[n] for n in names)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            output_names, _ = _output_tensors(module(**inputs))
        clashing = [n for n in output_names if n in inputs]
        if clashing:  # an ONNX graph defines each name once
            raise ExportError(f"{type(module).__name__}'s outputs {clashing} have the names of inputs; an ONNX model "
                              f"names every value once: rename the inputs or the outputs")
        call = _KeywordCall(module, names)
        dynamic = tuple({d: torch.export.Dim.AUTO for d in range(t.dim())} for t in tensors)
        with quiet_exporter():
            try:
                captured = _capture(call, tensors, (dynamic,))
            except Exception as exc:  # noqa: BLE001  (the capture raises many types)
                logger.warning("exporting %s with dynamic dims failed (%s: %s); exporting it with the sample's "
                               "shapes %s", type(module).__name__, type(exc).__name__, str(exc).splitlines()[0][:200],
                               [list(t.shape) for t in tensors])
                captured = _capture(call, tensors, None)
            program = torch.onnx.export(captured, (), dynamo=True, verbose=False, optimize=optimize,
                                        input_names=names, output_names=output_names)
    except ExportError:
        raise
    except Exception as exc:  # the exporter raises many types; the reason is in the message
        raise export_failure(f"torch.onnx.export could not export {type(module).__name__} for inference",
                             exc) from exc
    finally:
        module.train(was_training)
    io.save_model(program.model, path)
    return output_names
