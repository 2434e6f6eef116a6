"""Average pooling with ``divisor_override``: the exporter's translation ignores it (a silently
other result: the average rather than the sum over the divisor); ours divides each window's sum by
it, in 2-D and 3-D; with ``ceil_mode`` too the module runs in PyTorch."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402

F = torch.nn.functional


class _Pool(torch.nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.pool(x * self.scale)


@pytest.mark.parametrize("pool", [
    lambda x: F.avg_pool2d(x, 2, divisor_override=3),
    lambda x: F.avg_pool2d(x, (3, 2), stride=(2, 1), padding=1, divisor_override=5),
    lambda x: F.avg_pool2d(x, 3, padding=1, count_include_pad=False, divisor_override=2),
    lambda x: F.avg_pool3d(x.unsqueeze(1), 2, divisor_override=7),
], ids=["2d", "2d padded", "2d padding not counted", "3d"])
def test_divisor_override_matches_eager(pool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 6, generator=g)
    eager, module = _Pool(pool), _Pool(pool)
    wrapped = ORTModule(module, DebugOptions(fallback=False))
    leaves = [x.clone().requires_grad_() for _ in range(2)]
    expected, got = eager(leaves[0]), wrapped(leaves[1])
    weight = torch.randn(expected.shape, generator=g)
    (expected * weight).sum().backward()
    (got * weight).sum().backward()
    torch.testing.assert_close(got.detach(), expected.detach())
    torch.testing.assert_close(leaves[1].grad, leaves[0].grad)
    torch.testing.assert_close(module.scale.grad, eager.scale.grad)


def test_divisor_override_with_ceil_mode_runs_in_pytorch():
    wrapped = ORTModule(_Pool(lambda x: F.avg_pool2d(x, 2, ceil_mode=True, divisor_override=3)))
    x = torch.randn(1, 2, 5, 5)
    with pytest.warns(ORTModuleFallbackWarning, match="divisor_override"):
        got = wrapped(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(got, _Pool(lambda x: F.avg_pool2d(x, 2, ceil_mode=True, divisor_override=3))(x))
