"""ORTModule's backward session runs each layer's weight gradient right after that layer's
output gradient (the backward graph's own order), not all weight gradients at the end, which
kept every layer's output gradient alive through the whole backward run."""

import json

import onnxruntime as ort
import torch

from onnxtrain.torch import DebugOptions, ORTModule


def _profiled_backward_order(tmp_path, net: torch.nn.Module, x: torch.Tensor) -> tuple[list[str], object]:
    """Node names in the order the backward session ran them (one profiled training step), and
    the graphs ORTModule built."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "ort")
    wrapped = ORTModule(net, DebugOptions(session_options=options, fallback=False))
    wrapped(x).square().sum().backward()
    (variant,) = [v for variants in wrapped._variants.values() for v in variants]
    (programs,) = variant.training.values()
    profile = programs.backward.session.end_profiling()
    events = json.loads(open(profile).read())
    ran = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    ran.sort(key=lambda e: e["ts"])
    return [e["name"][:-len("_kernel_time")] for e in ran], programs.graphs


def _position(order: list[str], node_name: str) -> int:
    """Where the node named ``node_name`` ran (onnxruntime's rewrites keep it as a name prefix)."""
    hits = [i for i, name in enumerate(order) if name == node_name or name.startswith(node_name + "/")]
    assert hits, f"{node_name} not found among {order}"
    return hits[0]


def _gradient_producers(graphs) -> dict[str, str]:
    """Parameter name -> the name of the node that produces its gradient."""
    return {name: value.producer().name for name, value in zip(graphs.wrt, graphs.backward.graph.outputs)}


def test_weight_gradients_run_as_their_layers_are_reached(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    order, graphs = _profiled_backward_order(tmp_path, net, torch.randn(32, 6))
    backward = graphs.backward.graph
    producers = _gradient_producers(graphs)
    # the product that carries the gradient through the second layer (to the first one's output)
    (through_second_layer,) = [n for n in backward if n.op_type in ("MatMul", "Gemm") and n.outputs[0] not in
                               backward.outputs and any(i is not None and i.name == "2.weight" for i in n.inputs)]
    assert _position(order, producers["6.weight"]) < _position(order, through_second_layer.name), order
    assert _position(order, through_second_layer.name) < _position(order, producers["0.weight"])


def test_conv_weight_gradients_run_in_the_graphs_order(tmp_path):
    """A Conv's weight gradient ends with nodes onnxruntime's optimizers leave in place; one they
    rewrite becomes a new node that the default order would walk first (the first layer's
    gradient, with the whole backward chain before it)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1, bias=False), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(16 * 10 * 10, 4))
    order, graphs = _profiled_backward_order(tmp_path, net, torch.randn(4, 1, 10, 10))
    producers = _gradient_producers(graphs)
    assert _position(order, producers["5.weight"]) < _position(order, producers["2.weight"]), order
    assert _position(order, producers["2.weight"]) < _position(order, producers["0.weight"]), order
