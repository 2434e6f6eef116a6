"""Small PyTorch models exported with torch.onnx.export(dynamo=True), shared by tests."""

from __future__ import annotations

import io as _io
import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx

torch = __import__("pytest").importorskip("torch")
from bench import models as bench_models  # noqa: E402  (after the torch check)
nn = torch.nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x):
        return self.net(x)


class MomentumEncoder(nn.Module):
    """MoCo/BYOL style: the key encoder follows the query encoder under torch.no_grad() in the
    forward (frozen parameters the forward changes in place)."""

    def __init__(self, features: int = 8):
        super().__init__()
        self.q = nn.Linear(features, features)
        self.k = nn.Linear(features, features)
        self.k.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.mul_(0.5).add_(pq, alpha=0.5)
        return (self.q(x) * self.k(x)).sum(-1)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        # no conv bias before a BatchNorm (it cancels): with batch statistics its gradient is
        # rounding noise, which Adam's normalization would turn into real but arbitrary updates
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.AvgPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 2 * 2, 10))

    def forward(self, x):
        return self.head(self.features(x))


def GPT(vocab=40, d=16, heads=2, layers=2, max_len=16) -> nn.Module:
    """The benchmark's GPT-style decoder (bench/models.py: causal mask, tanh GELU), small by default."""
    return bench_models.modules()["GPT"](vocab, d, heads, layers, max_len)


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


class BertLogits(nn.Module):
    """BERT classifier returning the logits tensor only (not a ModelOutput)."""

    def __init__(self):
        super().__init__()
        self.bert = tiny_bert()

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).logits


def export(model: nn.Module, args: tuple, input_names: list[str], dynamic: dict) -> onnx.ModelProto:
    """torch.onnx.export(dynamo=True) without the optimizer's BatchNorm folding (it would erase parameters)."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, args, dynamo=True, input_names=input_names, output_names=["output"],
                                    dynamic_shapes=dynamic, optimize=False, verbose=False)
    return program.model_proto


def export_legacy(model: nn.Module, args: tuple, input_names: list[str], opset: int = 14) -> onnx.ModelProto:
    """The TorchScript exporter of older stacks (opset 14-17), in training mode (BatchNorm uses batch stats)."""
    buffer = _io.BytesIO()
    dynamic_axes = {name: {0: "batch", 1: "seq"} if np.ndim(a) >= 2 and a.dtype in (torch.int64,) else {0: "batch"}
                    for name, a in zip(input_names, args)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, buffer, dynamo=False, opset_version=opset, input_names=input_names,
                          output_names=["output"], dynamic_axes=dynamic_axes,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return onnx.load_from_string(buffer.getvalue())


@dataclass
class Example:
    name: str
    model: nn.Module
    inputs: Callable[[int, np.random.Generator], list[np.ndarray]]  # batch -> user inputs
    labels: Callable[[int, np.random.Generator], np.ndarray]
    input_names: list[str]
    dynamic: Callable[[], dict]


def examples() -> dict[str, Example]:
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=2, max=64)
    seq = torch.export.Dim("seq", min=2, max=16)
    return {
        "mlp": Example("mlp", MLP(), lambda n, r: [r.standard_normal((n, 12)).astype(np.float32)],
                       lambda n, r: r.integers(0, 5, n), ["x"], lambda: ({0: batch},)),
        "cnn": Example("cnn", CNN(), lambda n, r: [r.standard_normal((n, 1, 8, 8)).astype(np.float32)],
                       lambda n, r: r.integers(0, 10, n), ["image"], lambda: ({0: batch},)),
        # the sequence length varies with the batch size (6..8): both symbolic dims change
        "gpt": Example("gpt", GPT(), lambda n, r: [r.integers(0, 40, (n, 6 + n % 3))],
                       lambda n, r: r.integers(0, 40, (n, 6 + n % 3)), ["idx"], lambda: ({0: batch, 1: seq},)),
        "bert": Example("bert", BertLogits(),
                        # ids start at 1: BERT's embedding has padding_idx=0, whose row torch never
                        # updates; an ONNX Gather has no such notion (the export drops it)
                        lambda n, r: [r.integers(1, 60, (n, 10)),
                                      (np.arange(10)[None, :] < r.integers(5, 11, (n, 1))).astype(np.int64)],
                        lambda n, r: r.integers(0, 3, n), ["input_ids", "attention_mask"],
                        lambda: ({0: batch, 1: seq}, {0: batch, 1: seq})),
    }


def training_gradients(onnx_model: onnx.ModelProto, params: list[str], inputs: dict, weight: np.ndarray) -> dict:
    """onnxtrain's gradients of ``sum(output0 * weight)`` (a random-direction VJP for a random
    ``weight``) for the initializers ``params``, run through the training graph onnxblock builds."""
    import onnxruntime as ort

    from onnxtrain import names
    from onnxtrain.ir import io
    from onnxtrain.onnxblock import TrainingBlock, base, blocks

    class SumOfWeighted(TrainingBlock):
        def build(self, output_name):
            return blocks.ReduceSum()(blocks.Mul()(output_name, blocks.Constant(weight)()))

    block = SumOfWeighted()
    for name in params:
        block.requires_grad(name)
    values = {t.name: onnx.numpy_helper.to_array(t) for t in onnx_model.graph.initializer}
    with base(onnx_model):
        block(onnx_model.graph.output[0].name)
    training, _ = block.to_ir_models()
    session = ort.InferenceSession(io.serialize(training), providers=["CPUExecutionProvider"])
    feeds = {**inputs, names.LAZY_RESET_GRAD: np.array(True)}
    for name in params:
        feeds[name] = values[name]
        feeds[names.accumulation_buffer_name(name)] = np.zeros_like(values[name])
    wanted = {i.name for i in session.get_inputs()}
    results = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {k: v for k, v in feeds.items() if k in wanted})))
    return {name: results[names.accumulation_out_name(name)] for name in params}


def assert_exported_gradients_match_torch(make: Callable[[], nn.Module], sample: Callable, batch_axis: int = 0,
                                          case: str = "") -> onnx.ModelProto:
    """Export ``make()`` (eval mode) with a dynamic batch along ``batch_axis`` from a sample of 3,
    run its training graph on a sample of 5 (``sample(rng, n)``), and compare the parameters'
    gradients of a random-direction VJP with torch.autograd's. Returns the exported model."""
    torch.manual_seed(0)
    model = make().eval()
    rng = np.random.default_rng(0)
    onnx_model = export(model, (torch.tensor(sample(rng, 3)),), ["x"],
                        ({batch_axis: torch.export.Dim("batch", min=2, max=16)},))
    x = sample(rng, 5)  # another batch size than the export's
    out = model(torch.tensor(x))
    weight = rng.standard_normal(tuple(out.shape)).astype(np.float32)
    params = dict(model.named_parameters())
    ours = training_gradients(onnx_model, list(params), {"x": x}, weight)
    (out * torch.tensor(weight)).sum().backward()
    for name, p in params.items():
        np.testing.assert_allclose(ours[name], p.grad.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=f"{case}: gradient of {name}")
    return onnx_model
