"""ClientApp: each SuperNode trains its shard (``shard<partition-id>.npz``) with the artifacts.

Flower runs every message in a fresh process; the client records that it ran without torch
in ``client<partition-id>.json``.
"""

import json
import pathlib
import sys

import numpy as np

from onnxtrain.integrations.flower import make_client_app


def load_data(context):
    data = pathlib.Path(context.run_config["data-dir"])
    partition = int(context.node_config["partition-id"])
    shard = np.load(data / f"shard{partition}.npz")
    (data / f"client{partition}.json").write_text(json.dumps({"torch_imported": "torch" in sys.modules}))
    return (shard["x"], shard["y"]), None


app = make_client_app(lambda context: context.run_config["artifacts"], load_data, accuracy_output="logits")
