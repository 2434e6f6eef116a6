"""Gradient rules: loss family."""

from __future__ import annotations
