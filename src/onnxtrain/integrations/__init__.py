"""Glue between onnxtrain and other libraries; each module imports its library lazily."""
