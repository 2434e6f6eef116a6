"""A module ORTModule cannot build a gradient graph for, whichever ops onnxtrain differentiates:
``torch.fft.hfft`` with the DFT gradient rule taken out of the registry for the length of a test
(the ``without_dft_rule`` fixture). Fallback tests use it; the rule itself is tested in the
gradient table."""

from __future__ import annotations

import pytest

from onnxtrain.autodiff.registry import DEFAULT_REGISTRY


@pytest.fixture
def without_dft_rule(monkeypatch):
    """The DFT op has no gradient rule during the test (its exports then fail with UnsupportedOpError)."""
    monkeypatch.delitem(DEFAULT_REGISTRY.rules, ("", "DFT"))
