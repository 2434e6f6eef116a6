"""ServerApp: onnxtrain's FedAvg from the artifacts, central evaluation on the held-out digits.

Writes ``server.json`` (central accuracy per round, whether torch was imported) into the
run config's ``data-dir`` after every evaluation, and the global checkpoint after every round.
"""

import json
import pathlib
import sys

import numpy as np
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from onnxtrain.integrations.flower import make_evaluate_fn, make_strategy


def server_fn(context):
    config = context.run_config
    data = pathlib.Path(config["data-dir"])
    test = np.load(data / "test.npz")
    central = make_evaluate_fn(config["artifacts"], (test["x"], test["y"]), accuracy_output="logits")
    accuracy = []

    def evaluate(server_round, parameters, fit_config):
        loss, metrics = central(server_round, parameters, fit_config)
        accuracy.append([server_round, metrics["accuracy"]])
        report = {"accuracy": accuracy, "torch_imported": "torch" in sys.modules}
        (data / "server.json").write_text(json.dumps(report))
        return loss, metrics

    strategy = make_strategy(config["artifacts"], evaluate_fn=evaluate, min_clients=3, fraction_evaluate=0.0,
                             fit_config={"local_epochs": int(config["local-epochs"]),
                                         "learning_rate": float(config["learning-rate"])},
                             save_checkpoint_to=data / "global_checkpoint")
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=int(config["num-server-rounds"])))


app = ServerApp(server_fn=server_fn)
