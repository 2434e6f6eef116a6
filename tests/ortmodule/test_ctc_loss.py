"""The CTC loss (``F.ctc_loss``, ``nn.CTCLoss``) trains in ONNX Runtime: PyTorch's op has an
output shape the capture cannot know, so ORTModule captures it as a ``scan`` over the frames
(``onnxtrain.torch._ctc``), whose ONNX ``Scan`` the gradient graph differentiates. Same losses
and gradients as PyTorch's, for every reduction, padded and concatenated targets, samples whose
targets cannot be aligned (inf, or 0 with ``zero_infinity``) and empty ones."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402
from onnxtrain.torch._ctc import ctc_loss  # noqa: E402

F = torch.nn.functional
CLASSES = 6


class _Recognizer(torch.nn.Module):
    """Frame features -> log-probabilities over the classes (blank 0) -> CTC loss."""

    def __init__(self, reduction="mean", zero_infinity=False, blank=0):
        super().__init__()
        self.project = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
        self.loss = torch.nn.CTCLoss(blank=blank, reduction=reduction, zero_infinity=zero_infinity)

    def forward(self, frames, targets, input_lengths, target_lengths):
        return self.loss(self.project(frames).log_softmax(-1), targets, input_lengths, target_lengths)


def _batch(frames=14, labels=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(frames, 4, 8, generator=g)
    targets = torch.randint(1, CLASSES, (4, labels), generator=g)
    input_lengths = torch.tensor([frames, frames - 3, 3, 0])
    target_lengths = torch.tensor([labels, 2, labels, 0])  # sample 2 cannot fit 4 labels in 3 frames
    return x, targets, input_lengths, target_lengths


def _assert_training_matches(factory, *batches):
    torch.manual_seed(0)
    eager, module = factory(), factory()
    module.load_state_dict(eager.state_dict())
    wrapped = ORTModule(module, DebugOptions(fallback=False))
    for batch in batches:
        for model in (eager, wrapped):
            for p in model.parameters():
                p.grad = None
        expected = eager(*batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            got = wrapped(*batch)
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-5, equal_nan=True)
        if torch.isfinite(expected).all():
            expected.sum().backward()
            got.sum().backward()
            for ours, theirs in zip(module.parameters(), eager.parameters()):
                torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_with_zero_infinity(reduction):
    _assert_training_matches(lambda: _Recognizer(reduction, zero_infinity=True), _batch())


def test_an_unalignable_sample_makes_the_loss_infinite():
    _assert_training_matches(lambda: _Recognizer("none"), _batch())


def test_concatenated_targets_and_another_blank():
    x, targets, input_lengths, target_lengths = _batch()
    targets = torch.where(targets == 3, 0, targets)  # class 3 is the blank here
    concatenated = torch.cat([targets[n, :target_lengths[n]] for n in range(4)])
    _assert_training_matches(lambda: _Recognizer("mean", zero_infinity=True, blank=3),
                             (x, concatenated, input_lengths, target_lengths))


def test_lengths_given_as_tuples():
    x, targets, _, _ = _batch()
    _assert_training_matches(lambda: _Recognizer("sum"), (x, targets, (14, 12, 9, 5), (4, 3, 2, 1)))


@pytest.mark.slow  # ~13 s; the other tests here cover the rule, a new length re-exports as any shape does
def test_longer_sequences_and_a_new_length():
    _assert_training_matches(lambda: _Recognizer("mean", zero_infinity=True), _batch(60, 12, seed=1),
                             _batch(45, 12, seed=2))


def test_the_capture_form_matches_pytorch_in_double():
    """The function the capture traces, eagerly in float64: the loss and PyTorch's gradient for the
    log-probabilities themselves (which carries exp(log_probs) over each sample's frames), also
    for unbatched input."""
    g = torch.Generator().manual_seed(3)
    log_probs = torch.randn(15, 4, CLASSES, generator=g, dtype=torch.float64).log_softmax(-1).requires_grad_()
    targets = torch.randint(1, CLASSES, (4, 4), generator=g)
    lengths = (torch.tensor([15, 10, 3, 0]), torch.tensor([4, 2, 3, 0]))
    for reduction in ("mean", "sum", "none"):
        expected = F.ctc_loss(log_probs, targets, *lengths, reduction=reduction, zero_infinity=True)
        got = ctc_loss(log_probs, targets, *lengths, reduction=reduction, zero_infinity=True)
        torch.testing.assert_close(got, expected)
        (expected_grad,) = torch.autograd.grad(expected.sum(), log_probs)
        (got_grad,) = torch.autograd.grad(got.sum(), log_probs)
        torch.testing.assert_close(got_grad, expected_grad)
    single = log_probs[:, 0].detach()
    torch.testing.assert_close(ctc_loss(single, targets[0, :3], (15,), (3,)),
                               F.ctc_loss(single, targets[0, :3], (15,), (3,)))


def _hugging_face_ctc_step(model, inputs, labels):
    model.zero_grad()
    loss = model(input_values=inputs, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_hugging_face_ctc_head_trains_in_onnx_runtime():
    """Wav2Vec2ForCTC (HuBERT, WavLM, ... share its loss): its label check branches on the data and
    its loss concatenates the labels with ``masked_select`` (a length that depends on their
    values); both made it run in PyTorch. The capture answers the check and pads the targets."""
    transformers = pytest.importorskip("transformers")
    from ._parity import eager_and_wrapped

    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)
    eager, wrapped = eager_and_wrapped(lambda: transformers.Wav2Vec2ForCTC(config),
                                       debug_options=DebugOptions(fallback=False))
    eager.train()
    wrapped.train()
    for _ in range(2):
        inputs, labels = torch.randn(2, 1600), torch.randint(1, 12, (2, 5))
        labels[1, 3:] = -100  # padding
        labels[0, 2] = 0  # a blank among the labels: dropped, as masked_select drops it
        loss, grads = _hugging_face_ctc_step(wrapped, inputs, labels)
        expected, expected_grads = _hugging_face_ctc_step(eager, inputs, labels)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():  # (sums over ~100 units of loss: rounding relative to the largest)
            scale = float(expected_grads[name].abs().max())
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5 + 1e-4 * scale)
    assert wrapped.export_count == 1
