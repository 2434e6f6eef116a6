"""Choose which forward nodes the backward graph recomputes, by a minimum cut.

Every forward value the backward graph reads is either *saved* (kept alive between the
forward and the backward run: costs its bytes) or *recomputed* in the backward graph from
values that are themselves saved or recomputed (costs the node's run time, weighted by a
factor ``weight`` against bytes). Forward inputs, initializers and model outputs are at
hand for free. The cheapest such choice is a minimum s-t cut of a flow network:

- ``source -> N(node)``, capacity ``weight * cost(node)`` (infinite for a node that must
  not be recomputed: random ops, control flow): cut when the node is recomputed;
- ``N(node) -> V(value)`` for each output, capacity ``bytes(value)``: cut when the value is
  saved (computed in the forward, read by the backward);
- ``V(input) -> N(node)``, infinite: a recomputed node needs its inputs in the backward;
- ``V(value) -> sink``, infinite, for each value the backward graph reads.

The weight trades memory for time: a large weight saves everything the backward reads
(no recompute), a weight near 0 minimizes the saved bytes. Under a memory budget the
largest weight whose cut fits the budget is found by bisection (the saved bytes only
shrink as the weight does).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor

from onnxtrain.ir.nodes import RANDOM_OPS
from onnxtrain.passes.memory import ValueSizes

# Never recomputed: a random op would draw a new sample (its mask is saved instead), and
# control flow is not worth costing.
NEVER_RECOMPUTED = RANDOM_OPS | {"If", "Loop", "Scan", "SequenceMap"}

# Normalizations start a layer: their input (the residual stream of a transformer, a block's
# output in a CNN) is what layer-wise recompute saves. Recomputing it instead would chain the
# recompute of every layer below into the first backward use, keeping all their values alive.
NORMALIZATIONS = frozenset({"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
                            "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "BatchNormalization",
                            "GroupNormalization", "InstanceNormalization"})

# Ops whose run time is their multiply-adds rather than their memory traffic.
COMPUTE_HEAVY = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "FusedMatMul",
                           "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv"})

# A recomputed op costs about the bytes it reads and writes, or for compute-heavy ops its
# floating-point operations divided by this: a CPU core streams ~10 GB/s and runs an fp32
# GEMM at ~80 GFLOP/s, so ~8 flops take as long as one byte of traffic.
FLOPS_PER_BYTE = 8.0

# Weight of recompute cost against saved bytes for the fixed levels: small enough that any
# recompute that saves bytes is taken, large enough to choose the cheaper of equal cuts.
MINIMAL_MEMORY_WEIGHT = 1e-3

# Bisection steps of the weight under a budget (from 1 down to 1e-6: ~2% per step).
BISECTION_STEPS = 24
_WEIGHT_RANGE = (1e-6, 1.0)


# How far (elementwise ops) a decomposed normalization's statistic travels before it meets the
# normalized value again: RMSNorm's mean of squares -> + eps -> Sqrt -> Reciprocal -> Mul(x, .)
_STATISTIC_STEPS = 5
_STATISTIC_CHAIN = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Pow", "Cast", "Expand"})


def layer_boundaries(nodes: Sequence[ir.Node]) -> set[ir.Node]:
    """Forward nodes whose output a normalization reads: the layer inputs, never recomputed. The
    normalization may be an op (LayerNormalization, ...) or its decomposition as exporters write
    a model's own norm (Llama's RMSNorm, a training-mode BatchNorm): a mean over ``x`` or ``x``
    squared whose result comes back to scale or shift ``x`` itself."""
    inside = set(nodes)
    inputs = [n.inputs[0] for n in nodes if n.op_type in NORMALIZATIONS and n.inputs and n.inputs[0] is not None]
    inputs += [x for n in nodes if n.op_type == "ReduceMean" and (x := _decomposed_norm_input(n, inside)) is not None]
    return {x.producer() for x in inputs if x.producer() in inside}


def _decomposed_norm_input(mean: ir.Node, inside: set[ir.Node]) -> ir.Value | None:
    """``x`` where ``mean`` is ``ReduceMean(x)`` or ``ReduceMean(x * x)`` (``Pow(x, 2)``) and its
    result reaches, through a few elementwise ops, a Sub, Mul or Div that reads ``x`` too."""
    source = mean.inputs[0] if mean.inputs else None
    if source is None:
        return None
    square = source.producer()
    x = source
    if square is not None and square.op_type == "Mul" and square.inputs[0] is square.inputs[1]:
        x = square.inputs[0]
    elif square is not None and square.op_type == "Pow" and _is_two(square.inputs[1]):
        x = square.inputs[0]
    if x is not source and x.producer() is not None and x.producer().op_type == "Sub":
        return None  # a variance of centered values: the mean subtracted marks the layer input
    frontier = list(mean.outputs)
    for _ in range(_STATISTIC_STEPS):
        reached = []
        for value in frontier:
            for use in value.uses():
                node = use.node
                if node not in inside or node.op_type not in _STATISTIC_CHAIN:
                    continue
                if node.op_type in ("Sub", "Mul", "Div") and x in node.inputs:
                    return x
                reached.extend(node.outputs)
        frontier = reached
    return None


def _is_two(value: ir.Value | None) -> bool:
    tensor = get_const_tensor(value) if value is not None else None
    return tensor is not None and tensor.size == 1 and float(tensor.numpy().reshape(-1)[0]) == 2.0


def node_cost(node: ir.Node, sizes: ValueSizes) -> float:
    """Byte-equivalents of running ``node`` once (traffic, or flops / FLOPS_PER_BYTE)."""
    traffic = sum(sizes.of(v) for v in (*node.inputs, *node.outputs))
    if node.op_type not in COMPUTE_HEAVY or not node.outputs:
        return float(traffic)
    out = node.outputs[0]
    out_elements = sizes.of(out) / max(out.dtype.itemsize if out.dtype else 4, 1)
    reduced = _reduced_size(node, sizes)
    return max(float(traffic), 2.0 * out_elements * reduced / FLOPS_PER_BYTE)


def _reduced_size(node: ir.Node, sizes: ValueSizes) -> float:
    """How many products each output element of a compute-heavy node sums (its K)."""
    a = node.inputs[0] if node.inputs else None
    b = node.inputs[1] if len(node.inputs) > 1 else None
    if node.op_type in ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv") and b is not None:
        w = b if node.op_type != "QLinearConv" else node.inputs[3]
        if w is not None and w.shape is not None and all(isinstance(d, int) for d in w.shape[1:]):
            return float(math.prod(w.shape[1:]))
    if a is not None and a.shape is not None and len(a.shape) and isinstance(a.shape[-1], int):
        transposed = node.op_type == "Gemm" and any(at.name == "transA" and at.value for at in node.attributes.values())
        dim = a.shape[0] if transposed and len(a.shape) == 2 else a.shape[-1]
        if isinstance(dim, int):
            return float(dim)
    return 64.0  # unknown K: a typical hidden size slice


@dataclass(frozen=True)
class Plan:
    """What the backward graph recomputes, and what that leaves saved."""

    recomputed: frozenset[ir.Node]
    saved_bytes: int
    recompute_cost: float
    weight: float


class _FlowNetwork:
    """Dinic's maximum flow on a small directed graph of integer-numbered vertices."""

    def __init__(self, size: int):
        self.heads: list[list[int]] = [[] for _ in range(size)]
        self.to: list[int] = []
        self.capacity: list[float] = []

    def add_edge(self, a: int, b: int, capacity: float) -> None:
        self.heads[a].append(len(self.to))
        self.to.append(b)
        self.capacity.append(capacity)
        self.heads[b].append(len(self.to))
        self.to.append(a)
        self.capacity.append(0.0)

    def _levels(self, source: int, sink: int) -> list[int] | None:
        level = [-1] * len(self.heads)
        level[source] = 0
        queue = deque([source])
        while queue:
            a = queue.popleft()
            for e in self.heads[a]:
                b = self.to[e]
                if self.capacity[e] > 0 and level[b] < 0:
                    level[b] = level[a] + 1
                    queue.append(b)
        return level if level[sink] >= 0 else None

    def _augment(self, source: int, sink: int, level: list[int], cursor: list[int]) -> float:
        """One blocking-flow path from source to sink (iterative DFS); its flow."""
        path: list[int] = []  # edge ids
        a = source
        while True:
            if a == sink:
                flow = min(self.capacity[e] for e in path)
                for e in path:
                    self.capacity[e] -= flow
                    self.capacity[e ^ 1] += flow
                return flow
            edges = self.heads[a]
            while cursor[a] < len(edges):
                e = edges[cursor[a]]
                b = self.to[e]
                if self.capacity[e] > 0 and level[b] == level[a] + 1:
                    break
                cursor[a] += 1
            if cursor[a] == len(edges):  # dead end: retreat
                if not path:
                    return 0.0
                level[a] = -1
                e = path.pop()
                a = self.to[e ^ 1]
                cursor[a] += 1
                continue
            e = edges[cursor[a]]
            path.append(e)
            a = self.to[e]

    def source_side(self, source: int, sink: int) -> list[bool]:
        """Run the max flow; return which vertices the residual graph reaches from the source."""
        while (level := self._levels(source, sink)) is not None:
            cursor = [0] * len(self.heads)
            while self._augment(source, sink, level, cursor) > 0:
                pass
        reached = [False] * len(self.heads)
        reached[source] = True
        queue = deque([source])
        while queue:
            a = queue.popleft()
            for e in self.heads[a]:
                b = self.to[e]
                if self.capacity[e] > 0 and not reached[b]:
                    reached[b] = True
                    queue.append(b)
        return reached


def cut(nodes: Sequence[ir.Node], needed: Iterable[ir.Value], free: set[ir.Value], sizes: ValueSizes,
        may_recompute: Callable[[ir.Node], bool], weight: float) -> Plan:
    """The cheapest split of ``needed`` into saved and recomputed values (see the module doc).

    ``nodes`` are the forward nodes in topological order; ``free`` the values the backward
    has without saving them; ``may_recompute`` says which nodes the backward may rerun.
    """
    needed = [v for v in dict.fromkeys(needed) if v not in free]
    producer_of = {o: n for n in nodes for o in n.outputs}
    relevant: list[ir.Node] = []  # forward nodes upstream of a needed value
    wanted, seen = {producer_of[v] for v in needed if v in producer_of}, set()
    for node in reversed(nodes):
        if node in wanted and node not in seen:
            seen.add(node)
            relevant.append(node)
            wanted.update(producer_of[i] for i in node.inputs if i is not None and i in producer_of and i not in free)
    vertex: dict[object, int] = {}
    for node in relevant:
        vertex[node] = len(vertex)
        for out in node.outputs:
            vertex[out] = len(vertex)
    source, sink = len(vertex), len(vertex) + 1
    network = _FlowNetwork(len(vertex) + 2)
    costs = {}
    for node in relevant:
        costs[node] = node_cost(node, sizes)
        network.add_edge(source, vertex[node], weight * costs[node] if may_recompute(node) else math.inf)
        for out in node.outputs:
            network.add_edge(vertex[node], vertex[out], 0.0 if out in free else float(sizes.of(out)))
        for value in dict.fromkeys(i for i in node.inputs if i is not None and i in vertex):
            network.add_edge(vertex[value], vertex[node], math.inf)
    for value in needed:
        if value in vertex:
            network.add_edge(vertex[value], sink, math.inf)
    reached = network.source_side(source, sink)
    recomputed = frozenset(n for n in relevant if not reached[vertex[n]])
    saved = sum(sizes.of(v) for n in relevant if reached[vertex[n]] for v in n.outputs
                if v not in free and not reached[vertex[v]])
    return Plan(recomputed, saved, sum(costs[n] for n in recomputed), weight)


def cut_within_budget(nodes, needed, free, sizes, may_recompute, budget: int) -> Plan:
    """The least-recompute cut whose saved bytes fit ``budget`` (or the smallest cut there is,
    when even that exceeds the budget)."""
    needed = list(needed)
    high, low = _WEIGHT_RANGE[1], _WEIGHT_RANGE[0]
    best = cut(nodes, needed, free, sizes, may_recompute, high)
    if best.saved_bytes <= budget:
        return best
    smallest = cut(nodes, needed, free, sizes, may_recompute, low)
    if smallest.saved_bytes > budget:
        return smallest
    best = smallest
    for _ in range(BISECTION_STEPS):  # invariant: the cut at `low` fits, the one at `high` does not
        middle = math.sqrt(low * high)
        plan = cut(nodes, needed, free, sizes, may_recompute, middle)
        if plan.saved_bytes <= budget:
            low, best = middle, plan
        else:
            high = middle
    return best
