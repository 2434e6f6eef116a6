"""Build the static page that trains the digits CNN in the browser: examples/web/site/.

    (cd js && npm ci)                      # onnxruntime-web (its .wasm files are served from here)
    python examples/web/prepare.py         # writes examples/web/site/
    python examples/web/serve.py           # http://127.0.0.1:8000/

``site/`` gets the page (index.html, app.mjs and the two shared modules), the model, its
training artifacts and the digits data (``examples/digits_for_js.py``) under ``data/``, and
under ``vendor/`` copies of onnxtrain-web (``js/src``) and of the onnxruntime-web build the
page imports with its wasm files: nothing is loaded from a CDN. The folder is self-contained
and can be served by any static web server.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PAGE_FILES = ["index.html", "app.mjs", "digits_data.mjs", "digits_training.mjs"]
# the onnxruntime-web build named in index.html's import map, and the wasm runtime it loads
ORT_FILES = ["ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm"]


def _digits_for_js():
    spec = importlib.util.spec_from_file_location("digits_for_js", ROOT / "examples" / "digits_for_js.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepare(site: str | pathlib.Path = HERE / "site", node_modules: str | pathlib.Path = ROOT / "js" / "node_modules") -> pathlib.Path:
    """Write the page, data, artifacts and vendored scripts into ``site``; return it."""
    site, node_modules = pathlib.Path(site), pathlib.Path(node_modules)
    ort_dist = node_modules / "onnxruntime-web" / "dist"
    missing = [name for name in ORT_FILES if not (ort_dist / name).exists()]
    if missing:
        raise SystemExit(f"{ort_dist} lacks {missing}: run `npm ci` in js/ first")
    site.mkdir(parents=True, exist_ok=True)
    for name in PAGE_FILES:
        shutil.copy2(HERE / name, site / name)
    vendor = site / "vendor"
    shutil.rmtree(vendor, ignore_errors=True)
    (vendor / "onnxruntime-web").mkdir(parents=True)
    for name in ORT_FILES:
        shutil.copy2(ort_dist / name, vendor / "onnxruntime-web" / name)
    src = ROOT / "js" / "src"
    shutil.copytree(src / "core", vendor / "onnxtrain-web" / "core")
    shutil.copy2(src / "web.js", vendor / "onnxtrain-web" / "web.js")
    _digits_for_js().write_all(site / "data")
    for path in (site / "data").rglob("*"):  # the checkpoint is written 0600; a web server may run as another user
        path.chmod(0o644 if path.is_file() else 0o755)
    return site


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="build examples/web/site/")
    parser.add_argument("--site", default=str(HERE / "site"), help="output folder")
    args = parser.parse_args(argv)
    site = prepare(args.site)
    print(f"page written to {site}; serve it with: python {pathlib.Path(__file__).with_name('serve.py')}")


if __name__ == "__main__":
    sys.exit(main())
