"""Memory planning without PyTorch: value sizes, the live-set simulation, the min cut, and
forward/backward graphs cut under memory options still computing the same gradients."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.ir import io
from onnxtrain.passes import memory, recompute
from onnxtrain.passes.partition import (FROM_FORWARD_OUTPUT, FROM_INPUT, FROM_OUTPUT_GRAD, MemoryOptions,
                                        build_forward_backward)
from onnxtrain.runtime.session import list_for_default_order

BATCH, WIDTH, LAYERS = 8, 6, 3


def _norm(kind: str, k: int) -> list[onnx.NodeProto]:
    """``n{k}`` = the normalization of ``x{k}`` with scale ``g{k}`` (and shift ``c{k}``): the op, or
    its decomposition as exporters write a model's own RMSNorm (Llama's) or LayerNorm."""
    x, n = f"x{k}", f"n{k}"
    if kind == "op":
        return [helper.make_node("LayerNormalization", [x, f"g{k}", f"c{k}"], [n], axis=-1)]
    nodes = [helper.make_node("Constant", [], [f"axes{k}"], value_ints=[-1]),
             helper.make_node("Constant", [], [f"eps{k}"], value_float=1e-5)]
    if kind == "rms":
        nodes += [helper.make_node("Constant", [], [f"two{k}"], value_float=2.0),
                  helper.make_node("Pow", [x, f"two{k}"], [f"sq{k}"]),
                  helper.make_node("ReduceMean", [f"sq{k}", f"axes{k}"], [f"ms{k}"]),
                  helper.make_node("Add", [f"ms{k}", f"eps{k}"], [f"mse{k}"]),
                  helper.make_node("Sqrt", [f"mse{k}"], [f"rms{k}"]),
                  helper.make_node("Reciprocal", [f"rms{k}"], [f"inv{k}"]),
                  helper.make_node("Mul", [x, f"inv{k}"], [f"xs{k}"]),
                  helper.make_node("Mul", [f"xs{k}", f"g{k}"], [n])]
    else:
        nodes += [helper.make_node("ReduceMean", [x, f"axes{k}"], [f"mean{k}"]),
                  helper.make_node("Sub", [x, f"mean{k}"], [f"cen{k}"]),
                  helper.make_node("Mul", [f"cen{k}", f"cen{k}"], [f"sq{k}"]),
                  helper.make_node("ReduceMean", [f"sq{k}", f"axes{k}"], [f"var{k}"]),
                  helper.make_node("Add", [f"var{k}", f"eps{k}"], [f"vare{k}"]),
                  helper.make_node("Sqrt", [f"vare{k}"], [f"std{k}"]),
                  helper.make_node("Div", [f"cen{k}", f"std{k}"], [f"z{k}"]),
                  helper.make_node("Mul", [f"z{k}", f"g{k}"], [f"zs{k}"]),
                  helper.make_node("Add", [f"zs{k}", f"c{k}"], [n])]
    return nodes


def _mlp(norm: str = "op") -> onnx.ModelProto:
    """LAYERS blocks of h = LayerNorm(x); x = x + W2 @ tanh(W1 @ h) (symbolic batch), loss-free;
    the normalization as ``_norm(norm)`` writes it."""
    nodes, inputs = [], [helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["batch", WIDTH])]
    for k in range(LAYERS):
        x = f"x{k}"
        nodes += _norm(norm, k)
        nodes += [
            helper.make_node("MatMul", [f"n{k}", f"W1_{k}"], [f"a{k}"]),
            helper.make_node("Tanh", [f"a{k}"], [f"t{k}"]),
            helper.make_node("Mul", [f"t{k}", f"t{k}"], [f"s{k}"]),
            helper.make_node("MatMul", [f"s{k}", f"W2_{k}"], [f"m{k}"]),
            helper.make_node("Add", [x, f"m{k}"], [f"x{k + 1}"]),
        ]
        inputs += [helper.make_tensor_value_info(f"g{k}", TensorProto.FLOAT, [WIDTH]),
                   helper.make_tensor_value_info(f"c{k}", TensorProto.FLOAT, [WIDTH]),
                   helper.make_tensor_value_info(f"W1_{k}", TensorProto.FLOAT, [WIDTH, 4 * WIDTH]),
                   helper.make_tensor_value_info(f"W2_{k}", TensorProto.FLOAT, [4 * WIDTH, WIDTH])]
    out = helper.make_tensor_value_info(f"x{LAYERS}", TensorProto.FLOAT, ["batch", WIDTH])
    return helper.make_model(helper.make_graph(nodes, "mlp", inputs, [out]),
                             opset_imports=[helper.make_opsetid("", 18)])


def _values(model: onnx.ModelProto, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value or BATCH for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32) * 0.5
    return feeds


def _gradients(options: MemoryOptions | None, norm: str = "op"):
    proto = _mlp(norm)
    feeds = _values(proto)
    wrt = [n for n in feeds if n != "x0"]
    shapes = {n: v.shape for n, v in feeds.items()}
    graphs = build_forward_backward(io.load_model(proto), wrt, memory_options=options, input_shapes=shapes)
    forward = ort.InferenceSession(io.serialize(graphs.forward), providers=["CPUExecutionProvider"])
    listed = io.to_proto(graphs.backward)
    list_for_default_order(listed.graph)  # as ORTModule's backward session runs it
    backward = ort.InferenceSession(listed.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = forward.run(None, feeds)
    seed = np.random.default_rng(1).standard_normal(outputs[0].shape).astype(np.float32)
    names = [v.name for v in graphs.forward.graph.inputs]
    sources = {FROM_OUTPUT_GRAD: lambda i: seed, FROM_FORWARD_OUTPUT: lambda i: outputs[i],
               FROM_INPUT: lambda i: feeds[names[i]]}
    backward_feeds = {v.name: sources[src](i) for v, (src, i) in zip(graphs.backward.graph.inputs, graphs.backward_inputs)}
    return dict(zip(wrt, backward.run(None, backward_feeds))), graphs


@pytest.mark.parametrize("options", [MemoryOptions(level=1), MemoryOptions(level=2), MemoryOptions(budget=0),
                                     MemoryOptions(budget=BATCH * 4 * WIDTH * 4 * 3)],
                         ids=["level1", "level2", "budget0", "budget-some"])
@pytest.mark.parametrize("norm", ["op", "rms", "layer"], ids=["LayerNormalization", "decomposed-RMSNorm",
                                                          "decomposed-LayerNorm"])
def test_recompute_keeps_gradients_and_saves_less(options, norm):
    expected, plain = _gradients(None, norm)
    got, planned = _gradients(options, norm)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    report = planned.memory
    assert plain.memory.saved_bytes == plain.memory.unplanned_saved_bytes > 0
    assert report.saved_bytes < plain.memory.saved_bytes
    assert report.recomputed, "nothing recomputed"
    if options.budget is not None and options.budget > 0:
        assert report.saved_bytes <= options.budget
    # layer inputs (read by a normalization, or its decomposition) are saved, never recomputed: a
    # recomputed one chains the recompute of every layer below into the first backward use
    assert {f"x{k}" for k in range(1, LAYERS)} <= {v.name for v in planned.forward.graph.outputs}
    assert "saved activations" in report.explain()


def test_level_one_never_recomputes_matmuls_and_level_two_does():
    _, level1 = _gradients(MemoryOptions(level=1))
    _, level2 = _gradients(MemoryOptions(level=2))
    assert "MatMul" not in {op for _, op in level1.memory.recomputed}
    assert "MatMul" in {op for _, op in level2.memory.recomputed}
    assert level2.memory.saved_bytes < level1.memory.saved_bytes


def test_environment_variable_sets_the_level(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "2")
    _, graphs = _gradients(MemoryOptions())
    assert graphs.memory.level == 2 and graphs.memory.recomputed
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "7")
    with pytest.raises(ValueError, match="ORTMODULE_MEMORY_OPT_LEVEL"):
        _gradients(MemoryOptions())


def test_options_need_input_shapes():
    with pytest.raises(ValueError, match="input_shapes"):
        build_forward_backward(io.load_model(_mlp()), ["W1_0"], memory_options=MemoryOptions(level=2))


def test_value_sizes_bind_symbolic_dims_and_infer_missing_shapes():
    model = io.load_model(_mlp())
    for node in model.graph:  # forget every intermediate shape: inference must find them again
        for out in node.outputs:
            out.shape = None
    sizes = memory.value_sizes(model, {"x0": (5, WIDTH)})
    assert sizes.bytes["a0"] == 5 * 4 * WIDTH * 4
    assert sizes.bytes["x3"] == 5 * WIDTH * 4
    assert not sizes.guessed


def _neg_neg_add(value_bytes: int) -> tuple[ir.Graph, memory.ValueSizes]:
    """x -> a = -x -> b = -a -> c = a + b (c the output), every value ``value_bytes`` large."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([10]))
    a = ir.node("Neg", [x], num_outputs=1)
    b = ir.node("Neg", [a.outputs[0]], num_outputs=1)
    c = ir.node("Add", [a.outputs[0], b.outputs[0]], num_outputs=1)
    graph = ir.Graph([x], c.outputs, nodes=[a, b, c])
    return graph, memory.ValueSizes({v.name: value_bytes for v in [x, *a.outputs, *b.outputs, *c.outputs]},
                                    frozenset())


def test_live_peak_counts_values_until_their_last_reader():
    graph, sizes = _neg_neg_add(40)
    peak = memory.live_peak(graph, sizes)
    assert peak.bytes == 120 and peak.at_end == 40  # a, b and c alive while c runs


def test_value_sizes_follow_shapes_computed_in_the_graph():
    """Gradient graphs compute shapes and axes in the graph (here: which axes a broadcast
    gradient sums over, Equal -> Not -> NonZero on two shapes, then a ConstantOfShape of the
    summed shape); ONNX shape inference cannot follow them, but once the input shapes are
    bound they fold to constants and every size is exact instead of guessed."""
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Shape", ["y"], ["y_shape"]),
        helper.make_node("Equal", ["x_shape", "y_shape"], ["same"]),
        helper.make_node("Not", ["same"], ["broadcast"]),
        helper.make_node("NonZero", ["broadcast"], ["where"]),
        helper.make_node("Reshape", ["where", "flat"], ["axes"]),
        helper.make_node("ReduceSum", ["x", "axes"], ["summed"], keepdims=1),
        helper.make_node("Shape", ["summed"], ["summed_shape"]),
        helper.make_node("ConstantOfShape", ["summed_shape"], ["zeros"]),
        helper.make_node("Add", ["zeros", "y"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "computed_shapes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "m"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("flat", TensorProto.INT64, [1], [-1])])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    sizes = memory.value_sizes(model, {"x": (700, 5), "y": (1, 5)})
    for name in ("summed", "zeros", "out"):
        assert sizes.bytes[name] == 5 * 4, name
    assert all(sizes.bytes[name] <= 64 for name in ("x_shape", "same", "where", "axes"))
    assert not sizes.guessed


def test_views_and_transposes_folded_into_a_product_take_no_memory_of_their_own():
    """ONNX Runtime's Reshape aliases its input, and a Transpose of the last two axes read by one
    MatMul becomes part of a FusedMatMul: neither allocates, and the value they stand for lives
    until their reader has run. A Transpose read by anything else is a copy."""
    def run(transpose_reader: str):
        x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4, 8]))
        a = ir.node("Neg", [x], num_outputs=1)
        view = ir.node("Reshape", [a.outputs[0], ir.Value(name="shape")], num_outputs=1)
        t = ir.node("Transpose", [view.outputs[0]], attributes={"perm": [1, 0]}, num_outputs=1)
        t.outputs[0].dtype = ir.DataType.FLOAT
        reader = ir.node(transpose_reader, [x, t.outputs[0]] if transpose_reader == "MatMul" else [t.outputs[0]],
                         num_outputs=1)
        graph = ir.Graph([x], reader.outputs, nodes=[a, view, t, reader])
        sizes = memory.ValueSizes({v.name: 100 for n in graph for v in n.outputs}, frozenset())
        return graph, memory.live_peak(graph, sizes)

    graph, peak = run("MatMul")
    assert set(memory.shared_buffers(graph)) == {graph.node(1).outputs[0], graph.node(2).outputs[0]}
    assert peak.bytes == 200  # a (read through the view and the transpose by the product), the product
    graph, peak = run("Neg")
    assert set(memory.shared_buffers(graph)) == {graph.node(1).outputs[0]}
    assert peak.bytes == 200 and peak.node == graph.node(2).name  # a, then the transposed copy


MiB = 2**20


def test_arena_model_reuses_freed_chunks_and_grows_by_doubling_regions():
    arena = memory.ArenaModel()
    first = arena.allocate(256 * 1024)        # the 1 MiB first region, split
    second = arena.allocate(256 * 1024)
    assert arena.resident == 512 * 1024
    arena.free(first)
    again = arena.allocate(200 * 1024)        # best fit: the freed chunk, no new memory
    assert arena.resident == 512 * 1024
    big = arena.allocate(5 * MiB)             # a new region (2 MiB doubled to 8 MiB), written up to 5 MiB
    assert arena.resident == 512 * 1024 + 5 * MiB
    for chunk in (second, again, big):
        arena.free(chunk)
    arena.allocate(7 * MiB)                   # the 8 MiB region again, 2 MiB more of it written
    assert arena.resident == arena.peak == 512 * 1024 + 7 * MiB


def test_arena_model_fragmentation_costs_resident_memory_that_live_bytes_do_not_show():
    """Two 3 MiB buffers freed around a held 1 MiB one cannot serve a 5 MiB request: the arena
    takes a new region, so resident memory exceeds the live bytes' peak."""
    arena = memory.ArenaModel()
    arena.allocate(10)  # the first region
    a, held, b = arena.allocate(3 * MiB), arena.allocate(1 * MiB), arena.allocate(3 * MiB)
    arena.free(a)
    arena.free(b)
    arena.allocate(5 * MiB)
    live_peak = 7 * MiB
    assert arena.peak >= live_peak + 4 * MiB


def test_arena_model_shrink_releases_wholly_free_regions_only():
    arena = memory.ArenaModel()
    kept = arena.allocate(600 * 1024)
    held = arena.allocate(3 * MiB)
    freed = arena.allocate(9 * MiB)
    arena.free(freed)
    resident = arena.resident
    arena.shrink()
    assert arena.resident == resident - 9 * MiB and arena.peak == resident
    arena.free(held)
    arena.free(kept)
    arena.shrink()  # the first region stays, as ORT keeps it
    assert arena.resident == 600 * 1024


def test_simulated_run_keeps_graph_outputs_and_frees_the_rest():
    graph, sizes = _neg_neg_add(MiB // 4)
    arena = memory.ArenaModel()
    held = memory.simulate_run(arena, graph, sizes)
    output = graph.outputs[0].name
    assert set(held) == {output}
    assert arena.peak == 3 * MiB // 4  # a, b and c at once; x is the caller's
    before = arena.resident
    arena.free(held[output])
    memory.simulate_run(arena, graph, sizes)  # a second run fits in what the first touched
    assert arena.resident == before


def test_min_cut_saves_the_cheaper_side():
    """A chain x -> e -> r (small) -> g (big) whose g the backward reads: depending on the
    weight of recompute time against bytes, save g, or save r and recompute g, or recompute
    everything from x (at hand for free)."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([100]))
    expand = ir.node("Tanh", [x], num_outputs=1)
    reduce = ir.node("ReduceSum", [expand.outputs[0]], num_outputs=1)
    grow = ir.node("Exp", [reduce.outputs[0]], num_outputs=1)
    nodes = [expand, reduce, grow]
    names = {expand.outputs[0]: 400, reduce.outputs[0]: 4, grow.outputs[0]: 4000}
    for v, n in zip(names, ["e", "r", "g"]):
        v.name = n
    sizes = memory.ValueSizes({"x": 400, "e": 400, "r": 4, "g": 4000}, frozenset())
    needed = [grow.outputs[0]]
    allow = lambda node: True  # noqa: E731
    # costs are traffic: e 800, r 404, g 4004 byte-equivalents
    middle = recompute.cut(nodes, needed, {x}, sizes, allow, weight=0.5)
    assert middle.recomputed == {grow} and middle.saved_bytes == 4
    everything = recompute.cut(nodes, needed, {x}, sizes, allow, weight=1e-3)
    assert everything.recomputed == set(nodes) and everything.saved_bytes == 0
    expensive = recompute.cut(nodes, needed, {x}, sizes, allow, weight=1e3)
    assert expensive.recomputed == frozenset() and expensive.saved_bytes == 4000
    fits = recompute.cut_within_budget(nodes, needed, {x}, sizes, allow, budget=100)
    assert fits.saved_bytes <= 100


def test_a_view_whose_target_shape_is_computed_is_recomputed_not_saved():
    """With a symbolic batch a Reshape's target shape comes from Shape/Concat in the graph: the
    backward recomputes the view from the value it keeps anyway (and the 3-element shape), as it
    does where the shape is a constant, instead of saving the view too."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("Shape", ["x"], ["x_shape"], start=0, end=1),
             helper.make_node("Constant", [], ["tail"], value_ints=[2, 3]),
             helper.make_node("Concat", ["x_shape", "tail"], ["target"], axis=0),
             helper.make_node("Reshape", ["t", "target"], ["v"]), helper.make_node("Mul", ["v", "v"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                                           helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 3])])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    graphs = build_forward_backward(model, ["W"], input_shapes={"x": [5, 4], "W": [4, 6]})
    saved = [v.name for v in graphs.forward.graph.outputs[graphs.num_model_outputs:]]
    assert "v" not in saved and "t" in saved, saved
