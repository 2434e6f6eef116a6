"""Reverse-mode automatic differentiation over ONNX graphs."""

from onnxtrain.autodiff import rules as _rules  # noqa: F401  (registers the gradient rules)
from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.autodiff.registry import DEFAULT_REGISTRY, GradContext, Registry, grad

__all__ = ["build_gradients", "grad", "GradContext", "Registry", "DEFAULT_REGISTRY"]
