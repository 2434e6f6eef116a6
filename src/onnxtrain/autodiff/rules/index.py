"""Gradient rules: index family."""

from __future__ import annotations
