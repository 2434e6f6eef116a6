"""Machine probe: this machine's peak float32 matmul rate, measured in its own process.

``python -m bench.probe --threads 2`` prints JSON: the best rate of a 2048x2048 float32 matrix
product over several repetitions (2 n^3 FLOPs each), by each library the benchmark's systems
compute with (PyTorch's ``torch.mm`` and onnxruntime's ``MatMul``), and the faster of the two as
the machine's peak. Which library is faster depends on the CPU: on one Intel host of this
workplace ``torch.mm`` led, on an AMD EPYC host onnxruntime's MLAS ran ~2x faster than PyTorch's
GEMM, and a bound taken from ``torch.mm`` alone put onnxruntime's GPT step *below* it.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _timed_runs(run, reps: int, warmup: int = 2) -> list[float]:
    """The wall time of each of ``reps`` calls of ``run``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def _torch_mm_times(a, b, reps: int, threads: int) -> list[float]:
    import torch

    torch.set_num_threads(threads)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    out = torch.empty(a.shape[0], b.shape[1])
    return _timed_runs(lambda: torch.mm(ta, tb, out=out), reps)


def _onnxruntime_matmul_times(a, b, reps: int, threads: int) -> list[float]:
    import onnx
    import onnxruntime as ort
    from onnx import helper

    n, k, m = a.shape[0], a.shape[1], b.shape[1]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul_probe",
                              [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [n, k]),
                               helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [k, m])],
                              [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [n, m])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    # the output stays bound to one preallocated buffer, as torch.mm's ``out=``
    binding = session.io_binding()
    binding.bind_cpu_input("a", a)
    binding.bind_cpu_input("b", b)
    binding.bind_ortvalue_output("c", ort.OrtValue.ortvalue_from_shape_and_type([n, m], np.float32))
    return _timed_runs(lambda: session.run_with_iobinding(binding), reps)


LIBRARIES = {"torch.mm": _torch_mm_times, "onnxruntime MatMul": _onnxruntime_matmul_times}


def matmul_peak(n: int = 2048, reps: int = 10, threads: int = 2) -> dict:
    """The best float32 ``n x n`` matrix-product rate of each library, and the faster as ``gflops``.

    A library that cannot run here (onnxruntime missing, say) is reported with its error and
    left out of the peak.
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    flops = 2 * n**3
    by_library: dict[str, dict] = {}
    for name, times_of in LIBRARIES.items():
        try:
            times = sorted(times_of(a, b, reps, threads))
        except Exception as exc:  # noqa: BLE001 - the other library still gives a peak
            by_library[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        by_library[name] = {"best_s": times[0], "gflops": flops / times[0] / 1e9,
                            "median_gflops": flops / times[len(times) // 2] / 1e9}
    rated = {name: r for name, r in by_library.items() if "gflops" in r}
    result: dict = {"n": n, "reps": reps, "threads": threads, "by_library": by_library}
    if rated:
        fastest = max(rated, key=lambda name: rated[name]["gflops"])
        result.update(library=fastest, best_s=rated[fastest]["best_s"], gflops=rated[fastest]["gflops"],
                      median_gflops=rated[fastest]["median_gflops"])
    return result


def load_probe(threads: int = 2, n: int = 1024, reps: int = 8) -> float:
    """How much of the machine this process gets right now: the median rate (GFLOP/s) of a short
    burst of ``torch.mm`` on ``n x n`` float32 matrices (~0.1 s).

    Every bench cell takes it before (through :func:`load_probe_in_child`) and after its steps. The machine is shared: when outside
    work takes a core, this rate drops with the cell's speed (onnxruntime's spinning thread
    pools lose even more), so a cell whose probe ran far below the run's best was measured on a
    disturbed machine (``bench.analysis.mark_disturbed``).
    """
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    out = torch.empty(n, n)
    times = _timed_runs(lambda: torch.mm(a, b, out=out), reps, warmup=1)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


def load_probe_in_child(threads: int = 2, timeout: float = 300) -> float:
    """:func:`load_probe` run in a fresh process, so that this process's PyTorch is left as it was.

    A bench cell takes its first probe this way, before it prepares the system it measures: a
    ``torch.mm`` burst in the cell's own process warms PyTorch's matrix-product code for what
    follows. Measured on an AMD EPYC host: eager's MLP step 1.45-1.9 ms after an in-process
    burst, 2.4-2.9 ms without one (400 steps each), so in-process probes flattered eager.
    """
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "bench.probe", "--load", "--threads", str(threads)],
                          capture_output=True, text=True, timeout=timeout, check=True)
    return float(json.loads(proc.stdout)["gflops"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--load", action="store_true", help="print the load probe's rate instead (load_probe)")
    args = parser.parse_args(argv)
    if args.load:
        print(json.dumps({"gflops": load_probe(args.threads)}))
    else:
        print(json.dumps(matmul_peak(args.n, args.reps, args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
