"""One process of the federation in tests/integrations/test_flower.py.

``server``: Flower's server (``flwr.server.start_server``) with onnxtrain's FedAvg strategy and
central evaluation; records what every client sent. ``client``: a Flower client process
(``flwr.client.start_client``) training its shard with the on-device API. Each writes a JSON
report to ``--report``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _server(args) -> dict:
    import flwr

    from onnxtrain.integrations.flower import make_evaluate_fn, make_strategy
    from flwr.common import parameters_to_ndarrays

    test = np.load(args.data)
    evaluate = make_evaluate_fn(args.artifacts, (test["x"], test["y"]), accuracy_output="logits")
    strategy = make_strategy(args.artifacts, evaluate_fn=evaluate, min_clients=args.clients,
                             fit_config={"local_epochs": args.local_epochs, "learning_rate": args.learning_rate},
                             save_checkpoint_to=args.checkpoint_out)
    payloads = []  # what each client sent back in each round: the arrays' shapes and dtypes, the metric names
    aggregate_fit = strategy.aggregate_fit

    def recording_aggregate_fit(server_round, results, failures):
        for _, res in results:
            arrays = parameters_to_ndarrays(res.parameters)
            payloads.append({"round": server_round, "shapes": [list(a.shape) for a in arrays],
                             "dtypes": [str(a.dtype) for a in arrays], "metrics": sorted(res.metrics),
                             "num_examples": res.num_examples, "loss": res.metrics.get("loss")})
        return aggregate_fit(server_round, results, failures)

    strategy.aggregate_fit = recording_aggregate_fit
    history = flwr.server.start_server(server_address=args.address, strategy=strategy,
                                       config=flwr.server.ServerConfig(num_rounds=args.rounds))
    return {
        "centralized_accuracy": [[r, float(a)] for r, a in history.metrics_centralized.get("accuracy", [])],
        "centralized_loss": [[r, float(v)] for r, v in history.losses_centralized],
        "distributed_accuracy": [[r, float(a)] for r, a in history.metrics_distributed.get("accuracy", [])],
        "payloads": payloads,
        "rejected": [msg for _, msg in strategy.rejected],
    }


def _client(args) -> dict:
    import flwr

    from onnxtrain.integrations.flower import make_client_fn

    shard = np.load(args.data)
    calls = []

    def load_data(context):
        calls.append(context.node_id)
        return (shard["x"], shard["y"]), (shard["x_eval"], shard["y_eval"])

    client_fn = make_client_fn(args.artifacts, load_data, accuracy_output="logits", batch_size=32,
                               seed=args.seed)
    flwr.client.start_client(server_address=args.address, client_fn=client_fn, max_wait_time=60.0)
    return {"clients_built": len(calls), "classes": sorted(set(shard["y"].tolist()))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["server", "client"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--checkpoint-out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    report = _server(args) if args.role == "server" else _client(args)
    report["seconds"] = time.perf_counter() - start
    report["torch_imported"] = "torch" in sys.modules
    with open(args.report, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
