"""SoftmaxNaNGuardPass: the exporter's NaN guard after a masked Softmax becomes a per-row factor.

Rows with a kept entry must come out bit-identical to the exporter's graph; fully masked rows
as PyTorch's attention gives them (zeros).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir import io
from onnxtrain.passes.softmax_guard import SoftmaxNaNGuardPass
from tests.passes._graphs import model_of, run

B, H, T, S, D = 3, 2, 5, 6, 4
LOWEST32 = float(np.finfo(np.float32).min)


def _const(name, value, dtype=np.float32):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype=dtype)))


def _attention(masked, kept=0.0, *, mask_first=False, cond_true_masks=False, softmax_axis=-1, fill=0.0,
               dtype=np.float32):
    """scores [B, H, T, S] + Where(cond, kept, masked) -> Softmax -> NaN guard -> MatMul with v -> [B, T, H, D]."""
    branches = ["masked", "kept"] if cond_true_masks else ["kept", "masked"]
    add_inputs = ["mask", "scores"] if mask_first else ["scores", "mask"]
    return [
        _const("kept", kept, dtype), _const("masked", masked, dtype), _const("fill", fill, dtype),
        helper.make_node("Where", ["cond", *branches], ["mask"]),
        helper.make_node("Add", add_inputs, ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=softmax_axis),
        helper.make_node("IsNaN", ["probs"], ["nan"]),
        helper.make_node("Where", ["nan", "fill", "probs"], ["guarded"]),
        helper.make_node("MatMul", ["guarded", "v"], ["context"]),
        helper.make_node("Transpose", ["context"], ["out"], perm=[0, 2, 1, 3]),
    ]


def _model(nodes, cond_shape=(B, 1, T, S), elem=TensorProto.FLOAT, opset=18, outputs=("out",)):
    inputs = [("scores", [B, H, T, S]), ("cond", list(cond_shape), TensorProto.BOOL), ("v", [B, H, S, D])]
    return model_of(nodes, inputs, list(outputs), elem=elem, opset=opset)


def _feeds(cond_shape=(B, 1, T, S), dtype=np.float32, seed=0, cond_true_masks=False):
    rng = np.random.default_rng(seed)
    keep = rng.random(cond_shape) < 0.6
    keep[..., 1, :] = False                 # a fully masked query row (in every batch when the mask has one)
    keep[..., 2, :] = True                  # a row with nothing masked
    if len(cond_shape) == 4:
        keep[1] = False                     # a sequence that is all padding
    cond = ~keep if cond_true_masks else keep
    return {"scores": rng.standard_normal((B, H, T, S)).astype(dtype), "cond": cond,
            "v": rng.standard_normal((B, H, S, D)).astype(dtype)}, keep


def _pytorch_attention(feeds, keep):
    """Softmax over the kept entries, zeros for a row without any (torch's scaled_dot_product_attention)."""
    scores = feeds["scores"].astype(np.float64)
    keep = np.broadcast_to(keep, scores.shape)
    logits = np.where(keep, scores, -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    e = np.where(keep, np.exp(logits - np.where(np.isfinite(top), top, 0)), 0.0)
    total = e.sum(-1, keepdims=True)
    probs = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return (probs @ feeds["v"].astype(np.float64)).transpose(0, 2, 1, 3)


def _rewritten(original):
    model = io.load_model(original)
    assert SoftmaxNaNGuardPass()(model).modified
    ops = [n.op_type for n in model.graph]
    return io.to_proto(model), ops


def _row_factor_reads(proto):
    """The op types whose outputs the per-row factor multiplies."""
    graph = proto.graph
    producers = {o: n.op_type for n in graph.node for o in n.output}
    return [producers.get(n.input[0]) for n in graph.node if n.op_type == "Mul" and n.name.endswith("/rows")]


def _rows_with_a_kept_entry(keep, shape):
    return np.broadcast_to(keep.any(-1, keepdims=True), shape)


@pytest.mark.parametrize("masked", [LOWEST32, -np.inf], ids=["lowest", "minus_inf"])
@pytest.mark.parametrize("form", ["plain", "mask_first", "cond_true_masks", "opset17", "mask_per_head"])
def test_rows_match_the_exporter_and_fully_masked_rows_are_zero(masked, form):
    cond_true_masks = form == "cond_true_masks"
    cond_shape = (B, H, T, S) if form == "mask_per_head" else (B, 1, T, S)
    nodes = _attention(masked, mask_first=form == "mask_first", cond_true_masks=cond_true_masks)
    original = _model(nodes, cond_shape, opset=17 if form == "opset17" else 18)
    rewritten, ops = _rewritten(original)
    # the rewritten graph: no IsNaN, one Softmax feeding a Mul by the per-row factor
    assert "IsNaN" not in ops and ops.count("ReduceMax") == 1
    # the attention product alone reads the probabilities: its rows are zeroed, not the probabilities'
    assert _row_factor_reads(rewritten) == ["MatMul"]
    feeds, keep = _feeds(cond_shape, cond_true_masks=cond_true_masks)
    (expected,), (got,) = run(original, feeds), run(rewritten, feeds)
    rows = np.broadcast_to(_rows_with_a_kept_entry(keep, (B, H, T, 1)), (B, H, T, D)).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(got[rows], expected[rows])  # bit-identical where a key is kept
    np.testing.assert_array_equal(got[~rows], 0.0)            # PyTorch's zeros elsewhere
    np.testing.assert_allclose(got, _pytorch_attention(feeds, keep), rtol=1e-5, atol=1e-6)
    if masked == -np.inf:  # the guard itself worked there: the whole output is the same
        np.testing.assert_array_equal(got, expected)


def test_mask_of_lower_rank_than_the_scores():
    original = _model(_attention(LOWEST32), cond_shape=(T, S))
    rewritten, _ = _rewritten(original)
    feeds, keep = _feeds((T, S))
    (got,) = run(rewritten, feeds)
    np.testing.assert_allclose(got, _pytorch_attention(feeds, keep), rtol=1e-5, atol=1e-6)
    assert np.all(got[:, 1] == 0.0)  # query row 1 of every head


def test_double():
    original = _model(_attention(float(np.finfo(np.float64).min), dtype=np.float64), elem=TensorProto.DOUBLE)
    rewritten, ops = _rewritten(original)
    assert "Mul" in ops
    feeds, keep = _feeds(dtype=np.float64)
    (got,) = run(rewritten, feeds)
    np.testing.assert_allclose(got, _pytorch_attention(feeds, keep), rtol=1e-12, atol=1e-12)


def test_a_mask_that_never_masks_drops_the_guard():
    """Both branches finite and above the dtype's lowest: no row can be NaN, nothing to zero."""
    original = _model(_attention(-1e4))
    rewritten, ops = _rewritten(original)
    assert "IsNaN" not in ops and "ReduceMax" not in ops and "Mul" not in ops
    feeds, _ = _feeds()
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(original, feeds)[0])


@pytest.mark.parametrize("case", ["fill_not_zero", "softmax_not_last_axis", "both_branches_mask", "mask_not_constant",
                                  "guard_is_graph_output"])
def test_other_forms_are_left_alone(case):
    nodes = _attention(LOWEST32, fill=1.0 if case == "fill_not_zero" else 0.0,
                       softmax_axis=2 if case == "softmax_not_last_axis" else -1,
                       kept=LOWEST32 if case == "both_branches_mask" else 0.0)
    outputs = ("out",)
    if case == "mask_not_constant":  # the kept branch computed at run time
        nodes[0] = helper.make_node("ReduceMin", ["v"], ["kept"], keepdims=0)
    if case == "guard_is_graph_output":
        outputs = ("out", "guarded")
    model = io.load_model(_model(nodes, outputs=outputs))
    assert not SoftmaxNaNGuardPass()(model).modified


def test_guarded_probabilities_read_twice():
    """Every reader of the guard's output reads the rewritten probabilities."""
    nodes = _attention(-np.inf) + [helper.make_node("ReduceSum", ["guarded"], ["row_sums"], keepdims=0)]
    original = _model(nodes, outputs=("out", "row_sums"))
    rewritten, _ = _rewritten(original)
    assert _row_factor_reads(rewritten) == ["Softmax"]  # two readers: the probabilities themselves are scaled
    feeds, _ = _feeds()
    for expected, got in zip(run(original, feeds), run(rewritten, feeds)):
        np.testing.assert_array_equal(got, expected)


def _folded_attention(mask):
    """The exporter's graph for a constant boolean mask once folding has run: the mask's
    ``Where`` is a constant float tensor."""
    nodes = _attention(LOWEST32)
    nodes[3] = helper.make_node("Constant", [], ["mask"], value=numpy_helper.from_array(mask))
    return model_of(nodes, [("scores", [B, H, T, S]), ("v", [B, H, S, D])], ["out"], opset=18)


@pytest.mark.parametrize("masked", [LOWEST32, -np.inf], ids=["lowest", "minus_inf"])
def test_a_folded_constant_mask_zeroes_its_fully_masked_rows(masked):
    feeds, keep = _feeds((T, S))
    mask = np.where(keep, 0.0, masked).astype(np.float32)
    original = _folded_attention(mask)
    rewritten, ops = _rewritten(original)
    assert "IsNaN" not in ops and "ReduceMax" not in ops  # the factor is a constant
    del feeds["cond"]
    (expected,), (got,) = run(original, feeds), run(rewritten, feeds)
    np.testing.assert_allclose(got, _pytorch_attention(feeds, keep), rtol=1e-5, atol=1e-6)
    assert np.all(got[:, 1] == 0.0)  # the fully masked query row: PyTorch's zeros
    rows = np.ones(T, dtype=bool)
    rows[1] = False
    np.testing.assert_array_equal(got[:, rows], expected[:, rows])  # bit-identical where a key is kept


def test_a_folded_constant_mask_without_a_fully_masked_row_drops_the_guard():
    keep = np.ones((T, S), dtype=bool)
    keep[:, 3] = False
    original = _folded_attention(np.where(keep, 0.0, LOWEST32).astype(np.float32))
    rewritten, ops = _rewritten(original)
    assert "IsNaN" not in ops and "Mul" not in ops
    feeds, _ = _feeds((T, S))
    del feeds["cond"]
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(original, feeds)[0])
