"""ORTModule under torch.autocast (bf16 on CPU) against eager autocast: 20 training steps
of the GPT-style model and of a BERT-mini classifier, same optimizer, same data; and the GPT
converted to bf16/fp16 without autocast."""

from __future__ import annotations

import copy

import pytest

from tests.torch_models import GPT, BertLogits, torch

from onnxtrain.torch import DebugOptions, ORTModule

STRICT = DebugOptions(fallback=False)
STEPS = 20
LOSS_RTOL = 1e-2  # the brief's bound: ORTModule's loss within 1e-2 relative of eager autocast's


def _train_side_by_side(model, batch, loss_fn, steps=STEPS, lr=3e-3):
    """Train eager and ORTModule copies under bf16 autocast; return both loss curves."""
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (reference, wrapped)]
    generator = torch.Generator().manual_seed(1)
    curves = ([], [])
    for step in range(steps):
        inputs, target = batch(generator)
        outputs = []
        for module, optimizer, curve in zip((reference, wrapped), optimizers, curves):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(*inputs)
                loss = loss_fn(out, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
            outputs.append(out)
        assert outputs[1].dtype == outputs[0].dtype == torch.bfloat16, f"output dtype at step {step}"
        for (name, p), (_, q) in zip(reference.named_parameters(), wrapped.named_parameters()):
            assert q.dtype == torch.float32 and (q.grad is None) == (p.grad is None), name
            if q.grad is not None:
                assert q.grad.dtype == torch.float32, name
    assert wrapped.export_count == 1
    return curves, wrapped


def _assert_tracks(curves):
    eager, ort = (torch.tensor(c) for c in curves)
    relative = ((ort - eager).abs() / eager.abs()).max().item()
    assert relative < LOSS_RTOL, f"max relative loss difference {relative:.3g} over {len(eager)} steps"
    assert eager[-5:].mean() < eager[:5].mean()  # the run trains (a fixed batch: the loss falls)


def test_gpt_under_bf16_autocast_tracks_eager_autocast():
    torch.manual_seed(0)
    model = GPT()
    fixed = torch.randint(0, 40, (4, 9), generator=torch.Generator().manual_seed(3))

    def batch(_):
        return (fixed[:, :-1],), fixed[:, 1:]

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 40), target.reshape(-1))

    curves, wrapped = _train_side_by_side(model, batch, loss_fn, lr=1e-2)
    _assert_tracks(curves)

    # the autocast state is part of the cache key: fp32 outside autocast, a second export
    out = wrapped(fixed[:, :-1])
    assert out.dtype == torch.float32 and wrapped.export_count == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wrapped(fixed[:, :-1]).dtype == torch.bfloat16
    assert wrapped.export_count == 2


def test_bert_mini_under_bf16_autocast_tracks_eager_autocast():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = BertLogits()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 60, (8, 10), generator=g)
    mask = (torch.arange(10)[None, :] < torch.randint(5, 11, (8, 1), generator=g)).long()
    labels = torch.randint(0, 3, (8,), generator=g)

    def batch(_):
        return (ids, mask), labels

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.float(), target)

    curves, _ = _train_side_by_side(model, batch, loss_fn)
    _assert_tracks(curves)


def test_mlp_under_fp16_autocast_matches_eager_output_and_gradients():
    """fp16 autocast runs on CPU too (the same precision pass as CUDA's fp16, with the CPU
    kernel table): fp16 output as eager, fp32 gradients close to eager's."""
    from tests.torch_models import MLP

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    x = torch.randn(16, 12)
    outputs = []
    for module in (reference, wrapped):
        with torch.autocast("cpu", dtype=torch.float16):
            out = module(x)
        out.float().square().mean().backward()
        outputs.append(out)
    assert outputs[1].dtype == outputs[0].dtype == torch.float16
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-3, atol=1e-3)
    for (name, p), (_, q) in zip(reference.named_parameters(), wrapped.named_parameters()):
        assert q.grad.dtype == torch.float32, name
        assert (q.grad - p.grad).abs().max() <= 1e-2 * p.grad.abs().max(), name


def test_bf16_autocast_with_dynamic_shapes_trains_in_onnxruntime():
    """dynamic=True (ORTTrainer's default): the backward's run-time row of ones (a bias
    gradient's sum) is a ConstantOfShape, typed float, not as its int64 shape input."""
    from tests.torch_models import MLP

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT, dynamic=True)
    for batch in (16, 9):
        x = torch.randn(batch, 12)
        for module in (reference, wrapped):
            module.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(x)
            out.float().square().mean().backward()
        for (name, p), (_, q) in zip(reference.named_parameters(), wrapped.named_parameters()):
            assert (q.grad - p.grad).abs().max() <= 2e-2 * p.grad.abs().max(), name
    assert wrapped.export_count == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_converted_to_low_precision_trains_in_onnxruntime_like_eager(dtype):
    """``model.to(torch.bfloat16)`` on the CPU, whose onnxruntime provider has no arithmetic in
    that type (bf16: the session did not load, and the module fell back): the graph gets
    autocast's precision pass, and trains as eager does in that type."""
    torch.manual_seed(0)
    reference = GPT().to(dtype)
    wrapped = ORTModule(copy.deepcopy(reference), STRICT)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, wrapped)]
    fixed = torch.randint(0, 40, (4, 9), generator=torch.Generator().manual_seed(3))
    curves = ([], [])
    for _ in range(10):
        for module, optimizer, curve in zip((reference, wrapped), optimizers, curves):
            logits = module(fixed[:, :-1])
            assert logits.dtype == dtype
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 40), fixed[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
    assert all(p.dtype == dtype and p.grad.dtype == dtype for p in wrapped.parameters())
    _assert_tracks(curves)
    assert wrapped.export_count == 1
