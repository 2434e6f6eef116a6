"""The JavaScript runtime (js/, npm package onnxtrain-web) against the Python runtime.

Python makes the fixtures (tests/js/fixtures.py: artifacts, data, an uninterrupted Python
run), Node's test runner trains the same steps on onnxruntime-node and onnxruntime-web
(js/test/), Python resumes the checkpoint Node wrote and runs what the Node example exported,
and headless Chromium trains the digits page (examples/web/) served on localhost, the small
contract models on wasm and on WebGPU (its software adapter where there is no GPU), and the
digits CNN on WebGPU. Needs ``node`` with ``npm ci`` done in js/ and Debian's ``chromium``;
without them these tests skip, except in CI (``CI=true``), where a
missing tool is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.js import fixtures

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "js"
ARTIFACTS_DIR = ROOT / "test-artifacts"
CHROMIUM = Path(os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
NODE_TIMEOUT_S = 180
PAGE_MIN_ACCURACY = 0.9
WEBGPU_PAGE_MIN_ACCURACY = 0.5  # after one epoch (~0.64 seen); chance is 0.1


def _missing(what: str) -> None:
    message = f"{what} (see README, 'Web and Node')"
    if IN_CI:
        pytest.fail(f"CI must run the JavaScript tests, but {message}")
    pytest.skip(message)


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        _missing("node is not installed")
    if not (JS / "node_modules" / "onnxruntime-node").is_dir() or not (JS / "node_modules" / "onnxruntime-web").is_dir():
        _missing("js/node_modules is missing: run `npm ci` in js/")
    return node


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=NODE_TIMEOUT_S, **kwargs)


def _report(run: subprocess.CompletedProcess) -> str:
    return f"exit code {run.returncode}\n--- stdout\n{run.stdout[-6000:]}\n--- stderr\n{run.stderr[-6000:]}"


@pytest.fixture(scope="module")
def node_run(tmp_path_factory):
    """Fixtures by Python, then `node --test` on them (js/test/*.test.js)."""
    node = _node()
    out = fixtures.make_fixtures(tmp_path_factory.mktemp("js_fixtures"))
    tests = sorted(str(p.relative_to(JS)) for p in (JS / "test").glob("*.test.js"))
    run = _run([node, "--test", *tests], cwd=JS, env=_env(ONNXTRAIN_JS_FIXTURES=str(out)))
    return out, run


def test_node_test_runner_passes(node_run):
    """Node: 20 steps equal Python's within 1e-4, wasm equals native, exports and errors (js/test/)."""
    _, run = node_run
    assert run.returncode == 0, _report(run)
    assert "# fail 0" in run.stdout and "# pass" in run.stdout, _report(run)


def test_checkpoint_python_node_python_continues_identically(node_run):
    """Python reads what Node wrote (with optimizer state) and continues as if never interrupted."""
    from onnxtrain.checkpoint import read_checkpoint

    out, run = node_run
    assert (out / "node_step20").exists(), _report(run)
    steps, tolerance = fixtures.SETTINGS["steps"], fixtures.SETTINGS["tolerance"]
    from_node = read_checkpoint(out / "node_step20")
    from_python = read_checkpoint(out / "python_step20")
    assert from_node.optimizer.step == steps
    assert from_node.optimizer.learning_rate == pytest.approx(fixtures.SETTINGS["learning_rate"])
    assert from_node.optimizer.states == ["momentum0", "momentum1"]
    assert from_node.properties["best_loss"] == float("inf") and np.isnan(from_node.properties["ratio"])
    for name, value in fixtures.BIG_PROPERTIES.items():  # through Node exactly (BigInt there)
        assert from_node.properties[name] == value and type(from_node.properties[name]) is type(value), name
    for name, record in from_python.parameters.items():
        assert from_node.parameters[name].requires_grad == record.requires_grad
        np.testing.assert_allclose(from_node.parameters[name].value, record.value, rtol=0, atol=tolerance)
        for state in ("momentum0", "momentum1"):
            np.testing.assert_allclose(from_node.optimizer.values[name][state], from_python.optimizer.values[name][state],
                                       rtol=0, atol=tolerance)

    fixtures.resume(out, out / "node_step20", out / "resumed_step40")
    resumed = read_checkpoint(out / "resumed_step40")
    uninterrupted = read_checkpoint(out / "python_step40")
    initial = read_checkpoint(out / "artifacts" / "checkpoint")
    assert resumed.optimizer.step == uninterrupted.optimizer.step == 2 * steps
    for name, record in uninterrupted.parameters.items():
        np.testing.assert_allclose(resumed.parameters[name].value, record.value, rtol=0, atol=tolerance)
        assert np.abs(record.value - initial.parameters[name].value).max() > 100 * tolerance  # it did train


def _browser_tools() -> str:
    node = _node()
    if not CHROMIUM.exists():
        _missing(f"{CHROMIUM} is missing: apt-get install chromium")
    if not (JS / "node_modules" / "playwright-core").is_dir():
        _missing("playwright-core is missing: run `npm ci` in js/")
    return node


@pytest.fixture(scope="module")
def served_site(node_run, tmp_path_factory):
    """examples/web/prepare.py's site plus the small models and the contract page, served by
    examples/web/serve.py on a free localhost port; yields (site folder, base URL)."""
    _browser_tools()
    out, _ = node_run
    spec = importlib.util.spec_from_file_location("web_prepare", ROOT / "examples" / "web" / "prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    site = prepare.prepare(tmp_path_factory.mktemp("web") / "site")
    shutil.copytree(out / "small", site / "data" / "small")
    shutil.copy2(JS / "test-browser" / "contract_page.html", site / "contract_page.html")
    server = subprocess.Popen([sys.executable, str(ROOT / "examples" / "web" / "serve.py"), "--port", "0", str(site)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), f"serve.py printed {url!r}; stderr: {server.stderr.read()}"
        yield site, url
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_browser_page_trains_digits_to_90_percent(served_site, tmp_path):
    """Headless Chromium on the served page: trains, reports >= 90% test accuracy, screenshot saved."""
    site, url = served_site
    screenshot = ARTIFACTS_DIR / "digits_page.png"
    downloads = tmp_path / "downloads"
    run = _run([_browser_tools(), "test-browser/digits_page.mjs", url, str(screenshot), str(PAGE_MIN_ACCURACY),
                str(downloads)], cwd=JS, env=_env(CHROMIUM_PATH=str(CHROMIUM)))
    assert run.returncode == 0, _report(run)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["state"] == "done" and result["epochs"] == 8, result
    assert result["accuracy"] >= PAGE_MIN_ACCURACY, result
    # the page loaded every file it asked for (no CDN, all vendored) and threw no error
    assert not [p for p in result["problems"] if p.startswith(("page error", "request failed"))], result["problems"]
    assert not [p for p in result["problems"] if "404" in p], result["problems"]

    # what the page offers for download: a checkpoint Python reads, an inference model Python runs
    import onnxruntime as ort

    from onnxtrain.checkpoint import read_checkpoint

    trained = read_checkpoint(downloads / "checkpoint")
    assert trained.optimizer.step == 8 * 45 and trained.optimizer.states == ["momentum0", "momentum1"]
    data = fixtures.load_data(site / "data")
    session = ort.InferenceSession(str(downloads / "inference_model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"image": np.ascontiguousarray(data["test_images"])})
    assert float(np.mean(np.argmax(logits, axis=1) == data["test_labels"])) == pytest.approx(result["accuracy"])
    assert screenshot.stat().st_size > 10_000


@pytest.mark.slow  # ~17 s; WebGPU training itself is checked by the two webgpu parity tests below
def test_browser_page_trains_digits_on_webgpu(served_site, tmp_path):
    """The page with ``?ep=webgpu`` (one epoch): trains on the WebGPU provider, no fallback to wasm."""
    _, url = served_site
    run = _run([_browser_tools(), "test-browser/digits_page.mjs", url + "?ep=webgpu&epochs=1",
                str(tmp_path / "webgpu_page.png"), str(WEBGPU_PAGE_MIN_ACCURACY)], cwd=JS,
               env=_env(CHROMIUM_PATH=str(CHROMIUM), CHROMIUM_ARGS="--enable-unsafe-webgpu"))
    result = json.loads(run.stdout.strip().splitlines()[-1]) if run.stdout.strip() else {}
    if "WebGPU unavailable" in result.get("backend", ""):
        _missing("Chromium offers no WebGPU adapter, even with --enable-unsafe-webgpu")
    assert run.returncode == 0, _report(run)
    assert result["state"] == "done" and result["epochs"] == 1, result
    assert result["backend"] == "WebGPU (wasm fallback)", result  # "wasm, ... (WebGPU failed: ...)" after a fallback
    assert not [p for p in result["problems"] if p.startswith(("page error", "request failed"))], result["problems"]


def _small_models(url: str, execution_provider: str, models: list[str]) -> dict:
    run = _run([_browser_tools(), "test-browser/small_models.mjs", url + "contract_page.html", execution_provider,
                *models], cwd=JS, env=_env(CHROMIUM_PATH=str(CHROMIUM)))
    assert run.returncode == 0, _report(run)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_browser_wasm_matches_python_on_batchnorm_and_fp16_models(served_site):
    """In Chromium (wasm): plain, BatchNorm and fp16 loss-scaled MLPs train as the Python runtime does."""
    _, url = served_site
    report = _small_models(url, "wasm", ["plain", "batchnorm", "fp16"])
    for model, result in report["results"].items():
        assert "error" not in result, (model, result)
        assert result["steps"] == result["expectedSteps"], (model, result)
        assert result["maxAbsDiff"] <= fixtures.SETTINGS["tolerance"], (model, result)


def test_browser_webgpu_trains_like_python(served_site):
    """In Chromium with WebGPU (the software adapter where there is no GPU): the plain MLP
    trains on onnxruntime-web's WebGPU execution provider as the Python runtime does."""
    _, url = served_site
    report = _small_models(url, "webgpu", ["plain"])
    if report["adapter"] is None:
        _missing("Chromium offers no WebGPU adapter, even with --enable-unsafe-webgpu")
    result = report["results"]["plain"]
    assert "error" not in result, result
    assert result["steps"] == result["expectedSteps"], result
    assert result["maxAbsDiff"] <= fixtures.SETTINGS["tolerance"], result


def _digits_steps(site, url: str, out, execution_provider: str) -> dict:
    """The fixture's digits CNN trained in Chromium for the fixture's steps (js/test-browser/digits_steps.mjs)."""
    served = site / "data" / "fixture"
    if not served.exists():
        shutil.copytree(out / "artifacts", served / "artifacts")
        for name in ("python_step20", "digits.bin", "digits.json", "fixture.json"):
            shutil.copy2(out / name, served / name)
        for path in served.rglob("*"):  # checkpoints are written 0600; let any server user read them
            path.chmod(0o644 if path.is_file() else 0o755)
    run = _run([_browser_tools(), "test-browser/digits_steps.mjs", url + "contract_page.html", execution_provider,
                "data/fixture"], cwd=JS, env=_env(CHROMIUM_PATH=str(CHROMIUM)))
    assert run.returncode == 0, _report(run)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_browser_webgpu_trains_the_digits_cnn_like_python(served_site, node_run):
    """In Chromium with WebGPU: the digits CNN (Conv, MaxPool and their gradients, which use no
    MaxPool Indices) trains 20 steps on the WebGPU execution provider as the Python runtime does."""
    site, url = served_site
    out, _ = node_run
    report = _digits_steps(site, url, out, "webgpu")
    if report["adapter"] is None:
        _missing("Chromium offers no WebGPU adapter, even with --enable-unsafe-webgpu")
    result = report["result"]
    assert "error" not in result, result
    assert result["steps"] == result["expectedSteps"] == fixtures.SETTINGS["steps"], result
    assert result["maxAbsDiff"] <= fixtures.SETTINGS["tolerance"], result


def test_node_example_trains_and_its_exports_work_in_python(node_run):
    """examples/node/train_digits.mjs: >= 90% test accuracy; Python reads its checkpoint and
    runs its inference model (exported by the JS side) with the same accuracy."""
    import onnx
    import onnxruntime as ort

    from onnxtrain.checkpoint import read_checkpoint

    out, _ = node_run
    run = _run([_node(), str(ROOT / "examples" / "node" / "train_digits.mjs"), str(out), "8"], cwd=ROOT, env=_env())
    assert run.returncode == 0, _report(run)
    accuracies = [float(line.rsplit(" ", 1)[1].rstrip("%")) / 100 for line in run.stdout.splitlines()
                  if line.startswith("epoch 8/8")]
    assert accuracies and accuracies[0] >= PAGE_MIN_ACCURACY, run.stdout

    trained = read_checkpoint(out / "trained_checkpoint")
    assert trained.optimizer.step == 8 * 45  # 1437 training digits in batches of 32
    model = onnx.load(out / "inference_model.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["image"] and [o.name for o in model.graph.output] == ["logits"]
    data = fixtures.load_data(out)
    session = ort.InferenceSession(str(out / "inference_model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"image": np.ascontiguousarray(data["test_images"])})
    python_accuracy = float(np.mean(np.argmax(logits, axis=1) == data["test_labels"]))
    assert python_accuracy == pytest.approx(accuracies[0], abs=1e-3)
    # the inference model holds the trained weights
    weights = {init.name: onnx.numpy_helper.to_array(init) for init in model.graph.initializer}
    np.testing.assert_array_equal(weights["fc.weight"], trained.parameters["fc.weight"].value)
