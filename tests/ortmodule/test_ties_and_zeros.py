"""Values and gradients at ties and zeros as PyTorch defines them: ``max``/``min`` over a dim send the
gradient to the returned index only (the exporter's ReduceMax split it among ties), ``amax()``
over every axis exports, ``x ** 0`` has a zero gradient at 0 (0 * 0^-1 was NaN), ``std`` of equal
elements and p-norms of a zero vector have a zero gradient (the root's infinite derivative made
NaN), ``atan2`` keeps PyTorch's signed zeros and a finite gradient on the axes, and attention
rows masked by -inf everywhere give zeros (they were NaN); a stable sort keeps the order of ties;
``fmax``/``fmin`` skip NaNs and give ties to their first argument; ``median()`` shares its
gradient among tied elements, and a median over a slice with a NaN is NaN, while ``nanmedian`` leaves
NaNs out; ``copysign`` reads a negative zero's sign; binary cross entropy
on probabilities of exactly 0 and 1 has PyTorch's finite gradient (it was NaN); ``hypot`` neither
overflows nor underflows."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import FunctionModule  # noqa: E402

F = torch.nn.functional

TIES = torch.tensor([[2.0, 5.0, 5.0], [-1.0, 5.0, 0.0], [3.0, 3.0, -4.0]])
ZEROS = torch.zeros(2, 3)


def _assert_input_gradient_matches(function, x, rtol=None, atol=None):
    expected_input = x.clone().requires_grad_()
    expected = function(expected_input)
    (expected_grad,) = torch.autograd.grad((expected * torch.arange(1.0, expected.numel() + 1).reshape(
        expected.shape)).sum(), expected_input)
    wrapped = ORTModule(FunctionModule(function), DebugOptions(fallback=False))
    got_input = x.clone().requires_grad_()
    got = wrapped(got_input)
    (got_grad,) = torch.autograd.grad((got * torch.arange(1.0, got.numel() + 1).reshape(got.shape)).sum(), got_input)
    torch.testing.assert_close(got.detach(), expected.detach(), equal_nan=True, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_grad, expected_grad, equal_nan=True, rtol=rtol, atol=atol)


@pytest.mark.parametrize("function", [
    lambda x: x.max(dim=1).values,
    lambda x: x.max(dim=0, keepdim=True).values,
    lambda x: torch.min(-x, dim=1)[0],
    lambda x: x.max(dim=1).indices.float() + x.max(dim=1).values,
    lambda x: x.amax(),
    lambda x: x.amin(),
    lambda x: x.amax(dim=(0, 1), keepdim=True),
    lambda x: x.median(),
    lambda x: torch.cat([x.reshape(-1), torch.tensor([float("inf"), -float("inf")])]).median(),
    lambda x: (x * 2).median(dim=1).values,
], ids=["max dim", "max dim keepdim", "min dim", "max indices", "amax all", "amin all", "amax dims", "median all", "median all with infinities",
        "median dim"])
def test_ties(function):
    _assert_input_gradient_matches(function, TIES)


@pytest.mark.parametrize("function", [
    lambda x: x ** 0,
    lambda x: torch.pow(x.abs(), x),
    lambda x: x.std(dim=1),
    lambda x: x.std(),
    lambda x: torch.std(x, dim=0, correction=0, keepdim=True),
    lambda x: torch.linalg.vector_norm(x, ord=3, dim=1),
    lambda x: torch.linalg.vector_norm(x, ord=0.5),
    lambda x: x.norm(p=4),
    lambda x: x / x.norm(keepdim=True),
    lambda x: torch.linalg.vector_norm(x, ord=3, keepdim=True),
    lambda x: torch.std_mean(x, dim=1)[0],
    lambda x: torch.stack(torch.std_mean(x, dim=0, correction=0, keepdim=True)),
], ids=["pow 0", "pow tensor", "std dim", "std all", "std correction 0", "norm 3", "norm 0.5", "norm 4", "norm keepdim", "norm 3 keepdim", "std_mean dim",
        "std_mean dim correction 0"])
def test_zeros(function):
    _assert_input_gradient_matches(function, torch.cat([ZEROS, TIES[:1] - 2.0]))


def test_the_count_of_nonzero_elements_has_a_zero_gradient():
    """``vector_norm(x, ord=0)`` counts nonzero elements: PyTorch's gradient is undefined (no
    gradient), ours zeros; ORTModule refused the input ("gives no gradient to x")."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.5, 0.0, -2.0], [0.0, -0.0, 0.0], [inf, nan, 1.0]])
    wrapped = ORTModule(FunctionModule(lambda t: torch.linalg.vector_norm(t, ord=0, dim=1)), DebugOptions(fallback=False))
    got_input = x.clone().requires_grad_()
    got = wrapped(got_input)
    torch.testing.assert_close(got.detach(), torch.linalg.vector_norm(x, ord=0, dim=1))
    (got_grad,) = torch.autograd.grad(got.sum(), got_input)
    torch.testing.assert_close(got_grad, torch.zeros_like(x))


@pytest.mark.parametrize("function", [torch.fmax, torch.fmin])
def test_fmax_and_fmin_ignore_nans_and_give_ties_to_the_first_argument(function):
    """``torch.fmax``/``fmin`` (they fell back: the exporter has no translation)."""
    nan = float("nan")
    a = torch.tensor([1.0, 2.0, 3.0, nan, nan, 5.0])
    _assert_input_gradient_matches(lambda x: function(x, a.flip(0) - 1.0) + function(a, x), a)


@pytest.mark.parametrize("ord_", [3.0, 0.5, -1.0, float("inf"), 1.0, 2.0])
def test_norms_of_every_order_elsewhere(ord_):
    x = torch.tensor([[1.5, -2.0, 0.5], [3.0, 1.0, -1.0]])
    _assert_input_gradient_matches(lambda x: torch.linalg.vector_norm(x, ord=ord_, dim=1), x)


def test_atan2_on_the_axes_and_at_the_origin():
    """Signed zeros as PyTorch (+π above the negative x axis, ±π/2 on the y axis whatever the zero's
    sign), and the gradient finite everywhere: 0 at the origin, ``(x dy - y dx) / r²`` elsewhere."""
    y = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -2.0, 0.0, 3.0, -1.0, 0.0])
    x = torch.tensor([-1.0, -1.0, 0.0, -0.0, -0.0, 0.0, 0.0, 4.0, -2.0, 2.0])
    _assert_input_gradient_matches(lambda t: torch.atan2(t[0], t[1]), torch.stack([y, x]))


@pytest.mark.parametrize("rank", [3, 4])
def test_attention_rows_masked_by_minus_infinity_give_zeros(rank):
    """``scaled_dot_product_attention`` with a float mask whose first query row is -inf everywhere:
    PyTorch's zeros there (and zero gradients); the exporter's softmax made the row NaN."""
    keep = torch.tril(torch.ones(4, 4, dtype=torch.bool), diagonal=-1)
    mask = torch.where(keep, 0.25, float("-inf"))
    shape = (2, 4, 3) if rank == 3 else (2, 2, 4, 3)

    def attention(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q * 2, q * 3, attn_mask=mask)

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    _assert_input_gradient_matches(attention, x, rtol=1e-4, atol=1e-5)  # two softmaxes, rounding apart


@pytest.mark.parametrize("dim", [1, -1])
def test_safe_softmax_of_a_slice_masked_throughout_is_zero_with_a_zero_gradient(dim):
    """``aten._safe_softmax`` (PyTorch's attention decompositions): its gradient was NaN there."""
    inf = float("inf")
    x = torch.tensor([[[1.0, -inf, 0.5], [2.0, -inf, -inf], [0.5, -inf, 3.0]]])
    _assert_input_gradient_matches(lambda t: torch.ops.aten._safe_softmax.default(t, dim), x)


class _MaskedAttentionRow(torch.nn.Module):
    """A hand-written masked softmax whose fully masked row (NaN) is zeroed afterwards."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x, mask):
        attention = self.proj(x).masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return attention.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def test_a_fully_masked_softmax_row_zeroed_afterwards_has_zero_gradients():
    """The gradient through ``masked_fill(mask, -inf)`` is chosen exactly: as ``dy * mask`` the
    NaN that the masked row's softmax sends back made every weight gradient NaN; PyTorch's is 0."""
    torch.manual_seed(0)
    eager = _MaskedAttentionRow()
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    x, mask = torch.randn(2, 3), torch.tensor([[True, False, True], [False, False, False]])
    weights = torch.randn(2, 3)
    grads = []
    for module in (eager, wrapped):
        source = x.clone().requires_grad_()
        (module(source, mask) * weights).sum().backward()
        grads.append([source.grad, *(p.grad for p in module.parameters())])
    for ours, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("function", [
    lambda h: torch.sqrt(torch.relu(h)), lambda h: torch.relu(h) ** 0.5,
    lambda h: torch.log(torch.relu(h)).clamp(min=-10), lambda h: (torch.relu(h) * 2).sqrt(),
    lambda h: torch.where(h > 0, h, 0.0).sqrt(), lambda h: h.masked_fill(h < 0, 0.0).sqrt(),
    lambda h: F.threshold(h, 0.1, 0.0).sqrt(), lambda h: F.softshrink(h, 0.5).abs().sqrt(),
    lambda h: F.hardswish(h * 4.0 - 3.0).abs().sqrt(),
], ids=["sqrt relu", "relu pow half", "log relu", "scaled relu sqrt", "where sqrt", "masked_fill sqrt",
        "threshold sqrt", "softshrink sqrt", "hardswish sqrt"])
def test_a_masked_value_meeting_an_infinite_derivative_has_pytorchs_gradient(function):
    """A mask (ReLU, ``where``, ``masked_fill``, threshold, the flat parts of softshrink and
    hardswish) before a square root or logarithm: the
    masked positions' gradient is inf, and PyTorch's mask gives 0 there. As ``dy * mask`` it was
    NaN, and every weight gradient with it; such masks are chosen exactly, with a Where."""
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 6)

        def forward(self, x):
            return function(self.linear(x))

    torch.manual_seed(0)
    eager = Masked()
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    x = torch.randn(5, 4)
    for module in (eager, wrapped):
        module(x).sum().backward()
    assert torch.isfinite(eager.linear.weight.grad).all()
    for ours, theirs in zip(wrapped.module.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("descending", [False, True])
def test_stable_sort_keeps_the_order_of_ties(descending):
    """``torch.sort(stable=True)`` / ``argsort(stable=True)`` did not export (a fallback); equal
    values keep their order, as PyTorch's, and the values' gradient goes where they came from."""
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 3.0], [0.0, 0.0, 5.0, -1.0, 5.0, 0.0]])

    def stable(t):
        values, indices = torch.sort(t, dim=1, descending=descending, stable=True)
        return values * torch.arange(1.0, 7.0) + indices.float()

    _assert_input_gradient_matches(stable, x)


@pytest.mark.parametrize("function", [
    lambda x: x.max(), lambda x: x.min(), lambda x: x.amax(1), lambda x: x.amin(0, keepdim=True),
    lambda x: x.max(1).values, lambda x: x.min(1).indices, lambda x: torch.max(x, 0)[1],
    lambda x: x.argmax(), lambda x: x.argmin(1), lambda x: torch.argmax(x, 0, keepdim=True),
    lambda x: x.argmin(keepdim=True), lambda x: x[1].argmax(),
    lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1), lambda x: torch.linalg.vector_norm(x, -float("inf")),
], ids=["max", "min", "amax dim", "amin keepdim", "max dim", "min dim indices", "max dim 0 indices", "argmax",
        "argmin dim", "argmax dim keepdim", "argmin keepdim", "argmax without nan", "inf norm dim", "-inf norm"])
def test_a_nan_among_the_candidates_of_a_maximum_or_minimum_is_the_result(function):
    """onnxruntime's reductions and ArgMax keep a NaN only where it comes first; PyTorch returns it
    (``argmax``/``argmin`` and the ±inf norms skipped it)."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 3.0, -2.0], [5.0, 2.0, 1.0, 0.0], [inf, 2.0, nan, 1.0], [nan, nan, 1.0, 2.0]])
    wrapped = ORTModule(FunctionModule(function), DebugOptions(fallback=False))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), function(x), equal_nan=True)


@pytest.mark.parametrize("function", [
    lambda x: x.median(dim=1).values, lambda x: x.median(dim=0, keepdim=True).values,
    lambda x: x.median(dim=1).indices.float() + x.median(dim=1).values, lambda x: x.median(),
    lambda x: x[1].median(), lambda x: torch.kthvalue(x, 3, dim=1).values,
    lambda x: torch.kthvalue(x, 2, dim=0).indices.float() + torch.kthvalue(x, 2, dim=0).values,
], ids=["median dim", "median dim keepdim", "median dim indices", "median all", "median all of a row without nan",
        "kthvalue", "kthvalue indices"])
def test_medians_with_nans_are_nan_at_the_first_nan(function):
    """``median`` of a slice holding a NaN is NaN, its index the first NaN's and its gradient goes
    there, as PyTorch's (onnxruntime's TopK orders NaNs last, and the median skipped them);
    ``kthvalue`` counts NaNs as the largest values, as PyTorch's sort."""
    nan = float("nan")
    x = torch.tensor([[1.0, nan, 3.0, -2.0, nan], [5.0, 2.0, 1.0, 0.0, 4.0], [nan, 2.5, 2.0, 1.0, -1.0]])
    _assert_input_gradient_matches(function, x)


@pytest.mark.parametrize("function", [
    lambda x: x[:3].nanmedian(dim=1).values, lambda x: x[:3].nanmedian(dim=0, keepdim=True).values,
    lambda x: x[:3].nanmedian(dim=1).indices.float() + x[:3].nanmedian(dim=1).values, lambda x: x.nanmedian(),
    lambda x: x[3].nanmedian(), lambda x: x[1].nanmedian(0).values,
    lambda x: (x[:3] * 2).long().nanmedian(1).values.float() * x[:3, 0],
], ids=["dim", "dim keepdim", "dim indices", "all", "all of nans", "without nan", "integers"])
def test_nanmedian_leaves_nans_out(function):
    """``nanmedian`` (which the exporter lacks) is the median of each slice's numbers, its gradient
    at that element (shared by the elements equal to it, over all elements; by the NaNs, if all are)."""
    _assert_input_gradient_matches(function, _WITH_NANS)


def test_nanmedian_of_a_slice_of_nans_only_is_nan():
    # (at index 0; PyTorch's index there is whichever NaN its selection leaves first)
    wrapped = ORTModule(FunctionModule(lambda x: x.nanmedian(dim=1)), DebugOptions(fallback=False))
    values, indices = wrapped(_WITH_NANS)
    torch.testing.assert_close(values, _WITH_NANS.nanmedian(dim=1).values, equal_nan=True)
    assert indices[3] == 0


_WITH_NANS = torch.tensor([[1.0, float("nan"), 3.0, -2.0, float("nan")], [5.0, 2.0, 1.0, 0.0, 4.0],
                           [float("nan"), 2.5, 2.0, 1.0, -1.0], [float("nan")] * 5])


@pytest.mark.parametrize("function", [
    lambda x: torch.copysign(x, x.flip(1)), lambda x: torch.copysign(x, -0.0), lambda x: torch.copysign(x, 2),
    lambda x: torch.copysign(x[0], torch.tensor([1.0, -1.0, 0.0, -0.0])),
    lambda x: torch.copysign(x.long(), x[:, :1]) * x,
], ids=["tensor", "negative zero", "number", "signed zeros", "integers"])
def test_copysign_takes_signed_zeros_and_pytorchs_gradient(function):
    """``copysign`` (which the exporter lacks): a negative zero's sign counts; the gradient is 0
    where ``x`` is 0, as PyTorch's."""
    x = torch.tensor([[1.5, -2.0, 0.0, 3.0], [-0.0, 2.5, -1.0, 0.5]])
    _assert_input_gradient_matches(function, x)


@pytest.mark.parametrize("function", [
    lambda x: x.median(0).values * 2 + x.median(0).indices, lambda x: torch.kthvalue(x, 1, 0).values,
    lambda x: x.median(), lambda x: torch.cummax(x, 0).values + torch.cummin(x, -1).indices,
    lambda x: torch.cumprod(x, 0) * 3,
], ids=["median dim", "kthvalue", "median all", "cummax cummin", "cumprod"])
def test_reductions_along_the_only_dim_of_a_0d_tensor(function):
    """A 0-d tensor's median, kth value, running extremes and products along dim 0 are the tensor
    itself (index 0); their translations failed the export on the missing axis."""
    _assert_input_gradient_matches(function, torch.tensor(1.5))


@pytest.mark.parametrize("function", [
    lambda x: (x > 0).max(1).values.float(), lambda x: (x > 0).min(0).indices.float(),
    lambda x: (x * 10).long().max().float(), lambda x: (x * 10).int().amax(1).float(),
], ids=["bool max dim", "bool min dim indices", "int max", "int amax dim"])
def test_maxima_of_integers_and_booleans(function):
    x = torch.tensor([[1.5, -2.0, 0.5], [-3.0, 1.0, 0.25], [0.0, -1.0, -0.5]])
    wrapped = ORTModule(FunctionModule(lambda x: function(x) * x.sum()), DebugOptions(fallback=False))
    torch.testing.assert_close(wrapped(x), function(x) * x.sum())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy_at_probabilities_of_zero_and_one(reduction):
    """Probabilities clamped to exactly 0 and 1, and given as 0 and 1: the logarithms are clamped
    at -100 and the gradient is PyTorch's ``(p - t) / max(p (1 - p), 1e-12)``."""
    target = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.3], [1.0, 0.0, 0.5]])
    weight = torch.tensor([0.5, 2.0, 1.0])
    F = torch.nn.functional
    _assert_input_gradient_matches(lambda x: F.binary_cross_entropy(x.clamp(0.0, 1.0), target, reduction=reduction),
                                   torch.tensor([[1.5, -0.5, 0.2], [0.0, 1.0, 0.6], [0.9, 0.1, 2.0]]))
    _assert_input_gradient_matches(lambda x: F.binary_cross_entropy(x, target, weight=weight, reduction=reduction),
                                   torch.tensor([[1.0, 0.0, 0.25], [0.0, 1.0, 0.6], [0.999, 1e-30, 0.5]]),
                                   rtol=1e-5, atol=1e-5)


def test_binary_cross_entropy_target_gradient():
    # (PyTorch's is -logit(p): infinite at p = 0 and 1, where ours is the clamped logarithms' ±100)
    probabilities = torch.tensor([[0.2, 0.9], [1e-6, 0.999]])
    F = torch.nn.functional
    _assert_input_gradient_matches(lambda t: F.binary_cross_entropy(probabilities, t.sigmoid()), torch.randn(2, 2))


def test_binary_cross_entropy_of_a_saturated_float64_sigmoid():
    """float64: 1 - sigmoid(40) is 0 and its logarithm's gradient 0 * inf (NaN where PyTorch gives 0)."""
    z = torch.tensor([40.0, -40.0, 0.3, -2.0], dtype=torch.float64)
    t = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    F = torch.nn.functional
    _assert_input_gradient_matches(lambda x: F.binary_cross_entropy(torch.sigmoid(x), t), z)


@pytest.mark.parametrize("p", [3.0, 1.5, 0.5])
def test_distances_of_other_orders_at_zero(p):
    """cdist and pdist of orders other than 0, 1, 2 and inf end in a root, whose infinite
    derivative at a zero distance made every gradient NaN (pdist picks from cdist(x, x), whose
    diagonal is zero); PyTorch's gradient there is 0."""
    points = torch.tensor([[0.0, 1.0], [2.0, -1.0], [0.0, 1.0], [1.5, 0.5]])
    _assert_input_gradient_matches(lambda x: torch.nn.functional.pdist(x, p), points, rtol=1e-5, atol=1e-5)
    _assert_input_gradient_matches(lambda x: torch.cdist(x, points[:2], p), points, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("function", [
    lambda t: torch.cummax(t, 1), lambda t: torch.cummin(t, 1), lambda t: torch.cummax(t > 2, 1),
    lambda t: torch.fmax(t, t.flip(1)), lambda t: torch.fmin(t, t.flip(1)),
], ids=["cummax", "cummin", "cummax bool", "fmax", "fmin"])
def test_nan_aware_translations_of_integers(function):
    """Integers and booleans hold no NaN: IsNaN refuses them, and the graph did not load."""
    t = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    expected = function(t)
    got = ORTModule(FunctionModule(function), DebugOptions(fallback=False))(t)
    for e, g in zip(expected if isinstance(expected, tuple) else (expected,), got if isinstance(got, tuple) else (got,)):
        assert torch.equal(e, g)


@pytest.mark.parametrize("function", [
    lambda base, index, src: torch.scatter(base, 1, index, src),
    lambda base, index, src: torch.scatter_add(base, 1, index, src),
], ids=["scatter", "scatter_add"])
def test_a_scatter_from_a_constant_larger_than_its_index(function):
    """PyTorch reads only the part of ``src`` the index covers; a ``src`` that needs no gradient
    (a constant) cut to it had no shape, and the export raised a TypeError."""
    index = torch.tensor([[0, 1, 2], [1, 2, 3]])
    src = torch.arange(10.0).reshape(2, 5)
    _assert_input_gradient_matches(lambda base: function(base, index, src), torch.randn(2, 5))


def test_atan2_of_infinite_and_huge_arguments():
    """The gradient's carrier multiplied the arguments (x * y - y * x): NaN values for an infinite
    argument or beyond ~1e19 in float32 (PyTorch's values; its gradients are NaN at infinities)."""
    y = torch.tensor([float("inf"), 0.0, -float("inf"), 3.0])
    x = torch.tensor([1.0, float("inf"), 2.0, -4.0])
    got = ORTModule(FunctionModule(lambda v: torch.atan2(v, x)), DebugOptions(fallback=False))(y)
    torch.testing.assert_close(got, torch.atan2(y, x))
    huge = torch.tensor([1e20, -3e19, 2.0, 5e19])
    _assert_input_gradient_matches(lambda v: torch.atan2(v, huge.flip(0)), huge, rtol=1e-6, atol=1e-6)


def test_hypot_of_huge_tiny_and_infinite_arguments():
    """``torch.hypot`` squared its arguments: inf beyond ~1.8e19 in float32 and 0 below ~1e-19.
    Values and gradients match PyTorch's (NaN at the origin, as PyTorch's); infinite arguments
    give inf even against a NaN."""
    a = torch.tensor([3e30, 1e-30, 3.0, -4.0, 0.0, 2e38, -5e-37])
    b = torch.tensor([4e30, 1e-30, 3.0, 0.0, -0.0, 2e38, 1e-36])
    _assert_input_gradient_matches(lambda x: torch.hypot(x[0], x[1]), torch.stack([a, b]))
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([[inf, nan, -inf, nan, 1.0], [nan, -inf, 2.0, 1.0, nan]])
    wrapped = ORTModule(FunctionModule(lambda x: torch.hypot(x[0], x[1])), DebugOptions(fallback=False))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(special), torch.hypot(special[0], special[1]), equal_nan=True)

