"""How many bytes a graph's values take, and the peak of what is alive while it runs.

Used by the recompute planner (which values are worth saving) and reported to users
(:func:`onnxtrain.torch.estimate_memory`). Sizes are concrete: symbolic dims are bound
from the shapes of the inputs of one call. The run order is the one ONNX Runtime uses by
default (a reverse depth-first walk from the graph's leaf nodes, inputs visited from
the highest node index down, nodes emitted after their inputs), and a value lives from
the node that produces it until its last consumer has run; graph outputs live to the end.
"""

from __future__ import annotations

import ast
import bisect
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import onnx_ir as ir
from onnxscript.optimizer import fold_constants

from onnxtrain.ir import io
from onnxtrain.ir.nodes import is_onnx_op
from onnxtrain.passes.fold import never_fold_random


@dataclass(frozen=True)
class ValueSizes:
    """Bytes of each value of a graph (by name) for one binding of its symbolic dims.

    Attributes:
        bytes: value name -> size in bytes.
        guessed: names whose shape could not be derived; their size is the largest of
            their producer's inputs (a guess, counted so a report can say how many).
    """

    bytes: dict[str, int]
    guessed: frozenset[str]
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def of(self, value: ir.Value | None) -> int:
        return 0 if value is None else self.bytes.get(value.name, 0)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv}
_CALLS = {"floor": math.floor, "ceiling": math.ceil, "ceil": math.ceil, "Max": max, "Min": min,
          "max": max, "min": min, "FloorDiv": operator.floordiv, "Mod": operator.mod}


def _evaluate(expression: str, symbols: Mapping[str, int]) -> int | None:
    """The value of a dim expression the exporter writes (``s0*s1``, ``2*s0 + 1``, ``floor(s0/2)``)."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            return symbols[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
            return _CALLS[node.func.id](*(walk(a) for a in node.args))
        raise KeyError(expression)

    try:
        result = walk(ast.parse(expression, mode="eval"))
    except (KeyError, SyntaxError, ZeroDivisionError, TypeError, ValueError):
        return None
    return int(result) if result == int(result) else None


def _concrete(shape: ir.Shape | None, symbols: Mapping[str, int]) -> list[int] | None:
    if shape is None:
        return None
    dims = []
    for dim in shape:
        if isinstance(dim, int):
            dims.append(dim)
        elif isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            value = symbols.get(dim.value)
            value = _evaluate(dim.value, symbols) if value is None else value
            if value is None:
                return None
            dims.append(value)
        else:
            return None
    return dims


def _bytes(dtype: ir.DataType | None, dims: Sequence[int]) -> int:
    itemsize = dtype.itemsize if dtype is not None else 4
    return math.ceil(math.prod(dims) * itemsize)


def value_sizes(model: ir.Model, input_shapes: Mapping[str, Sequence[int]]) -> ValueSizes:
    """Sizes of every value of ``model``'s graph when its inputs have ``input_shapes``.

    Symbolic dims of the graph inputs are bound from ``input_shapes`` (input name ->
    concrete shape) and the exporter's dim expressions evaluated with them; values
    without a usable shape get one from ONNX shape inference on a concrete copy, and
    failing that the size of their largest input.
    """
    graph = model.graph
    symbols: dict[str, int] = {}
    for value in graph.inputs:
        concrete = input_shapes.get(value.name)
        if concrete is None or value.shape is None or len(value.shape) != len(concrete):
            continue
        for dim, size in zip(value.shape, concrete):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                symbols.setdefault(dim.value, int(size))

    sizes: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    unknown: list[ir.Value] = []
    values = [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]
    for value in values:
        if value.name in sizes:
            continue
        dims = list(input_shapes[value.name]) if value.name in input_shapes else _concrete(value.shape, symbols)
        if value.is_initializer() and value.const_value is not None:
            dims = list(value.const_value.shape)
        if dims is None:
            unknown.append(value)
        else:
            sizes[value.name] = _bytes(value.dtype, dims)
            shapes[value.name] = dims
    guessed: set[str] = set()
    if unknown:
        inferred, folded = _shapes_after_folding(model, input_shapes)
        if any(v.name not in inferred and v.name not in folded for v in unknown):
            inferred = {**io.infer_concrete_shapes(model, input_shapes), **inferred}
        for value in unknown:
            found = inferred.get(value.name)
            if found is not None:
                dtype, dims = found
                sizes[value.name] = _bytes(dtype, dims)
                shapes[value.name] = dims
            elif value.name in folded:  # shape arithmetic: at most FOLDED_SIZE_LIMIT elements
                sizes[value.name] = 0
        for node in graph:  # in order: a guess may use an earlier guess
            for out in node.outputs:
                if out.name not in sizes:
                    sizes[out.name] = max((sizes.get(i.name, 0) for i in node.inputs if i is not None), default=0)
                    guessed.add(out.name)
    return ValueSizes(sizes, frozenset(guessed), shapes)


# Values computed from shapes alone (Shape -> Slice -> Concat -> Reshape chains) are folded
# into constants when the inputs' shapes are concrete; a folded value has at most this many
# elements, so it is counted as 0 bytes.
FOLDED_SIZE_LIMIT = 1024


def _shapes_after_folding(model: ir.Model, input_shapes: Mapping[str, Sequence[int]]):
    """Concrete ``(dtype, dims)`` of ``model``'s values when its inputs have ``input_shapes``,
    found by folding everything computable from those shapes into constants (onnxscript's
    folder, with ONNX shape inference on each node), and the names of the values folded away.

    ONNX shape inference alone stops at a ``Reshape``/``Expand``/``ConstantOfShape`` whose
    shape is computed in the graph (gradient graphs are full of them); after folding those
    shapes are constants. ``model`` is not changed.
    """
    copy = ir.from_proto(ir.to_proto(model))
    for value in copy.graph.inputs:
        if value.name in input_shapes:
            value.shape = ir.Shape([int(d) for d in input_shapes[value.name]])
    produced = [out.name for node in copy.graph for out in node.outputs]
    try:
        fold_constants(copy, onnx_shape_inference=True, input_size_limit=FOLDED_SIZE_LIMIT,
                       output_size_limit=FOLDED_SIZE_LIMIT,
                       should_fold=never_fold_random)
    except Exception:  # the folder is a best effort here: the caller falls back to shape inference
        return {}, set()
    found: dict[str, tuple[ir.DataType, list[int]]] = {}
    remaining: set[str] = set()
    for node in copy.graph:
        for out in node.outputs:
            remaining.add(out.name)
            if out.dtype is not None and out.shape is not None and all(isinstance(d, int) for d in out.shape):
                found[out.name] = (out.dtype, list(out.shape))
    for name, value in copy.graph.initializers.items():
        if value.const_value is not None:
            found.setdefault(name, (value.const_value.dtype, list(value.const_value.shape)))
    folded = {name for name in produced if name not in remaining and name not in found}
    return found, folded


def execution_order(graph: ir.Graph) -> list[ir.Node]:
    """The order ONNX Runtime runs ``graph``'s nodes in by default (``ExecutionOrder.DEFAULT``).

    A reverse depth-first walk from the leaf nodes (nodes no other node reads from); a
    node's producers are pushed by ascending index, so the highest-indexed one is walked
    first; a node is emitted once all its producers are. (ONNX Runtime's own graph
    optimizations add and fuse nodes, so this is the order before them.)
    """
    nodes = list(graph)
    index = {node: i for i, node in enumerate(nodes)}
    consumed: set[ir.Node] = set()
    producers: dict[ir.Node, list[ir.Node]] = {}
    for node in nodes:
        found = {i.producer() for i in node.inputs if i is not None and i.producer() in index}
        producers[node] = sorted(found, key=index.__getitem__)
        consumed.update(found)
    stack: list[tuple[ir.Node, bool]] = [(node, False) for node in nodes if node not in consumed]
    visited: set[ir.Node] = set()
    order: list[ir.Node] = []
    while stack:
        node, leaving = stack.pop()
        if leaving:
            order.append(node)
            continue
        if node in visited:
            continue
        visited.add(node)
        stack.append((node, True))
        stack.extend((p, False) for p in producers[node] if p not in visited)
    return order


def just_in_time_order(graph: ir.Graph, driving: set[ir.Node]) -> list[ir.Node]:
    """A topological order that runs the ``driving`` nodes in their graph order and every
    other node as late as possible: right before the first driving node that needs it.

    For a backward graph whose driving nodes are the gradient nodes, this recomputes a
    layer's forward values just before that layer's gradient, so they are alive during
    that layer only.
    """
    emitted: set[ir.Node] = set()
    order: list[ir.Node] = []
    for target in graph:
        if target not in driving or target in emitted:
            continue
        stack: list[tuple[ir.Node, bool]] = [(target, False)]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                if node not in emitted:
                    emitted.add(node)
                    order.append(node)
                continue
            if node in emitted:
                continue
            stack.append((node, True))
            producers = [i.producer() for i in node.inputs if i is not None and i.producer() is not None]
            stack.extend((p, False) for p in reversed(producers) if p not in emitted)
    order.extend(n for n in graph if n not in emitted)  # nodes no driving node needs (dead ends)
    return order


@dataclass(frozen=True)
class LivePeak:
    """The largest total size of values alive at once during one run of a graph.

    Attributes:
        bytes: that total (graph inputs excluded: the caller owns them).
        node: the node running at the peak (its outputs allocated, its inputs alive).
        at_end: bytes alive when the run ends (the graph outputs).
    """

    bytes: int
    node: str | None
    at_end: int


# ONNX Runtime's CPU kernels for these ops declare their output an alias of their input 0
_VIEW_OPS = ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")
_FUSED_TRANSPOSE_DTYPES = (ir.DataType.FLOAT,)


def _folded_into_product(node: ir.Node, graph_outputs: set[ir.Value]) -> bool:
    """Whether ONNX Runtime folds this Transpose into the MatMul that reads it.

    Its ``MatmulTransposeFusion`` (optimization level 2 and up, the sessions' default) turns
    ``MatMul(a, Transpose(b))`` into one ``FusedMatMul`` reading ``b`` when the Transpose swaps
    the last two axes, is float32 and has that MatMul as its only reader.
    """
    out = node.outputs[0]
    perm = node.attributes.get("perm")
    rank = len(perm.value) if perm is not None else 0
    if rank < 2 or list(perm.value) != [*range(rank - 2), rank - 1, rank - 2]:
        return False
    uses = out.uses()
    if out in graph_outputs or out.dtype not in _FUSED_TRANSPOSE_DTYPES or len(uses) != 1:
        return False
    return is_onnx_op(uses[0].node, "MatMul")


def shared_buffers(graph: ir.Graph) -> dict[ir.Value, ir.Value]:
    """Values ONNX Runtime computes without a buffer of their own, as ``value -> the value whose
    buffer it is``: the outputs of views (``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Flatten``,
    ``Identity``: the same buffer as their input) and of transposes folded into the product that
    reads them (:func:`_folded_into_product`: the product reads the untransposed input). The
    value they stand for lives as long as they are read. Graph outputs keep their buffers.
    """
    shared: dict[ir.Value, ir.Value] = {}
    outputs = set(graph.outputs)
    for node in graph:  # in order: a view of a view resolves to the first one's input
        if not node.inputs or node.inputs[0] is None or not is_onnx_op(node) or node.outputs[0] in outputs:
            continue
        if node.op_type in _VIEW_OPS or (node.op_type == "Transpose" and _folded_into_product(node, outputs)):
            source = node.inputs[0]
            shared[node.outputs[0]] = shared.get(source, source)
    return shared


def _run_steps(graph: ir.Graph, order: Sequence[ir.Node] | None) -> Iterator[tuple[ir.Node, list[ir.Value]]]:
    """Each node of a run of ``graph`` in ``order`` (default: :func:`execution_order`), with
    the values freed once it has run: those it was the last reader of, and its outputs that
    nothing reads. Graph inputs and initializers (the caller's) and graph outputs (alive to
    the end) are never freed. Values without a buffer of their own (:func:`shared_buffers`)
    are not allocated: their readers keep the value whose buffer they share alive."""
    order = execution_order(graph) if order is None else order
    shared = shared_buffers(graph)
    order = [node for node in order if node.outputs[0] not in shared] if shared else order
    position = {node: k for k, node in enumerate(order)}
    outputs = set(graph.outputs)
    last_use: dict[ir.Value, int] = {}
    for node in order:
        for value in node.inputs:
            value = shared.get(value, value)
            if value is not None and value.producer() in position:
                last_use[value] = max(last_use.get(value, -1), position[node])
    for k, node in enumerate(order):
        freed = [value for value in {*(shared.get(v, v) for v in node.inputs), *node.outputs}
                 if value is not None and value not in outputs and value.producer() in position
                 and last_use.get(value, -1) <= k]
        yield node, freed


def live_peak(graph: ir.Graph, sizes: ValueSizes, order: Sequence[ir.Node] | None = None) -> LivePeak:
    """Simulate a run of ``graph`` in ``order`` (default: :func:`execution_order`) and
    return the peak of the bytes of the values it holds at once."""
    live = peak = 0
    peak_node = None
    for node, freed in _run_steps(graph, order):
        live += sum(sizes.of(o) for o in node.outputs)
        if live > peak:
            peak, peak_node = live, node.name
        live -= sum(sizes.of(value) for value in freed)
    return LivePeak(peak, peak_node, live)


@dataclass(eq=False)
class _Chunk:
    address: int
    size: int
    region: int
    in_use: bool = False
    before: _Chunk | None = None
    after: _Chunk | None = None


class ArenaModel:
    """A model of ONNX Runtime's CPU arena (``BFCArena`` with its default settings), to tell
    how much memory a sequence of allocations really makes resident.

    The arena takes memory from the system in regions: the first of 1 MiB, each next one twice
    the last (or the next power-of-two multiple large enough for the request that needed it),
    and never gives it back unless shrunk. A request is rounded up to 256 bytes and served by
    the smallest free chunk that fits (lowest address among equals), split unless the chunk is
    less than twice the request and the rest under 128 MiB; a freed chunk merges with free neighbours of its own region.
    Region memory becomes resident when first written, so the resident bytes are the union of
    the spans every request ever used (a request served by a larger chunk touches only its own
    size): fragmentation and regions sized by doubling both show in it, which a count of live
    bytes misses.
    """

    GRANULE = 256
    INITIAL_REGION = 1 << 20
    GROWTH_AFTER_SHRINK = 2 << 20  # ORT's initial_growth_chunk_size_bytes default
    MAX_DEAD_BYTES = 128 << 20     # a chunk is split anyway when it would waste this much

    def __init__(self):
        self._next_region = self.INITIAL_REGION
        self._free: list[tuple[int, int]] = []   # (size, address) of free chunks, sorted
        self._at: dict[int, _Chunk] = {}         # free chunks by address
        self._regions: dict[int, tuple[int, int]] = {}  # id -> (base address, size)
        self._touched: dict[int, list[tuple[int, int]]] = {}  # id -> disjoint [start, end) spans
        self._top = 1 << 46  # regions are placed downwards, as the system's mmap does
        self.resident = 0
        self.peak = 0

    def allocate(self, nbytes: int) -> _Chunk | None:
        """Hand out a chunk for ``nbytes`` (``None`` for 0 bytes)."""
        if nbytes <= 0:
            return None
        size = -(-nbytes // self.GRANULE) * self.GRANULE
        k = bisect.bisect_left(self._free, (size, -1))
        if k == len(self._free):
            self._extend(size)
            k = bisect.bisect_left(self._free, (size, -1))
        _, address = self._free.pop(k)
        chunk = self._at.pop(address)
        if chunk.size >= 2 * size or chunk.size - size >= self.MAX_DEAD_BYTES:
            rest = _Chunk(chunk.address + size, chunk.size - size, chunk.region, False, chunk, chunk.after)
            if chunk.after is not None:
                chunk.after.before = rest
            chunk.after, chunk.size = rest, size
            self._add_free(rest)
        chunk.in_use = True
        self._touch(chunk, size)
        return chunk

    def free(self, chunk: _Chunk | None) -> None:
        """Give ``chunk`` back (merging it with free neighbours)."""
        if chunk is None:
            return
        chunk.in_use = False
        if chunk.after is not None and not chunk.after.in_use:
            self._absorb_next(chunk)
        if chunk.before is not None and not chunk.before.in_use:
            chunk = chunk.before
            self._absorb_next(chunk)
        self._add_free(chunk)

    def _absorb_next(self, chunk: _Chunk) -> None:
        """Merge the free chunk after ``chunk`` into it (whichever of the two is listed free)."""
        after = chunk.after
        for listed in (chunk, after):
            if listed.address in self._at and self._at[listed.address] is listed:
                self._remove_free(listed)
        chunk.size += after.size
        chunk.after = after.after
        if after.after is not None:
            after.after.before = chunk

    def shrink(self) -> None:
        """Release every wholly free region but the first (what ORT's arena shrinkage does)."""
        for region, (base, size) in list(self._regions.items()):
            chunk = self._at.get(base)
            if region == 0 or chunk is None or chunk.size != size:
                continue
            self._remove_free(chunk)
            del self._regions[region]
            self.resident -= sum(end - start for start, end in self._touched.pop(region, []))
        self._next_region = self.GROWTH_AFTER_SHRINK

    def _extend(self, size: int) -> None:
        grew = False
        while size > self._next_region:
            self._next_region *= 2
            grew = True
        nbytes = self._next_region
        if not grew:
            self._next_region *= 2
        self._top -= nbytes + self.INITIAL_REGION
        region = len(self._regions) and max(self._regions) + 1
        self._regions[region] = (self._top, nbytes)
        self._add_free(_Chunk(self._top, nbytes, region))

    def _add_free(self, chunk: _Chunk) -> None:
        self._at[chunk.address] = chunk
        bisect.insort(self._free, (chunk.size, chunk.address))

    def _remove_free(self, chunk: _Chunk) -> None:
        del self._at[chunk.address]
        self._free.pop(bisect.bisect_left(self._free, (chunk.size, chunk.address)))

    def _touch(self, chunk: _Chunk, size: int) -> None:
        start, end = chunk.address, chunk.address + size
        kept, added = [], end - start
        for a, b in self._touched.get(chunk.region, []):
            if b < start or a > end:
                kept.append((a, b))
            else:
                added -= max(0, min(end, b) - max(start, a))
                start, end = min(start, a), max(end, b)
        kept.append((start, end))
        self._touched[chunk.region] = sorted(kept)
        self.resident += added
        self.peak = max(self.peak, self.resident)


def simulate_run(arena: ArenaModel, graph: ir.Graph, sizes: ValueSizes,
                 order: Sequence[ir.Node] | None = None) -> dict[str, _Chunk | None]:
    """Run ``graph`` (in ``order``, default :func:`execution_order`) against ``arena``: each
    node's outputs are allocated, then every value whose last reader it was is freed. Graph
    inputs are the caller's (not allocated); the graph outputs' chunks are returned, still
    allocated, keyed by name (the caller frees them when it lets go of the outputs)."""
    live: dict[str, _Chunk | None] = {}
    for node, freed in _run_steps(graph, order):
        for value in node.outputs:
            live[value.name] = arena.allocate(sizes.of(value))
        for value in freed:
            arena.free(live.pop(value.name))
    return {value.name: live.get(value.name) for value in graph.outputs}
