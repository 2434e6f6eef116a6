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
from onnxtrain.api import CheckpointState  # noqa: E402
from onnxtrain.demo import build_cnn, load_digits  # noqa: E402
from onnxtrain.errors import CheckpointError, OnnxTrainError  # noqa: E402
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
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", PYTHONPATH=os.pathsep.join(
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
        assert payload["metrics"] == ["loss", "skipped_steps", "steps"]
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


# -- the client in process -----------------------------------------------------------------


def _client(artifacts, digits):
    x_train, y_train, x_test, y_test = digits
    return fl.OnnxTrainClient(artifacts, (x_train[:96], y_train[:96]), (x_test[:64], y_test[:64]),
                              accuracy_output="logits", learning_rate=LEARNING_RATE, batch_size=96)


@pytest.fixture()
def client(artifacts, digits):
    return _client(artifacts, digits)


@pytest.fixture(scope="module")
def shared_client(artifacts, digits):
    """For tests that must leave the client as they found it."""
    return _client(artifacts, digits)


def test_parameters_are_the_trainable_initializers_in_checkpoint_order(client, artifacts):
    reference = _initial_params()
    assert client.parameter_names == PARAM_NAMES == [s.name for s in fl.parameter_specs(artifacts)]
    for name, array in zip(PARAM_NAMES, client.get_parameters({})):
        np.testing.assert_array_equal(array, reference[name])
    for name, array in zip(PARAM_NAMES, fl.read_parameters(artifacts)):
        np.testing.assert_array_equal(array, reference[name])


def test_evaluate_matches_the_plain_model(client, digits):
    _, _, x_test, y_test = digits
    rng = np.random.default_rng(1)
    params = {n: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for n, v in _initial_params().items()}
    loss, count, metrics = client.evaluate([params[n] for n in PARAM_NAMES], {})
    logits = _reference_logits(params, x_test[:64])
    assert count == 64
    assert loss == pytest.approx(_cross_entropy(logits, y_test[:64]), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(np.mean(np.argmax(logits, axis=1) == y_test[:64]))


def test_fit_reports_the_loss_before_the_step_and_takes_an_adam_step(client, digits):
    x_train, y_train, _, _ = digits
    start = client.get_parameters({})
    new, count, metrics = client.fit(start, {"local_epochs": 1})
    assert count == 96 and metrics["steps"] == 1  # batch_size 96: one full-batch step
    reference = _reference_logits(dict(zip(PARAM_NAMES, start)), x_train[:96])
    assert metrics["loss"] == pytest.approx(_cross_entropy(reference, y_train[:96]), rel=1e-5)
    # the first AdamW step (upstream's default: transformers-style bias correction, eps 1e-6,
    # beta2 0.999) moves each element by lr * |g| / (|g| + eps / sqrt(1 - beta2)): at most lr,
    # and nearly lr wherever |g| is far above eps / sqrt(1 - beta2) ~ 3e-5
    for before, after in zip(start, new):
        delta = np.abs(after - before)
        assert delta.max() <= LEARNING_RATE * (1 + 1e-4)
        assert np.mean(delta > 0.9 * LEARNING_RATE) > 0.5
    for got, want in zip(client.get_parameters({}), new):
        np.testing.assert_array_equal(got, want)


def test_fit_config_overrides_and_training_lowers_the_loss(client):
    weights = client.get_parameters({})
    _, _, first = client.fit(weights, {"local_epochs": 1})
    weights, _, metrics = client.fit(client.get_parameters({}), {"local_epochs": 5, "batch_size": 32})
    assert metrics["steps"] == 5 * 3
    loss, _, _ = client.evaluate(weights, {})
    assert metrics["loss"] < first["loss"]
    assert np.isfinite(loss)


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: p[:-1], "received 5 arrays; expected 6"),
    (lambda p: p + [p[-1]], "received 7 arrays; expected 6"),
    (lambda p: [p[0].reshape(8, 9)] + p[1:], "'conv1.weight' has shape [8, 9]; expected [8, 1, 3, 3]"),
    (lambda p: p[:5] + [p[5].astype(np.float64)], "'fc.bias' has dtype float64; expected float32"),
    (lambda p: p[:5] + [np.full(10, np.nan, np.float32)], "'fc.bias' contains NaN"),
    (lambda p: p[:5] + [list(p[5])], "'fc.bias' is a list; expected a numpy array"),
])
def test_mismatching_parameters_raise_and_change_nothing(shared_client, corrupt, message):
    client = shared_client
    before = client.get_parameters({})
    received = [(v + 1.0).astype(np.float32) for v in before]
    with pytest.raises(fl.ParameterMismatchError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        client.fit(corrupt(received), {})
    assert isinstance(info.value, OnnxTrainError)
    assert "expected 6 arrays in this order: conv1.weight [8, 1, 3, 3] float32" in str(info.value)
    for got, want in zip(client.get_parameters({}), before):
        np.testing.assert_array_equal(got, want)


def test_parameter_names_sent_by_the_server_are_checked(client):
    before = client.get_parameters({})
    swapped = PARAM_NAMES[1::-1] + PARAM_NAMES[2:]
    with pytest.raises(fl.ParameterMismatchError, match=r"#0: 'conv1.bias' \(expected 'conv1.weight'\)"):
        client.evaluate(before, {fl.PARAMETER_NAMES_KEY: json.dumps(swapped)})
    with pytest.raises(fl.ParameterMismatchError, match=r"5 names for 6 parameters, mismatches \[\"#5: none "
                                                        r"\(expected 'fc.bias'\)\"\]"):
        client.evaluate(before, {fl.PARAMETER_NAMES_KEY: json.dumps(PARAM_NAMES[:-1])})
    with pytest.raises(fl.ParameterMismatchError, match="is 'conv1.weight,conv1.bias'; expected a JSON list"):
        client.evaluate(before, {fl.PARAMETER_NAMES_KEY: "conv1.weight,conv1.bias"})
    _, _, metrics = client.fit(before, {fl.PARAMETER_NAMES_KEY: json.dumps(PARAM_NAMES)})
    assert metrics["steps"] == 1


def test_client_rejects_data_that_does_not_fit_the_model(artifacts, digits):
    x_train, y_train, _, _ = digits
    with pytest.raises(onnxtrain.errors.InputMismatchError, match=r"takes \['image', 'labels'\]"):
        fl.OnnxTrainClient(artifacts, (x_train[:8],))
    with pytest.raises(onnxtrain.errors.InputMismatchError, match=r"row counts \[8, 7\]"):
        fl.OnnxTrainClient(artifacts, (x_train[:8], y_train[:7]))
    with pytest.raises(onnxtrain.errors.InputMismatchError, match="'probs' is not an eval-model output"):
        fl.OnnxTrainClient(artifacts, (x_train[:8], y_train[:8]), accuracy_output="probs")


def _fit_through_client_fn(client_fn, context, weights):
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays

    res = client_fn(context).fit(FitIns(ndarrays_to_parameters(weights), {"local_epochs": 1}))
    return parameters_to_ndarrays(res.parameters)


def test_client_fn_keeps_optimizer_state_in_the_context_across_processes(artifacts, digits):
    from flwr.app import Context, RecordDict

    x_train, y_train, _, _ = digits
    kwargs = dict(learning_rate=LEARNING_RATE, batch_size=128)  # one full-batch step per fit

    def load(context):
        return (x_train[:128], y_train[:128]), None

    def context(state):
        return Context(run_id=1, node_id=7, node_config={}, state=state, run_config={})

    start = fl.read_parameters(artifacts)
    # one long-lived process: two fits of the same client
    fn = fl.make_client_fn(artifacts, load, **kwargs)
    shared = context(RecordDict())
    kept = _fit_through_client_fn(fn, shared, _fit_through_client_fn(fn, shared, start))
    # a new process per message (a fresh client_fn) with the node's context.state carried over
    carried = RecordDict()
    first = _fit_through_client_fn(fl.make_client_fn(artifacts, load, **kwargs), context(carried), start)
    assert "onnxtrain.optimizer_state" in carried and carried["onnxtrain.optimizer"]["step"] == 1
    resumed = _fit_through_client_fn(fl.make_client_fn(artifacts, load, **kwargs), context(carried), first)
    # ... and without it: the second fit starts a fresh AdamW (its first step moves every weight by ~lr)
    fresh = _fit_through_client_fn(fl.make_client_fn(artifacts, load, **kwargs), context(RecordDict()), first)
    for k, r, f in zip(kept, resumed, fresh):
        np.testing.assert_allclose(r, k, rtol=1e-5, atol=1e-6)
    assert max(np.abs(f - k).max() for k, f in zip(kept, fresh)) > 0.1 * LEARNING_RATE


@pytest.fixture(scope="module")
def fp16_artifacts(tmp_path_factory) -> Path:
    from ..test_artifacts import regression_model

    folder = tmp_path_factory.mktemp("flower_fp16") / "artifacts"
    art.generate_artifacts(regression_model(), loss=art.LossType.MSELoss, optimizer=art.OptimType.AdamW,
                           artifact_directory=folder, precision="fp16", additional_output_names=["y"])
    return folder


def _regression_data(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (rows, 3)).astype(np.float32)
    return x, (np.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3]).astype(np.float32)


def test_a_rebuilt_client_goes_on_like_the_kept_one(fp16_artifacts):
    """Under the deployment engine every message rebuilds the client: the loss scale (fp16
    artifacts' checkpoint property) and the shuffling must carry over with the optimizer state."""
    from flwr.app import Context, RecordDict
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays

    data = _regression_data(40)
    kwargs = dict(learning_rate=1e-2, batch_size=8)  # five shuffled batches per fit

    def context(state):
        return Context(run_id=1, node_id=7, node_config={}, state=state, run_config={})

    def fit(client_fn, ctx, weights):
        res = client_fn(ctx).fit(FitIns(ndarrays_to_parameters(weights), {}))
        return parameters_to_ndarrays(res.parameters), res.metrics

    start = fl.read_parameters(fp16_artifacts)
    kept_fn, kept_ctx = fl.make_client_fn(fp16_artifacts, lambda c: (data, None), **kwargs), context(RecordDict())
    carried = RecordDict()
    kept, resumed = start, start
    for _ in range(3):
        kept, kept_metrics = fit(kept_fn, kept_ctx, kept)
        resumed, resumed_metrics = fit(fl.make_client_fn(fp16_artifacts, lambda c: (data, None), **kwargs),
                                       context(carried), resumed)
        assert resumed_metrics == kept_metrics
        for k, r in zip(kept, resumed):
            np.testing.assert_array_equal(r, k)
    # the first steps overflow at the initial loss scale: skipped, not counted as steps
    client = fl.OnnxTrainClient(fp16_artifacts, data, **kwargs)
    _, _, metrics = client.fit(start, {})
    assert metrics["skipped_steps"] > 0 and metrics["steps"] + metrics["skipped_steps"] == 5
    assert metrics["steps"] == client.optimizer_state().step


def test_running_statistics_are_federated(tmp_path):
    """BatchNorm's running statistics cross the wire with the weights and are averaged like them,
    so the server's model (central evaluation, checkpoint, inference model) uses trained ones."""
    from ..test_ort_format import batchnorm_cnn

    folder = tmp_path / "artifacts"
    art.generate_artifacts(batchnorm_cnn(), loss=art.LossType.CrossEntropyLoss, optimizer=art.OptimType.AdamW,
                           artifact_directory=folder, additional_output_names=["logits"],
                           frozen_params=["bn.running_mean", "bn.running_var"],
                           requires_grad=["conv.weight", "bn.weight", "bn.bias", "fc.weight"])
    names = ["conv.weight", "bn.weight", "bn.bias", "fc.weight", "bn.running_mean", "bn.running_var"]
    assert [s.name for s in fl.parameter_specs(folder)] == names
    assert [s.name for s in fl.parameter_specs(folder / "checkpoint")] == names
    rng = np.random.default_rng(0)
    shards = [(rng.normal(shift, 1.0, (rows, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, rows).astype(np.int64))
              for shift, rows in ((0.5, 24), (-1.0, 8))]
    test = (rng.normal(0.0, 1.0, (16, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int64))
    clients = [fl.OnnxTrainClient(folder, shard, test, batch_size=8, learning_rate=1e-2, accuracy_output="logits")
               for shard in shards]
    strategy = fl.make_strategy(folder, save_checkpoint_to=tmp_path / "global")
    start = fl.read_parameters(folder)
    results = [(None, _fit_res(*c.fit(start, strategy.on_fit_config_fn(1))[:2], 0.0)) for c in clients]
    local = [dict(zip(names, c.get_parameters({}))) for c in clients]
    assert not np.allclose(local[0]["bn.running_mean"], 0.0)
    aggregate = dict(zip(names, flwr.common.parameters_to_ndarrays(strategy.aggregate_fit(1, results, [])[0])))
    for name in names:
        np.testing.assert_allclose(aggregate[name], (24 * local[0][name] + 8 * local[1][name]) / 32, rtol=1e-5,
                                   atol=1e-7)
    global_params = [aggregate[n] for n in names]
    central_loss, central = fl.make_evaluate_fn(folder, test, accuracy_output="logits")(1, global_params, {})
    for client in clients:  # every side evaluates the same model
        loss, _, metrics = client.evaluate(global_params, strategy.on_evaluate_config_fn(1))
        assert loss == pytest.approx(central_loss, rel=1e-5) and metrics == pytest.approx(central)
    saved = CheckpointState.load_checkpoint(tmp_path / "global")
    np.testing.assert_array_equal(saved.parameters["bn.running_var"].data, aggregate["bn.running_var"])
    fl.save_global_parameters(global_params, folder, inference_model_path=tmp_path / "model.onnx",
                              output_names=["logits"])
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"image": test[0]})[0]
    assert _cross_entropy(logits, test[1]) == pytest.approx(central_loss, rel=1e-5)


def test_bad_local_settings_and_accuracy_outputs_are_refused(fp16_artifacts, shared_client):
    data = _regression_data(8)
    for kwargs, message in [({"batch_size": 0}, "batch_size is 0; expected an integer >= 1"),
                            ({"local_epochs": -1}, "local_epochs is -1; expected an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            fl.OnnxTrainClient(fp16_artifacts, data, **kwargs)
    before = shared_client.get_parameters({})
    moved = [v + 1.0 for v in before]
    for config, message in [({"local_epochs": 0}, "local_epochs is 0"), ({"local_epochs": 1.5}, "local_epochs is 1.5"),
                            ({"batch_size": "many"}, "batch_size is 'many'"),
                            ({"learning_rate": "fast"}, "learning_rate is 'fast'; expected a number")]:
        with pytest.raises(ValueError, match=message):
            shared_client.fit(moved, config)
    for got, want in zip(shared_client.get_parameters({}), before):  # refused before the parameters were set
        np.testing.assert_array_equal(got, want)
    # a regression output is not class scores: no accuracy to report
    client = fl.OnnxTrainClient(fp16_artifacts, data, accuracy_output="y")
    with pytest.raises(onnxtrain.errors.InputMismatchError, match=r"accuracy_output 'y' has shape \[8, 1\]"):
        client.evaluate(client.get_parameters({}), {})
    evaluate = fl.make_evaluate_fn(fp16_artifacts, data, accuracy_output="y")
    with pytest.raises(onnxtrain.errors.InputMismatchError, match="accuracy needs class scores"):
        evaluate(0, fl.read_parameters(fp16_artifacts), {})


# -- the server side in process ----------------------------------------------------------------


def test_central_evaluation_matches_the_plain_model(artifacts, digits):
    _, _, x_test, y_test = digits
    evaluate = fl.make_evaluate_fn(artifacts, (x_test, y_test), accuracy_output="logits")
    loss, metrics = evaluate(0, fl.read_parameters(artifacts), {})
    logits = _reference_logits(_initial_params(), x_test)
    assert loss == pytest.approx(_cross_entropy(logits, y_test), rel=1e-5)
    assert metrics == {"accuracy": pytest.approx(np.mean(np.argmax(logits, axis=1) == y_test))}
    with pytest.raises(fl.ParameterMismatchError, match="received 1 arrays"):
        evaluate(1, fl.read_parameters(artifacts)[:1], {})
    # int64 labels (numpy's and scikit-learn's default) for the int32 labels input, as onnxtrain.api takes them
    wide = fl.make_evaluate_fn(artifacts, (x_test, y_test.astype(np.int64)), accuracy_output="logits")
    assert wide(0, fl.read_parameters(artifacts), {}) == (loss, metrics)


def _fit_res(arrays, count, loss):
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), count, {"loss": loss, "steps": 1})


def test_strategy_averages_valid_results_rejects_others_and_saves(artifacts, tmp_path):
    saved = tmp_path / "global"
    strategy = fl.make_strategy(artifacts, fit_config={"local_epochs": 2}, save_checkpoint_to=saved, min_clients=3)
    initial = flwr.common.parameters_to_ndarrays(strategy.initialize_parameters(None))
    for got, want in zip(strategy.global_parameters, initial):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(initial, _initial_params().values()):
        np.testing.assert_array_equal(got, want)
    assert strategy.on_fit_config_fn(1) == {"local_epochs": 2, fl.PARAMETER_NAMES_KEY: json.dumps(PARAM_NAMES)}
    assert strategy.on_evaluate_config_fn(1) == {fl.PARAMETER_NAMES_KEY: json.dumps(PARAM_NAMES)}
    a = [np.full_like(v, 1.0) for v in initial]
    b = [np.full_like(v, 4.0) for v in initial]
    bad = [np.zeros(3, np.float32)] + initial[1:]
    results = [(None, _fit_res(a, 10, 1.0)), (None, _fit_res(b, 20, 4.0)), (None, _fit_res(bad, 70, 0.0))]
    parameters, metrics = strategy.aggregate_fit(1, results, [])
    expected = (10 * 1.0 + 20 * 4.0) / 30  # FedAvg: example-weighted mean of the valid results
    for array in flwr.common.parameters_to_ndarrays(parameters):
        np.testing.assert_allclose(array, expected, rtol=1e-6)
    assert metrics == {"loss": pytest.approx(expected), "steps": 1.0}
    assert len(strategy.rejected) == 1 and "'conv1.weight' has shape [3]" in strategy.rejected[0][1]
    for array in fl.read_parameters(saved):
        np.testing.assert_allclose(array, expected, rtol=1e-6)


def test_save_global_parameters_writes_a_runnable_inference_model(artifacts, digits, tmp_path):
    _, _, x_test, _ = digits
    rng = np.random.default_rng(2)
    params = {n: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for n, v in _initial_params().items()}
    fl.save_global_parameters([params[n] for n in PARAM_NAMES], artifacts, tmp_path / "ckpt",
                              inference_model_path=tmp_path / "model.onnx", output_names=["logits"])
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["image"]
    np.testing.assert_allclose(session.run(None, {"image": x_test})[0], _reference_logits(params, x_test),
                               rtol=1e-5, atol=1e-5)
    for name, array in zip(PARAM_NAMES, fl.read_parameters(tmp_path / "ckpt")):
        np.testing.assert_array_equal(array, params[name])
    with pytest.raises(fl.ParameterMismatchError):
        fl.save_global_parameters([params[n] for n in PARAM_NAMES[:-1]], artifacts, tmp_path / "other")
    # a failed call writes nothing: every argument is checked before the checkpoint is written
    arrays = [params[n] for n in PARAM_NAMES]
    with pytest.raises(ValueError, match="needs output_names"):
        fl.save_global_parameters(arrays, artifacts, tmp_path / "other", inference_model_path=tmp_path / "m.onnx")
    with pytest.raises(OnnxTrainError, match="probs"):
        fl.save_global_parameters(arrays, artifacts, tmp_path / "other", inference_model_path=tmp_path / "m.onnx",
                                  output_names=["probs"])
    with pytest.raises(CheckpointError, match="needs the artifact folder"):
        fl.save_global_parameters(arrays, tmp_path / "ckpt", tmp_path / "other", inference_model_path=tmp_path / "m.onnx",
                                  output_names=["logits"])
    assert not (tmp_path / "other").exists()


def test_docstring_examples(artifacts, digits, tmp_path):
    import doctest

    x_train, y_train, x_test, y_test = digits
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(fl, extraglobs={"artifacts": str(artifacts), "x": x_train[:64], "y": y_train[:64],
                                        "x_test": x_test, "y_test": y_test, "out": str(tmp_path), "flwr": flwr})
    assert sum(len(t.examples) for t in tests) > 10
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_importing_onnxtrain_does_not_import_flwr():
    code = "import sys, onnxtrain, onnxtrain.api, onnxtrain.integrations; print('flwr' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(Path(onnxtrain.__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_example_federated_digits(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "federated_digits.py"
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", PYTHONPATH=os.pathsep.join(
        [str(Path(onnxtrain.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(example), "--out", str(tmp_path), "--rounds", "6"], env=env,
                         capture_output=True, text=True, timeout=FEDERATION_TIMEOUT_S)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(s for s in out.stdout.splitlines() if s.startswith("central test accuracy by round:"))
    accuracy = [float(a) for a in line.split(":")[1].split()]
    assert len(accuracy) == 7 and accuracy[0] < 0.5 and accuracy[-1] >= REQUIRED_ACCURACY
    _, _, x_test, y_test = load_digits(0)
    session = ort.InferenceSession(str(tmp_path / "global_model.onnx"), providers=["CPUExecutionProvider"])
    exported = np.mean(session.run(None, {"image": x_test})[0].argmax(1) == y_test)
    assert exported == pytest.approx(accuracy[-1], abs=1e-3)


def _prepare_federation_data(folder: Path, digits) -> list[np.ndarray]:
    x_train, y_train, x_test, y_test = digits
    np.savez(folder / "test.npz", x=x_test, y=y_test)
    shards = _non_iid_shards(y_train)
    for i, idx in enumerate(shards):
        np.savez(folder / f"shard{i}.npz", x=x_train[idx], y=y_train[idx])
    return shards


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} (process exit code {process.poll()})")


@pytest.mark.slow
def test_deployment_engine_superlink_supernodes_flwr_run(artifacts, digits, tmp_path):
    """Flower's deployment engine: flower-superlink, 3 flower-supernode processes, `flwr run`
    of the Flower App in flower_app/ (make_client_app + make_strategy). Every ClientApp call
    is a fresh process, so this also exercises resuming the optimizer from context.state."""
    shards = _prepare_federation_data(tmp_path, digits)
    home = tmp_path / "flwr_home"
    home.mkdir()
    link_port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", PYTHONPATH=os.pathsep.join(
        [str(Path(onnxtrain.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    bin_dir = Path(sys.executable).parent
    commands = [[str(bin_dir / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                 "--port", str(link_port)]]
    commands += [[str(bin_dir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                  "--port", str(_free_port()), "--node-config", f"partition-id={i} num-partitions={len(shards)}"]
                 for i in range(len(shards))]
    if not all(Path(c[0]).exists() for c in commands):
        pytest.skip("flower-superlink / flower-supernode are not installed beside this python")
    processes, logs = [], []
    try:
        for i, command in enumerate(commands):
            logs.append(open(tmp_path / f"deploy{i}.log", "w"))
            # own session: killing the group also ends the flwr-serverapp / flwr-clientapp children
            processes.append(subprocess.Popen(command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                              start_new_session=True))
        _wait_for_port(link_port, processes[0])
        run_config = f'artifacts="{artifacts}" data-dir="{tmp_path}"'
        run = subprocess.run([str(bin_dir / "flwr"), "run", str(Path(__file__).with_name("flower_app")), "local",
                              "--run-config", run_config, "--stream"],
                             env=env, capture_output=True, text=True, timeout=480)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, 9)
            process.wait()
        for log in logs:
            log.close()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Run finished 3 round(s)" in run.stdout, run.stdout[-4000:]
    report = json.loads((tmp_path / "server.json").read_text())
    accuracy = [a for _, a in report["accuracy"]]
    print(f"deployment engine: central accuracy by round {report['accuracy']}")
    assert [r for r, _ in report["accuracy"]] == [0, 1, 2, 3]
    assert accuracy[0] < 0.5 and accuracy[-1] >= REQUIRED_ACCURACY and accuracy[-1] > accuracy[1]
    assert not report["torch_imported"]
    assert not any(json.loads((tmp_path / f"client{i}.json").read_text())["torch_imported"] for i in range(3))
    final = dict(zip(PARAM_NAMES, fl.read_parameters(tmp_path / "global_checkpoint")))
    logits = _reference_logits(final, digits[2])
    assert np.mean(np.argmax(logits, axis=1) == digits[3]) == pytest.approx(accuracy[-1], abs=1e-9)
