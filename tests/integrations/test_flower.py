"""Flower federated learning on the on-device API (onnxtrain.integrations.flower).

A real federation (Flower's own server and three client processes on loopback) trains the
digits CNN on non-IID shards; the client class, the central evaluation, the strategy's
checks and the write-back are also tested in process against references computed here
from the plain CNN in an ``onnxruntime.InferenceSession`` and from formulas.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
pytest.importorskip("sklearn")

import onnxruntime as ort  # noqa: E402
from onnx import numpy_helper  # noqa: E402

import onnxtrain  # noqa: E402
from onnxtrain import artifacts as art  # noqa: E402
from onnxtrain.demo import build_cnn, load_digits  # noqa: E402
from onnxtrain.errors import OnnxTrainError  # noqa: E402
from onnxtrain.integrations import flower as fl  # noqa: E402

WORKER = Path(__file__).with_name("flower_worker.py")
PARAM_NAMES = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias"]
# Non-IID split: each client owns 3-4 classes and gets OWN_FRACTION of their examples; the rest
# of each class is spread over the other clients.
CLASS_GROUPS = [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]
OWN_FRACTION = 0.9
ROUNDS = 6
LOCAL_EPOCHS = 3
LEARNING_RATE = 1e-2
FEDERATION_TIMEOUT_S = 240
REQUIRED_ACCURACY = 0.90


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("flower") / "artifacts"
    art.generate_artifacts(build_cnn(0), loss=art.LossType.CrossEntropyLoss, optimizer=art.OptimType.AdamW,
                           artifact_directory=folder, additional_output_names=["logits"])
    return folder


@pytest.fixture(scope="module")
def digits():
    return load_digits(0)


def _non_iid_shards(labels: np.ndarray, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    owner_of = {c: i for i, group in enumerate(CLASS_GROUPS) for c in group}
    owners = []
    for label in labels:
        own = owner_of[int(label)]
        others = [i for i in range(len(CLASS_GROUPS)) if i != own]
        owners.append(own if rng.random() < OWN_FRACTION else int(rng.choice(others)))
    owners = np.array(owners)
    return [np.flatnonzero(owners == i) for i in range(len(CLASS_GROUPS))]


def _reference_logits(params: dict[str, np.ndarray], images: np.ndarray) -> np.ndarray:
    """The plain CNN (no onnxtrain graph) with ``params`` as initializers."""
    model = build_cnn(0)
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(params[init.name], init.name))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"image": images})[0]


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].mean())


def _initial_params() -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in build_cnn(0).graph.initializer}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the federation ----------------------------------------------------------------------


def test_federation_of_processes_on_loopback_learns_digits(artifacts, digits, tmp_path):
    x_train, y_train, x_test, y_test = digits
    np.savez(tmp_path / "test.npz", x=x_test, y=y_test)
    shards = _non_iid_shards(y_train)
    for i, idx in enumerate(shards):
        cut = int(0.85 * len(idx))  # each client keeps a local eval split of its own shard
        np.savez(tmp_path / f"shard{i}.npz", x=x_train[idx[:cut]], y=y_train[idx[:cut]],
                 x_eval=x_train[idx[cut:]], y_eval=y_train[idx[cut:]])
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(onnxtrain.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    common = ["--address", address, "--artifacts", str(artifacts)]
    commands = [[sys.executable, str(WORKER), "server", *common, "--data", str(tmp_path / "test.npz"),
                 "--report", str(tmp_path / "server.json"), "--rounds", str(ROUNDS),
                 "--clients", str(len(shards)), "--learning-rate", str(LEARNING_RATE),
                 "--local-epochs", str(LOCAL_EPOCHS),
                 "--checkpoint-out", str(tmp_path / "global_checkpoint")]]
    commands += [[sys.executable, str(WORKER), "client", *common, "--data", str(tmp_path / f"shard{i}.npz"),
                  "--report", str(tmp_path / f"client{i}.json"), "--seed", str(i)] for i in range(len(shards))]
    processes, logs = [], []
    start = time.perf_counter()
    try:
        for i, command in enumerate(commands):
            logs.append(open(tmp_path / f"process{i}.log", "w"))
            processes.append(subprocess.Popen(command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + FEDERATION_TIMEOUT_S
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    seconds = time.perf_counter() - start
    outputs = "\n".join(f"--- process {i} ---\n" + (tmp_path / f"process{i}.log").read_text()[-3000:]
                        for i in range(len(commands)))
    assert all(p.returncode == 0 for p in processes), outputs

    server = json.loads((tmp_path / "server.json").read_text())
    clients = [json.loads((tmp_path / f"client{i}.json").read_text()) for i in range(len(shards))]
    print(f"federation: {seconds:.1f} s, central accuracy by round {server['centralized_accuracy']}")

    # no PyTorch anywhere in the federation; each client process built its client once
    assert not server["torch_imported"] and not any(c["torch_imported"] for c in clients)
    assert [c["clients_built"] for c in clients] == [1, 1, 1]
    # the shards are non-IID: most of a client's examples come from its own classes
    for i, group in enumerate(CLASS_GROUPS):
        labels = np.load(tmp_path / f"shard{i}.npz")["y"]
        assert np.isin(labels, group).mean() > 0.8

    # only the trainable parameters crossed the wire: 6 float32 arrays of the CNN's shapes,
    # no optimizer moments; metrics are the training loss and step count
    expected_shapes = [list(v.shape) for v in _initial_params().values()]
    assert len(server["payloads"]) == ROUNDS * len(shards)
    for payload in server["payloads"]:
        assert payload["shapes"] == expected_shapes
        assert payload["dtypes"] == ["float32"] * len(PARAM_NAMES)
        assert payload["metrics"] == ["loss", "steps"]
    assert sorted(p["num_examples"] for p in server["payloads"][:3]) == \
        sorted(int(0.85 * len(idx)) for idx in shards)
    assert server["rejected"] == []

    # central accuracy (round 0 = the initial parameters) rises and ends >= 90%
    accuracy = [a for _, a in server["centralized_accuracy"]]
    assert [r for r, _ in server["centralized_accuracy"]] == list(range(ROUNDS + 1))
    assert accuracy[0] < 0.5
    assert accuracy[-1] >= REQUIRED_ACCURACY
    assert accuracy[-1] > accuracy[1] > accuracy[0]
    assert len(server["distributed_accuracy"]) == ROUNDS

    # the written-back global checkpoint is the final global model: re-evaluate it independently
    final = dict(zip(PARAM_NAMES, fl.read_parameters(tmp_path / "global_checkpoint")))
    logits = _reference_logits(final, x_test)
    assert np.mean(np.argmax(logits, axis=1) == y_test) == pytest.approx(accuracy[-1], abs=1e-9)
