"""``scaled_dot_product_attention`` in the layouts timm's vision models use: more than one
leading batch axis (NesT, Twins, Hiera: ``[batch, blocks, heads, tokens, features]``; the
exporter's translation took 4-D inputs only), and a learned attention bias followed by
``transpose(1, 2).reshape(...)`` (BEiT, MaxViT: PyTorch's decomposition of the attention gives
its output other strides than its shape function, and the reshape, captured as a view, failed).
Outputs and gradients are eager's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import assert_steps_match  # noqa: E402


class _BlockAttention(torch.nn.Module):
    """Attention over ``[batch, *blocks, heads, tokens, features]`` projections of ``x``."""

    def __init__(self, blocks, mask, causal=False):
        super().__init__()
        self.blocks, self.mask, self.causal = blocks, mask, causal
        self.qkv = torch.nn.Linear(8, 3 * 2 * 4)  # 2 heads of 4 features
        self.bias = torch.nn.Parameter(torch.randn(2, 5, 5) * 0.1)

    def forward(self, x):  # x: [batch, *blocks, tokens=5, 8]
        lead = x.shape[:-2]
        q, k, v = self.qkv(x).reshape(*lead, 5, 3, 2, 4).movedim(-3, 0).transpose(-2, -3).unbind(0)
        mask = None
        if self.mask == "bias":  # [heads, tokens, tokens], broadcast over the leading axes
            mask = self.bias
        elif self.mask == "bool":  # [tokens, tokens]
            mask = torch.ones(5, 5, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return out.transpose(-2, -3).reshape(*lead, 5, 8)


@pytest.mark.parametrize(("blocks", "mask", "causal"), [
    ((3,), None, False), ((3,), "bias", False), ((3,), "bool", False), ((3,), None, True),
    ((2, 3), "bias", False),  # 6-D
    ((), "bias", False),  # 4-D, BEiT's case: a learned bias, then transpose + reshape
])
def test_attention_over_several_batch_axes_trains_as_eager(blocks, mask, causal):
    torch.manual_seed(0)
    eager = _BlockAttention(blocks, mask, causal)
    wrapped = ORTModule(_BlockAttention(blocks, mask, causal), DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    assert_steps_match(eager, wrapped, torch.randn(2, *blocks, 5, 8))


class _BeitAttention(torch.nn.Module):
    """timm's BEiT attention: qkv from one projection, a learned relative-position bias as the
    mask, the heads' outputs joined by ``transpose(1, 2).reshape``."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.relative_bias = torch.nn.Parameter(torch.randn(2, 7, 7) * 0.1)

    def forward(self, x):
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.relative_bias.unsqueeze(0))
        return out.transpose(1, 2).reshape(batch, tokens, 16)


def test_a_learned_attention_bias_then_a_reshape_trains_as_eager():
    torch.manual_seed(0)
    eager = _BeitAttention()
    wrapped = ORTModule(_BeitAttention(), DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    assert_steps_match(eager, wrapped, torch.randn(3, 7, 16))
