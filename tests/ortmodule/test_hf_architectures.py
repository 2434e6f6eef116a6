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


def _audio():
    return torch.randn(3, 400)


def _features():  # Whisper's log-mel frames: [batch, mel bins, 2 * max_source_positions]
    return torch.randn(3, 8, 16)


ARCHITECTURES = {
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), _text),
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(vocab_size=50, num_key_value_heads=1,
                                                       max_position_embeddings=16, **_SMALL)), _text),
    # mixture of experts: transformers' grouped product of the routed tokens (its custom op)
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(vocab_size=50, num_key_value_heads=1, num_local_experts=4,
                                                             num_experts_per_tok=2, max_position_embeddings=16,
                                                             **_SMALL)), _text),
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
    # encoder-decoders (the decoder reads the same ids), ALiBi, parallel attention, softcapping,
    # relative attention (XLNet's einsums, Funnel's pooling), NoNorm, local/global attention,
    # span-based dynamic convolution, relative position bias, depthwise convolutions, audio
    # front ends (Conv1d, GroupNorm, the weight-normed positional convolution)
    "bart": (lambda: _EncoderDecoder(T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))), _text),
    "t5": (lambda: _EncoderDecoder(T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0))), _text),
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=50, hidden_size=16, n_layer=2, n_head=2,
                                                       hidden_dropout=0.0, attention_dropout=0.0)), _text),
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                          num_attention_heads=2, hidden_dropout=0.0,
                                                          attention_dropout=0.0)), _text),
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(vocab_size=50, num_key_value_heads=1,
                                                          max_position_embeddings=16, head_dim=8, **_SMALL)), _text),
    "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(vocab_size=50, max_position_embeddings=16, pad_token_id=0,
                                                    **_SMALL)), _text),
    "xlnet": (lambda: T.XLNetForSequenceClassification(T.XLNetConfig(
        vocab_size=50, d_model=16, n_layer=2, n_head=2, d_inner=32, dropout=0.0, summary_last_dropout=0.0)), _text),
    "funnel": (lambda: T.FunnelForSequenceClassification(T.FunnelConfig(
        vocab_size=50, d_model=16, n_head=2, d_head=8, d_inner=32, block_sizes=[1, 1], hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0)), _text),
    "mobilebert": (lambda: T.MobileBertForSequenceClassification(T.MobileBertConfig(
        vocab_size=50, hidden_size=16, embedding_size=8, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, intra_bottleneck_size=16, true_hidden_size=16, max_position_embeddings=16,
        **_NO_DROPOUT)), _text),
    "modernbert": (lambda: T.ModernBertForSequenceClassification(T.ModernBertConfig(
        vocab_size=50, max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2, **_SMALL)), _text),
    "convbert": (lambda: T.ConvBertForSequenceClassification(T.ConvBertConfig(
        vocab_size=50, embedding_size=16, max_position_embeddings=16, **_NO_DROPOUT, **_SMALL)), _text),
    "beit": (lambda: T.BeitForImageClassification(T.BeitConfig(image_size=32, patch_size=8, num_labels=3,
                                                              drop_path_rate=0.0, **_NO_DROPOUT, **_SMALL)), _image),
    "convnext": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, drop_path_rate=0.0)), _image),
    "wav2vec2": (lambda: T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_labels=3, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, final_dropout=0.0)), _audio),
    "whisper-encoder": (lambda: T.WhisperForAudioClassification(T.WhisperConfig(
        d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=8,
        max_source_positions=8, num_labels=3, dropout=0.0)), _features),
}


class _EncoderDecoder(torch.nn.Module):
    """An encoder-decoder whose decoder reads the encoder's ids (teacher forcing on the input)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(input_ids=x, decoder_input_ids=x)


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
