"""``tensor.contiguous()`` before a ``view``: the exporter's decomposition re-traces it with other
strides, drops the copy and fails the view (Hugging Face T5 and Swin attention did not export, so
ORTModule ran them in PyTorch). ORTModule exports such a ``contiguous`` as a clone."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from onnxtrain.torch import ORTModuleFallbackWarning  # noqa: E402
from onnxtrain.torch._exporter import capture, contiguous_as_clone  # noqa: E402

from ._parity import assert_steps_match, eager_and_wrapped  # noqa: E402


class _T5Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        config = transformers.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                       dropout_rate=0.0)
        self.encoder = transformers.T5EncoderModel(config)

    def forward(self, ids):
        return self.encoder(ids).last_hidden_state


def test_t5_encoder_trains_in_onnxruntime_like_eager():
    eager, wrapped = eager_and_wrapped(_T5Encoder)
    ids = torch.randint(0, 50, (3, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for _ in range(2):
            assert_steps_match(eager, wrapped, ids)


class _WritesIntoContiguous(torch.nn.Module):
    def forward(self, x):
        written = x.t().contiguous()
        written.mul_(2)  # in place on the copy (on x itself, were x.t() contiguous)
        return written.sum(0) + x.t().contiguous().view(-1).sum()


def _users_of_contiguous(program):
    return [u for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.contiguous.default
            for u in n.users]


def test_a_contiguous_written_in_place_is_left_alone():
    program = capture(_WritesIntoContiguous(), (torch.randn(3, 4),), None)
    before = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.contiguous.default]
    assert len(before) == 2
    assert contiguous_as_clone(program) == 1
    after = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.contiguous.default]
    assert len(after) == 1 and any(u.target is torch.ops.aten.mul_.Tensor for u in _users_of_contiguous(program))
