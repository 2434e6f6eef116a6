"""Objects that torch.utils._pytree does not flatten, in a call's arguments or output (a Hugging
Face cache): the caller never gets the exporter's placeholder tensors."""

from __future__ import annotations

import copy
import warnings

import pytest

from tests.torch_models import torch

from onnxtrain.torch import DroppedOutputWarning, ORTModule, ORTModuleFallbackWarning

transformers = pytest.importorskip("transformers")


def _gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return config, transformers.GPT2LMHeadModel(config)


def test_a_cache_in_the_output_comes_back_as_none_and_training_runs_in_onnx_runtime():
    """GPT-2 with its default use_cache=True returns a DynamicCache: the trace's held FakeTensors."""
    _, eager = _gpt2()
    model = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.warns(DroppedOutputWarning, match="None in place of the DynamicCache"):
        out = model(ids, labels=ids)
    ref = eager(ids, labels=ids)
    assert out.past_key_values is None and model.fallback_reason is None
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_a_cache_given_as_an_argument_is_never_written_with_placeholders():
    """A block that writes into the caller's cache: the trace ran on a copy, and the block runs
    in PyTorch (a graph cannot write into it), so the caller's cache gets eager's tensors."""
    config, eager = _gpt2()
    eager.eval()
    block = eager.transformer.h[0]
    model = ORTModule(copy.deepcopy(block))
    x = torch.randn(2, 8, 32)
    caches = [transformers.DynamicCache(config=config) for _ in range(2)]
    with torch.no_grad(), pytest.warns(ORTModuleFallbackWarning, match="stores tensors in its DynamicCache argument"):
        model(x, caches[0], use_cache=True, position_ids=torch.arange(8)[None])
    with torch.no_grad():
        block(x, caches[1], use_cache=True, position_ids=torch.arange(8)[None])
    keys = [cache.layers[0].keys for cache in caches]
    assert type(keys[0]) is torch.Tensor  # a real tensor, not a FakeTensor
    torch.testing.assert_close(keys[0], keys[1])


def test_tensors_deep_inside_an_argument_object_are_not_baked_in():
    """Tensors two levels down in an argument object (list of objects): the export would have
    baked them in as constants; the module runs in PyTorch instead."""

    class Item:
        def __init__(self, value):
            self.value = value

    class Holder:
        def __init__(self, tensors):
            self.items = [Item(t) for t in tensors]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x, holder):
            return self.fc(x) + holder.items[0].value

    model = ORTModule(Net())
    x = torch.randn(2, 3)
    first, second = Holder([torch.zeros(3)]), Holder([torch.ones(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ORTModuleFallbackWarning)
        a, b = model(x, first), model(x, second)
    torch.testing.assert_close(b - a, torch.ones(2, 3))
    assert model.fallback_reason is not None and "Holder" in model.fallback_reason


def test_a_failed_dynamic_export_leaves_the_callers_tensors_unmarked():
    """A dynamic capture marks its example tensors for dynamo; after it failed (a BertEncoder
    given a 4-D bool mask), the static retry on the same tensors was traced dynamically again
    and the module fell back to PyTorch for good."""
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    encoder = transformers.BertModel(config).encoder
    model = ORTModule(copy.deepcopy(encoder))

    def inputs(length):
        mask = torch.ones(3, 1, length, length, dtype=torch.bool)
        mask[1, :, :, length - 3:] = False
        return torch.randn(3, length, 32), mask

    for length in (10, 13):
        hidden, mask = inputs(length)
        out = model(hidden, attention_mask=mask)
        assert model.fallback_reason is None, model.fallback_reason
        assert not [key for key in vars(hidden) if "dynamo" in key]
        torch.testing.assert_close(out.last_hidden_state, encoder(hidden, attention_mask=mask).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)


def test_an_output_that_is_only_an_unflattened_object_runs_in_pytorch_and_says_how():
    """A forward returning a plain dataclass: the graph had no outputs at all, and onnxruntime's
    session failed with "OrtValue indexes should have been populated". Registered as a pytree
    node, the dataclass trains in ONNX Runtime."""
    import dataclasses

    from onnxtrain.errors import ExportError
    from onnxtrain.torch import DebugOptions

    @dataclasses.dataclass
    class Scores:
        logits: torch.Tensor
        penalty: torch.Tensor

    class Scored(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            y = self.fc(x)
            return Scores(y, y.square().mean())

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    with pytest.raises(ExportError, match="returns a Scores holding tensors .*register_dataclass"):
        ORTModule(Scored(), DebugOptions(fallback=False))(x)
    torch.utils._pytree.register_dataclass(Scores)
    try:
        eager = Scored()
        model = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
        out, ref = model(x), eager(x)
        assert isinstance(out, Scores) and model.export_count == 1
        torch.testing.assert_close(out.penalty, ref.penalty)
        out.penalty.backward()
        ref.penalty.backward()
        torch.testing.assert_close(model.module.fc.weight.grad, eager.fc.weight.grad)
    finally:
        torch.utils._pytree._deregister_pytree_node(Scores)


class _Options:  # a plain options object, as training scripts pass around
    def __init__(self, scale):
        self.scale = scale


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, options):
        return self.fc(x) * options.scale


def test_an_argument_object_changed_between_calls_gets_a_graph_for_its_new_state():
    """A plain object hashes by identity: keyed by itself, an options object whose attribute
    the caller changed still matched the graph exported for the first value (baked in), which
    kept running with wrong outputs and gradients."""
    torch.manual_seed(0)
    eager = _Scaled()
    model = ORTModule(copy.deepcopy(eager))
    options, x = _Options(1.0), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for scale in (1.0, 2.0, 1.0):
            options.scale = scale
            out, ref = model(x, options), eager(x, options)
            torch.testing.assert_close(out, ref)
            out.sum().backward()
            ref.sum().backward()
            torch.testing.assert_close(model.module.fc.weight.grad, eager.fc.weight.grad)
    assert model.export_count == 2  # the third call's state is the first's
