"""Machine probe: this machine's peak float32 matmul rate, measured in its own process.

``python -m bench.probe --threads 2`` prints JSON: the best rate of ``torch.mm`` on
2048x2048 float32 matrices over several repetitions (2 n^3 FLOPs each).
"""

from __future__ import annotations

import argparse
import json
import time


def matmul_peak(n: int = 2048, reps: int = 10, threads: int = 2) -> dict:
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    out = torch.empty(n, n)
    for _ in range(2):  # warm up
        torch.mm(a, b, out=out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"n": n, "reps": reps, "threads": threads, "best_s": best,
            "gflops": 2 * n**3 / best / 1e9, "median_gflops": 2 * n**3 / sorted(times)[len(times) // 2] / 1e9}


def load_probe(threads: int = 2, n: int = 1024, reps: int = 8) -> float:
    """How much of the machine this process gets right now: the median rate (GFLOP/s) of a short
    burst of ``torch.mm`` on ``n x n`` float32 matrices (~0.1 s).

    Every bench cell takes it before and after its steps. The machine is shared: when outside
    work takes a core, this rate drops with the cell's speed (onnxruntime's spinning thread
    pools lose even more), so a cell whose probe ran far below the run's best was measured on a
    disturbed machine (``bench.analysis.mark_disturbed``).
    """
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(matmul_peak(args.n, args.reps, args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
