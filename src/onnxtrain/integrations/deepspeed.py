"""DeepSpeed: ``deepspeed.initialize`` around :class:`~onnxtrain.torch.ORTModule`.

``deepspeed.initialize(model=ORTModule(model), ...)`` works as it is (ZeRO stage 1 and 2
reduce and partition the gradients ORTModule leaves in ``.grad``; tests/ortmodule/test_zero.py).
:func:`initialize` adds the three things one otherwise writes by hand:

- it wraps the model in ``ORTModule`` (unless it already is one), with ORTModule's options;
- when the config asks for DeepSpeed's ``Adam``/``AdamW`` and no optimizer is passed, it
  builds our :class:`~onnxtrain.torch.optim.FusedAdam` with the config's parameters and
  DeepSpeed's semantics and defaults instead. On CPU, DeepSpeed's own Adam is a C++ op that
  it JIT-compiles on first use (measured here: minutes of compiler time for ``fused_adam``);
  ours runs PyTorch's fused Adam kernel, on CPU and CUDA alike;
- on DeepSpeed's CPU accelerator it marks the shared-memory all-reduce op
  (``deepspeed_shm_comm``) unavailable before DeepSpeed loads it: DeepSpeed would otherwise
  JIT-compile it on first use (3 min wall here). Training collectives go through
  ``torch.distributed`` either way.

This module imports DeepSpeed (``import onnxtrain`` does not import this module): install
the ``deepspeed`` extra, and set ``DS_ACCELERATOR=cpu`` on a machine without GPUs.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path

import deepspeed
import deepspeed.ops
import hjson
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
from deepspeed.runtime.zero.config import get_zero_config

from onnxtrain.errors import OnnxTrainError
from onnxtrain.torch import DebugOptions, ORTModule
from onnxtrain.torch.optim import AdamWMode, FusedAdam

# DeepSpeed's optimizer "type" names it builds an Adam for (it compares them lower-cased)
_ADAM_TYPES = ("adam", "adamw")
# DeepSpeed's FusedAdam defaults (deepspeed.ops.adam.FusedAdam), which its config falls back on;
# they differ from upstream onnxruntime's FusedAdam (eps 1e-6, transformers-style AdamW)
_DEEPSPEED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                            "bias_correction": True}
# decoupled weight decay by default, unless "adam_w_mode": false (type "Adam" only)
_DEEPSPEED_ADAM_W_MODE_DEFAULT = True
# the shared-memory all-reduce op of DeepSpeed's CPU backend
_CPU_SHM_OP = "deepspeed_shm_comm"
# ZeRO-3 partitions the parameters themselves (gathered by forward hooks on each submodule)
_ZERO_PARAMETER_PARTITIONING_STAGE = 3


class DeepSpeedConfigError(OnnxTrainError, ValueError):
    """The DeepSpeed config asks for an optimizer setting FusedAdam cannot provide."""


def _load_config(config) -> dict | None:
    """The config as a dict we may edit, read as DeepSpeed reads it: a dict, a path to a JSON
    (hjson: comments and trailing commas allowed, duplicate keys refused) file, or base64 JSON."""
    if config is None or isinstance(config, Mapping):
        return None if config is None else json.loads(json.dumps(config))  # a deep copy we may edit
    if not isinstance(config, (str, os.PathLike)):
        raise DeepSpeedConfigError(f"DeepSpeed config must be a dict, a JSON file path or base64 JSON, "
                                   f"got {type(config).__name__}")
    try:
        if Path(config).exists():
            with open(config, encoding="utf-8") as file:
                loaded = hjson.load(file, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        else:
            loaded = hjson.loads(base64.urlsafe_b64decode(str(config)).decode("utf-8"))
    except (ValueError, hjson.HjsonDecodeError, binascii.Error) as exc:  # includes duplicate keys
        raise DeepSpeedConfigError(f"DeepSpeed config {str(config)[:200]!r} is neither a readable JSON file nor "
                                   f"base64 JSON: {exc}") from exc
    if not isinstance(loaded, Mapping):
        raise DeepSpeedConfigError(f"DeepSpeed config {str(config)[:200]!r} holds a {type(loaded).__name__}; "
                                   f"expected a JSON object")
    return json.loads(json.dumps(loaded))


def _zero_settings(config: dict) -> tuple[int, str]:
    """ZeRO's stage and optimizer-offload device as DeepSpeed reads them (its bool form,
    strings for numbers, the deprecated ``cpu_offload``)."""
    try:
        zero = get_zero_config(config)
    except ValueError as exc:  # pydantic's ValidationError
        raise DeepSpeedConfigError(f"DeepSpeed config 'zero_optimization' is not valid: {exc}") from exc
    offload = zero.offload_optimizer
    device = "none" if offload is None else getattr(offload.device, "value", offload.device)
    return int(zero.stage), str(device).lower()


def _adam_params(optimizer_config: Mapping) -> dict:
    params = optimizer_config.get("params")
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise DeepSpeedConfigError(f"DeepSpeed optimizer 'params' must be an object, got {params!r}")
    return dict(params)


def _wants_our_adam(config: dict, offload: str) -> bool:
    """Whether ``config`` asks for an Adam our FusedAdam can be (``offload``: ZeRO's
    optimizer-offload device, from :func:`_zero_settings`)."""
    optimizer = config.get("optimizer")
    if not isinstance(optimizer, Mapping) or str(optimizer.get("type", "")).lower() not in _ADAM_TYPES:
        return False
    # torch_adam: the user chose torch's Adam; offload: ZeRO-Offload needs DeepSpeed's CPU Adam
    return not _adam_params(optimizer).get("torch_adam", False) and offload in ("none", "")


def fused_adam_from_config(params, optimizer_config: Mapping) -> FusedAdam:
    """Our :class:`FusedAdam` for a DeepSpeed ``"optimizer"`` config entry of type ``Adam`` or
    ``AdamW``, with DeepSpeed's semantics: ``AdamW``, and ``Adam`` unless ``"adam_w_mode":
    false``, decay the weights as ``torch.optim.AdamW`` (``AdamWMode.ADAMW_TORCH``); ``Adam``
    with ``"adam_w_mode": false`` adds the decay to the gradient (``ADAM_L2_REGULARIZATION``).
    Unset parameters take DeepSpeed's defaults (``eps`` 1e-8).

    Example:
        >>> fused_adam_from_config(model.parameters(), {"type": "AdamW", "params": {"lr": 1e-4}})
    """
    kind = str(optimizer_config.get("type", "")).lower()
    if kind not in _ADAM_TYPES:
        raise DeepSpeedConfigError(f"optimizer type must be Adam or AdamW, got {optimizer_config.get('type')!r}")
    settings = _adam_params(optimizer_config)
    adam_w_mode = settings.pop("adam_w_mode", _DEEPSPEED_ADAM_W_MODE_DEFAULT) or kind == "adamw"
    settings.pop("torch_adam", None)
    unknown = sorted(set(settings) - set(_DEEPSPEED_ADAM_DEFAULTS))
    if unknown:
        raise DeepSpeedConfigError(
            f"DeepSpeed optimizer params {unknown} have no FusedAdam counterpart (expected "
            f"{sorted(_DEEPSPEED_ADAM_DEFAULTS)} and adam_w_mode); pass use_fused_adam=False to "
            "let DeepSpeed build its own optimizer")
    settings = {**_DEEPSPEED_ADAM_DEFAULTS, **settings}
    settings["betas"] = tuple(settings["betas"])
    mode = AdamWMode.ADAMW_TORCH if adam_w_mode else AdamWMode.ADAM_L2_REGULARIZATION
    return FusedAdam(params, adam_w_mode=mode, **settings)


def initialize(model: torch.nn.Module, *, debug_options: DebugOptions | None = None,
               memory_opt_level: int | None = None, memory_budget: int | None = None,
               use_fused_adam: bool = True, build_cpu_shm_comm: bool = False,
               optimizer=None, model_parameters=None, config=None, **deepspeed_kwargs):
    """``deepspeed.initialize`` for a model run by ORTModule; returns DeepSpeed's tuple
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Args:
        model: a ``torch.nn.Module``, wrapped in ``ORTModule`` unless it already is one.
        debug_options, memory_opt_level, memory_budget: ``ORTModule``'s options (used only
            when this call wraps the model).
        use_fused_adam: when ``optimizer`` is None and ``config`` asks for ``Adam``/``AdamW``
            (without ``torch_adam`` or optimizer offload), build
            :func:`fused_adam_from_config` on ``model_parameters`` (default: the parameters
            that require grad) and remove ``"optimizer"`` from the config DeepSpeed sees
            (adding ``zero_allow_untested_optimizer``: DeepSpeed's ZeRO lists the optimizer
            classes it knows). The config's ``"scheduler"`` still applies.
        build_cpu_shm_comm: on DeepSpeed's CPU accelerator, let DeepSpeed JIT-compile its
            shared-memory all-reduce op (by default it is marked unavailable, which DeepSpeed
            remembers for the rest of the process).
        optimizer, model_parameters, config, **deepspeed_kwargs: as for ``deepspeed.initialize``
            (``config``, or its older name ``config_params``: a dict, a JSON file path or base64
            JSON, read as DeepSpeed reads them).

    Raises:
        DeepSpeedConfigError: the config cannot be read, its Adam params have no FusedAdam
            counterpart, or it asks for ZeRO stage 3 (checked before anything else happens).

    Example:
        >>> config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1},
        ...           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
        >>> engine, optimizer, _, _ = initialize(net, config=config)
        >>> loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()
    """
    if config is None and "config_params" in deepspeed_kwargs:  # DeepSpeed's older name for config
        config = deepspeed_kwargs.pop("config_params")
    loaded = _load_config(config)
    stage, offload = (0, "none") if loaded is None else _zero_settings(loaded)
    if stage >= _ZERO_PARAMETER_PARTITIONING_STAGE:
        raise DeepSpeedConfigError(
            f"ZeRO stage {stage} partitions the parameters and gathers them in forward hooks of each "
            "submodule, which ORTModule's exported graph does not run (the export sees empty "
            "parameters); expected stage 0, 1 or 2")
    if not isinstance(model, ORTModule):
        model = ORTModule(model, debug_options, memory_opt_level=memory_opt_level, memory_budget=memory_budget)
    if not build_cpu_shm_comm and get_accelerator().device_name() == "cpu":
        # DeepSpeed reads this dict (its ops' compatibility) before building an op
        deepspeed.ops.__compatible_ops__[_CPU_SHM_OP] = False
    if optimizer is None and use_fused_adam and loaded is not None and _wants_our_adam(loaded, offload):
        params = model_parameters if model_parameters is not None else \
            [p for p in model.parameters() if p.requires_grad]
        optimizer = fused_adam_from_config(params, loaded.pop("optimizer"))
        loaded["zero_allow_untested_optimizer"] = True
        model_parameters, config = None, loaded
    return deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                                config=config, **deepspeed_kwargs)
