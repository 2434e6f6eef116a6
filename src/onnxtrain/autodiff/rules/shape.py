"""Gradient rules: shape family."""

from __future__ import annotations
