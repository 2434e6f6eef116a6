"""Small questions about ``onnx_ir`` nodes that passes ask everywhere."""

from __future__ import annotations

import onnx_ir as ir

# the default ONNX domain's two spellings
ONNX_DOMAINS = ("", "ai.onnx")


def is_onnx_op(node: ir.Node | None, *op_types: str) -> bool:
    """Whether ``node`` is an op of the default ONNX domain, and one of ``op_types`` if any are given."""
    return node is not None and node.domain in ONNX_DOMAINS and (not op_types or node.op_type in op_types)


def base_name(node: ir.Node) -> str:
    """A name for nodes that replace ``node``: its first output's (value names are unique; node
    names may be empty)."""
    return node.outputs[0].name or node.name
