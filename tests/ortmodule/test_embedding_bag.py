"""nn.EmbeddingBag trains in ONNX Runtime in every mode (the exporter's Loop has no gradient; our
translation scatters rows into bags), for ORTModule and for artifacts exported with the
translation table; nn.Embedding(scale_grad_by_freq=True) too (it did not export)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import ORTModuleFallbackWarning, onnx_translation_table  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402

nn = torch.nn


class _Bags(nn.Module):
    """``nn.EmbeddingBag``, or with ``functional_padding_idx`` ``F.embedding_bag`` on its weight,
    which passes a negative padding index on as given (the module counts it from the end first)."""

    def __init__(self, mode="sum", padding_idx=None, weighted=False, include_last_offset=False,
                 functional_padding_idx=None):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset)
        self.head = nn.Linear(4, 3)
        self.weighted = weighted
        self.functional_padding_idx = functional_padding_idx

    def forward(self, indices, offsets):
        weights = torch.sigmoid(indices.float() * 0.1) if self.weighted else None
        if self.functional_padding_idx is not None:
            return self.head(nn.functional.embedding_bag(indices, self.bag.weight, offsets, mode=self.bag.mode,
                                                         per_sample_weights=weights,
                                                         padding_idx=self.functional_padding_idx))
        return self.head(self.bag(indices, offsets, per_sample_weights=weights))


def _step(model, *inputs):
    for p in model.parameters():
        p.grad = None
    out = model(*inputs)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


# offsets with an empty bag in the middle (2, 2) and, with include_last_offset, a last bag
CASES = {
    "sum": (dict(mode="sum"), [0, 2, 2, 6]),
    "mean": (dict(mode="mean"), [0, 2, 2, 6]),
    "mean-padding": (dict(mode="mean", padding_idx=3), [0, 2, 2, 6]),
    "sum-weighted-last-offset": (dict(mode="sum", weighted=True, include_last_offset=True), [0, 2, 2, 6, 9]),
    "max": (dict(mode="max"), [0, 2, 2, 6]),
    "max-padding-trailing-empty": (dict(mode="max", padding_idx=0), [0, 2, 6, 9]),
    # F.embedding_bag's negative padding index counts from the last row (it was taken for none)
    "functional-sum-negative-padding": (dict(mode="sum", functional_padding_idx=-17, weighted=True), [0, 2, 2, 6]),
    "functional-mean-negative-padding": (dict(mode="mean", functional_padding_idx=-1), [0, 2, 2, 6]),
    "functional-max-negative-padding": (dict(mode="max", functional_padding_idx=-1), [0, 2, 6, 9]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ortmodule_matches_eager(case):
    options, offsets = CASES[case]
    eager, wrapped = eager_and_wrapped(lambda: _Bags(**options))
    inputs = (torch.tensor([0, 3, 5, 3, 7, 0, 11, 19, 2]), torch.tensor(offsets))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for _ in range(2):
            (out, grads), (eager_out, eager_grads) = _step(wrapped, *inputs), _step(eager, *inputs)
            torch.testing.assert_close(out, eager_out)
            for ours, theirs in zip(grads, eager_grads):
                torch.testing.assert_close(ours, theirs)


def test_artifacts_from_the_translated_export_match_torch():
    """Fixed-size bags (a 2-D input, as fastText-style classifiers use) exported with the table."""
    from tests.torch_models import training_gradients

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(30, 6, mode="mean", padding_idx=0)
            self.head = nn.Linear(6, 2)

        def forward(self, tokens):
            return self.head(self.bag(tokens))

    torch.manual_seed(0)
    model = Classifier()
    example = torch.randint(0, 30, (3, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (example,), dynamo=True, input_names=["x"], optimize=False,
                                    dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=16)},),
                                    custom_translation_table=onnx_translation_table(), verbose=False)
    onnx_model = program.model_proto
    assert "Loop" not in {n.op_type for n in onnx_model.graph.node}
    tokens = np.array([[0, 4, 4, 9, 0], [1, 2, 3, 0, 0], [7, 7, 7, 7, 7], [0, 0, 0, 0, 0]], np.int64)
    out = model(torch.tensor(tokens))
    weight = np.random.default_rng(0).standard_normal(tuple(out.shape)).astype(np.float32)
    params = dict(model.named_parameters())
    ours = training_gradients(onnx_model, list(params), {"x": tokens}, weight)
    (out * torch.tensor(weight)).sum().backward()
    for name, p in params.items():
        np.testing.assert_allclose(ours[name], p.grad.numpy(), rtol=1e-5, atol=1e-6)


class _FrequencyScaled(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.embed = nn.Embedding(12, 4, scale_grad_by_freq=True, padding_idx=padding_idx)
        self.head = nn.Linear(4, 2)

    def forward(self, indices):
        return self.head(self.embed(indices))


@pytest.mark.parametrize("padding_idx", [None, 1])
def test_embedding_gradients_scaled_by_frequency_match_eager(padding_idx):
    from onnxtrain.torch import DebugOptions

    from ._parity import assert_steps_match

    eager, wrapped = eager_and_wrapped(lambda: _FrequencyScaled(padding_idx), debug_options=DebugOptions(fallback=False))
    indices = torch.tensor([[1, 3, 3, 7], [3, 1, 0, 11]])  # row 3 three times, row 1 twice
    grads = assert_steps_match(eager, wrapped, indices)
    assert grads[0][3].abs().sum() > 0


def test_a_sparse_embedding_runs_in_pytorch_for_its_sparse_gradient(tmp_path):
    # onnxruntime's gradient is dense: SparseAdam refused it. ORTModule falls back, saying why;
    # artifacts, whose optimizer is dense, train it with a dense gradient
    import copy
    import warnings

    from onnxtrain.torch import ORTModule, ORTModuleFallbackWarning, export_for_training

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    model = ORTModule(copy.deepcopy(embedding))
    ids = torch.tensor([[1, 2, 2], [3, 1, 0]])
    optimizer = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids).square().sum().backward()
    assert any(issubclass(w.category, ORTModuleFallbackWarning) and "sparse=True" in str(w.message) for w in caught)
    assert model.weight.grad.is_sparse
    optimizer.step()
    embedding(ids).square().sum().backward()
    torch.testing.assert_close(model.weight.grad.to_dense(), embedding.weight.grad.to_dense())
    onnx_model = export_for_training(copy.deepcopy(embedding), (ids,))
    assert [n.op_type for n in onnx_model.graph.node if n.op_type == "Gather"]
