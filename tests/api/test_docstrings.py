"""The examples in the public classes' docstrings run (against the hand-built artifacts)."""

from __future__ import annotations

import doctest

import pytest

from onnxtrain import checkpoint
from onnxtrain.api import checkpoint_state, lr_scheduler, module, optimizer

from .conftest import batch


@pytest.mark.parametrize("mod", [checkpoint, checkpoint_state, lr_scheduler, module, optimizer],
                         ids=lambda m: m.__name__)
def test_docstring_examples(mod, artifacts):
    x, y = batch()
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(mod, extraglobs={"artifacts": str(artifacts.dir), "x": x, "y": y})
    assert any(t.examples for t in tests)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0
