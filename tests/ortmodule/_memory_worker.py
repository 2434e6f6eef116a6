"""One training run of the benchmark GPT in a fresh interpreter; prints its peak memory as JSON.

``python _memory_worker.py <level|budget-bytes|eager> <batch>``: the exporter is warmed up on
a tiny module first, so that the measured peak (the high-water mark of the resident set
minus the resident set before the model is built) is the training's, not the imports'.
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

STEPS = 2


def main(mode: str, batch: int) -> dict:
    warm = ORTModule(torch.nn.Linear(2, 2))
    warm(torch.randn(1, 2)).sum().backward()
    spec = models.get("gpt")
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, spec.vocab, (batch, spec.seq), generator=gen)
    labels = torch.randint(0, spec.vocab, (batch, spec.seq), generator=gen)
    memory.trim()
    before = memory.rss_mb()
    memory.reset_high_water_mark()
    net = spec.build()
    if mode == "eager":
        model = net
    elif mode.startswith("level"):
        model = ORTModule(net, memory_opt_level=int(mode[5:]))
    else:
        model = ORTModule(net, memory_budget=int(mode))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(STEPS):
        loss = models.cross_entropy(model(idx), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    report = getattr(model, "memory_report", None)
    return {"peak_mb": memory.high_water_mark_mb() - before, "loss": loss.item(),
            "unplanned_saved_bytes": report.unplanned_saved_bytes if report else None,
            "saved_bytes": report.saved_bytes if report else None}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
