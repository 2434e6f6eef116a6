"""Typed exceptions raised by onnxtrain.

Every error names the thing that was wrong and what was expected, so that a
user can fix the input without reading onnxtrain's source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class OnnxTrainError(Exception):
    """Base class of every error onnxtrain raises on purpose."""


class UnsupportedOpError(OnnxTrainError):
    """One or more ops on the path to the loss have no gradient rule.

    ``unsupported`` maps ``"domain::OpType"`` (domain empty for the default
    domain) to the names of the nodes that use it; all of them are reported at
    once so a user sees the whole list in one run.
    """

    def __init__(self, unsupported: Mapping[str, Sequence[str]], reason: str | None = None):
        self.unsupported = {op: list(nodes) for op, nodes in unsupported.items()}
        self.reason = reason
        lines = [
            f"  {op}: {len(nodes)} node(s): {', '.join(nodes[:8])}{' ...' if len(nodes) > 8 else ''}"
            for op, nodes in sorted(self.unsupported.items())
        ]
        if reason is None:
            head = f"no gradient rule for {len(self.unsupported)} op type(s) on the path to the loss:\n"
        else:
            head = f"the gradient rule cannot handle this use of the op ({reason}):\n"
        super().__init__(head + "\n".join(lines))


class InputMismatchError(OnnxTrainError, ValueError):
    """A user input does not match what the model expects (count, name, shape, dtype)."""


class CheckpointError(OnnxTrainError):
    """A checkpoint is missing, corrupt, or does not match the model."""


class ArtifactError(OnnxTrainError, ValueError, RuntimeError):
    """The arguments to artifact generation are inconsistent with the model (a ``RuntimeError``
    too: upstream's ``generate_artifacts`` and onnxblock raised that for the same misuse)."""


class ModelError(OnnxTrainError, ValueError):
    """The ONNX model itself is invalid or uses something onnxtrain cannot handle."""


class GradientCheckError(OnnxTrainError, AssertionError):
    """Analytic and numerical gradients disagree (raised by ``check_gradients``)."""


class RunError(OnnxTrainError, RuntimeError):
    """onnxruntime failed a run of a model onnxtrain made (a training step, an ORTModule call):
    an input value it cannot take, such as an index out of range; the message says which
    inputs to check. State is left as it was before the run."""


class ExportError(OnnxTrainError):
    """PyTorch's ONNX exporter could not export a module (ORTModule); the message says why."""


class NoGradientWarning(UserWarning):
    """Parameters named to train that have no gradient: the loss does not depend on them through
    differentiable ops (unused, or behind an integer cast, a comparison, a rounding). The
    artifacts keep them as frozen parameters."""
