"""Cross entropy as PyTorch computes it: label smoothing included (the exporter's translation
drops it: a silently different loss and gradient), with class weights, an ignored index,
every reduction, and a sequence dim; and against class probabilities (which the exporter's
translation takes for class indices)."""

import itertools
import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModuleFallbackWarning  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402

CLASS_WEIGHTS = torch.tensor([0.6, 1.4, 0.9, 1.2, 0.7, 1.1])


class Classifier(torch.nn.Module):
    def __init__(self, **loss_options):
        super().__init__()
        self.linear = torch.nn.Linear(5, 6)
        self.loss_options = loss_options

    def forward(self, x, target):
        logits = self.linear(x)
        if x.dim() == 3:  # [batch, seq, classes] -> [batch, classes, seq], as PyTorch expects
            logits = logits.transpose(1, 2)
        return torch.nn.functional.cross_entropy(logits, target, **self.loss_options)


@pytest.mark.parametrize(("smoothing", "weighted", "reduction", "sequence"), [
    case for case in itertools.product((0.0, 0.1), (False, True), ("mean", "sum", "none"), (False, True))
    if case[0] or (case[2] == "mean" and not case[3])  # without smoothing: the exporter's own path
])
def test_cross_entropy_matches_pytorch(smoothing, weighted, reduction, sequence):
    options = dict(label_smoothing=smoothing, reduction=reduction, ignore_index=2,
                   weight=CLASS_WEIGHTS if weighted else None)
    eager, wrapped = eager_and_wrapped(lambda: Classifier(**options))
    generator = torch.Generator().manual_seed(1)
    shape = (4, 3) if sequence else (4,)
    x = torch.randn(*shape, 5, generator=generator)
    target = torch.randint(0, 6, shape, generator=generator)
    target[0] = 2  # ignored
    _assert_same_loss_and_gradients(eager, wrapped, x, target)


def _assert_same_loss_and_gradients(eager, wrapped, x, target):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        loss = wrapped(x, target)
    expected = eager(x, target)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(wrapped.module.linear.weight.grad, eager.linear.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wrapped.module.linear.bias.grad, eager.linear.bias.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("smoothing", "weighted", "reduction", "sequence"), [
    (0.0, False, "mean", False), (0.1, True, "mean", True), (0.2, False, "sum", False), (0.0, True, "none", True)])
def test_cross_entropy_against_class_probabilities_matches_pytorch(smoothing, weighted, reduction, sequence):
    """Probability targets (mixup, distillation): the exporter's translation takes them for class
    indices (the graph did not load, so the module ran in PyTorch); ours follows PyTorch's
    formula, the mean over samples, smoothing and class weights included."""
    options = dict(label_smoothing=smoothing, reduction=reduction, weight=CLASS_WEIGHTS if weighted else None)
    eager, wrapped = eager_and_wrapped(lambda: Classifier(**options))
    generator = torch.Generator().manual_seed(2)
    shape = (4, 3) if sequence else (4,)
    x = torch.randn(*shape, 5, generator=generator)
    target = torch.softmax(torch.randn(4, 6, *shape[1:], generator=generator) * 2, dim=1)
    _assert_same_loss_and_gradients(eager, wrapped, x, target)


@pytest.mark.parametrize(("smoothing", "weighted"), [(0.0, False), (0.0, True), (0.2, False), (0.2, True)])
def test_every_target_ignored_gives_pytorchs_nan_loss_and_zero_gradients(smoothing, weighted):
    """A batch whose targets are all ``ignore_index`` (all padding): the mean is 0/0 (NaN, as
    PyTorch's), and the parameters' gradients are PyTorch's zeros, not NaN (0 * 1/0)."""
    options = dict(label_smoothing=smoothing, weight=CLASS_WEIGHTS if weighted else None)
    eager, wrapped = eager_and_wrapped(lambda: Classifier(**options), debug_options=DebugOptions(fallback=False))
    x, target = torch.randn(4, 5), torch.full((4,), -100)
    for model in (eager, wrapped):
        loss = model(x, target)
        assert torch.isnan(loss)
        loss.backward()
    for ours, theirs in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)
        assert not ours.grad.any()


class _EmbedAndClassify(torch.nn.Module):
    def __init__(self, loss: str = "cross_entropy"):
        super().__init__()
        self.embedding = torch.nn.Embedding(5, 3)
        self.linear = torch.nn.Linear(3, 4)
        self.loss = loss

    def forward(self, ids, labels):
        scores = self.linear(self.embedding(ids)).flatten(0, 1)
        if self.loss == "nll_loss":  # the exporter writes a NegativeLogLikelihoodLoss node
            return torch.nn.functional.nll_loss(torch.log_softmax(scores, -1), labels.flatten())
        return torch.nn.functional.cross_entropy(scores, labels.flatten())


@pytest.mark.parametrize("ids, labels, what, loss", [
    ([[0, 1, -1]], [[1, 2, 3]], "a negative token id", "cross_entropy"),
    ([[0, 1, 2]], [[1, 2, -1]], "a negative class label", "cross_entropy"),
    ([[0, 1, 2]], [[1, 2, -1]], "a negative class label", "nll_loss"),
    ([[0, 1, 7]], [[1, 2, 3]], "a token id past the vocabulary", "cross_entropy"),
])
def test_negative_indices_fail_as_in_pytorch(ids, labels, what, loss):
    # ONNX's Gather reads a negative index from the end: a -1 silently took the last row or class
    from onnxtrain.errors import RunError
    from onnxtrain.torch import ORTModule

    torch.manual_seed(0)
    module = _EmbedAndClassify(loss)
    model = ORTModule(module, DebugOptions(fallback=False))
    good_ids, good_labels = torch.tensor([[0, 1, 2]]), torch.tensor([[1, -100, 3]])  # -100: ignore_index
    torch.testing.assert_close(model(good_ids, good_labels), module(good_ids, good_labels))
    with pytest.raises(IndexError):
        module(torch.tensor(ids), torch.tensor(labels))
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(RunError, match=r"index was out of range: check the integer inputs.*tensor 0 of the call"):
        model(torch.tensor(ids), torch.tensor(labels)).backward()
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before)), what


class PerSampleLosses(torch.nn.Module):
    """Per-sample losses (``reduction='none'``) of several kinds, reduced by the module: weighted,
    as custom losses do."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 6)

    def forward(self, x, target, sample_weight):
        logits = self.linear(x)
        f = torch.nn.functional
        kinds = [
            f.cross_entropy(logits, target, reduction="none"),
            f.cross_entropy(logits, target, weight=CLASS_WEIGHTS, label_smoothing=0.1, reduction="none"),
            f.nll_loss(logits.log_softmax(1), target, reduction="none"),
            torch._C._nn.nll_loss(logits.log_softmax(1), target, None, 0, -100),  # aten.nll_loss itself
            # an ignore_index known at run time only (a symbolic size)
            f.cross_entropy(logits, target, reduction="none", ignore_index=x.shape[0]),
        ]
        return sum(k * ((losses * sample_weight).sum() / x.shape[0] + losses.mean()) for k, losses in
                   enumerate(kinds, 1))


def test_per_sample_losses_reduced_by_the_module_with_a_dynamic_batch():
    """The batch size changes (an epoch's last batch): the re-export has a symbolic batch, and
    torch's decomposition gave the per-sample losses a scalar shape, which the exporter and the
    folder trusted: ``.sum()`` returned the vector, ``.mean()``'s gradient was N times too large."""
    eager, wrapped = eager_and_wrapped(PerSampleLosses)
    generator = torch.Generator().manual_seed(2)
    for batch in (4, 3):
        x = torch.randn(batch, 5, generator=generator)
        target = torch.randint(0, 6, (batch,), generator=generator)
        target[0] = batch  # ignored where the ignore_index is the batch size
        sample_weight = torch.rand(batch, generator=generator)
        for module in (eager, wrapped):
            module.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ORTModuleFallbackWarning)
            loss = wrapped(x, target, sample_weight)
        expected = eager(x, target, sample_weight)
        assert loss.shape == expected.shape == ()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(wrapped.module.linear.weight.grad, eager.linear.weight.grad, rtol=1e-5, atol=1e-5)


class _Unbatched(torch.nn.Module):
    def __init__(self, reduction, smoothing):
        super().__init__()
        self.linear = torch.nn.Linear(5, 6)
        self.reduction, self.smoothing = reduction, smoothing

    def forward(self, x, target):  # x: [5], target: a class index or class probabilities [6]
        return torch.nn.functional.cross_entropy(self.linear(x), target, reduction=self.reduction,
                                                 label_smoothing=self.smoothing)


@pytest.mark.parametrize(("reduction", "smoothing", "soft"), [("none", 0.0, False), ("mean", 0.1, False),
                                                               ("sum", 0.0, True)])
def test_an_unbatched_input_is_a_batch_of_one(reduction, smoothing, soft):
    """cross_entropy on one sample's [C] logits: ONNX's loss takes [N, C] (onnxruntime refused the
    model and the module fell back to PyTorch)."""
    eager, wrapped = eager_and_wrapped(lambda: _Unbatched(reduction, smoothing))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, generator=generator)
    target = torch.rand(6, generator=generator).softmax(0) if soft else torch.tensor(2)
    _assert_same_loss_and_gradients(eager, wrapped, x, target)
