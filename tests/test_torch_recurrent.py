"""nn.LSTM and nn.GRU through the dynamo exporter: our gradients equal torch.autograd's, and an LSTM
classifier trains from generated artifacts.

The exporter emits ONNX ``LSTM``/``GRU`` nodes (a 2-layer model: one per layer, a batch-first one:
layout 0 between Transposes) whose gradients come from rules/recurrent.py. The models return
the whole output sequence together with the final hidden (and cell) states, so every output
of the nodes receives a gradient; one model learns its initial states.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer
from tests.torch_models import assert_exported_gradients_match_torch, export, torch

nn = torch.nn


class LstmNet(nn.Module):
    """One layer over [seq, batch, feature]; the sequence and both final states flattened per sample."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4)

    def forward(self, x):
        y, (h, c) = self.rnn(x)
        return torch.cat([y.transpose(0, 1).flatten(1), h[0], c[0]], dim=1)


class DeepBidirectionalLstmNet(nn.Module):
    """Two bidirectional batch-first layers with learned initial states."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(4, 1, 4) * 0.5)
        self.c0 = nn.Parameter(torch.randn(4, 1, 4) * 0.5)

    def forward(self, x):
        batch = x.shape[0]
        state = (self.h0.expand(-1, batch, -1).contiguous(), self.c0.expand(-1, batch, -1).contiguous())
        y, (h, c) = self.rnn(x, state)
        return torch.cat([y.flatten(1), h.transpose(0, 1).flatten(1), c.transpose(0, 1).flatten(1)], dim=1)


class BidirectionalGruNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, bidirectional=True, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        y, h = self.rnn(x)
        return torch.cat([self.out(y).flatten(1), h.transpose(0, 1).flatten(1)], dim=1)


# name: (model, batch axis of x, x for a batch size, the ONNX op the export should contain)
CASES = {
    "lstm": (LstmNet, 1, lambda r, n: r.standard_normal((5, n, 3)).astype(np.float32), "LSTM"),
    "lstm_2_layers_bidirectional_batch_first": (
        DeepBidirectionalLstmNet, 0, lambda r, n: r.standard_normal((n, 5, 3)).astype(np.float32), "LSTM"),
    "gru_bidirectional_batch_first": (
        BidirectionalGruNet, 0, lambda r, n: r.standard_normal((n, 5, 3)).astype(np.float32), "GRU"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recurrent_gradients_match_torch(case):
    make, batch_axis, sample, op_type = CASES[case]
    onnx_model = assert_exported_gradients_match_torch(make, sample, batch_axis, case)
    assert op_type in {n.op_type for n in onnx_model.graph.node}, "the exporter no longer emits the ONNX op"


class LstmClassifier(nn.Module):
    """Which of 3 frequencies a noisy sine sequence has, from the LSTM's last hidden state."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(1, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        _, (h, _) = self.rnn(x)
        return self.head(h[-1])


def _sine_batches(seed: int, count: int, size: int = 16, steps: int = 12):
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float32)
    for _ in range(count):
        labels = rng.integers(0, 3, size)
        phase = rng.uniform(0, 2 * np.pi, (size, 1))
        x = np.sin(t * (0.3 + 0.5 * labels[:, None]) + phase) + 0.1 * rng.standard_normal((size, steps))
        yield x[:, :, None].astype(np.float32), labels.astype(np.int32)


def test_lstm_classifier_trains_from_artifacts(tmp_path):
    torch.manual_seed(0)
    model = LstmClassifier().train()
    x, _ = next(_sine_batches(0, 1))
    onnx_model = export(model, (torch.tensor(x),), ["x"], ({0: torch.export.Dim("batch", min=2, max=64)},))
    assert "LSTM" in {n.op_type for n in onnx_model.graph.node}
    artifacts.generate_artifacts(onnx_model, requires_grad=[n for n, _ in model.named_parameters()],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.03)
    losses = []
    for x, labels in _sine_batches(1, 100):
        losses.append(float(module(x, labels)))
        optimizer.step()
        module.lazy_reset_grad()
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), losses
