"""Optimizer step time over the benchmark GPT's parameters: onnxtrain's optimizers beside PyTorch's.

    python -m bench.optim_step             # gpt (bench/models.py, as the suite), 60 rounds of 2 steps
    python -m bench.optim_step --quick     # 12 rounds (well under a minute on 2 CPU cores)
    python -m bench.optim_step --model tiny-gpt --rounds 2 --out /tmp/o.json

Every system gets its own copy of the model's parameters with the same gradients (one fixed
random draw; only the optimizer runs, no forward or backward). After ``--warmup`` untimed
steps each, round ``r`` times ``--steps`` consecutive steps of every system, in the systems'
order on even rounds and reversed on odd ones, so slow drift of a shared machine hits all
alike; a system's figure is the median over rounds of its mean step time within a round, and
its ratio to PyTorch's fastest AdamW both as a ratio of medians and as the median of the
per-round ratios (paired, so less sensitive to the machine's load).

Writes ``bench/results/optim_step.json`` (``--out``) and prints :func:`markdown`'s table,
with each system's time as a ratio to PyTorch's fastest AdamW.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from bench import models, package_versions, write_results

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "optim_step.json"
LR, WEIGHT_DECAY = 1e-3, 0.01
GRAD_SEED = 4321

# many short rounds: on a shared machine a burst of load then hits one round of every system
QUICK = {"rounds": 12, "steps": 2, "warmup": 3}
FULL = {"rounds": 60, "steps": 2, "warmup": 5}


def _systems() -> dict[str, tuple[str, Callable]]:
    """name -> (label, factory(params) -> optimizer); the same hyperparameters for all AdamWs."""
    import torch

    from onnxtrain.torch.optim import LAMB, AdamWMode, FusedAdam

    adamw = dict(lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-8, betas=(0.9, 0.999))
    return {
        "onnxtrain_fused_adam": ("onnxtrain FusedAdam (ADAMW_TORCH)",
                                 lambda ps: FusedAdam(ps, adam_w_mode=AdamWMode.ADAMW_TORCH, **adamw)),
        "torch_adamw_fused": ("torch.optim.AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, fused=True, **adamw)),
        "torch_adamw_foreach": ("torch.optim.AdamW(foreach=True)",
                                lambda ps: torch.optim.AdamW(ps, foreach=True, **adamw)),
        "onnxtrain_lamb": ("onnxtrain LAMB", lambda ps: LAMB(ps, lr=LR, weight_decay=WEIGHT_DECAY)),
    }


TORCH_SYSTEMS = ("torch_adamw_fused", "torch_adamw_foreach")
ADAMW_SYSTEMS = ("onnxtrain_fused_adam", *TORCH_SYSTEMS)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: str = "gpt", rounds: int = FULL["rounds"], steps: int = FULL["steps"],
            warmup: int = FULL["warmup"], device: str = "cpu", systems: list[str] | None = None) -> dict:
    """Time every system's ``optimizer.step()`` (see the module docstring); returns the results dict."""
    import torch

    dev = torch.device(device)
    spec = models.get(model)
    reference = [p.detach().to(dev) for p in spec.build().parameters()]
    gen = torch.Generator().manual_seed(GRAD_SEED)
    grads = [torch.randn(p.shape, generator=gen).mul_(1e-2).to(dev) for p in reference]
    table = _systems()
    names = list(systems or table)
    optimizers = {}
    for name in names:
        params = [torch.nn.Parameter(p.clone()) for p in reference]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizers[name] = table[name][1](params)
    for name in names:
        for _ in range(warmup):
            optimizers[name].step()
    _sync(dev)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            optimizer = optimizers[name]
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            _sync(dev)
            per_round[name].append((time.perf_counter() - t0) / steps)
    results = {
        "model": spec.name, "description": spec.description, "device": str(dev),
        "n_params": sum(p.numel() for p in reference), "n_tensors": len(reference),
        "threads": torch.get_num_threads(), "rounds": rounds, "steps_per_round": steps, "warmup": warmup,
        "lr": LR, "weight_decay": WEIGHT_DECAY, "versions": package_versions(("torch", "onnxtrain")),
        "systems": {name: {"label": table[name][0], "median_step_ms": 1e3 * statistics.median(per_round[name]),
                           "best_step_ms": 1e3 * min(per_round[name]),
                           "round_step_ms": [1e3 * t for t in per_round[name]]} for name in names},
    }
    torch_names = [n for n in TORCH_SYSTEMS if n in results["systems"]]
    if torch_names:
        fastest = min(torch_names, key=lambda n: results["systems"][n]["median_step_ms"])
        results["torch_fastest"] = fastest
        base = results["systems"][fastest]
        for entry in results["systems"].values():
            entry["ratio_vs_torch_fastest"] = entry["median_step_ms"] / base["median_step_ms"]
            # paired: the ratio within each round (same moment, same machine load), then the median
            entry["paired_ratio_vs_torch_fastest"] = statistics.median(
                a / b for a, b in zip(entry["round_step_ms"], base["round_step_ms"]))
        # like with like: every AdamW ran the same steps on the same gradients, so they must agree
        expected = _params_of(optimizers[fastest])
        for name in names:
            if name in ADAMW_SYSTEMS:
                got = _params_of(optimizers[name])
                results["systems"][name]["max_abs_diff_vs_torch_fastest"] = max(
                    (a - b).abs().max().item() for a, b in zip(got, expected))
    return results


def _params_of(optimizer) -> list:
    return [p.detach() for group in optimizer.param_groups for p in group["params"]]


def markdown(results: dict) -> str:
    """The results as a markdown table: median step time and its ratio to PyTorch's fastest."""
    fastest = results.get("torch_fastest")
    base = results["systems"][fastest]["label"] if fastest else "torch"
    lines = [f"Optimizer step over the `{results['model']}` model's parameters ({results['n_params']:,} in "
             f"{results['n_tensors']} tensors) on {results['device']}, {results['threads']} threads; median of "
             f"{results['rounds']} rounds of {results['steps_per_round']} steps.",
             "",
             f"| system | median step (ms) | best round (ms) | vs {base}: ratio of medians | median of per-round ratios "
             "|",
             "|---|---:|---:|---:|---:|"]
    for entry in results["systems"].values():
        ratio, paired = entry.get("ratio_vs_torch_fastest"), entry.get("paired_ratio_vs_torch_fastest")
        lines.append(f"| {entry['label']} | {entry['median_step_ms']:.2f} | {entry['best_step_ms']:.2f} | "
                     f"{'—' if ratio is None else f'{ratio:.2f}x'} | {'—' if paired is None else f'{paired:.2f}x'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.optim_step", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"fewer rounds: {QUICK}")
    parser.add_argument("--model", default="gpt", help="a model of bench/models.py (default: gpt, as the suite)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    preset = QUICK if args.quick else FULL
    results = measure(args.model, rounds=args.rounds or preset["rounds"], steps=args.steps or preset["steps"],
                      warmup=preset["warmup"] if args.warmup is None else args.warmup, device=args.device)
    write_results(results, args.out, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
