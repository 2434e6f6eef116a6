"""Many PyTorch layer types through the current exporter: our gradients equal torch.autograd's.

Each model is small; what is tested is that every op the exporter emits for these layers
has a correct gradient rule (or decomposition) on real exported graphs, with a symbolic batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.torch_models import assert_exported_gradients_match_torch, torch

nn = torch.nn


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(2, 4, 3, stride=2, padding=1, dilation=1), nn.ELU(),
                                 nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1, output_padding=1), nn.Softplus())

    def forward(self, x):
        return self.net(x)


class Conv2dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1, groups=2), nn.Hardswish(), nn.ConvTranspose2d(4, 4, 2, stride=2),
            nn.LeakyReLU(0.1), nn.MaxPool2d(3, stride=2, padding=1), nn.Conv2d(4, 6, 1), nn.SiLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3), nn.Mish())

    def forward(self, x):
        return self.net(x)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm1d(4, affine=True)
        self.ln = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.ln(self.inorm(self.gn(x)))
        return torch.sigmoid(self.lin(y)) * torch.tanh(y).pow(2) + torch.clamp(y, -0.5, 0.5)


class TextNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 5)

    def forward(self, idx):
        x = self.emb(idx)
        y, _ = self.attn(x, x, x, need_weights=False)
        pooled = torch.cat([y.mean(dim=1), y.amax(dim=1)], dim=-1)
        return self.out(pooled[:, :8] + pooled[:, 8:]).log_softmax(-1)


class ResampleNet(nn.Module):
    """F.interpolate in its common modes: Resize with scales, with sizes, downsampling."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Conv2d(2, 3, 3, padding=1)
        self.outer = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        f = nn.functional
        y = f.interpolate(self.inner(x), scale_factor=2, mode="nearest")
        y = f.interpolate(self.outer(y), size=(7, 9), mode="bilinear", align_corners=True)
        return f.interpolate(y, scale_factor=0.5, mode="bicubic") + f.interpolate(y, size=(3, 4), mode="area")


class SpatialTransformerNet(nn.Module):
    """A spatial transformer: an affine grid predicted from the input, then F.grid_sample
    (GridSample; the gradient reaches the localization layer through the grid)."""

    def __init__(self, mode="bilinear"):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.localize = nn.Linear(2 * 4 * 5, 6)
        self.mode = mode

    def forward(self, x):
        theta = self.localize(x.flatten(1)).reshape(-1, 2, 3) * 0.1 + torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
        grid = nn.functional.affine_grid(theta, [x.shape[0], 3, 3, 4], align_corners=False)
        return nn.functional.grid_sample(self.conv(x), grid, mode=self.mode, align_corners=False)


class PatchNet(nn.Module):
    """F.unfold (exported as Gathers) and F.fold (Col2Im) around a per-patch linear layer."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(2 * 2 * 3, 2 * 2 * 3)

    def forward(self, x):
        patches = nn.functional.unfold(x, (2, 3), stride=(1, 2), padding=(0, 1))  # [N, 12, L]
        mixed = self.mix(patches.transpose(1, 2)).transpose(1, 2)
        return nn.functional.fold(mixed, (4, 5), (2, 3), stride=(1, 2), padding=(0, 1))


class SelectNet(nn.Module):
    """topk, sort and split: values picked or moved by index."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x):
        y = self.lin(x)
        top = torch.topk(y, 3, dim=-1).values
        low, high = torch.split(torch.sort(y, dim=1, descending=True).values, [3, 5], dim=-1)
        return torch.cat([top * low, high.amax(-1, keepdim=True)], dim=-1)


CASES = {
    "conv1d": (Conv1dNet, lambda r, n: r.standard_normal((n, 2, 9)).astype(np.float32)),
    "conv2d": (Conv2dNet, lambda r, n: r.standard_normal((n, 2, 6, 6)).astype(np.float32)),
    "norms": (NormNet, lambda r, n: r.standard_normal((n, 4, 6)).astype(np.float32)),
    "text": (TextNet, lambda r, n: r.integers(0, 20, (n, 7))),
    "resample": (ResampleNet, lambda r, n: r.standard_normal((n, 2, 4, 5)).astype(np.float32)),
    "stn": (SpatialTransformerNet, lambda r, n: r.standard_normal((n, 2, 4, 5)).astype(np.float32)),
    "stn-bicubic": (lambda: SpatialTransformerNet("bicubic"),
                    lambda r, n: r.standard_normal((n, 2, 4, 5)).astype(np.float32)),
    "patches": (PatchNet, lambda r, n: r.standard_normal((n, 2, 4, 5)).astype(np.float32)),
    "select": (SelectNet, lambda r, n: r.standard_normal((n, 4, 6)).astype(np.float32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_gradients_match_torch(case):
    make, sample = CASES[case]
    assert_exported_gradients_match_torch(make, sample, case=case)
