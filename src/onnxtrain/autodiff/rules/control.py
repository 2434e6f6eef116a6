"""Gradient rules: control flow (If, Scan).

A branch of an ``If`` reads the values of the enclosing graph it needs without listing them as
inputs: their gradients are what the rule computes. It runs a gradient ``If`` on the same
condition whose branches are copies of the forward branches, each differentiated by the same
autodiff (seeded with the gradients of the ``If``'s outputs, read from the enclosing graph), so
the taken branch computes the gradient of the taken computation. A captured value a branch does
not read gets zeros from that branch.

A ``Scan``'s gradient is a Scan too, over the iterations in reverse, with the forward body
differentiated by the same autodiff as its body (see :func:`_scan`).
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.autodiff.builder import build_gradients, is_float
from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.ir.shapes import shapes_equal


def _branch_gradients(ctx: GradContext, branch: ir.Graph, label: str) -> ir.Graph:
    """A copy of ``branch`` whose outputs are the gradients of ``ctx.captured_needing_grad``."""
    copy = branch.clone(allow_outer_scope_values=True)
    copy.name = f"{branch.name or label}_gradient"
    b = ctx.b.for_subgraph(copy, f"{ctx.b.scope}/{label}")
    seeded = [(out, g) for out, g in zip(copy.outputs, ctx.grad_outputs) if g is not None and is_float(out)]
    wanted = ctx.captured_needing_grad
    if seeded:
        grads = build_gradients(copy, [out for out, _ in seeded], wanted, loss_grad=[g for _, g in seeded], builder=b)
    else:
        grads = {w: b.zeros_like(w) for w in wanted}
    outputs = []
    for w in wanted:
        g = b.owned(grads[w])
        g.type, g.shape = w.type, w.shape
        outputs.append(g)
    copy.outputs.clear()
    copy.outputs.extend(outputs)
    return copy


@grad("If", versions=(13, None))
def _if(ctx):
    wanted = ctx.captured_needing_grad
    if wanted:
        then_branch = _branch_gradients(ctx, ctx.node.attributes["then_branch"].value, "then")
        else_branch = _branch_gradients(ctx, ctx.node.attributes["else_branch"].value, "else")
        grads = ctx.op.If(ctx.inputs[0], then_branch=then_branch, else_branch=else_branch, _outputs=len(wanted))
        grads = grads if isinstance(grads, tuple) else (grads,)
        for value, g in zip(wanted, grads):
            g.type, g.shape = value.type, value.shape
            ctx.captured_grads[value] = g
    return (None,)  # the condition is boolean


def _without_dead_nodes(graph: ir.Graph) -> None:
    """Remove the nodes of ``graph`` whose outputs nothing reads (last first)."""
    outputs = set(graph.outputs)
    for node in reversed(list(graph)):
        if not any(o.uses() or o in outputs for o in node.outputs):
            graph.remove(node, safe=True)


def _body_input(b: GraphBuilder, label: str, like: ir.Value) -> ir.Value:
    """A new input for the subgraph ``b`` builds, typed and shaped like ``like``."""
    return ir.Value(name=b.fresh_name(label), type=like.type, shape=like.shape)


def _typed_like(values, likes) -> None:
    """Give each of ``values`` (a new node's outputs) the type of its counterpart in ``likes``:
    the builder would type them all as the node's first input."""
    for value, like in zip(values, likes):
        value.type = like.type


def _recording_body(ctx: GradContext, body: ir.Graph, label: str, carried: int,
                    pick) -> tuple[ir.Graph, list[ir.Value]]:
    """A copy of a loop's ``body`` that returns its first ``carried`` outputs (the values the loop
    carries) and then, as scan outputs, the inputs ``pick(inputs)`` chooses, which every
    iteration starts from; the nodes only its other outputs needed are dropped. Returns the
    copy and the chosen inputs."""
    copy = body.clone(allow_outer_scope_values=True)
    copy.name = f"{body.name or 'body'}_{label}"
    b = ctx.b.for_subgraph(copy, f"{ctx.b.scope}/{label}")
    recorded = pick(list(copy.inputs))
    entering = [b.op.Identity(v) for v in recorded]
    for value, source in zip(entering, recorded):
        value.type, value.shape = source.type, source.shape
    kept = b.distinct_outputs(copy.outputs[:carried])
    copy.outputs.clear()
    copy.outputs.extend([*kept, *entering])
    _without_dead_nodes(copy)
    return copy, recorded


def _state_stacks(ctx: GradContext, body: ir.Graph, num_states: int) -> list[ir.Value]:
    """Each loop state's value at the start of every iteration, stacked in iteration order:
    the forward Scan run again with a body that returns its state inputs in place of its scan
    outputs."""
    node = ctx.node
    copy, recorded = _recording_body(ctx, body, "states", num_states, lambda inputs: inputs[:num_states])
    num_scan_inputs = len(node.inputs) - num_states
    results = ctx.op.Scan(*node.inputs, body=copy, num_scan_inputs=num_scan_inputs,
                          scan_input_axes=ctx.attr("scan_input_axes", [0] * num_scan_inputs),
                          scan_input_directions=ctx.attr("scan_input_directions", [0] * num_scan_inputs),
                          _outputs=2 * num_states)
    _typed_like(results, [*node.inputs[:num_states], *recorded])
    return list(results[num_states:])


@grad("Scan", versions=(9, None))
def _scan(ctx):
    """Reverse-mode through the loop: a Scan over the iterations last first, whose body is the
    forward body differentiated (seeded with the gradients of its next states and of its scan
    outputs' slices), carrying the states' gradients and summing those of the values the body
    captures. The states each iteration started from come from running the forward Scan again
    with a body that returns them."""
    node = ctx.node
    body: ir.Graph = node.attributes["body"].value
    num_scan_inputs = ctx.attr("num_scan_inputs")
    num_states = len(node.inputs) - num_scan_inputs
    num_scan_outputs = len(node.outputs) - num_states
    in_axes = ctx.attr("scan_input_axes", [0] * num_scan_inputs)
    in_dirs = ctx.attr("scan_input_directions", [0] * num_scan_inputs)
    out_axes = ctx.attr("scan_output_axes", [0] * num_scan_outputs)
    out_dirs = ctx.attr("scan_output_directions", [0] * num_scan_outputs)

    float_states = [i for i in range(num_states) if is_float(node.inputs[i])]
    wanted_scans = [j for j in range(num_scan_inputs)
                    if ctx.needs(num_states + j) and is_float(node.inputs[num_states + j])]
    captured = ctx.captured_needing_grad
    if not float_states and not wanted_scans and not captured:
        return (None,) * len(node.inputs)
    seeded_outputs = [j for j in range(num_scan_outputs)
                      if ctx.grad_outputs[num_states + j] is not None and is_float(node.outputs[num_states + j])]

    copy = body.clone(allow_outer_scope_values=True)
    copy.name = f"{body.name or 'body'}_gradient"
    b = ctx.b.for_subgraph(copy, f"{ctx.b.scope}/body")
    state_in, scan_in = list(copy.inputs[:num_states]), list(copy.inputs[num_states:])

    state_grad_in = [_body_input(b, "state_grad", state_in[i]) for i in float_states]
    captured_sum_in = [_body_input(b, "captured_grad", v) for v in captured]
    slice_grad_in = [_body_input(b, "slice_grad", copy.outputs[num_states + j]) for j in seeded_outputs]
    seeds = [(copy.outputs[i], g) for i, g in zip(float_states, state_grad_in)]
    seeds += [(copy.outputs[num_states + j], g) for j, g in zip(seeded_outputs, slice_grad_in)]
    wrt = [state_in[i] for i in float_states] + [scan_in[j] for j in wanted_scans] + list(captured)
    grads = build_gradients(copy, [v for v, _ in seeds], wrt, loss_grad=[g for _, g in seeds], builder=b)

    body_outputs = b.distinct_outputs([*(grads[state_in[i]] for i in float_states),
                                       *(b.op.Add(total, grads[v]) for total, v in zip(captured_sum_in, captured)),
                                       *(grads[scan_in[j]] for j in wanted_scans)])
    for value, like in zip(body_outputs, [*(state_in[i] for i in float_states), *captured,
                                          *(scan_in[j] for j in wanted_scans)]):
        value.type, value.shape = like.type, like.shape
    copy.inputs.clear()
    copy.inputs.extend([*state_grad_in, *captured_sum_in, *state_in, *scan_in, *slice_grad_in])
    copy.outputs.clear()
    copy.outputs.extend(body_outputs)

    stacks = _state_stacks(ctx, body, num_states) if num_states else []
    results = ctx.op.Scan(
        *(ctx.grad_output(i) for i in float_states), *(ctx.b.zeros_like(v) for v in captured),
        *stacks, *node.inputs[num_states:], *(ctx.grad_outputs[num_states + j] for j in seeded_outputs),
        body=copy, num_scan_inputs=num_states + num_scan_inputs + len(seeded_outputs),
        scan_input_axes=[0] * num_states + list(in_axes) + [out_axes[j] for j in seeded_outputs],
        scan_input_directions=[1] * num_states + [1 - d for d in in_dirs] + [1 - out_dirs[j] for j in seeded_outputs],
        # no scan outputs: no attributes for them (an empty list has no attribute type)
        **({"scan_output_axes": [in_axes[j] for j in wanted_scans],
            "scan_output_directions": [1 - in_dirs[j] for j in wanted_scans]} if wanted_scans else {}),
        _outputs=len(body_outputs))
    results = list(results) if isinstance(results, tuple) else [results]
    _typed_like(results, body_outputs)
    state_grads = dict(zip(float_states, results))
    for value, g in zip(captured, results[len(float_states):]):
        g.type, g.shape = value.type, value.shape
        ctx.captured_grads[value] = g
    scan_grads = dict(zip(wanted_scans, results[len(float_states) + len(captured):]))
    input_grads = [state_grads.get(i) if ctx.needs(i) else None for i in range(num_states)]
    input_grads += [scan_grads.get(j) for j in range(num_scan_inputs)]
    for g, value in zip(input_grads, node.inputs):
        if g is not None:
            g.type, g.shape = value.type, value.shape
    return tuple(input_grads)


def _loop_history(ctx: GradContext, body: ir.Graph,
                  num_states: int) -> tuple[list[ir.Value], set[int], ir.Value | None, ir.Value]:
    """What every iteration of a Loop started from: each state, the condition the body read (None
    if it reads none), and the iteration number (whose count is the number of iterations run).
    The forward Loop run again with a body that returns these in place of its scan outputs,
    stacked in iteration order; a state whose shape may change between iterations (an
    accumulator grown by Concat) cannot be a scan output, so it is collected in a sequence the
    loop carries instead. Returns the states' histories (stacks or sequences), the indices of
    the states kept in sequences, the conditions and the iterations."""
    # (a sequence needs the element type: a state of unknown type is stacked, as before)
    in_sequence = {i for i in range(num_states) if body.inputs[2 + i].dtype is not None
                   and not shapes_equal(body.inputs[2 + i].shape, body.outputs[1 + i].shape)}

    def pick(inputs):
        iteration, condition, states = inputs[0], inputs[1], inputs[2:]
        stacked = [state for i, state in enumerate(states) if i not in in_sequence]
        return [*stacked, *([condition] if condition.uses() else []), iteration]

    copy, recorded = _recording_body(ctx, body, "history", 1 + num_states, pick)
    sequences = []
    if in_sequence:
        b = ctx.b.for_subgraph(copy, f"{ctx.b.scope}/history")
        for i in sorted(in_sequence):
            state = copy.inputs[2 + i]
            so_far = ir.Value(name=b.fresh_name("history_in"), type=ir.SequenceType(state.type))
            grown = b.op.SequenceInsert(so_far, state)
            grown.type = so_far.type
            copy.inputs.append(so_far)  # after the states: carried
            copy.outputs.insert(1 + num_states + len(sequences), grown)
            empty = ctx.op.SequenceEmpty(dtype=int(state.dtype))
            empty.type = so_far.type
            sequences.append(empty)
    carried = num_states + len(sequences)
    results = ctx.op.Loop(*ctx.node.inputs, *sequences, body=copy, _outputs=carried + len(recorded))
    results = list(results) if isinstance(results, tuple) else [results]
    _typed_like(results, [*ctx.node.inputs[2:], *sequences, *recorded])
    collected = iter(results[num_states:carried])
    stacks = iter(results[carried:])
    histories = [next(collected) if i in in_sequence else next(stacks) for i in range(num_states)]
    rest = list(stacks)
    reads_condition = len(rest) > 1
    return histories, in_sequence, (rest[0] if reads_condition else None), rest[-1]


@grad("Loop", versions=(11, None))
def _loop(ctx):
    """Reverse-mode through the loop: a Loop over as many iterations as the forward ran, last
    first, whose body is the forward body differentiated at the states (and iteration number and
    condition) that iteration started from, seeded with the gradients of its next states and of
    its scan outputs' slices; it carries the states' gradients and sums those of the values the
    body captures. The trip count and the condition carry no gradient."""
    node = ctx.node
    body: ir.Graph = node.attributes["body"].value
    num_states = len(node.inputs) - 2
    num_scan_outputs = len(node.outputs) - num_states
    float_states = [i for i in range(num_states) if is_float(node.inputs[2 + i])]
    captured = ctx.captured_needing_grad
    if not float_states and not captured:
        return (None,) * len(node.inputs)
    seeded_outputs = [k for k in range(num_scan_outputs)
                      if ctx.grad_outputs[num_states + k] is not None and is_float(node.outputs[num_states + k])]
    op = ctx.op
    histories, in_sequence, conditions, iterations = _loop_history(ctx, body, num_states)
    count = ctx.b.squeeze(op.Shape(iterations), [0])  # iterations run (a scalar)
    last = op.Sub(count, ctx.b.scalar_int(1))

    copy = body.clone(allow_outer_scope_values=True)
    copy.name = f"{body.name or 'body'}_gradient"
    b = ctx.b.for_subgraph(copy, f"{ctx.b.scope}/body")
    iteration, condition, states = copy.inputs[0], copy.inputs[1], list(copy.inputs[2:])
    step = ir.Value(name=b.fresh_name("step"), type=iteration.type, shape=ir.Shape([]))
    keep_going = ir.Value(name=b.fresh_name("keep_going"), type=condition.type, shape=ir.Shape([]))
    state_grad_in = [_body_input(b, "state_grad", states[i]) for i in float_states]
    captured_sum_in = [_body_input(b, "captured_grad", v) for v in captured]
    # the forward body's inputs, as that iteration had them
    at = b.op.Sub(last, step)
    began = [b.op.SequenceAt(history, at) if i in in_sequence else b.op.Gather(history, at, axis=0)
             for i, history in enumerate(histories)]
    for value, started in zip([iteration, *states], [at, *began]):
        started.type, started.shape = value.type, value.shape
        value.replace_all_uses_with(started, replace_graph_outputs=True)  # a state passed through too
    if conditions is not None:
        read = b.op.Gather(conditions, at, axis=0)
        read.type, read.shape = condition.type, condition.shape
        condition.replace_all_uses_with(read, replace_graph_outputs=True)
    seeds = [(copy.outputs[1 + i], g) for i, g in zip(float_states, state_grad_in)]
    for k in seeded_outputs:
        piece = b.op.Gather(ctx.grad_outputs[num_states + k], at, axis=0)
        piece.type, piece.shape = copy.outputs[1 + num_states + k].type, copy.outputs[1 + num_states + k].shape
        seeds.append((copy.outputs[1 + num_states + k], piece))
    wrt = [began[i] for i in float_states] + list(captured)
    grads = build_gradients(copy, [v for v, _ in seeds], wrt, loss_grad=[g for _, g in seeds], builder=b)

    body_outputs = b.distinct_outputs([keep_going, *(grads[began[i]] for i in float_states),
                                       *(b.op.Add(total, grads[v]) for total, v in zip(captured_sum_in, captured))])
    for value, like in zip(body_outputs, [condition, *(states[i] for i in float_states), *captured]):
        value.type, value.shape = like.type, like.shape
    copy.inputs.clear()
    copy.inputs.extend([step, keep_going, *state_grad_in, *captured_sum_in])
    copy.outputs.clear()
    copy.outputs.extend(body_outputs)
    copy.sort()  # the forward nodes now read the slices taken after them

    results = op.Loop(count, None, *(ctx.grad_output(i) for i in float_states),
                      *(ctx.b.zeros_like(v) for v in captured), body=copy, _outputs=len(body_outputs) - 1)
    results = list(results) if isinstance(results, tuple) else [results]
    _typed_like(results, body_outputs[1:])
    for value, g in zip(captured, results[len(float_states):]):
        g.type, g.shape = value.type, value.shape
        ctx.captured_grads[value] = g
    state_grads = dict(zip(float_states, results))
    input_grads = [None, None] + [state_grads.get(i) if ctx.needs(2 + i) else None for i in range(num_states)]
    for g, value in zip(input_grads, node.inputs):
        if g is not None:
            g.type, g.shape = value.type, value.shape
    return tuple(input_grads)
