"""Glue for training libraries: each submodule imports its library lazily (on its own import).

- :mod:`onnxtrain.integrations.huggingface`: ``ORTTrainer`` / ``ORTTrainingArguments``, drop-ins
  for ``transformers.Trainer`` / ``TrainingArguments`` (extra ``onnxtrain[hf]``).
- :mod:`onnxtrain.integrations.flower`: Flower clients and a server strategy on the on-device
  API (extra ``onnxtrain[flower]``).
"""
