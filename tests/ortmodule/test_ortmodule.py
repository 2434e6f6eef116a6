"""ORTModule against eager PyTorch: outputs, every parameter gradient, buffers, and the
nn.Module behaviour a training script relies on."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import warnings

import pytest

from tests.torch_models import CNN, GPT, MLP, torch

from onnxtrain.errors import UnsupportedOpError
from tests.ortmodule._unsupported import without_dft_rule  # noqa: F401  (a fixture)
from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning

RTOL, ATOL = 1e-4, 1e-5
STRICT = DebugOptions(fallback=False)


def _assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _assert_same_gradients(module, reference):
    got = dict(module.named_parameters())
    for name, param in reference.named_parameters():
        if param.grad is None:
            assert got[name].grad is None, name
        else:
            _assert_close(got[name].grad, param.grad, f"gradient of {name}")


def _run_both(model, make_inputs, loss_fn, steps=1):
    """Train ``model`` wrapped and eager side by side; compare outputs, gradients and buffers."""
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    for step in range(steps):
        inputs = make_inputs(step)
        out, ref_out = wrapped(*inputs), reference(*inputs)
        _assert_close(out, ref_out, f"output at step {step}")
        loss_fn(out).backward()
        loss_fn(ref_out).backward()
        _assert_same_gradients(model, reference)
        for (name, buf), (_, ref_buf) in zip(model.named_buffers(), reference.named_buffers()):
            _assert_close(buf, ref_buf, f"buffer {name} at step {step}")
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
    return wrapped


def test_mlp_matches_eager():
    torch.manual_seed(0)
    wrapped = _run_both(MLP(), lambda s: (torch.randn(4 + s, 12),), lambda y: (y * y).mean(), steps=3)
    assert wrapped.export_count == 2  # three batch sizes: the first call's shapes, then dynamic dims


def test_cnn_with_batch_norm_matches_eager_including_running_statistics():
    torch.manual_seed(0)
    model = CNN()
    _run_both(model, lambda s: (torch.randn(6, 1, 8, 8),), lambda y: y.logsumexp(1).mean(), steps=2)
    assert int(model.features[1].num_batches_tracked) == 2


def test_batch_norm_with_a_cumulative_average_matches_eager():
    """``momentum=None`` (running statistics as the average over every batch, PyTorch's factor a
    Python number from a buffer: the capture failed) trains in ONNX Runtime, and so does
    ``torch.optim.swa_utils.update_bn``, which switches to it for a pass over the data and back."""
    torch.manual_seed(0)
    model = CNN()
    model.features[1].momentum = None
    _run_both(model, lambda s: (torch.randn(6, 1, 8, 8),), lambda y: y.logsumexp(1).mean(), steps=3)

    torch.manual_seed(1)
    model = CNN()
    reference, wrapped = copy.deepcopy(model), ORTModule(model, STRICT)
    for net in (reference, wrapped):  # trained with momentum 0.1, then the statistics recomputed
        net(torch.randn(6, 1, 8, 8)).sum().backward()
    batches = [torch.randn(6, 1, 8, 8) for _ in range(3)]
    for net in (reference, wrapped):
        torch.optim.swa_utils.update_bn(batches, net)
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        _assert_close(buffer, expected, f"buffer {name} after update_bn")
    assert model.features[1].momentum == 0.1 and wrapped.fallback_reason is None


def test_gpt_with_causal_mask_matches_eager():
    torch.manual_seed(0)
    _run_both(GPT(), lambda s: (torch.randint(0, 40, (3, 6 + s)),),
              lambda y: torch.nn.functional.cross_entropy(y.flatten(0, 1), torch.arange(y.shape[0] * y.shape[1]) % 40),
              steps=2)


def _hf(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(
            vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(config)
    config = transformers.GPT2Config(vocab_size=60, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_hugging_face_models_with_masks_and_labels_match_eager(kind):
    model = _hf(kind)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    for batch, length in [(3, 9), (4, 7), (2, 11)]:
        ids = torch.randint(1, 60, (batch, length))
        mask = torch.ones(batch, length, dtype=torch.int64)
        mask[0, length - 3:] = 0
        ids[0, length - 3:] = 0  # padding tokens: BERT's padding row must get no gradient
        labels = torch.randint(0, 3, (batch,)) if kind == "bert" else ids.masked_fill(mask == 0, -100)
        kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels)
        if kind == "gpt2":
            kwargs["use_cache"] = False
        out, ref_out = wrapped(**kwargs), reference(**kwargs)
        assert type(out) is type(ref_out)
        _assert_close(out.loss, ref_out.loss, "loss")
        _assert_close(out.logits, ref_out.logits, "logits")
        out.loss.backward()
        ref_out.loss.backward()
        _assert_same_gradients(model, reference)
        model.zero_grad()
        reference.zero_grad()
    assert wrapped.export_count == 2  # the first call's shapes, then dynamic batch and sequence dims


def test_fully_masked_attention_rows_match_eager():
    """PyTorch's attention gives zeros for a query row whose every key is masked; the exporter's
    graph gave a uniform row there (its mask uses the dtype's lowest value, so its NaN guard never
    fired), until passes/softmax_guard.py."""
    model = _hf("bert")
    ids = torch.randint(1, 60, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.int64)
    mask[0, 6:] = 0
    mask[1] = 0  # a sequence of padding only: every query row of it is fully masked
    labels = torch.tensor([0, 1, 2])
    _run_both(model, lambda s: (ids, mask), lambda out: torch.nn.functional.cross_entropy(out.logits, labels))

    class MaskedAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x, keep):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    keep = torch.rand(2, 1, 5, 5) < 0.5
    keep[0, :, 1] = False  # single fully masked query rows
    keep[1, :, 3] = False
    keep[:, :, 2] = True
    torch.manual_seed(0)
    _run_both(MaskedAttention(), lambda s: (torch.randn(2, 5, 8), keep), lambda y: (y * y).sum())

    class ConstantMaskAttention(MaskedAttention):
        """A mask the forward builds from constants: folded into the graph before the guard pass saw it."""

        def forward(self, x):
            keep = torch.ones(5, 5, dtype=torch.bool).tril()
            keep[3] = False
            return super().forward(x, keep)

    torch.manual_seed(0)
    _run_both(ConstantMaskAttention(), lambda s: (torch.randn(2, 5, 8),), lambda y: (y * y).sum())


def _tanh_mlp():
    # onnxruntime's CPU Erf (GELU) has no float64 kernel: float64 tests use Tanh
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def test_batch_size_re_exports_once_with_dynamic_dims_while_mode_and_dtype_re_export():
    torch.manual_seed(0)
    wrapped = ORTModule(_tanh_mlp(), STRICT)
    wrapped(torch.randn(2, 12)).sum().backward()
    assert wrapped.export_count == 1  # static: the first call's shapes
    for batch in (5, 9, 2):
        wrapped(torch.randn(batch, 12)).sum().backward()
    assert wrapped.export_count == 2  # one dynamic re-export serves every later batch size
    wrapped.eval()
    wrapped(torch.randn(3, 12))
    assert wrapped.export_count == 3
    wrapped.train()
    wrapped(torch.randn(3, 12))
    assert wrapped.export_count == 3  # the training graphs are still cached
    wrapped.double()
    out = wrapped(torch.randn(3, 12, dtype=torch.float64))
    assert out.dtype == torch.float64 and wrapped.export_count == 4


def _exported_shapes(wrapped):
    return [variant.graph.input_shapes[0] for variants in wrapped._variants.values() for variant in variants]


@pytest.mark.parametrize("dynamic, exports", [(None, 2), (True, 1), (False, 3)])
def test_dynamic_argument_chooses_static_or_dynamic_exports(dynamic, exports):
    torch.manual_seed(0)
    model = _tanh_mlp()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT, dynamic=dynamic)
    for batch in (4, 6, 8, 6, 4):
        x = torch.randn(batch, 12)
        _assert_close(wrapped(x), reference(x), f"output at batch {batch}")
    assert wrapped.export_count == exports
    shapes = _exported_shapes(wrapped)
    if dynamic is None:  # the first call's shapes, then one export with a symbolic batch
        assert shapes[0] == (4, 12) and isinstance(shapes[1][0], str)
    elif dynamic:
        assert len(shapes) == 1 and isinstance(shapes[0][0], str)
    else:
        assert shapes == [(4, 12), (6, 12), (8, 12)]


def test_a_model_that_fails_the_dynamic_export_gets_one_static_export_per_shape(monkeypatch):
    from onnxtrain.errors import ExportError
    from onnxtrain.torch import ortmodule as ortmodule_module

    real_export = ortmodule_module.export_call
    dynamic_requests = []

    def export_without_dynamic_shapes(module, call, keep_exported=False, dynamic=True, **options):
        if dynamic:  # as a model whose shapes the exporter cannot make symbolic
            dynamic_requests.append(tuple(call.tensors[0].shape))
            raise ExportError("torch.onnx.export could not export: constraint violation")
        return real_export(module, call, keep_exported=keep_exported, dynamic=False, **options)

    monkeypatch.setattr(ortmodule_module, "export_call", export_without_dynamic_shapes)
    torch.manual_seed(0)
    model = _tanh_mlp()
    wrapped = ORTModule(model, STRICT)
    for batch in (4, 6, 8, 6):
        x = torch.randn(batch, 12)
        _assert_close(wrapped(x), model(x), f"output at batch {batch}")
    assert dynamic_requests == [(6, 12)]  # tried once, for the first new shape
    assert wrapped.export_count == 3 and wrapped.fallback_reason is None
    assert _exported_shapes(wrapped) == [(4, 12), (6, 12), (8, 12)]


class _SqueezedRegressor(torch.nn.Module):
    """``fc(x).squeeze()``: a batch of one loses its batch axis too (a scalar), any other keeps it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 1)

    def forward(self, x):
        return self.fc(x).squeeze()


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_batch_of_one_is_not_served_by_a_graph_traced_with_a_symbolic_batch(dynamic):
    """The capture traces symbolic dims as at least 2: a last batch of one ran the symbolic graph,
    where squeeze() had kept the batch axis (the backward's run failed; squeeze((0, 1)) gave other
    numbers). Sizes 0 and 1 get a graph of their own."""
    torch.manual_seed(0)
    model = _SqueezedRegressor()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT, dynamic=dynamic)
    for batch in (4, 3, 1):
        x, target = torch.randn(batch, 6), torch.randn(batch).squeeze()
        for module in (wrapped, reference):
            module.zero_grad()
        out, expected = wrapped(x), reference(x)
        assert out.shape == expected.shape
        torch.nn.functional.mse_loss(out, target).backward()
        torch.nn.functional.mse_loss(expected, target).backward()
        _assert_close(model.fc.weight.grad, reference.fc.weight.grad, f"gradient at batch {batch}")


class _SqueezedAxes(torch.nn.Module):
    """squeeze of given axes: PyTorch drops those of size 1 and keeps the others."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x).unsqueeze(1)  # [batch, 1, 4]
        return h.squeeze(2).sum(2) + h.squeeze((0, 1)).sum(-1, keepdim=True) + h.squeeze(0).mean()


@pytest.mark.parametrize("dynamic", [None, True])
def test_squeezing_an_axis_that_is_not_of_size_one_keeps_it(dynamic):
    """torchlib squeezed every given axis: onnxruntime refused the model where the size was known
    (a fallback) and failed every run where it was symbolic."""
    torch.manual_seed(0)
    model = _SqueezedAxes()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT, dynamic=dynamic)
    for batch in (4, 3, 1):
        x = torch.randn(batch, 6)
        for module in (wrapped, reference):
            module.zero_grad()
        out, expected = wrapped(x), reference(x)
        _assert_close(out, expected, f"output at batch {batch}")
        out.square().sum().backward()
        expected.square().sum().backward()
        _assert_close(model.fc.weight.grad, reference.fc.weight.grad, f"gradient at batch {batch}")


class _Pieces(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):  # x: [batch, length, 6], halved along the length, then cut in pieces of that half
        h = self.fc(x)
        first, second = h.chunk(2, dim=1)
        pieces = h.split(first.shape[1], dim=1)
        return first.pow(2).mean() + second.mean() + sum(piece.sum() * (i + 1) for i, piece in enumerate(pieces))


def test_chunk_and_split_along_a_symbolic_dim_train_in_the_dynamic_graph():
    """chunk/split along a symbolic length exported as a SplitToSequence with a size computed at
    run time: the folder failed on it (a RuntimeError no fallback caught) and no rule
    differentiates it. They are Splits into as many pieces as the trace had."""
    torch.manual_seed(0)
    model = _Pieces()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT, dynamic=True)
    for length in (6, 8, 10):
        x = torch.randn(2, length, 6)
        for module in (wrapped, reference):
            module.zero_grad()
        loss, expected = wrapped(x), reference(x)
        _assert_close(loss, expected, f"loss at length {length}")
        loss.backward()
        expected.backward()
        _assert_close(model.fc.weight.grad, reference.fc.weight.grad, f"gradient at length {length}")
    assert all(isinstance(shape[1], str) for shape in _exported_shapes(wrapped))


def test_a_dynamic_graph_that_cannot_be_built_gives_way_to_one_graph_per_shape(monkeypatch):
    """In automatic mode a dynamic export whose gradient graphs cannot be built (an op that only
    the symbolic export has) gives way to static graphs per shape, as a failed dynamic export
    does, instead of a fallback to PyTorch for good."""
    from onnxtrain.errors import UnsupportedOpError

    real_build = ORTModule._training_programs

    def no_dynamic_build(self, variant, wrt, inputs):
        if variant.dynamic:
            raise UnsupportedOpError({"SplitToSequence": ["node_split"]})
        return real_build(self, variant, wrt, inputs)

    monkeypatch.setattr(ORTModule, "_training_programs", no_dynamic_build)
    torch.manual_seed(0)
    model = _Pieces()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    for length in (6, 8, 10, 8):
        x = torch.randn(2, length, 6)
        _assert_close(wrapped(x), reference(x), f"loss at length {length}")
    assert wrapped.fallback_reason is None
    assert [shape[1] for shape in _exported_shapes(wrapped) if isinstance(shape[1], int)] == [6, 8, 10]


def test_dynamic_must_be_none_or_a_bool():
    with pytest.raises(TypeError, match="dynamic must be None"):
        ORTModule(_tanh_mlp(), dynamic="auto")


def test_non_tensor_argument_is_part_of_the_schema():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x, scale=1.0, activation="relu"):
            y = self.linear(x) * scale
            return torch.relu(y) if activation == "relu" else torch.tanh(y)

    torch.manual_seed(0)
    model = Scaled()
    wrapped = ORTModule(model, STRICT)
    x = torch.randn(4, 3)
    for scale, activation in [(1.0, "relu"), (2.0, "relu"), (2.0, "tanh"), (1.0, "relu")]:
        _assert_close(wrapped(x, scale=scale, activation=activation), model(x, scale, activation), (scale, activation))
    assert wrapped.export_count == 3


def test_nested_inputs_kwargs_dict_outputs_and_input_gradients():
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(2, 4)

        def forward(self, pair, extra=None, *, options):
            x, (y,) = pair
            h = self.a(x) + self.b(extra["z"]) * options["gain"]
            return {"sum": h.sum(-1), "parts": (h, y.float() * 2)}

    torch.manual_seed(0)
    model = Nested()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    x = torch.randn(5, 3, requires_grad=True)
    z = torch.randn(5, 2, requires_grad=True)
    y = torch.arange(5)
    x_ref, z_ref = x.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    out = wrapped((x, (y,)), {"z": z}, options={"gain": 3.0})
    ref = reference((x_ref, (y,)), {"z": z_ref}, options={"gain": 3.0})
    assert set(out) == {"sum", "parts"} and isinstance(out["parts"], tuple)
    _assert_close(out["parts"][1], ref["parts"][1], "integer-derived output")
    assert not out["parts"][1].requires_grad
    (out["sum"].square().sum() + out["parts"][0].mean()).backward()
    (ref["sum"].square().sum() + ref["parts"][0].mean()).backward()
    _assert_close(x.grad, x_ref.grad, "gradient of input x")
    _assert_close(z.grad, z_ref.grad, "gradient of input z")
    _assert_same_gradients(model, reference)


def test_frozen_and_shared_parameters():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(7, 4)
            self.body = torch.nn.Linear(4, 4)
            self.out = torch.nn.Linear(4, 7, bias=False)
            self.out.weight = self.embed.weight  # shared

        def forward(self, ids):
            return self.out(torch.tanh(self.body(self.embed(ids))))

    torch.manual_seed(0)
    model = Tied()
    model.body.weight.requires_grad_(False)  # frozen
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    wrapped(ids).logsumexp(-1).sum().backward()
    reference(ids).logsumexp(-1).sum().backward()
    assert model.body.weight.grad is None
    assert model.out.weight is model.embed.weight
    _assert_same_gradients(model, reference)


def test_no_grad_runs_forward_only_and_returns_plain_tensors():
    torch.manual_seed(0)
    model = MLP()
    wrapped = ORTModule(model, STRICT)
    x = torch.randn(3, 12)
    with torch.no_grad():
        out = wrapped(x)
    assert out.grad_fn is None and not out.requires_grad
    variant = next(iter(wrapped._variants.values()))[0]
    assert variant.inference is not None and not variant.training  # no gradient graph was built
    _assert_close(out, model(x).detach(), "no-grad output")


def test_dropout_masks_outputs_and_gradients_consistently_and_is_off_in_eval():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Dropout(0.5))
    wrapped = ORTModule(model, STRICT)
    x = torch.randn(16, 8)
    y = wrapped(x)
    assert not torch.equal(y, wrapped(x))  # a fresh mask per call
    kept = y != 0
    assert 0.45 < kept.float().mean().item() < 0.55
    dense = model[0](x).detach()
    _assert_close(y[kept], 2 * dense[kept], "kept units are scaled by 1/(1-p)")
    (y * dense).sum().backward()  # weights the units so that every gradient entry is distinct
    expected = (2 * kept * dense).T @ x
    _assert_close(model[0].weight.grad, expected, "weight gradient through the same mask")
    wrapped.eval()
    _assert_close(wrapped(x), model(x), "eval output")


def test_dropout_of_everything_gives_zeros_and_zero_gradients():
    # onnxruntime's Dropout takes a ratio below 1 only: p = 1 failed the run
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(p=1.0), torch.nn.Linear(4, 2))
    wrapped = ORTModule(model, STRICT)
    x = torch.randn(3, 4)
    y = wrapped(x)
    _assert_close(y, model[2].bias.detach().expand(3, 2), "only the last bias is left")
    y.sum().backward()
    assert torch.count_nonzero(model[0].weight.grad) == 0 and torch.count_nonzero(model[2].weight.grad) == 0
    _assert_close(model[2].bias.grad, torch.full((2,), 3.0), "the last bias's gradient")


def test_dropout_drops_in_a_forward_only_run_of_a_training_module():
    """Under torch.no_grad() a module in train() mode runs a forward-only graph, where
    onnxruntime would remove a Dropout whose mask nothing reads: it must still drop, as eager."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
    wrapped = ORTModule(net, STRICT)
    x = torch.randn(64, 16)
    with torch.no_grad():
        net.eval()
        undropped = net(x)
        net.train()
        first, second = wrapped(x), wrapped(x)
    assert not torch.allclose(first, undropped, atol=1e-3) and not torch.allclose(first, second, atol=1e-3)
    net.eval()
    with torch.no_grad():
        _assert_close(wrapped(x), undropped, "eval output")


def test_module_behaviour_state_dict_copy_pickle_save():
    torch.manual_seed(0)
    model = CNN()
    wrapped = ORTModule(model)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in model.named_buffers()]
    wrapped(torch.randn(4, 1, 8, 8)).sum().backward()

    clone = copy.deepcopy(wrapped)
    assert clone.module is not model and not clone._variants
    x = torch.randn(4, 1, 8, 8)
    wrapped.eval(), clone.eval()
    _assert_close(clone(x), wrapped(x), "deep copy output")

    restored = pickle.loads(pickle.dumps(wrapped))
    _assert_close(restored(x), wrapped(x), "unpickled output")

    buffer = io.BytesIO()
    torch.save(wrapped.state_dict(), buffer)
    buffer.seek(0)
    plain = CNN()
    plain.load_state_dict(torch.load(buffer))
    plain.eval()
    _assert_close(plain(x), wrapped(x), "eager model loaded from ORTModule state_dict")

    fresh = ORTModule(CNN())
    fresh.load_state_dict(plain.state_dict())
    fresh.eval()
    _assert_close(fresh(x), plain(x), "ORTModule after load_state_dict")


class _Flagged(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([10.0]))
        self.use_scale = True

    def forward(self, x):
        return x * self.scale if self.use_scale else x


def test_attributes_set_through_the_wrapper_are_the_wrapped_modules():
    """As upstream's: a flag set on the ORTModule reaches the forward (and re-exports), new
    parameters, buffers and submodules land in the wrapped module's state_dict."""
    wrapped, x = ORTModule(_Flagged(), STRICT), torch.ones(2)
    assert wrapped(x).tolist() == [10.0, 10.0]
    wrapped.use_scale = False
    assert wrapped.module.use_scale is False and "use_scale" not in wrapped.__dict__
    assert wrapped(x).tolist() == [1.0, 1.0] and wrapped.export_count == 2
    wrapped.scale = torch.nn.Parameter(torch.tensor([3.0]))
    wrapped.use_scale = True
    assert wrapped(x).tolist() == [3.0, 3.0]
    wrapped.register_buffer("offset", torch.zeros(2))
    wrapped.head = torch.nn.Linear(2, 2)
    wrapped.note = "kept on the module"
    assert {"scale", "offset", "head.weight", "head.bias"} <= set(wrapped.state_dict())
    assert wrapped.module.note == wrapped.note == "kept on the module"
    del wrapped.note
    assert not hasattr(wrapped.module, "note")
    # the wrapper's own state stays its own
    wrapped.export_count = 0
    assert "export_count" not in wrapped.module.__dict__
    assert pickle.loads(pickle.dumps(wrapped)).module.head.weight.shape == (2, 2)


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 6), torch.nn.Linear(8, 6)

    def forward(self, a, b):
        x = a + b
        return torch.relu(self.first(x)), torch.relu(self.second(x))


def test_a_loss_of_one_output_leaves_the_other_heads_gradients_none():
    """As eager: parameters only an unused output reaches get no gradient (not zeros), so AdamW's
    weight decay and step count leave them alone; the inputs get the used output's gradient."""
    torch.manual_seed(0)
    eager, wrapped = _TwoHeads(), ORTModule(_TwoHeads(), STRICT)
    wrapped.module.load_state_dict(eager.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (eager, wrapped)]
    a, b = torch.randn(5, 8), torch.randn(5, 8)
    for used in (0, 1, 0):
        grads = []
        for model, optimizer in zip((eager, wrapped), optimizers):
            optimizer.zero_grad()
            a_, b_ = a.clone().requires_grad_(), b.clone()
            model(a_, b_)[used].sum().backward()
            optimizer.step()
            grads.append([a_.grad, *(p.grad for p in model.parameters())])
        assert [g is None for g in grads[1]] == [g is None for g in grads[0]]
        assert sum(g is None for g in grads[1]) == 2
        for ours, theirs in zip(*grads[::-1]):
            if theirs is not None:
                _assert_close(ours, theirs, "gradient")
    for ours, theirs in zip(wrapped.parameters(), eager.parameters()):
        _assert_close(ours, theirs, "parameters after AdamW")
    # both outputs in the loss: every parameter gets its gradient
    wrapped.zero_grad()
    sum(y.sum() for y in wrapped(a, b)).backward()
    assert all(p.grad is not None for p in wrapped.parameters())


def test_functional_call_with_other_parameters_does_not_send_the_module_to_pytorch_for_good():
    """torch.func.functional_call (meta-learning's fast weights) swaps plain tensors into the
    parameters' places: a call that needs an export then runs in PyTorch, that call only."""
    from torch.func import functional_call

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 4)
    grads = []
    for model in (eager, wrapped):
        fast = {n: p - 0.1 for n, p in model.named_parameters()}
        expected = pytest.warns(ORTModuleFallbackWarning, match="this call") if model is wrapped \
            else contextlib.nullcontext()
        with expected:
            out = functional_call(model, fast, (x,))
        out.square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for ours, theirs in zip(*grads):
        _assert_close(ours, theirs, "gradient through the fast weights")
    assert wrapped.fallback_reason is None and wrapped.export_count == 0
    _assert_close(wrapped(x), eager(x), "a plain call after it")
    assert wrapped.export_count == 1 and wrapped.fallback_reason is None


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_over_an_ortmodule_runs_it_in_onnxruntime(backend):
    """torch.compile of a model holding a not-yet-called ORTModule: the ORTModule's call is left
    to run as it is (dynamo traced into the export and failed, or made it fall back)."""
    torch.manual_seed(0)
    eager = _tanh_mlp()
    outer = torch.nn.Sequential(ORTModule(copy.deepcopy(eager), STRICT), torch.nn.ReLU())
    compiled = torch.compile(outer, backend=backend)
    x = torch.randn(8, 12)
    compiled(x).sum().backward()
    torch.nn.functional.relu(eager(x)).sum().backward()
    _assert_same_gradients(outer[0], eager)
    assert outer[0].export_count == 1 and outer[0].fallback_reason is None


def test_to_changes_dtype_and_optimizer_keeps_training():
    torch.manual_seed(0)
    model = _tanh_mlp()
    wrapped = ORTModule(model, STRICT).to(torch.float64)
    assert all(p.dtype == torch.float64 for p in wrapped.parameters())
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(8, 12, dtype=torch.float64)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = wrapped(x).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


class _WithoutRule(torch.nn.Module):
    """torch.fft.hfft exports as a one-sided inverse DFT: without the DFT rule (the
    ``without_dft_rule`` fixture), ORTModule cannot build its gradient graph."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)

    def forward(self, x):
        return torch.fft.hfft(self.linear(x).to(torch.complex64))


@pytest.mark.usefixtures("without_dft_rule")
def test_unsupported_op_falls_back_with_one_warning_and_trains_correctly():
    torch.manual_seed(0)
    model = _WithoutRule()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x = torch.randn(4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            wrapped(x).sum().backward()
    fallback = [w for w in caught if issubclass(w.category, ORTModuleFallbackWarning)]
    assert len(fallback) == 1 and "DFT" in str(fallback[0].message)
    assert "DFT" in wrapped.fallback_reason
    for _ in range(3):
        reference(x).sum().backward()
    _assert_same_gradients(model, reference)


@pytest.mark.usefixtures("without_dft_rule")
def test_unsupported_op_raises_when_fallback_is_off():
    wrapped = ORTModule(_WithoutRule(), DebugOptions(fallback=False))
    with pytest.raises(UnsupportedOpError, match="DFT"):
        wrapped(torch.randn(4, 6)).sum().backward()


@pytest.mark.parametrize("fallback", [False, True])
def test_numpy_inputs_are_rejected_with_the_argument_named(fallback):
    """A numpy array would be baked into the graph as a constant (and key the cache by its
    elided repr); the error names it, fallback or not, and nothing is exported."""
    import numpy as np

    from onnxtrain.errors import InputMismatchError

    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x, extra=None):
            return self.linear(x) + extra["shift"][1]

    wrapped = ORTModule(TwoInputs(), DebugOptions(fallback=fallback))
    with pytest.raises(InputMismatchError, match=r"positional argument \[0\] is a numpy.ndarray \(shape \[2, 3\]"):
        wrapped(np.zeros((2, 3), np.float32), extra={"shift": [0, torch.ones(2)]})
    with pytest.raises(InputMismatchError, match=r"keyword argument \['extra'\]\['shift'\]\[1\] is a numpy"):
        wrapped(torch.zeros(2, 3), extra={"shift": [0, np.ones(2)]})
    assert wrapped.export_count == 0 and wrapped.fallback_reason is None
    out = wrapped(torch.zeros(2, 3), extra={"shift": [0, torch.ones(2)]})
    _assert_close(out, (wrapped.module.linear.bias + 1).expand(2, 2), "output")


def test_an_export_that_did_not_trace_the_forward_is_an_export_error(monkeypatch):
    """Should the capture return a program without having run the module's forward as written,
    its outputs cannot be matched: ExportError, then fallback."""
    from onnxtrain.errors import ExportError
    from onnxtrain.torch import _export

    real = _export.capture

    def untraced(module, args, dynamic_shapes):
        program = real(module, args, dynamic_shapes)
        module.traced_outputs.clear()
        return program

    monkeypatch.setattr(_export, "capture", untraced)
    with pytest.raises(ExportError, match="did not trace MLP's forward"):
        ORTModule(MLP(), STRICT)(torch.randn(3, 12))
    wrapped = ORTModule(MLP())
    with pytest.warns(ORTModuleFallbackWarning, match="did not trace"):
        out = wrapped(torch.randn(3, 12))
    assert out.shape == (3, 5) and "did not trace" in wrapped.fallback_reason


def test_save_onnx_writes_every_stage(tmp_path):
    torch.manual_seed(0)
    wrapped = ORTModule(MLP(), DebugOptions(save_onnx=True, onnx_prefix="mlp", save_path=tmp_path, fallback=False))
    wrapped(torch.randn(3, 12)).sum().backward()
    with torch.no_grad():
        wrapped(torch.randn(3, 12))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"mlp_training_{s}.onnx" for s in ("exported", "optimized", "forward", "backward",
                                                                "inference"))
    import onnx

    for name in names:
        onnx.checker.check_model(onnx.load(str(tmp_path / name)))
    # values the gradient builder adds between the graphs (dropout masks, layer norm statistics)
    # carry the forward's inferred shapes, which onnx.checker requires on graph inputs and outputs
    net = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.LayerNorm(8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 5))
    wrapped = ORTModule(net, DebugOptions(save_onnx=True, onnx_prefix="ln", save_path=tmp_path, fallback=False))
    wrapped(torch.randn(3, 12)).sum().backward()
    for stage in ("forward", "backward"):
        onnx.checker.check_model(onnx.load(str(tmp_path / f"ln_training_{stage}.onnx")))


def test_copies_keep_debug_options():
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    wrapped = ORTModule(MLP(), DebugOptions(fallback=False, onnx_prefix="p", session_options=options))
    clone = copy.deepcopy(wrapped)
    assert clone._debug.session_options is options and clone._debug.onnx_prefix == "p"
    restored = pickle.loads(pickle.dumps(wrapped))
    assert restored._debug.session_options is None and restored._debug.fallback is False
    restored(torch.randn(2, 12)).sum().backward()


def test_embedding_padding_row_gets_no_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, padding_idx=2), torch.nn.Linear(4, 3))
    with torch.no_grad():
        model[0].weight[2] = 1.0  # a non-zero padding row: its value flows forward, not back
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, STRICT)
    ids = torch.tensor([[2, 1, 2], [3, 2, 5]])
    out, ref_out = wrapped(ids), reference(ids)
    _assert_close(out, ref_out, "output")
    out.square().sum().backward()
    ref_out.square().sum().backward()
    assert torch.count_nonzero(model[0].weight.grad[2]) == 0
    assert torch.count_nonzero(model[0].weight.grad[1]) > 0
    _assert_same_gradients(model, reference)


def test_parameters_changed_in_place_reassigned_or_replaced_between_calls_are_seen():
    # the bridge reuses a parameter's OrtValue while it is the same tensor with the same storage
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    model = ORTModule(net)
    x = torch.randn(2, 4)

    def check():
        out = model(x)
        out.sum().backward()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, net.weight, net.bias))

    check()
    with torch.no_grad():
        net.weight.add_(1.0)  # in place: same storage
    check()
    net.weight.data = torch.randn(3, 4)  # same Parameter, new storage
    check()
    net.weight = torch.nn.Parameter(torch.randn(3, 4))  # a new Parameter
    check()
    assert net.weight.grad is not None and model.export_count == 1


def test_exports_and_graph_builds_are_logged(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="onnxtrain.torch.ortmodule")
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    model(torch.randn(5, 4)).sum().backward()
    messages = [r.getMessage() for r in caplog.records if r.name == "onnxtrain.torch.ortmodule"]
    assert any(m.startswith("exported Sequential (training, static shapes, export #1) in ") and m.endswith(" nodes")
               for m in messages), messages
    assert any(m.startswith("built the forward (") and "saved activations:" in m for m in messages), messages


def test_lazy_modules_take_their_shapes_from_the_first_call_then_train_in_onnxruntime():
    """A lazy module's parameters get their shapes from its first call, which the export cannot
    give them: that call runs in PyTorch (the dry run PyTorch asks for before building the
    optimizer), the next ones in ONNX Runtime."""

    def lazy():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.LazyBatchNorm1d(), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 2))

    x = torch.randn(16, 6)
    reference, model = lazy(), lazy()
    wrapped = ORTModule(model, STRICT)
    for run in (reference, wrapped):
        torch.manual_seed(1)  # the first call initializes the parameters it shapes
        run(x)
    assert wrapped.export_count == 0 and model[0].weight.shape == (8, 6)
    for left, right in zip(reference.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(right, left, rtol=0, atol=0)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(3):
        for run, optimizer in zip((reference, wrapped), optimizers):
            optimizer.zero_grad()
            run(x + step).square().mean().backward()
            optimizer.step()
    assert wrapped.export_count == 1 and wrapped.fallback_reason is None
    for left, right in zip(reference.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(right, left)


class _NamedArguments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask=None, *, labels=None):
        return self.layer(input_ids)


@pytest.mark.parametrize("wrapper", ["ORTModule", "HierarchicalORTModule"])
def test_forward_reports_the_wrapped_modules_signature(wrapper):
    """As upstream's: inspect.signature(wrapped.forward) is the module's (tools read it to pick
    arguments: transformers.Trainer drops dataset columns the forward does not name)."""
    import inspect

    import onnxtrain.torch

    module = _NamedArguments()
    wrapped = getattr(onnxtrain.torch, wrapper)(module)
    assert inspect.signature(wrapped.forward) == inspect.signature(module.forward)
    assert wrapped.forward == wrapped.forward and wrapped.forward.__self__ is wrapped
    out = wrapped.forward(torch.randn(3, 4), labels=None)
    out.sum().backward()
    for again in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert again.forward.__self__ is again
        assert inspect.signature(again.forward) == inspect.signature(module.forward)
        torch.testing.assert_close(again(torch.ones(1, 4)), wrapped(torch.ones(1, 4)))


def test_names_the_wrapper_hides_are_named_when_made():
    """As upstream's ORTModule: an attribute of the model that the wrapper defines too (its
    ``module``, ``export_count``) reads as the wrapper's; it says so, and .module reaches it."""
    net = MLP()
    net.export_count = 5  # the model's own number
    with pytest.warns(UserWarning, match=r"ORTModule has its own export_count, which hide\(s\) the wrapped MLP's"):
        wrapped = ORTModule(net)
    assert wrapped.export_count == 0 and wrapped.module.export_count == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ORTModule(MLP())  # nothing hidden, nothing said
