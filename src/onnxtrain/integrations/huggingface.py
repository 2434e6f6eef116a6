"""Hugging Face ``transformers.Trainer`` with the model's forward and backward in ONNX Runtime.

:class:`ORTTrainer` and :class:`ORTTrainingArguments` are drop-ins for ``transformers.Trainer``
and ``TrainingArguments`` (upstream's names, from Hugging Face optimum): change the import and
the two class names, keep the rest of the script. The trainer wraps the model once in
:class:`onnxtrain.torch.ORTModule` where ``Trainer`` would hand it to its wrappers, so
training and evaluation run through ONNX Runtime, while ``trainer.model`` stays the plain
transformers model: checkpoints, ``save_model``, ``state_dict`` keys and ``model.config``
are exactly those of ``transformers.Trainer``. ``optim="adamw_ort_fused"`` selects
:class:`onnxtrain.torch.optim.FusedAdam` (``torch.optim.AdamW``'s update).

Importing this module imports transformers (and needs accelerate, as ``Trainer`` does);
``import onnxtrain`` does not.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import onnxruntime
import torch
import transformers
from transformers.training_args import OptimizerNames
from transformers.utils import ExplicitEnum

from onnxtrain.errors import OnnxTrainError
from onnxtrain.integrations.onnx_inference import export_inference_onnx
from onnxtrain.logs import LogLevel
from onnxtrain.torch import DebugOptions, ORTModule
from onnxtrain.torch._export import PURE_HOOK_ATTRIBUTE
from onnxtrain.torch.optim import AdamWMode, FusedAdam

__all__ = ["ORTOptimizerNames", "ORTTrainer", "ORTTrainerError", "ORTTrainingArguments"]


class ORTTrainerError(OnnxTrainError, ValueError):
    """ORTTrainer / ORTTrainingArguments were given something they cannot use."""


class ORTOptimizerNames(ExplicitEnum):
    """``optim`` values added by :class:`ORTTrainingArguments` (upstream's names)."""

    ADAMW_ORT_FUSED = "adamw_ort_fused"
    """:class:`~onnxtrain.torch.optim.FusedAdam` in ``AdamWMode.ADAMW_TORCH``: the update of
    ``torch.optim.AdamW`` (Trainer's ``adamw_torch``) in PyTorch's fused multi-tensor kernel."""


def _ort_optimizer(name) -> ORTOptimizerNames | None:
    try:
        return ORTOptimizerNames(name)
    except ValueError:
        return None


# TrainingArguments' own optim field (its default and help)
_BASE_OPTIM = next(f for f in fields(transformers.TrainingArguments) if f.name == "optim")


@dataclass
class ORTTrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` that also accept ``optim="adamw_ort_fused"`` and
    Optimum's ORTModule arguments.

    Every other argument and ``optim`` value means what it means for ``TrainingArguments``.
    Optimum's ``save_onnx``, ``onnx_prefix`` and ``onnx_log_level`` (``"VERBOSE"`` ...
    ``"FATAL"``) make :class:`ORTTrainer`'s :class:`~onnxtrain.torch.DebugOptions` where none is
    given; ``use_module_with_loss`` is accepted and changes nothing: a Hugging Face model given
    labels computes its loss in its forward, which runs in ONNX Runtime already.

    Example:
        >>> args = ORTTrainingArguments("out", optim="adamw_ort_fused", learning_rate=5e-5,
        ...                             weight_decay=0.01, report_to="none")
    """

    # redeclared as a plain string: HfArgumentParser offers OptimizerNames' values as the only
    # choices of the inherited field, so `--optim adamw_ort_fused` was refused on a command line
    optim: str = field(default=_BASE_OPTIM.default, metadata={
        "help": f"{_BASE_OPTIM.metadata.get('help', 'The optimizer to use.')} Also 'adamw_ort_fused' "
                f"(onnxtrain's FusedAdam in torch.optim.AdamW's update)."})
    use_module_with_loss: bool = False
    save_onnx: bool = False
    onnx_prefix: str | None = None
    onnx_log_level: str | None = None

    def __post_init__(self):
        if self.onnx_log_level is not None and str(self.onnx_log_level).upper() not in LogLevel.__members__:
            raise ValueError(f"onnx_log_level must be one of {list(LogLevel.__members__)}, got {self.onnx_log_level!r}")
        ort_optim = _ort_optimizer(self.optim)
        if ort_optim is not None:
            # TrainingArguments only knows its own names: check the rest against adamw_torch,
            # whose update ours computes
            self.optim = OptimizerNames.ADAMW_TORCH
        super().__post_init__()
        if ort_optim is not None:
            self.optim = ort_optim

    def set_optimizer(self, name: str | OptimizerNames | ORTOptimizerNames = "adamw_torch", **kwargs):
        """``TrainingArguments.set_optimizer``, also accepting ``"adamw_ort_fused"``."""
        ort_optim = _ort_optimizer(name)
        super().set_optimizer("adamw_torch" if ort_optim is not None else name, **kwargs)
        if ort_optim is not None:
            self.optim = ort_optim
        return self


# See ORTTrainer.__init__: ONNX Runtime is seeded with args.seed + this.
ORT_SEED_OFFSET = 1


def _neftune_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """The input embeddings NEFTune adds noise to (a PEFT model's base model's)."""
    base = getattr(getattr(model, "base_model", None), "model", None)
    if base is not None and hasattr(model, "peft_config"):
        model = base
    return model.get_input_embeddings()


def _neftune_noise(alpha: float, module, inputs, output):
    """NEFTune's forward hook (transformers.integrations.neftune): uniform noise in
    ``[-m, m]``, ``m = alpha / sqrt(length * hidden)``, drawn as ``(2 rand - 1) m`` (no bounds
    read back from tensors, which an export cannot do)."""
    if module.training:
        magnitude = alpha / (output.size(1) * output.size(2)) ** 0.5
        output = output + (torch.rand_like(output) * 2 - 1) * magnitude
    return output


class ORTTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose model runs forward and backward in ONNX Runtime.

    Takes ``Trainer``'s arguments, plus ORTModule's options: ``debug_options``
    (:class:`~onnxtrain.torch.DebugOptions`; ``DebugOptions(fallback=False)`` raises instead of
    running in PyTorch when the model cannot be exported), ``memory_opt_level`` and
    ``memory_budget`` (recompute; see :class:`~onnxtrain.torch.ORTModule`), and ``dynamic``
    (default ``True`` here: ``Trainer``'s collators pad each batch to its own longest sequence,
    so the first export already takes dynamic dims instead of exporting again on the second
    batch; ``None`` exports the first batch's shapes first, as ORTModule does).

    - Training and evaluation call ``trainer.ort_module``, an :class:`ORTModule` around
      ``trainer.model`` made on first use (one export for training, one for evaluation).
      ``trainer.model`` stays the plain model: saving, loading and ``resume_from_checkpoint``
      are ``Trainer``'s own.
    - Mixed precision (``bf16=True``, on CPU too) is ``Trainer``'s: accelerate runs the
      ORTModule's forward under ``torch.autocast``, which ORTModule exports.
    - ``optim="adamw_ort_fused"`` (with :class:`ORTTrainingArguments`) selects
      :class:`~onnxtrain.torch.optim.FusedAdam` with ``Trainer``'s parameter groups (no weight
      decay for biases and LayerNorm), betas, epsilon and learning-rate schedule.
    - ONNX Runtime's dropout draws from its own generator, seeded with ``args.seed`` here; it is
      not part of a checkpoint's RNG state, so a resumed run with dropout draws other masks.
    - :meth:`export_onnx` writes the trained model as a plain ONNX model for inference.

    Example:
        >>> from onnxtrain.integrations.huggingface import ORTTrainer, ORTTrainingArguments
        >>> args = ORTTrainingArguments("out", optim="adamw_ort_fused", max_steps=10, report_to="none")
        >>> trainer = ORTTrainer(model=model, args=args, train_dataset=train, eval_dataset=test)
        >>> trainer.train(); trainer.evaluate()
        >>> trainer.export_onnx("out/model.onnx")
    """

    def __init__(self, model=None, args=None, *rest, debug_options: DebugOptions | None = None,
                 memory_opt_level: int | None = None, memory_budget: int | None = None,
                 dynamic: bool | None = True, **kwargs):
        if args is None:
            args = ORTTrainingArguments(output_dir="tmp_trainer")  # Trainer's default folder
        if args.torch_compile:
            raise ORTTrainerError("ORTTrainer runs the model in ONNX Runtime; torch_compile=True would compile the "
                                  "ORTModule wrapper instead: expected torch_compile=False")
        self._ort_debug_options = debug_options
        self._ort_options = {"memory_opt_level": memory_opt_level, "memory_budget": memory_budget,
                             "dynamic": dynamic}
        self._ort_module: ORTModule | None = None
        super().__init__(model, args, *rest, **kwargs)
        # ORTModule's dropout masks come from ONNX Runtime's generator. It seeds each run's engine
        # with the next integer, and its CPU engine (minstd) treats seeds 0 and 1 alike: from
        # seed 0 the first two runs would draw the same masks. Starting one higher avoids that.
        onnxruntime.set_seed(int(self.args.seed) + ORT_SEED_OFFSET)

    def call_model_init(self, trial=None):
        # Trainer seeds torch with args.seed before each model_init (a second train(), each
        # hyperparameter trial): ONNX Runtime's generator starts over with it, as torch's does
        onnxruntime.set_seed(int(self.args.seed) + ORT_SEED_OFFSET)
        return super().call_model_init(trial)

    def train(self, *args, **kwargs):
        """``Trainer.train``; NEFTune (``neftune_noise_alpha``) adds its noise with ops the export
        takes (Trainer's own hook draws with tensor bounds, which it cannot)."""
        alpha = self.neftune_noise_alpha
        if alpha is None:
            return super().train(*args, **kwargs)
        hook = functools.partial(_neftune_noise, float(alpha))
        setattr(hook, PURE_HOOK_ATTRIBUTE, True)  # its noise is the graph's: no ForwardHookWarning
        handle = _neftune_embeddings(self.accelerator.unwrap_model(self.model)).register_forward_hook(hook)
        self.neftune_noise_alpha = None  # Trainer's own hook stays off
        try:
            return super().train(*args, **kwargs)
        finally:
            self.neftune_noise_alpha = alpha
            handle.remove()

    @property
    def ort_module(self) -> ORTModule | None:
        """The :class:`ORTModule` around ``trainer.model`` (None before the first train/evaluate)."""
        if self._ort_module is not None and self._ort_module.module is not self.model:
            return None  # model_init replaced the model; the next _wrap_model wraps the new one
        return self._ort_module

    def _ortmodule_for(self, model: torch.nn.Module) -> ORTModule:
        if self.ort_module is None or self._ort_module.module is not model:
            self._ort_module = ORTModule(model, self._debug_options(), **self._ort_options)
        return self._ort_module

    def _debug_options(self) -> DebugOptions | None:
        """The ``debug_options`` given, else those Optimum's arguments ask for (or the defaults)."""
        if self._ort_debug_options is not None:
            return self._ort_debug_options
        args = self.args
        options = {}
        if getattr(args, "save_onnx", False):
            options.update(save_onnx=True, save_path=args.output_dir)
            if args.onnx_prefix:
                options["onnx_prefix"] = args.onnx_prefix
        if getattr(args, "onnx_log_level", None):
            options["log_level"] = LogLevel[str(args.onnx_log_level).upper()]
        return DebugOptions(**options) if options else None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # Trainer passes the plain model here for training (model_wrapped) and evaluation
        # (model); ORTModule goes innermost, under DataParallel / DDP where those apply
        if model is self.model and not isinstance(model, ORTModule):
            model = self._ortmodule_for(model)
        if training and self.is_deepspeed_enabled and isinstance(model, ORTModule) \
                and not getattr(model, "_is_accelerate_prepared", False):
            # Trainer builds DeepSpeed's engine only around the model it holds (self.model): around
            # ours it never did (accelerator.backward then had no engine); prepared as Trainer would
            if hasattr(self.lr_scheduler, "step"):
                engine, self.optimizer = self.accelerator.prepare(model, self.optimizer)
            else:  # DeepSpeed's own scheduler (config "scheduler"): prepared with the rest
                engine, self.optimizer, self.lr_scheduler = self.accelerator.prepare(model, self.optimizer,
                                                                                     self.lr_scheduler)
            return engine
        wrapped = super()._wrap_model(model, training, dataloader)
        if wrapped is model and isinstance(model, ORTModule) and not getattr(model, "_is_accelerate_prepared", False):
            # Trainer hands accelerate only an unwrapped model; ours gets what it would have:
            # autocast for bf16/fp16, device placement, DDP when distributed
            wrapped = self.accelerator.prepare_model(model, evaluation_mode=not training)
        return wrapped

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        """``Trainer.get_optimizer_cls_and_kwargs``, plus ``optim="adamw_ort_fused"``."""
        if _ort_optimizer(args.optim) is ORTOptimizerNames.ADAMW_ORT_FUSED:
            # Trainer's create_optimizer supplies the groups' weight_decay (0 for biases and norms)
            return FusedAdam, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                               "eps": args.adam_epsilon, "adam_w_mode": AdamWMode.ADAMW_TORCH}
        return transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)

    def _export_sample(self) -> dict[str, torch.Tensor]:
        """The model inputs of the first evaluation (else training) batch, labels removed."""
        if self.eval_dataset is not None and not isinstance(self.eval_dataset, Mapping):
            loader = self.get_eval_dataloader()
        elif self.train_dataset is not None:
            loader = self.get_train_dataloader()
        else:
            raise ORTTrainerError("ORTTrainer.export_onnx needs sample inputs: pass inputs=, or give the "
                                  "trainer a train_dataset or a single eval_dataset")
        batch = self._prepare_inputs(next(iter(loader)))
        label_names = set(self.label_names or ()) | {"labels", "label", "label_ids"}
        sample = {k: v for k, v in batch.items() if k not in label_names and isinstance(v, torch.Tensor)}
        labels = batch.get("labels")
        if (isinstance(labels, torch.Tensor) and getattr(getattr(self.model, "config", None), "is_encoder_decoder", False)
                and "decoder_input_ids" not in sample and "decoder_inputs_embeds" not in sample):
            # an encoder-decoder trained from labels alone derives its decoder inputs from them:
            # without the labels its export would have no decoder input (or fail)
            sample["decoder_input_ids"] = self._decoder_inputs_from(labels)
        return sample

    def _decoder_inputs_from(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder inputs an encoder-decoder derives from ``labels`` (teacher forcing): its
        own ``prepare_decoder_input_ids_from_labels``, else the labels shifted right behind the
        decoder start token, ignored positions (-100) as padding, as Whisper's forward does."""
        prepare = getattr(self.model, "prepare_decoder_input_ids_from_labels", None)
        if prepare is not None:
            return prepare(labels=labels)
        config = self.model.config
        start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
        if start is None or pad is None:
            raise ORTTrainerError(f"ORTTrainer.export_onnx: {type(self.model).__name__} takes its decoder inputs from "
                                  f"the labels, which an inference model does not have: pass inputs= with "
                                  f"decoder_input_ids")
        shifted = labels.new_full(labels.shape, start)
        shifted[..., 1:] = labels[..., :-1]
        return shifted.masked_fill(shifted == -100, pad)

    def export_onnx(self, path: str | os.PathLike, inputs: Mapping[str, torch.Tensor] | None = None, *,
                    optimize: bool = True) -> list[str]:
        """Write the trained model as a plain ONNX inference model (fp32, eval mode) to ``path``.

        ``inputs`` is a sample call (keyword name -> tensor, e.g. a tokenizer's output without
        labels); by default the first evaluation (else training) batch, labels removed. Batch and
        sequence dims stay dynamic. Graph inputs are named as the keywords, outputs as the
        model output's fields (``logits``, ...); returns the output names. Runs in a stock
        ``onnxruntime.InferenceSession``. ``optimize=False`` skips the exporter's graph optimizer
        (faster export; ONNX Runtime optimizes the graph when it loads it anyway).

        Example:
            >>> trainer.export_onnx("model.onnx")
            ['logits']
            >>> onnxruntime.InferenceSession("model.onnx").run(["logits"], {"input_ids": ids, ...})
        """
        sample = dict(inputs) if inputs is not None else self._export_sample()
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        return export_inference_onnx(model, sample, path, optimize=optimize)
