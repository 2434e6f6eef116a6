"""Run a multi-process test's ranks: one interpreter per rank, as a launcher (torchrun) would.

    results = launch_ranks(worker_script, workdir, world_size=2, timeout_s=240)

Each rank runs ``python WORKER RANK WORLD_SIZE WORKDIR`` with what launchers set (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a free loopback port), one
thread for OpenMP/MKL (ranks share the machine's cores) and gloo on the loopback interface
(no network needed). The worker writes ``WORKDIR/rank<RANK>.pt``; ``launch_ranks`` waits for
every rank, kills the others when one fails (it would wait forever in a collective), asserts
that every rank exited with 0 (showing the tail of its log) and returns the loaded results.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

LOG_TAIL_CHARS = 6000  # enough for a traceback and the lines before it


def load_worker(path: Path):
    """The worker script at ``path`` as a module (its helpers and reference runs, in this process)."""
    spec = importlib.util.spec_from_file_location(f"_onnxtrain_{Path(path).stem.lstrip('_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(worker: Path, workdir: Path, world_size: int, *, timeout_s: float,
                 env: dict[str, str] | None = None) -> list[dict]:
    """Run ``worker`` once per rank and return each rank's ``WORKDIR/rank<RANK>.pt``."""
    base = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **(env or {}))
    base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(rank), str(world_size), str(workdir)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)))
        for rank in range(world_size)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:  # one rank failing leaves the others blocked in a collective
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{log[-LOG_TAIL_CHARS:]}"
    return [torch.load(workdir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
