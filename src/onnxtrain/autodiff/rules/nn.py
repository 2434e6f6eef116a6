"""Gradient rules: nn family."""

from __future__ import annotations
