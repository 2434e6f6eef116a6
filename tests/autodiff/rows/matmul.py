"""Gradient-table rows for rules/matmul.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

ROWS: list[Case] = [
    # -- matrix products --------------------------------------------------------------
    Case("MatMul", [I(3, 4), I(4, 5)], id="MatMul-2d"),
    Case("MatMul", [I(2, 3, 4), I(4, 5)], id="MatMul-batched-weight"),
    Case("MatMul", [I("N", 2, 3, 4), I(2, 4, 5)], id="MatMul-batch-broadcast-symbolic"),
    Case("MatMul", [I(4), I(2, 4, 5)], id="MatMul-vector-left"),
    Case("MatMul", [I(2, 3, 4), I(4)], id="MatMul-vector-right"),
    Case("MatMul", [I(5), I(5)], id="MatMul-dot"),  # torch.dot, spectral norm's sigma
]
ROWS += [
    Case("Gemm", [I(3, 4), I(4, 5)], id="Gemm-no-C"),
    Case("Gemm", [I(4, 3), I(5, 4), I(5)], attrs={"transA": 1, "transB": 1, "alpha": 0.7, "beta": -1.3},
         id="Gemm-trans-both-C-row"),
    Case("Gemm", [I("N", 4), I(5, 4), I("N", 1)], attrs={"transB": 1, "beta": 0.5}, id="Gemm-transB-C-column-symbolic"),
    Case("Gemm", [I(4, "N"), I(4, 5), I(1, 1)], attrs={"transA": 1, "alpha": 2.0}, id="Gemm-transA-C-scalar-symbolic"),
    Case("Gemm", [I(3, 4), I(4, 5), I()], attrs={"beta": 2.0}, id="Gemm-C-rank0"),
    Case("Gemm", [I(3, 4), I(4, 5), I(3, 5)], id="Gemm-C-full"),
]
ROWS += [
    Case("Einsum", [I(3, 4), I(4, 5)], attrs={"equation": "ij,jk->ik"}, opsets=(13, 23), id="Einsum-matmul"),
    Case("Einsum", [I("N", 3, 4), I("N", 4, 2)], attrs={"equation": "bij, bjk"}, opsets=(13, 23),
         id="Einsum-implicit-batched-symbolic"),
    Case("Einsum", [I(3, 4, 2), I(4, 5)], attrs={"equation": "ijk,jl->li"}, opsets=(13, 23),
         id="Einsum-summed-out-label"),
    Case("Einsum", [I(2, 3), I(3), I(3, 4)], attrs={"equation": "ab,b,bc->ac"}, opsets=(13, 23), id="Einsum-three"),
    Case("Einsum", [I(2, 3, 4)], attrs={"equation": "abc->cb"}, opsets=(13, 23), id="Einsum-unary-sum-transpose"),
    Case("Einsum", [I(2, 1, 3, 4), I(2, 5, 4, 3)], attrs={"equation": "...ij,...jk->...ik"}, opsets=(13, 23),
         id="Einsum-ellipsis-broadcast"),
    # a label of size 1 in one operand broadcasts against the other's (numpy's rule): the gradient
    # is summed down to 1 there, and expanded where the other operand's 1 met a contracted label
    Case("Einsum", [I(2, 3), I(1)], attrs={"equation": "ij,i->ij"}, opsets=(13, 23), id="Einsum-label-broadcast"),
    Case("Einsum", [I(2, 1), I(3, 4)], attrs={"equation": "ij,jk->ik"}, opsets=(13, 23),
         id="Einsum-contracted-label-broadcast"),
    Case("Einsum", [I(4, 2, 3), I(1, 3, 2)], attrs={"equation": "bij,bjk->bik"}, opsets=(13, 23),
         id="Einsum-batch-label-broadcast"),
    # onnxruntime rejects an output without '...' when an input has it (even implicit "i...j,ji")
    Case("Einsum", [I("N", 2, 3, 4), I(4, 5)], attrs={"equation": "...ij,jk->...ik"}, opsets=(13, 23),
         id="Einsum-ellipsis-weight-symbolic"),
    Case("Einsum", [I(3, "N", 2, 4), I(4, 3)], attrs={"equation": "i...j,ji->i..."}, opsets=(13, 23),
         id="Einsum-ellipsis-middle"),
    Case("Einsum", [I(2, 3), I(3, 4)], attrs={"equation": "ij,jk"}, opsets=(13, 23), id="Einsum-implicit"),
    # a label repeated within an operand reads its diagonal
    Case("Einsum", [I(3, 3)], attrs={"equation": "ii->i"}, opsets=(13, 23), id="Einsum-diagonal"),
    Case("Einsum", [I(2, 3, 3)], attrs={"equation": "bii"}, opsets=(13, 23), id="Einsum-batched-trace-implicit"),
    Case("Einsum", [I(3, 4, 3), I(4)], attrs={"equation": "iji,j->i"}, opsets=(13, 23), id="Einsum-diagonal-and-other"),
    Case("Einsum", [I(3, 3, 2)], attrs={"equation": "iij->j"}, opsets=(13, 23), id="Einsum-trace-summed-out"),
    Case("Einsum", [I(2, 3, 2, 3)], attrs={"equation": "ijij->"}, opsets=(13, 23), id="Einsum-two-diagonals"),
]
