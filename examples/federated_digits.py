"""Federated learning of the digits CNN with Flower on onnxtrain's on-device API (no PyTorch).

    python examples/federated_digits.py --rounds 6 --clients 3 --out federated_out

Writes training artifacts for the CNN of ``onnxtrain demo``, splits scikit-learn's digits into
non-IID shards (each client holds mostly a few of the 10 classes), then starts Flower's server
in this process and one client process per shard (this script with ``--client``) on
127.0.0.1. Each round the clients train locally with the artifacts; the server averages the
parameters (FedAvg) and evaluates them on the held-out digits. At the end the global model
is exported as an inference model and checked with a plain ``onnxruntime.InferenceSession``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

# Fraction of each class's examples that go to the client owning the class; the rest is
# spread over the other clients (so the shards are non-IID but not disjoint).
OWN_FRACTION = 0.9


def non_iid_shards(labels: np.ndarray, clients: int, seed: int = 0) -> list[np.ndarray]:
    """Indices per client: client i owns the i-th group of classes."""
    rng = np.random.default_rng(seed)
    groups = np.array_split(np.arange(10), clients)
    owner_of = {int(c): i for i, group in enumerate(groups) for c in group}
    owners = np.array([owner_of[int(y)] if rng.random() < OWN_FRACTION or clients == 1
                       else int(rng.choice([i for i in range(clients) if i != owner_of[int(y)]]))
                       for y in labels])
    return [np.flatnonzero(owners == i) for i in range(clients)]


def prepare(out: pathlib.Path, clients: int, seed: int = 0) -> None:
    from onnxtrain import artifacts
    from onnxtrain.demo import build_cnn, load_digits

    artifacts.generate_artifacts(build_cnn(seed), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=out / "artifacts",
                                 additional_output_names=["logits"])
    x_train, y_train, x_test, y_test = load_digits(seed)
    np.savez(out / "test.npz", x=x_test, y=y_test)
    for i, idx in enumerate(non_iid_shards(y_train, clients, seed)):
        np.savez(out / f"shard{i}.npz", x=x_train[idx], y=y_train[idx])


def run_client(out: pathlib.Path, index: int, address: str) -> None:
    """One client process: its shard, the artifacts, Flower's client loop."""
    import flwr

    from onnxtrain.integrations.flower import make_client_fn

    shard = np.load(out / f"shard{index}.npz")
    client_fn = make_client_fn(out / "artifacts", lambda context: ((shard["x"], shard["y"]), None),
                               accuracy_output="logits", seed=index)
    flwr.client.start_client(server_address=address, client_fn=client_fn, max_wait_time=60.0)
    assert "torch" not in sys.modules  # the client ran on onnxruntime alone


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: str | os.PathLike = "federated_out", rounds: int = 6, clients: int = 3, local_epochs: int = 3,
         learning_rate: float = 1e-2) -> dict:
    """Run the federation; return central accuracy per round and the exported model's accuracy."""
    import flwr
    import onnxruntime as ort

    from onnxtrain.integrations.flower import make_evaluate_fn, make_strategy, save_global_parameters

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prepare(out, clients)
    test = np.load(out / "test.npz")
    strategy = make_strategy(out / "artifacts", min_clients=clients,
                             evaluate_fn=make_evaluate_fn(out / "artifacts", (test["x"], test["y"]),
                                                          accuracy_output="logits"),
                             fit_config={"local_epochs": local_epochs, "learning_rate": learning_rate},
                             fraction_evaluate=0.0)  # central evaluation only
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    workers = [subprocess.Popen([sys.executable, __file__, "--client", str(i), "--address", address,
                                 "--out", str(out)], env=env) for i in range(clients)]
    try:
        history = flwr.server.start_server(server_address=address, strategy=strategy,
                                           config=flwr.server.ServerConfig(num_rounds=rounds))
        for worker in workers:
            worker.wait(timeout=60)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    if any(w.returncode != 0 for w in workers):
        raise RuntimeError(f"client exit codes {[w.returncode for w in workers]}")

    model = out / "global_model.onnx"
    save_global_parameters(strategy.global_parameters, out / "artifacts", out / "global_checkpoint",
                           inference_model_path=model, output_names=["logits"])
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"image": test["x"]})
    accuracy = [float(a) for _, a in history.metrics_centralized["accuracy"]]
    return {"accuracy_by_round": accuracy, "inference_accuracy": float(np.mean(logits.argmax(1) == test["y"])),
            "inference_model": str(model)}


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="federated_out")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        run_client(pathlib.Path(args.out), args.client, args.address)
    else:
        result = main(args.out, args.rounds, args.clients)
        print("central test accuracy by round:", " ".join(f"{a:.3f}" for a in result["accuracy_by_round"]))
        print(f"exported {result['inference_model']}: accuracy {result['inference_accuracy']:.3f}")
