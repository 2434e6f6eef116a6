"""ORTModule runs modules whose exports need the recurrent, resampling, selection, DFT, STFT and
Det rules, or our translations of 3-D scaled dot product attention, median, kthvalue, cdist,
pdist, hypot, searchsorted, cumprod, lgamma, digamma, polygamma, adaptive max pooling, 3-D
adaptive average pooling, cummax, cummin, erfinv, RReLU, masked_select, linalg.inv and
linalg.solve (which the exporter lacks) and multilabel_margin_loss (which it translates wrongly),
or nn.Transformer's causal-mask check, or torch.distributions (whose argument checks branch on
the data), in ONNX Runtime (they fell back to PyTorch before), with eager's outputs and
gradients."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402

from ._parity import assert_steps_match, eager_and_wrapped  # noqa: E402

nn = torch.nn


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(10, 3, batch_first=True)

    def forward(self, x):
        return self.gru(self.lstm(x)[0])[0]


class _Vision(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.theta = nn.Linear(2 * 4 * 4, 6)

    def forward(self, x):
        y = nn.functional.interpolate(self.conv(x), scale_factor=2, mode="bilinear", align_corners=False)
        theta = self.theta(x.flatten(1)).reshape(-1, 2, 3) * 0.1 + torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
        grid = nn.functional.affine_grid(theta, [x.shape[0], 3, 5, 5], align_corners=False)
        picked = torch.topk(nn.functional.grid_sample(y, grid, align_corners=False).flatten(2), 4, dim=-1)
        return picked.values


class _SingleHeadAttention(nn.Module):
    """F.scaled_dot_product_attention on [batch, sequence, features] (the exporter takes 4-D only):
    causal, with a boolean mask and with an additive float mask."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(6, 18)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        f = nn.functional
        causal = f.scaled_dot_product_attention(q, k, v, is_causal=True)
        keep = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        masked = f.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        bias = torch.arange(x.shape[1], dtype=x.dtype).expand(x.shape[0], x.shape[1], -1) * -0.1
        return causal + masked + f.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)


class _MedianDistance(nn.Module):
    """torch.median (over a dim, an even count, all elements), torch.cdist (p = 2, 1, 3), F.pdist,
    torch.kthvalue and torch.hypot."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 4)

    def forward(self, x):
        y = self.embed(x)
        anchors = y[:, :3] * 0.5 + 0.25  # not a shift of y: the bias gets a gradient
        centre = y[..., :4].median(dim=-1, keepdim=True).values + y.median()
        distances = torch.cdist(y, anchors) + torch.cdist(y, anchors, p=1.0) + torch.cdist(y, anchors, p=3.0)
        pairs = nn.functional.pdist(y[0]).sum() + torch.kthvalue(y, 2, dim=1).values.sum()
        pairs = pairs + torch.hypot(y[:, :3], 1 - y[:, :3]).sum()
        return (distances + centre + y.median(dim=1).values.sum(-1)[:, None, None] + pairs) * 0.1


class _ScatterExtrema(nn.Module):
    """scatter_reduce amax/amin (graph networks' max aggregation), with ties between a value and its
    copy (PyTorch shares the gradient among tied elements) and with or without the initial values;
    and a scatter_add whose index covers only part of its (constant) source, as PyTorch allows."""

    def __init__(self):
        super().__init__()
        self.message = nn.Linear(6, 4)

    def forward(self, x):
        messages = self.message(x)  # [nodes, 4]
        doubled = torch.cat([messages, messages[:2]])  # rows 0 and 1 twice: ties
        target = torch.cat([torch.arange(messages.shape[0]) % 3, torch.tensor([0, 1])])
        index = target.unsqueeze(1).expand(-1, 4)
        base = torch.zeros(3, 4) + messages[-1:] * 0.5
        high = base.scatter_reduce(0, index, doubled, reduce="amax")
        low = base.scatter_reduce(0, index, doubled, reduce="amin", include_self=False)
        counts = torch.zeros(3, 4).scatter_add(0, index[:4], torch.ones(messages.shape[0] + 5, 4))
        return high * 2 + low * counts


class _Bucketed(nn.Module):
    """torch.searchsorted (1-D and batched boundaries, left and right) choosing embeddings."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.score = nn.Linear(6, 1)
        self.register_buffer("edges", torch.tensor([-1.0, -0.3, 0.0, 0.4, 1.2]))

    def forward(self, x):
        t = self.score(x).squeeze(-1)
        left = torch.searchsorted(self.edges, t)
        right = torch.searchsorted(self.edges.expand(x.shape[0], -1).contiguous(), t.detach(), right=True)
        return self.embed(left) * t.unsqueeze(-1) + self.embed(right)


class _Transmittance(nn.Module):
    """torch.cumprod (volume rendering's transmittance), with exact zeros in the running product."""

    def __init__(self):
        super().__init__()
        self.density = nn.Linear(6, 1)

    def forward(self, x):
        alpha = torch.sigmoid(self.density(x)).squeeze(-1)  # [rays, samples]
        passed = torch.where(alpha > 0.6, torch.zeros_like(alpha), 1 - alpha)
        return torch.cumprod(passed, dim=1) * alpha + torch.cumprod(x[..., :3], dim=-1).sum(-1)


class _MultiLabelMargin(nn.Module):
    """F.multilabel_margin_loss (whose exporter translation returns other numbers): targets ending
    at a -1 (entries after it ignored), a class listed twice, every reduction, one unbatched sample."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(6, 6)

    def forward(self, x):
        scores = self.score(x)
        order = torch.argsort(x.detach(), dim=-1)  # [N, 6] class indices
        stop = torch.full_like(order[:, :1], -1)
        target = torch.cat([order[:, :2], order[:, :1], stop, order[:, 2:4]], dim=1)
        loss = nn.functional.multilabel_margin_loss
        return (loss(scores, target, reduction="none") + loss(scores, order, reduction="sum")
                + loss(scores[0], target[0]) + loss(scores, target))


class _Spectral(nn.Module):
    """torch.fft: FNet's token mixing (the real part of a 2-D transform) and an rfft magnitude
    spectrum with orthonormal scaling, as spectral losses use (the DFT rule); the imaginary part
    of an inverse transform (a negated view, which had no translation)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):  # [N, T, 6]
        h = self.proj(x)
        mixed = torch.fft.fft(torch.fft.fft(h.to(torch.complex64), dim=-1), dim=-2).real
        spectrum = torch.fft.rfft(h, dim=1, norm="ortho").abs()
        inverse = torch.fft.ifft(h, dim=1).imag
        return mixed.mean(1) * 0.2 + spectrum.mean(1) + inverse.mean(1)


class _StftLoss(nn.Module):
    """torch.stft as a multi-resolution spectral loss on a filtered waveform (centered, reflect
    padded), one resolution with a learned window (the STFT rule's window gradient)."""

    def __init__(self):
        super().__init__()
        self.filter = nn.Conv1d(1, 1, 5, padding=2)
        self.window = nn.Parameter(torch.hann_window(8))

    def forward(self, x):  # [N, T]
        wave = self.filter(x.unsqueeze(1)).squeeze(1)
        fine = torch.stft(wave, 8, hop_length=2, window=self.window, return_complex=True).abs()
        coarse = torch.stft(wave, 16, hop_length=4, window=torch.hann_window(16), center=False,
                            return_complex=True)
        return fine.mean((1, 2)) + torch.view_as_real(coarse).square().mean((1, 2, 3)) * 0.1


class _GammaFunctions(nn.Module):
    """torch.lgamma, digamma and polygamma(1, .) (the exporter has no translations) on positive
    arguments from 1e-2 to 1e3 and on negative ones between poles, and a Beta log-probability."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        t = self.lin(x)
        wide = torch.exp(t * 2.0)  # ~1e-2 .. 1e3
        between = -1.5 + 0.3 * torch.tanh(t)  # between the poles at -2 and -1
        beta = torch.distributions.Beta(nn.functional.softplus(t) + 0.5, 1.2, validate_args=False)
        return (torch.lgamma(wide) * 0.01 + torch.lgamma(between) + torch.digamma(wide) + torch.digamma(between)
                + 0.1 * (torch.polygamma(1, wide + 0.3) + torch.polygamma(1, between)) + beta.log_prob(torch.tensor(0.3)))


class _AdaptivePools(nn.Module):
    """F.adaptive_max_pool2d (windows that tile the input and windows that overlap, the indices
    used, ties after a ReLU: the first maximum takes the gradient), F.adaptive_max_pool1d and
    F.adaptive_avg_pool3d (the exporter translates none of them)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):  # [N, 2, 7, 6]
        y = torch.relu(self.conv(x) - 0.3)
        tiled = nn.functional.adaptive_max_pool2d(y[:, :, :6], (3, 2))
        overlapping, where = nn.functional.adaptive_max_pool2d(y, (3, 4), return_indices=True)
        picked = y.flatten(2).gather(2, where.flatten(2))
        line = nn.functional.adaptive_max_pool1d(y.flatten(2), 5)
        volume = nn.functional.adaptive_avg_pool3d(y.unsqueeze(1), (2, 3, 4))
        return tiled.flatten(1).sum(1) + picked.sum((1, 2)) + overlapping.flatten(1).mean(1) + line.sum((1, 2)) \
            + volume.flatten(1).sum(1)


class _RunningExtremes(nn.Module):
    """torch.cummax and cummin (the exporter has none): values (their gradient to the element
    each index names) and indices, with ties (the latest index wins, as in PyTorch)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):  # [N, T, 5]
        y = self.lin(x)
        tied = torch.round(y * 2) / 2 + y * 1e-3 * (y > 0)  # equal values where y <= 0
        high, where_high = torch.cummax(tied, dim=1)
        low, where_low = torch.cummin(y, dim=-1)
        return high * 2 + low + (where_high.float() - where_low.float()) * 0.1


class _Distributions(nn.Module):
    """torch.distributions with their default argument validation (which branches on the data:
    skipped while capturing): log-probabilities, a KL divergence, entropies."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 6)

    def forward(self, x):
        mean, raw_scale, logits = self.head(x).split([2, 2, 2], dim=-1)
        normal = torch.distributions.Normal(mean, nn.functional.softplus(raw_scale) + 0.1)
        prior = torch.distributions.Normal(torch.zeros_like(mean), torch.ones_like(mean))
        choice = torch.distributions.Categorical(logits=logits)
        beta = torch.distributions.Beta(nn.functional.softplus(logits) + 0.5, 1.5)
        student = torch.distributions.StudentT(3.0, mean, 1.5)  # builds a Chi2 inside: validated too
        terms = (normal.log_prob(x[:, :2]).sum(-1), torch.distributions.kl_divergence(normal, prior).sum(-1),
                 choice.entropy(), choice.log_prob(torch.zeros(x.shape[0], dtype=torch.long)),
                 beta.log_prob(torch.full_like(logits, 0.4)).sum(-1), student.log_prob(x[:, 2:]).sum(-1))
        return torch.stack(terms, dim=-1) * 0.2  # each term its own output (no cancellation between them)


class _MaskedSelect(nn.Module):
    """torch.masked_select (the exporter's translation fails): a data-dependent number of
    elements (another count each call), with a mask broadcast against the values."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        picked = torch.masked_select(y, x > 0)
        row_picked = torch.masked_select(y[:, :1], x > 0.5)  # [N, 1] values, [N, 4] mask
        return y * (picked.square().sum() + row_picked.sum())


class _LinearAlgebra(nn.Module):
    """torch.linalg.inv / torch.inverse, torch.linalg.solve (matrices, vectors, a matrix shared by
    the batch, left=False) and
    torch.linalg.det, batched (the exporter has no translation of the first two; Det had no rule)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):  # [N, 4, 4]
        a = self.lin(x) * 0.3 + 2 * torch.eye(4)
        inverse = torch.linalg.inv(a)
        solved = torch.linalg.solve(a, x[..., :2]) + torch.linalg.solve(a, x[..., 0:1, :], left=False).mT[..., :2]
        vector = torch.linalg.solve(a, x[..., 0])
        shared = torch.linalg.solve(a, x[0, :, :2])  # one [4, 2] right-hand side for the batch: matrices
        return (inverse.sum(-1) + a.inverse().mean(-2) + solved.sum(-1) + vector + shared.sum(-1)
                + torch.linalg.det(a).unsqueeze(-1) * 0.1)


class _Seq2Seq(nn.Module):
    """nn.Transformer with a causal target mask: its forward compares the mask with a causal one
    (data-dependent, which the capture cannot trace) to choose a kernel; the mask is applied."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        target = x[:, :4] * 0.5
        mask = nn.Transformer.generate_square_subsequent_mask(4)
        return self.transformer(x, target, tgt_mask=mask) * 0.1


@pytest.mark.parametrize(("factory", "shape"), [(_Recurrent, (3, 6, 4)), (_Vision, (2, 2, 4, 4)),
                                               (_SingleHeadAttention, (3, 5, 6)), (_MedianDistance, (3, 5, 6)),
                                               (_ScatterExtrema, (5, 6)), (_Bucketed, (4, 5, 6)),
                                               (_Transmittance, (4, 9, 6)), (_Seq2Seq, (3, 5, 8)),
                                               (_MultiLabelMargin, (4, 6)), (_Spectral, (3, 7, 6)),
                                               (_StftLoss, (3, 40)), (_GammaFunctions, (5, 4)),
                                               (_AdaptivePools, (2, 2, 7, 6)), (_RunningExtremes, (3, 9, 5)),
                                               (_Distributions, (5, 4)), (_MaskedSelect, (3, 4)),
                                               (_LinearAlgebra, (3, 4, 4))],
                         ids=["lstm-gru", "interpolate-grid-sample-topk", "attention-3d", "median-cdist",
                              "scatter-amax-amin", "searchsorted", "cumprod", "transformer-causal-mask",
                              "multilabel-margin-loss", "fft", "stft", "gamma-functions",
                              "adaptive-pooling", "cummax-cummin", "distributions", "masked-select",
                              "linalg"])
def test_runs_in_onnxruntime_with_eager_gradients(factory, shape):
    """Twice at the first shape (a static export), then at another batch size (a dynamic one)."""
    eager, wrapped = eager_and_wrapped(factory)
    other = (shape[0] + 2, *shape[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for size in (shape, shape, other):
            assert_steps_match(eager, wrapped, torch.randn(*size))
    assert wrapped.fallback_reason is None and wrapped.export_count == 2


def test_rrelu_draws_its_slopes_in_training_and_uses_their_mean_in_eval():
    """nn.RReLU (the exporter has no translation): in training each input at or below 0 is
    scaled by a slope drawn from U(lower, upper) in every run, and the gradient is that slope;
    in eval the slope is the mean, as in PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 256), nn.RReLU(0.1, 0.3))
    wrapped = ORTModule(model)
    x = torch.randn(32, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        out = wrapped(x)
        pre = model[0](x).detach()
        negative = pre <= 0
        slopes = torch.where(negative, out.detach() / pre, torch.ones_like(pre))
        assert torch.equal(out[~negative], pre[~negative])
        drawn = slopes[negative]
        assert drawn.min() >= 0.1 - 1e-6 and drawn.max() <= 0.3 + 1e-6 and drawn.std() > 0.03
        weight = torch.randn(out.shape)
        (out * weight).sum().backward()
        assert torch.allclose(model[0].bias.grad, (weight * slopes).sum(0), rtol=1e-4, atol=1e-5)
        again = wrapped(x).detach()
        assert not torch.equal(again, out.detach())  # fresh slopes every run
        wrapped.eval()
        torch.testing.assert_close(wrapped(x), nn.functional.leaky_relu(pre, 0.2))


@pytest.mark.parametrize(("name", "function", "tolerance"), [
    ("lgamma", torch.lgamma, 1e-5), ("digamma", torch.digamma, 2e-6),
    ("trigamma", lambda t: torch.polygamma(1, t), 5e-6)])
def test_gamma_function_translations_are_accurate_over_their_domain(name, function, tolerance):
    """Against float64 PyTorch, from -8 (between the poles) to 1e6, values and gradients, as
    ``|ours - exact| / (|exact| + 1)``."""

    class _Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.0))

        def forward(self, t):
            return function(t * self.scale)

    x = torch.cat([torch.linspace(-7.95, -0.05, 400), torch.linspace(0.01, 30, 400), torch.logspace(-3, 6, 200)])
    x = x[((x - x.round()).abs() > 0.05) | (x > 0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        ours = x.clone().requires_grad_(True)
        ORTModule(_Scaled())(ours).sum().backward()
        values = ORTModule(_Scaled())(x).detach()
    exact = x.double().requires_grad_(True)
    function(exact).sum().backward()
    for got, want in ((values, function(x.double())), (ours.grad, exact.grad)):
        assert ((got.double() - want).abs() / (want.abs() + 1)).max() < tolerance, name


def test_cummax_and_cummin_pick_pytorch_indices_with_ties_and_nans():
    class _Both(nn.Module):
        def forward(self, t):
            high, i = torch.cummax(t, 0)
            low, j = torch.cummin(t, 0)
            return torch.stack([high, i.float(), low, j.float()])

    nan = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for t in (torch.tensor([1.0, 1, 0, 2, 2, 0, 0, 5]), torch.tensor([1.0, nan, 0, 2, nan, 3, 1, 1])):
            ours, theirs = ORTModule(_Both())(t), _Both()(t)
            assert torch.equal(ours.nan_to_num(-7.0), theirs.nan_to_num(-7.0))


def test_erfinv_translation_is_accurate_and_infinite_at_the_ends():
    """torch.erfinv (the exporter has none): within 1e-6 (relative) of float64 PyTorch over
    (-1, 1), values and gradients; ±inf at ±1 and NaN beyond, with finite gradients inside."""

    class _Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.0))

        def forward(self, t):
            return torch.erfinv(t * self.scale)

    x = torch.cat([torch.linspace(-0.999999, 0.999999, 2001), torch.tensor([0.0, 1e-7, -1e-30, 1.0, -1.0, 1.5])])
    inside = x.abs() < 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        ours = x.clone().requires_grad_(True)
        values = ORTModule(_Scaled())(ours)
        values[inside].sum().backward()
    exact = x[inside].double().requires_grad_(True)
    torch.erfinv(exact).sum().backward()
    want = torch.erfinv(exact.detach())
    assert ((values[inside].detach().double() - want).abs() / (want.abs() + 1e-30)).max() < 1e-6
    assert ((ours.grad[inside].double() - exact.grad).abs() / exact.grad).max() < 1e-6
    assert torch.equal(values[-3:].detach()[:2], torch.tensor([float("inf"), -float("inf")]))
    assert torch.isnan(values[-1])


def test_a_distribution_that_asks_for_validation_runs_in_pytorch():
    """Only the default validation is skipped while capturing: ``validate_args=True`` is kept,
    and its data-dependent check makes the module run in PyTorch (with the check)."""

    class _Validated(nn.Module):
        def forward(self, x):
            return torch.distributions.Normal(x, x.abs() + 0.1, validate_args=True).log_prob(x)

    default = torch.distributions.Distribution._validate_args  # (torch._dynamo's setup turns it off)
    wrapped = ORTModule(_Validated())
    with pytest.warns(ORTModuleFallbackWarning):
        wrapped(torch.randn(3, 2))
    with pytest.raises(ValueError):
        wrapped(torch.tensor([[0.0, float("nan")]]))
    assert torch.distributions.Distribution._validate_args == default  # restored after the capture


_FAKE_QUANTIZERS = {
    "per-channel-float-zero-point": lambda y: torch.fake_quantize_per_channel_affine(
        y, torch.tensor([0.1, 0.05, 0.2, 0.3]), torch.tensor([0.0, 1.0, 2.5, -3.25]), 1, -8, 7),
    "per-tensor": lambda y: torch.fake_quantize_per_tensor_affine(y, 0.1, 3, -8, 7),
    "tensor-qparams": lambda y: torch.fake_quantize_per_tensor_affine(
        y, torch.tensor([0.07]), torch.tensor([2], dtype=torch.int32), -8, 7),
    "per-channel": lambda y: torch.fake_quantize_per_channel_affine(
        y, torch.tensor([0.1, 0.05, 0.2, 0.3]), torch.tensor([0, 1, -2, 3], dtype=torch.int32), 1, -8, 7),
}
_FAKE_QUANTIZER_SCALES = {"per-channel-float-zero-point": [0.1, 0.05, 0.2, 0.3], "per-tensor": [0.1] * 4,
                          "tensor-qparams": [0.07] * 4, "per-channel": [0.1, 0.05, 0.2, 0.3]}


@pytest.mark.parametrize(("kind", "dtype"), [
    ("per-tensor", torch.float32), ("tensor-qparams", torch.float32), ("per-channel", torch.float32),
    ("per-channel-float-zero-point", torch.float32), ("per-tensor", torch.float16), ("per-channel", torch.float16)])
def test_fake_quantization_trains_with_pytorchs_straight_through_gradient(kind, dtype):
    """torch.fake_quantize_per_tensor_affine / _per_channel_affine (quantization-aware training):
    the exporter's QuantizeLinear/DequantizeLinear pair has no gradient (the module's output did
    not require grad). Ours gives PyTorch's values bit for bit, and its straight-through gradient
    (zero where the value was clipped): also with a float zero point (``round(x / s + z)``, where
    ours added it after rounding) and in float16 (quantized in float32, as PyTorch's kernels: ours
    computed in float16 and missed the grid by an ulp or a step)."""
    quantize = _FAKE_QUANTIZERS[kind]

    class _Quantized(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return quantize(self.lin(x))

    eager, wrapped = eager_and_wrapped(_Quantized)
    eager.to(dtype), wrapped.to(dtype)
    x = (torch.randn(64, 4) * 2).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        ours = wrapped(x)
    theirs = eager(x)
    assert torch.equal(ours, theirs)
    weight = torch.randn(ours.shape).to(dtype)
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(wrapped.module.lin.weight.grad, eager.lin.weight.grad, rtol=tolerance, atol=tolerance)
    assert (eager.lin.weight.grad != 0).any()


@pytest.mark.parametrize("kind", sorted(_FAKE_QUANTIZERS))
def test_float64_fake_quantization_rounds_where_pytorchs_kernels_do(kind):
    """A float64 input to fake quantization: PyTorch's CPU kernels round the scale, its reciprocal,
    the per-tensor values ``(q - z) * s`` and the per-channel ``x / s`` before a float zero point is
    added to float32. Ours computed in float64 throughout: with a scale of 0.1 almost every value
    differed (0.1 against float32's 0.1), and values near a rounding tie landed a step apart."""
    quantize = _FAKE_QUANTIZERS[kind]

    class _Quantized(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4, dtype=torch.float64))

        def forward(self, x):
            return quantize(x * self.gain)

    scales = torch.tensor(_FAKE_QUANTIZER_SCALES[kind], dtype=torch.float64)
    ties = (torch.arange(-12, 12, dtype=torch.float64)[:, None] + 0.5) * scales
    x = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1),
                   torch.randn(64, 4, dtype=torch.float64)])
    eager, wrapped = eager_and_wrapped(_Quantized)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        ours = wrapped(x)
    theirs = eager(x)
    assert torch.equal(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(wrapped.module.gain.grad, eager.gain.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("var_shape", "full", "reduction"), [
    ("same", False, "mean"), ("one-less", True, "sum"), ("last-1", False, "none")])
def test_gaussian_nll_loss_trains_without_its_data_dependent_check(var_shape, full, reduction):
    """F.gaussian_nll_loss / nn.GaussianNLLLoss check ``var`` for negative entries with a branch
    on the data (the capture cannot trace it): captured without it, the same loss and gradients,
    a variance below ``eps`` clamped in value but not in gradient, as PyTorch."""

    class _Heteroscedastic(nn.Module):
        def __init__(self):
            super().__init__()
            self.mean = nn.Linear(4, 3)
            self.spread = nn.Linear(4, 3)
            self.loss = nn.GaussianNLLLoss(full=full, eps=1e-3, reduction=reduction)

        def forward(self, x):
            var = nn.functional.softplus(self.spread(x)) * (x[:, :1] > -1.0)  # some exactly 0: clamped
            var = {"same": var, "one-less": var[:, 0], "last-1": var[:, :1]}[var_shape]
            return self.loss(self.mean(x), x[:, 1:], var)

    eager, wrapped = eager_and_wrapped(_Heteroscedastic)
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        ours = wrapped(x)
    theirs = eager(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    weight = torch.randn(ours.shape)
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()
    for name in ("mean.weight", "spread.weight", "spread.bias"):
        torch.testing.assert_close(wrapped.module.get_parameter(name).grad, eager.get_parameter(name).grad,
                                   rtol=1e-4, atol=1e-5, msg=name)


def test_the_grouped_product_of_mixture_of_experts_layers_with_empty_experts():
    """transformers' ``grouped_mm_fallback`` (rows sorted by expert, ``offs`` each expert's end):
    one product per expert, an expert without rows included, new row counts on each call."""
    pytest.importorskip("transformers.integrations.moe")
    grouped = torch.ops.transformers.grouped_mm_fallback

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 4, 5))

        def forward(self, rows, offsets):
            return grouped(rows, self.weight, offsets)

    eager, wrapped = eager_and_wrapped(Experts, debug_options=DebugOptions(fallback=False))
    for count, ends in ((6, [2, 2, 6]), (9, [0, 4, 9]), (5, [5, 5, 5])):
        rows = torch.randn(count, 4, requires_grad=True)
        offsets = torch.tensor(ends, dtype=torch.int32)
        outputs, row_grads = [], []
        for model in (wrapped, eager):
            model.zero_grad()
            given = rows.detach().clone().requires_grad_()
            out = model(given, offsets)
            (out * torch.arange(5.0)).sum().backward()
            outputs.append(out.detach())
            row_grads.append(given.grad)
        torch.testing.assert_close(outputs[0], outputs[1])
        torch.testing.assert_close(row_grads[0], row_grads[1])
        torch.testing.assert_close(wrapped.module.weight.grad, eager.weight.grad)
    assert wrapped.export_count == 2  # the first call's row count, then a dynamic one


@pytest.mark.parametrize("bias", [False, True])
def test_conv3d_with_and_without_bias(bias):
    # the exporter wrote a missing Conv3d bias as zeros of shape [C_out, 2]: onnxruntime failed the run
    eager, wrapped = eager_and_wrapped(lambda: torch.nn.Conv3d(2, 3, 3, padding=1, stride=(1, 2, 1), bias=bias),
                                       debug_options=DebugOptions(fallback=False))
    assert_steps_match(eager, wrapped, torch.randn(2, 2, 4, 5, 6))


class _DroppedAttention(nn.Module):
    """Attention whose value is the identity: each output is the attention weights after dropout
    (no mask, a boolean mask, a float mask)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x, value):
        q = self.q(x).unflatten(-1, (2, 2)).transpose(1, 2)  # [batch, 2 heads, sequence, 2]
        return tuple(nn.functional.scaled_dot_product_attention(q, q, value, attn_mask=mask, dropout_p=0.5)
                     for mask in _attention_masks(x.shape[1]))


def _attention_masks(length):
    return None, torch.ones(length, length, dtype=torch.bool).tril(), torch.zeros(length, length)


def test_attention_dropout_applies_in_training():
    """F.scaled_dot_product_attention(dropout_p=0.5): the exporter's Dropout had no training mode,
    so nothing was dropped (every Hugging Face sdpa model trained without attention dropout). Each
    weight is now 0 or twice PyTorch's undropped one, and the gradient uses the same mask."""
    torch.manual_seed(0)
    wrapped = ORTModule(_DroppedAttention(), DebugOptions(fallback=False))
    x = torch.randn(3, 6, 4)
    value = torch.eye(6).expand(3, 2, 6, 6).clone().requires_grad_(True)
    outputs = wrapped(x, value)
    incoming = [torch.randn_like(dropped) for dropped in outputs]
    sum((dropped * g).sum() for dropped, g in zip(outputs, incoming)).backward()
    with torch.no_grad():
        q = wrapped.module.q(x).unflatten(-1, (2, 2)).transpose(1, 2)
        every_weight = [nn.functional.scaled_dot_product_attention(q, q, value, attn_mask=mask)
                        for mask in _attention_masks(6)]
    for dropped, weights in zip(outputs, every_weight):
        kept = dropped != 0
        assert 0.3 < kept[weights != 0].float().mean() < 0.7
        torch.testing.assert_close(dropped[kept], 2 * weights[kept], rtol=1e-5, atol=1e-6)
    # d/d value of sum(D @ value * g) = D^T g, D the dropped weights (= the output here)
    expected = sum(dropped.detach().transpose(-1, -2) @ g for dropped, g in zip(outputs, incoming))
    torch.testing.assert_close(value.grad, expected, rtol=1e-5, atol=1e-6)
