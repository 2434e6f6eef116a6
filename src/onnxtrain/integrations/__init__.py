"""Glue between onnxtrain and training libraries (Hugging Face Trainer, PyTorch Lightning,
DeepSpeed, Flower). Each submodule imports its library; ``import onnxtrain`` imports none."""
