"""Measure one model's training-step peak and print it next to estimate_memory's, as JSON.

``python _estimate_worker.py <bench model> <batch>``: the module is exported and its sessions
built on a one-example call first; then, from a trimmed resident set with its high-water
mark reset, two SGD steps on the full batch run (the graph is exported with dynamic dims,
so the full batch reuses it). The measured step peak (high-water mark
minus that resident set) is compared with ``MemoryEstimate.step_peak``.
"""

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from bench import memory, models  # noqa: E402
from onnxtrain.torch import ORTModule  # noqa: E402
from onnxtrain.torch.memory import estimate_memory  # noqa: E402


def _call(spec, model, batch, sample):
    inputs = {k: torch.from_numpy(v[:batch]) for k, v in sample.items()}
    labels = inputs.pop("labels")
    if spec.kind == "hf":
        logits = model(**inputs)
    else:
        logits = model(*inputs.values())
    return models.cross_entropy(logits, labels)


def main(name: str, batch: int) -> dict:
    spec = models.get(name)
    spec.batch = batch
    sample = spec.batches()[0]
    net = spec.export_model(spec.build())
    args = [torch.from_numpy(sample[n]) for n in spec.input_names]
    estimate = estimate_memory(net, *args, optimizer_states=0, dynamic=True)  # the graph measured below
    model = ORTModule(net, dynamic=True)  # the one-example call builds the graph the full batch reuses
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    _call(spec, model, 1, sample).backward()
    optimizer.zero_grad(set_to_none=True)
    memory.trim()
    before = memory.rss_mb()
    memory.reset_high_water_mark()
    for _ in range(2):
        _call(spec, model, batch, sample).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = (memory.high_water_mark_mb() - before) * 2**20
    return {"measured": measured, "estimated": estimate.step_peak, "explain": estimate.explain()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
