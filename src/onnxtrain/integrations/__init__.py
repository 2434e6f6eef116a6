"""Glue between onnxtrain and training libraries; each submodule imports its library lazily
(``import onnxtrain`` imports none of them) and is an optional extra.

- :mod:`onnxtrain.integrations.huggingface`: ``ORTTrainer`` / ``ORTTrainingArguments``, drop-ins
  for ``transformers.Trainer`` / ``TrainingArguments`` (``onnxtrain[hf]``).
- :mod:`onnxtrain.integrations.lightning`: ``ORTModuleCallback`` for ``lightning.Trainer``
  (``onnxtrain[lightning]``).
- :mod:`onnxtrain.integrations.deepspeed`: ``initialize``, ``deepspeed.initialize`` around
  ORTModule with onnxtrain's FusedAdam (``onnxtrain[deepspeed]``).
- :mod:`onnxtrain.integrations.flower`: Flower clients and a server strategy on the on-device
  API (``onnxtrain[flower]``).
"""
