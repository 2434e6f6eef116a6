"""Gradient-table rows for rules/linalg.py (Det, com.microsoft.Inverse).

Square matrices (batched, with a symbolic batch), sampled in [-2, 2] by each row's fixed seed;
the seeds give matrices far enough from singular for central differences.
"""

from __future__ import annotations

from tests.autodiff.grad_table import Case, I

ROWS: list[Case] = [
    Case("Det", [I(3, 3)], opsets=(11, 23), id="Det-matrix"),
    Case("Det", [I("N", 4, 4)], opsets=(11, 23), id="Det-batched"),
    Case("Inverse", [I(3, 3)], domain="com.microsoft", opsets=(11, 23), id="Inverse-matrix"),
    Case("Inverse", [I(2, "N", 2, 2)], domain="com.microsoft", opsets=(11, 23), id="Inverse-batched"),
]
