"""Packed sequences train in ONNX Runtime: ``pack_padded_sequence`` has a data-dependent size, so
ORTModule captures a packed batch as the padded one with its lengths (``onnxtrain.torch._packed``),
and LSTM, GRU and RNN layers given it as masked scans over the steps. Same outputs, final states
and gradients as PyTorch's packed kernels: bidirectional and stacked layers, batch-first or not,
sorted or not (``enforce_sorted``), initial states, ``proj_size``, ``padding_value`` and
``total_length``, a batch padded beyond its longest sequence, and new lengths each call."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402


class _Tagger(torch.nn.Module):
    """Features -> packed -> recurrent layer -> padded -> per-step scores, plus the final state."""

    def __init__(self, kind="LSTM", bidirectional=True, layers=2, batch_first=True, enforce_sorted=False, proj=0,
                 padding_value=0.0, total_length=None, initial_state=False):
        super().__init__()
        self.embed = torch.nn.Linear(5, 6)
        options = {"proj_size": proj} if proj else {}
        self.rnn = getattr(torch.nn, kind)(6, 4, num_layers=layers, bidirectional=bidirectional,
                                           batch_first=batch_first, **options)
        self.head = torch.nn.Linear((proj or 4) * (2 if bidirectional else 1), 3)
        self.batch_first, self.enforce_sorted = batch_first, enforce_sorted
        self.padding_value, self.total_length = padding_value, total_length
        self.initial_state = initial_state

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.embed(x), lengths, batch_first=self.batch_first,
                                      enforce_sorted=self.enforce_sorted)
        state = None
        if self.initial_state:
            rnn = self.rnn
            count = rnn.num_layers * (2 if rnn.bidirectional else 1)
            h0 = torch.full((count, lengths.shape[0], rnn.proj_size or rnn.hidden_size), 0.3)
            state = (h0, torch.full((count, lengths.shape[0], rnn.hidden_size), -0.2)) if rnn.mode == "LSTM" else h0
        out, final = self.rnn(packed, state)
        padded, padded_lengths = pad_packed_sequence(out, batch_first=self.batch_first,
                                                     padding_value=self.padding_value, total_length=self.total_length)
        final = final[0] if isinstance(final, tuple) else final
        return self.head(padded), final, padded_lengths


def _assert_matches(factory, calls):
    torch.manual_seed(0)
    eager, module = factory(), factory()
    module.load_state_dict(eager.state_dict())
    wrapped = ORTModule(module, DebugOptions(fallback=False))
    for x, lengths in calls:
        for model in (eager, module):
            for p in model.parameters():
                p.grad = None
        expected = eager(x, lengths)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            got = wrapped(x, lengths)
        for ours, theirs in zip(got, expected):
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-5)
        for outputs in (expected, got):
            (outputs[0].square().sum() + outputs[1].sum()).backward()
        for ours, theirs in zip(module.parameters(), eager.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def _batch(lengths, batch_first=True, steps=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((len(lengths), steps, 5) if batch_first else (steps, len(lengths), 5), generator=g)
    return x, torch.tensor(lengths)


# GRU and RNN share the packed-sequence path with LSTM (and have other tests of their own here):
# ~15 s of the default run, kept for pytest -m slow
@pytest.mark.parametrize("kind", ["LSTM", pytest.param("GRU", marks=pytest.mark.slow),
                                  pytest.param("RNN", marks=pytest.mark.slow)])
def test_bidirectional_stacked_layers(kind):
    _assert_matches(lambda: _Tagger(kind), [_batch([5, 7, 2, 4])])


def test_sorted_time_first_with_initial_states():
    _assert_matches(lambda: _Tagger("LSTM", batch_first=False, enforce_sorted=True, initial_state=True),
                    [_batch([7, 5, 4, 2], batch_first=False)])


def test_unsorted_with_initial_states():
    _assert_matches(lambda: _Tagger("GRU", initial_state=True), [_batch([3, 7, 1, 6])])


def test_projection_padding_value_and_total_length():
    _assert_matches(lambda: _Tagger("LSTM", bidirectional=False, proj=3, padding_value=-1.5, total_length=9),
                    [_batch([5, 7, 2, 4])])


def test_total_length_as_long_as_the_padded_batch():
    """``total_length`` equal to the padded length, beyond the longest sequence: that many steps."""
    _assert_matches(lambda: _Tagger("GRU", bidirectional=False, layers=1, total_length=7), [_batch([5, 6, 2, 4])])


def test_padded_beyond_the_longest_and_new_lengths_each_call():
    """The padded output is as long as each call's longest sequence, as PyTorch's."""
    _assert_matches(lambda: _Tagger("LSTM"), [_batch([5, 6, 2, 4], seed=1), _batch([3, 2, 2, 1], seed=2),
                                              _batch([7, 7, 7, 7], seed=3)])
