"""ORTModule on Hugging Face architectures built from small configs: each trains in ONNX Runtime
(no fallback) with eager's outputs and parameter gradients."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from onnxtrain.torch import ORTModuleFallbackWarning  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402

T = transformers
_SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _text():
    return torch.randint(0, 50, (3, 7))


def _image():
    return torch.randn(3, 3, 32, 32)


ARCHITECTURES = {
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), _text),
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(vocab_size=50, num_key_value_heads=1,
                                                       max_position_embeddings=16, **_SMALL)), _text),
    "deberta-v2": (lambda: T.DebertaV2ForSequenceClassification(
        T.DebertaV2Config(vocab_size=50, max_position_embeddings=20, **_NO_DROPOUT, **_SMALL)), _text),
    "t5-encoder": (lambda: T.T5EncoderModel(T.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                       num_heads=2, dropout_rate=0.0)), _text),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(image_size=32, patch_size=8, num_labels=3,
                                                            **_NO_DROPOUT, **_SMALL)), _image),
    "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=3,
        drop_path_rate=0.0, **_NO_DROPOUT)), _image),
    "segformer": (lambda: T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=16, num_labels=3, drop_path_rate=0.0,
        classifier_dropout_prob=0.0, **_NO_DROPOUT)), _image),
}


class _Head(torch.nn.Module):
    """The model's logits (or last hidden state) as one tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_trains_in_onnxruntime_like_eager(name):
    make, data = ARCHITECTURES[name]
    eager, wrapped = eager_and_wrapped(lambda: _Head(make()))
    x = data()
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for model in (wrapped, eager):
            torch.manual_seed(1)
            out = model(x)
            weight = torch.randn(out.shape)  # a random direction: no loss that normalization makes flat
            (out * weight).sum().backward()
            results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out, grads), (eager_out, eager_grads) = results
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-5)
    assert grads.keys() == eager_grads.keys()
    # against the model's largest gradient: a gradient that is zero in exact arithmetic (a bias
    # before a batch-statistics BatchNorm) is rounding noise on both sides
    scale = max(float(g.abs().max()) for g in eager_grads.values() if g is not None)
    for key, theirs in eager_grads.items():
        ours = grads[key]
        assert (ours is None) == (theirs is None), key
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * scale, msg=key)
