"""ORTModule's backward session runs each layer's weight gradient right after that layer's
output gradient (the backward graph's own order), not all weight gradients at the end, which
kept every layer's output gradient alive through the whole backward run."""

import json

import onnxruntime as ort
import torch

from onnxtrain.torch import DebugOptions, ORTModule


def _profiled_backward_order(tmp_path) -> tuple[list[str], object]:
    """Node names in the order the backward session ran them (one profiled training step)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "ort")
    wrapped = ORTModule(net, DebugOptions(session_options=options, fallback=False))
    wrapped(torch.randn(32, 6)).square().sum().backward()
    (variant,) = [v for variants in wrapped._variants.values() for v in variants]
    (programs,) = variant.training.values()
    profile = programs.backward.session.end_profiling()
    events = json.loads(open(profile).read())
    ran = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    ran.sort(key=lambda e: e["ts"])
    return [e["name"][:-len("_kernel_time")] for e in ran], programs.graphs


def _position(order: list[str], node_name: str) -> int:
    """Where the node named ``node_name`` ran (onnxruntime's fusions keep it as a name prefix)."""
    hits = [i for i, name in enumerate(order) if name == node_name or name.startswith(node_name + "/")]
    assert hits, f"{node_name} not found among {order}"
    return hits[0]


def test_weight_gradients_run_as_their_layers_are_reached(tmp_path):
    order, graphs = _profiled_backward_order(tmp_path)
    backward = graphs.backward.graph
    gradient_of = dict(zip(graphs.wrt, backward.outputs))
    # the product that carries the gradient through the second layer (to the first one's output)
    (through_second_layer,) = [n for n in backward if n.op_type in ("MatMul", "Gemm") and n.outputs[0] not in
                               backward.outputs and any(i is not None and i.name == "2.weight" for i in n.inputs)]
    last_weight = _position(order, gradient_of["6.weight"].producer().name)
    assert last_weight < _position(order, through_second_layer.name), order
    assert _position(order, through_second_layer.name) < _position(order, gradient_of["0.weight"].producer().name)
