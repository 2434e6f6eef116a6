"""Gradient rules: nondiff family."""

from __future__ import annotations
