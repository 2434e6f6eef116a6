"""Gradient rules: convolution and pooling."""

from __future__ import annotations
