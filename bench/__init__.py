"""onnxtrain's benchmark suite: ``python -m bench [--quick]`` (see bench/run.py).

- ``run.py``: the suite (rounds of cells, each in its own process), results.json, RESULTS.md, plot;
- ``cell.py``: one model x one system in this process (eager, compile, ortmodule, ondevice, upstream);
- ``upstream_worker.py``: the upstream onnxruntime-training 1.19.2 cell's worker, run by the
  virtualenv that ``setup_upstream.sh`` creates (bench/.venv-upstream); ``ondevice_worker.py``:
  the onnxtrain on-device cell's worker, a process without torch; ``worker_loop.py``: their
  shared training loop;
- ``models.py``: models and data (fixed seeds); ``probe.py``: peak matmul rate;
- ``analysis.py``: medians over rounds, loss check against eager, targets; ``report.py``: the report
  (``python -m bench.report`` renders it again from results.json).
"""


def write_results(results: dict, out, table: str) -> None:
    """Write a side benchmark's ``results`` as JSON to ``out`` (folders created) and print its table."""
    import json
    from pathlib import Path

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(table)
    print(f"\nwritten to {out}")


def package_versions(names) -> dict:
    """Python's and each named package's version, from their metadata (no import: importing
    transformers just for this would be slow); a package that is not installed is left out."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out
