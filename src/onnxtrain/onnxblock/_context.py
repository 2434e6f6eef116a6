"""The model a block builds into: passed explicitly, or made active with ``base()``.

Upstream's blocks find "the current model" through a module-level global. Here
the active model lives in a ``ContextVar`` set only inside ``with base(model):``
(so threads and nested contexts do not interfere), and every block can also be
applied to an explicit :class:`BuildContext` with ``block.apply(ctx, ...)``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import onnx_ir as ir

from onnxtrain.errors import ArtifactError, ModelError
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.passes.ceil_pool import CeilModePoolPass

# Opset of graphs built from nothing (optimizer models): the newest opset stock
# onnxruntime 1.20+ runs, and the one torch's exporter emits by default.
EMPTY_BASE_OPSET = 18


class BuildContext:
    """A model being built (``ir_model``, an ``onnx_ir.Model``), with a builder on its main graph
    and name lookup. ``with onnxblock.base(...) as accessor`` gives it; ``accessor.model`` is the
    model as an ``onnx.ModelProto``, as upstream's accessor (``onnx.save(accessor.model, path)``).
    """

    def __init__(self, model: ir.Model, path: str | None = None):
        self.ir_model = model
        # upstream's accessor: the file given to base() for models over 2 GB (not needed here)
        self.path = path
        self.builder = GraphBuilder(model.graph, scope="onnxblock")
        # initializers blocks added as parameters to train (blocks.Linear's weight and bias)
        self.new_parameters: list[str] = []

    @property
    def graph(self) -> ir.Graph:
        return self.ir_model.graph

    def find(self, name: str) -> ir.Value | None:
        """The value called ``name`` (a graph input, initializer or node output), or None."""
        graph = self.ir_model.graph
        for value in graph.inputs:
            if value.name == name:
                return value
        if name in graph.initializers:
            return graph.initializers[name]
        for node in graph:
            for out in node.outputs:
                if out.name == name:
                    return out
        return None

    def value(self, name: str | ir.Value) -> ir.Value:
        if isinstance(name, ir.Value):
            return name
        found = self.find(name)
        if found is None:
            raise ModelError(f"the model has no value named {name!r}")
        return found

    def shape_of(self, value: ir.Value) -> ir.Shape | None:
        """The shape of ``value``, running ONNX shape inference if the builder does not know it."""
        if value.shape is not None:
            return value.shape
        inferred = io.infer_shapes(io.load_model(io.to_proto(self.ir_model)))
        found = BuildContext(inferred).find(value.name)
        if found is not None and found.shape is not None:
            value.shape = found.shape
            if value.type is None:
                value.type = found.type
        return value.shape

    def trusted_shape(self, value: ir.Value) -> ir.Shape | None:
        """The shape of ``value`` as far as it can be trusted, for a new input that must match it
        (a loss's target): exporters declare wrong output shapes (the TorchScript exporter one
        symbol for the batch and length of a reflect-padded Conv1d, dynamo the example's length
        for a GRU's dynamic sequence), and the runtime enforces an input's declared shape.

        ONNX shape inference from the graph inputs decides each dim it can (a size, or a symbol
        of the graph inputs). Elsewhere a declared size stays, and a declared symbol only where
        it is a symbol of the graph inputs that the shape uses once; any other dim is left
        unnamed (any size).
        """
        declared = self.shape_of(value)
        if declared is None:
            return None
        input_symbols = {d.value for v in self.graph.inputs if v.shape is not None
                         for d in v.shape if isinstance(d, ir.SymbolicDim) and d.value is not None}
        found = BuildContext(io.infer_shapes_from_inputs(self.ir_model)).find(value.name)
        inferred = found.shape if found is not None and found.shape is not None else None
        if inferred is not None and len(inferred) != len(declared):
            inferred = None
        names = [d.value for d in declared if isinstance(d, ir.SymbolicDim)]
        dims = []
        for axis, dim in enumerate(declared):
            derived = inferred[axis] if inferred is not None else None
            if isinstance(derived, int) or (isinstance(derived, ir.SymbolicDim) and derived.value in input_symbols):
                dims.append(derived)
            elif isinstance(dim, int) or (dim.value in input_symbols and names.count(dim.value) == 1):
                dims.append(dim)
            else:
                dims.append(None)
        return ir.Shape(dims)

    @property
    def has_path(self) -> bool:
        """Whether ``base()`` was given a path (upstream's accessor)."""
        return self.path is not None

    @property
    def model(self):
        """The model built so far, as a new ``onnx.ModelProto``."""
        return io.to_proto(self.ir_model)

    model_proto = model


_ACTIVE: contextvars.ContextVar[BuildContext | None] = contextvars.ContextVar("onnxblock_base", default=None)


def active() -> BuildContext:
    ctx = _ACTIVE.get()
    if ctx is None:
        raise ModelError(
            "this block needs a model to build into: call it inside `with onnxblock.base(model):` "
            "or `with onnxblock.empty_base():`, or use block.apply(context, ...)"
        )
    return ctx


@contextlib.contextmanager
def _activate(ctx: BuildContext) -> Iterator[BuildContext]:
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)


def base(model: io.ModelLike, model_path: str | None = None) -> contextlib.AbstractContextManager[BuildContext]:
    """Make (a copy of) ``model`` the model that blocks called inside the ``with`` build into.

    ``model_path`` is upstream's file for models over 2 GB, which its build had to write out;
    onnx_ir holds models of any size, so it is accepted and not needed.

    Example:
        >>> import numpy as np, onnx
        >>> from onnx import helper, TensorProto
        >>> from onnxtrain import onnxblock
        >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        >>> with onnxblock.base(m) as ctx:
        ...     name = onnxblock.blocks.Neg()("y")
        >>> ctx.find(name).producer().op_type
        'Neg'
    """
    loaded = io.load_model(model)
    # ceil-mode pools whose shapes ONNX's inference gets wrong (passes/ceil_pool.py), before a
    # loss block takes a target shape from them
    CeilModePoolPass()(loaded)
    return _activate(BuildContext(loaded, model_path))


def empty_base(opset_version: int | None = None) -> contextlib.AbstractContextManager[BuildContext]:
    """Make an empty model the model that blocks called inside the ``with`` build into."""
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset_version or EMPTY_BASE_OPSET}, name="onnxtrain")
    return _activate(BuildContext(ir.Model(graph, ir_version=io.MAX_IR_VERSION, producer_name="onnxtrain")))


@contextlib.contextmanager
def custom_op_library(custom_op_library_path: str) -> Iterator[None]:
    """Upstream's context manager registering a custom op library for the blocks built inside it.
    onnxtrain's graphs use standard ONNX ops (and the contrib ops stock onnxruntime ships), so
    artifacts train on any stock onnxruntime: a custom op library is refused, naming it."""
    raise ArtifactError(f"custom op libraries are not supported ({custom_op_library_path!r}): onnxtrain emits "
                        "standard ONNX ops only, so its artifacts train on any stock onnxruntime")
    yield  # pragma: no cover
