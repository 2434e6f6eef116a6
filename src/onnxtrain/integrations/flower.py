"""Flower federated learning on onnxtrain's on-device training API.

Clients train with the training artifacts (:class:`~onnxtrain.api.CheckpointState`,
:class:`~onnxtrain.api.Module`, :class:`~onnxtrain.api.Optimizer`) on stock onnxruntime, so a
client process needs no PyTorch. What crosses the wire is the list of trainable parameters
and running statistics as numpy arrays, in the checkpoint's order (:func:`parameter_specs`);
gradients, optimizer state and data stay on the client. The server runs Flower's FedAvg
started from the artifacts' checkpoint (:func:`make_strategy`), optionally with central
evaluation of the eval model in a plain ``onnxruntime.InferenceSession``
(:func:`make_evaluate_fn`), and writes the global parameters back into a checkpoint or an
inference model (:func:`save_global_parameters`).

Importing this module imports ``flwr`` (``pip install 'onnxtrain[flower]'``); importing
``onnxtrain`` does not.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxtrain import checkpoint as ckpt
from onnxtrain.errors import CheckpointError, InputMismatchError
from onnxtrain.ir import io
from onnxtrain.api.module import TRAINING_METADATA_KEY
from onnxtrain.runtime.inputs import as_input_array
from onnxtrain.runtime.session import input_specs

try:
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg
except ImportError as exc:  # pragma: no cover - exercised only without flwr
    raise ImportError("onnxtrain.integrations.flower needs Flower: pip install 'onnxtrain[flower]'") from exc

logger = logging.getLogger(__name__)

# Config key under which the server sends the parameter names with every fit/evaluate
# instruction, so that a client can check the arrays are in the order it expects.
PARAMETER_NAMES_KEY = "onnxtrain.parameter_names"
# Rows per eval-model run (client and central evaluation): bounds activation memory of one
# run; the digits test set (360 rows) runs in one go.
EVAL_BATCH_SIZE = 1024
# Keys of the client's local records in Flower's ``context.state`` (never sent to the server):
# the optimizer state tensors; its step count and learning rate; the checkpoint properties and
# the state of the local shuffling.
OPTIMIZER_ARRAYS_KEY = "onnxtrain.optimizer_state"
OPTIMIZER_CONFIG_KEY = "onnxtrain.optimizer"
CLIENT_CONFIG_KEY = "onnxtrain.client"


class ParameterMismatchError(InputMismatchError):
    """Parameters received from the federation do not match the model's federated parameters.

    ``problems`` lists every mismatch found (count, names, shapes, dtypes, non-finite values).
    """

    def __init__(self, problems: Sequence[str], specs: Sequence[ParameterSpec]):
        self.problems = list(problems)
        expected = ", ".join(f"{s.name} {list(s.shape)} {s.dtype}" for s in specs)
        super().__init__("federated parameters do not match the model:\n"
                         + "\n".join(f"  {p}" for p in self.problems)
                         + f"\nexpected {len(specs)} arrays in this order: {expected}")


@dataclass(frozen=True)
class ParameterSpec:
    """Name, shape and dtype of one trainable parameter on the wire."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def _checkpoint_path(source: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(source)
    return path / "checkpoint" if path.is_dir() else path


def _running_statistics(source: str | os.PathLike) -> set[str]:
    """The frozen parameters that the training model updates as it trains (BatchNormalization's
    running mean and variance), from the artifact folder's training model; none when
    ``source`` is a checkpoint file outside an artifact folder."""
    path = pathlib.Path(source)
    training_model = (path if path.is_dir() else path.parent) / "training_model.onnx"
    if not training_model.exists():
        return set()
    text = io.metadata(training_model).get(TRAINING_METADATA_KEY)
    try:
        meta = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{str(training_model)!r}: metadata {TRAINING_METADATA_KEY!r} is not JSON: {exc}") from exc
    return set(meta.get("buffer_updates", {}).values()) if isinstance(meta, dict) else set()


def _federated(parameters: Iterable, statistics: set[str], where: str) -> list:
    """Of ``parameters`` (checkpoint records, or a state's parameters: anything with ``name``,
    ``requires_grad``, ``dtype``), those that cross the wire: the trainable ones and the
    floating-point running statistics among ``statistics``."""
    chosen = [p for p in parameters
              if p.requires_grad or (p.name in statistics and np.issubdtype(np.dtype(p.dtype), np.floating))]
    if not any(p.requires_grad for p in chosen):
        raise CheckpointError(f"{where} holds no trainable parameters: there is nothing to federate")
    return chosen


def _federated_records(source: str | os.PathLike, artifacts: str | os.PathLike | None = None
                       ) -> tuple[ckpt.CheckpointData, list[ckpt.ParameterRecord]]:
    """``source``'s checkpoint, read once, and its records that cross the wire; the running
    statistics are those of the training model in ``artifacts`` (default: next to the checkpoint)."""
    data = ckpt.read_checkpoint(_checkpoint_path(source))
    statistics = _running_statistics(source if artifacts is None else artifacts)
    return data, _federated(data.parameters.values(), statistics, f"checkpoint {str(_checkpoint_path(source))!r}")


def _specs(parameters: Iterable) -> list[ParameterSpec]:
    return [ParameterSpec(p.name, tuple(p.shape), np.dtype(p.dtype)) for p in parameters]


def _values(records: Sequence[ckpt.ParameterRecord], source: str | os.PathLike) -> list[np.ndarray]:
    missing = [r.name for r in records if r.value is None]
    if missing:
        raise CheckpointError(f"checkpoint {str(_checkpoint_path(source))!r} is nominal (no values for "
                              f"{missing[:8]}); federated training needs initial parameter values")
    return [np.ascontiguousarray(r.value) for r in records]


def parameter_specs(source: str | os.PathLike) -> list[ParameterSpec]:
    """The wire format: the parameters a federation averages, in checkpoint order.

    These are the trainable parameters and, given the artifact folder (or a checkpoint file
    in it), the running statistics its training model updates (BatchNorm's running mean and
    variance: averaged like the weights, as when a PyTorch client sends its ``state_dict``).
    Other frozen parameters stay on each side as the checkpoint has them.

    Example (``artifacts`` is a folder written by ``generate_artifacts``):
        >>> [s.name for s in parameter_specs(artifacts)][:2]
        ['conv1.weight', 'conv1.bias']
    """
    return _specs(_federated_records(source)[1])


def read_parameters(source: str | os.PathLike) -> list[np.ndarray]:
    """The values of the federated parameters (:func:`parameter_specs`) of a checkpoint or
    artifact folder, in wire order."""
    return _values(_federated_records(source)[1], source)


def check_parameters(specs: Sequence[ParameterSpec], arrays, names: Sequence[str] | None = None) -> list[np.ndarray]:
    """Check received arrays against ``specs`` (count, optional names, shapes, dtypes, finite);
    return them as a list, or raise :class:`ParameterMismatchError` listing every problem."""
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
        raise ParameterMismatchError([f"received a {type(arrays).__name__}; expected a list of arrays"], specs)
    arrays = list(arrays)
    problems = []
    expected_names = [s.name for s in specs]
    if names is not None and list(names) != expected_names:
        names = list(names)
        wrong = [f"#{i}: {got!r} (expected {want!r})" for i, (got, want) in
                 enumerate(zip(names, expected_names)) if got != want]
        wrong += [f"#{i}: {got!r} (expected none)" for i, got in enumerate(names[len(specs):], len(specs))]
        wrong += [f"#{i}: none (expected {want!r})" for i, want in enumerate(expected_names[len(names):], len(names))]
        more = f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""
        problems.append(f"parameter names differ: {len(names)} names for {len(specs)} parameters, "
                        f"mismatches {wrong[:8]}{more}")
    if len(arrays) != len(specs):
        problems.append(f"received {len(arrays)} arrays; expected {len(specs)}")
    for i, (spec, array) in enumerate(zip(specs, arrays)):
        if not isinstance(array, np.ndarray):
            problems.append(f"#{i} {spec.name!r} is a {type(array).__name__}; expected a numpy array")
            continue
        if tuple(array.shape) != spec.shape:
            problems.append(f"#{i} {spec.name!r} has shape {list(array.shape)}; expected {list(spec.shape)}")
        if array.dtype != spec.dtype:
            problems.append(f"#{i} {spec.name!r} has dtype {array.dtype}; expected {spec.dtype}")
        elif np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
            problems.append(f"#{i} {spec.name!r} contains NaN or infinity")
    if problems:
        raise ParameterMismatchError(problems, specs)
    return arrays


def _names_from_config(config: Mapping | None, specs: Sequence[ParameterSpec]) -> list[str] | None:
    text = (config or {}).get(PARAMETER_NAMES_KEY)
    if text is None:
        return None
    try:
        names = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        names = exc
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        problem = f"config {PARAMETER_NAMES_KEY!r} is {text!r}; expected a JSON list of parameter names"
        raise ParameterMismatchError([problem], specs)
    return names


def _rate_setting(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"learning_rate is {value!r}; expected a number") from None


def _count_setting(name: str, value, minimum: int = 1) -> int:
    """A local training setting (``local_epochs``, ``batch_size``) as an int, or a clear error."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not float(value).is_integer() or value < minimum:
        raise ValueError(f"{name} is {value!r}; expected an integer >= {minimum}")
    return int(value)


def _batches(count: int, batch_size: int, order: np.ndarray | None = None):
    for start in range(0, count, batch_size):
        yield slice(start, start + batch_size) if order is None else order[start:start + batch_size]


def _as_data(data: Sequence[np.ndarray], input_names: Sequence[str], what: str) -> list[np.ndarray]:
    arrays = [np.asarray(a) for a in data]
    if len(arrays) != len(input_names):
        raise InputMismatchError(f"{what} has {len(arrays)} arrays; the model takes {list(input_names)}")
    rows = {len(a) for a in arrays}
    if len(rows) != 1 or 0 in rows:
        raise InputMismatchError(f"{what} arrays {list(input_names)} have row counts "
                                 f"{[len(a) for a in arrays]}; expected one non-zero count")
    return arrays


def _accuracy(scores: np.ndarray, labels: np.ndarray, output: str) -> int:
    """How many rows' highest class score is at their label."""
    if scores.ndim < 2 or scores.shape[-1] < 2 or scores.shape[:-1] != labels.shape \
            or not np.issubdtype(labels.dtype, np.integer):
        raise InputMismatchError(
            f"accuracy_output {output!r} has shape {list(scores.shape)} and the labels {list(labels.shape)} "
            f"{labels.dtype}: accuracy needs class scores [..., classes >= 2] and integer class labels of the "
            f"scores' shape without the class axis")
    return int(np.sum(np.argmax(scores, axis=-1) == labels))


class OnnxTrainClient(NumPyClient):
    """A Flower ``NumPyClient`` that trains training artifacts with ``onnxtrain.api``.

    Parameters go over the wire as the trainable parameters and running statistics in
    checkpoint order (:attr:`parameter_names`); the optimizer state stays in the client
    across rounds.
    A received parameter list that does not match raises :class:`ParameterMismatchError`
    and leaves the client's parameters as they were.

    Args:
        artifact_dir: folder with ``training_model.onnx``, ``eval_model.onnx``,
            ``optimizer_model.onnx`` and ``checkpoint`` (from ``generate_artifacts``).
        train_data: arrays in the order of the training model's inputs (model inputs, then
            loss inputs), e.g. ``(images, labels)``; rows are examples.
        eval_data: arrays for :meth:`evaluate`, same layout (``None``: evaluate on ``train_data``).
        local_epochs, batch_size, learning_rate: local training per ``fit`` (a server's fit
            config may override them under the same names).
        accuracy_output: an eval-model output of class scores; ``evaluate`` then reports
            ``accuracy`` against the last data array (the labels).
        seed: seed of the local shuffling.
        device: where the parameters live (``"cpu"``, ``"cuda"``).
        optimizer_state: optimizer state to resume from (as :meth:`optimizer_state` returns).
        properties: checkpoint properties to resume from (fp16 artifacts keep their loss scale there).

    Example (``artifacts`` as from ``generate_artifacts`` for the digits CNN, ``x``, ``y`` a shard):
        >>> client = OnnxTrainClient(artifacts, (x, y), accuracy_output="logits", learning_rate=3e-3)
        >>> weights = client.get_parameters({})
        >>> new_weights, count, metrics = client.fit(weights, {"local_epochs": 1})
        >>> loss, count, metrics = client.evaluate(new_weights, {})
        >>> sorted(metrics)
        ['accuracy']
    """

    def __init__(self, artifact_dir: str | os.PathLike, train_data: Sequence[np.ndarray],
                 eval_data: Sequence[np.ndarray] | None = None, *, local_epochs: int = 1, batch_size: int = 32,
                 learning_rate: float = 1e-3, accuracy_output: str | None = None, seed: int = 0,
                 device: str = "cpu", optimizer_state: ckpt.OptimizerRecord | None = None,
                 properties: Mapping | None = None) -> None:
        from onnxtrain.api import CheckpointState, Module, Optimizer

        self.local_epochs = _count_setting("local_epochs", local_epochs)
        self.batch_size = _count_setting("batch_size", batch_size)
        self.learning_rate = learning_rate
        folder = pathlib.Path(artifact_dir)
        data = ckpt.read_checkpoint(folder / "checkpoint")
        if optimizer_state is not None:  # resume: the Optimizer adopts these instead of zeros
            data.optimizer = optimizer_state
        data.properties.update(properties or {})  # resume: e.g. the fp16 artifacts' loss scale
        self._state = CheckpointState(data)
        self._module = Module(folder / "training_model.onnx", self._state, folder / "eval_model.onnx", device=device)
        self._optimizer = Optimizer(folder / "optimizer_model.onnx", self._module)
        # the running statistics are those the training model writes back (its Module knows them)
        self._specs = _specs(_federated(self._state.parameters.values(),
                                        set(self._module._train.buffer_updates.values()),  # noqa: SLF001
                                        f"checkpoint {str(folder / 'checkpoint')!r}"))
        inputs = self._module.input_names()
        self._train_data = _as_data(train_data, inputs, "train_data")
        self._eval_data = self._train_data if eval_data is None else _as_data(eval_data, inputs, "eval_data")
        if accuracy_output is not None and accuracy_output not in self._module.eval().output_names():
            raise InputMismatchError(f"accuracy_output {accuracy_output!r} is not an eval-model output; "
                                     f"outputs are {self._module.output_names()}")
        self._module.train()
        self._accuracy_output = accuracy_output
        self._rng = np.random.default_rng(seed)
        self._local_records = None  # Flower's context.state, when built by make_client_fn

    @property
    def parameter_names(self) -> list[str]:
        """Names of the arrays that :meth:`get_parameters` returns and :meth:`set_parameters` takes
        (:func:`parameter_specs`: trainable parameters and running statistics)."""
        return [s.name for s in self._specs]

    @property
    def num_train_examples(self) -> int:
        return len(self._train_data[0])

    def optimizer_state(self) -> ckpt.OptimizerRecord:
        """A copy of the local optimizer state: step count, learning rate, state tensors."""
        return self._state._to_data(include_optimizer_state=True).optimizer  # noqa: SLF001 (same package)

    def get_parameters(self, config: Mapping | None = None) -> list[np.ndarray]:
        """The federated parameters, copied, in :attr:`parameter_names` order."""
        return [self._state.parameters[s.name].data for s in self._specs]

    def set_parameters(self, parameters: Sequence[np.ndarray], names: Sequence[str] | None = None) -> None:
        """Check every array first, then copy all of them into the parameters (all or nothing)."""
        arrays = check_parameters(self._specs, parameters, names)
        for spec, array in zip(self._specs, arrays):
            self._state.parameters[spec.name] = array

    def fit(self, parameters, config):
        """Load the global parameters, train ``local_epochs`` on the local shard, return
        ``(parameters, number of examples, {"loss": mean training loss, "steps": optimizer steps
        taken, "skipped_steps": steps skipped for non-finite gradients (fp16 artifacts)})``."""
        config = config or {}
        epochs = _count_setting("local_epochs", config.get("local_epochs", self.local_epochs))
        batch_size = _count_setting("batch_size", config.get("batch_size", self.batch_size))
        learning_rate = _rate_setting(config.get("learning_rate", self.learning_rate))
        self.set_parameters(parameters, _names_from_config(config, self._specs))
        self._optimizer.set_learning_rate(learning_rate)
        self._module.train()
        count, loss_sum, steps, skipped = self.num_train_examples, 0.0, 0, 0
        for _ in range(epochs):
            for idx in _batches(count, batch_size, self._rng.permutation(count)):
                loss = self._module(*(a[idx] for a in self._train_data))
                loss = loss[0] if isinstance(loss, tuple) else loss
                self._optimizer.step()
                self._module.lazy_reset_grad()
                loss_sum += float(loss) * len(idx)
                skipped += bool(self._optimizer.last_step_skipped)
                steps += 1
        if self._local_records is not None:
            _store_local_state(self._local_records, self)
        metrics = {"loss": loss_sum / (count * epochs), "steps": steps - skipped, "skipped_steps": skipped}
        return self.get_parameters(), count, metrics

    def evaluate(self, parameters, config):
        """Load the parameters, run the eval model on the local eval data, return
        ``(mean loss, number of examples, metrics)`` (``accuracy`` with ``accuracy_output``)."""
        self.set_parameters(parameters, _names_from_config(config, self._specs))
        try:
            loss, correct = self._evaluate()
        finally:
            self._module.train()
        count = len(self._eval_data[0])
        return loss, count, {} if correct is None else {"accuracy": correct / count}

    def _evaluate(self) -> tuple[float, int | None]:
        module = self._module.eval()
        names = module.output_names()
        count, loss_sum, correct = len(self._eval_data[0]), 0.0, 0
        for idx in _batches(count, EVAL_BATCH_SIZE):
            outputs = module(*(a[idx] for a in self._eval_data))
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            rows = len(self._eval_data[0][idx])
            loss_sum += float(outputs[0]) * rows
            if self._accuracy_output is not None:
                correct += _accuracy(outputs[names.index(self._accuracy_output)], self._eval_data[-1][idx],
                                     self._accuracy_output)
        return loss_sum / count, None if self._accuracy_output is None else correct


# load_data(context) -> (train_data, eval_data); artifact_dir(context) -> folder
LoadData = Callable[[object], tuple[Sequence[np.ndarray], Sequence[np.ndarray] | None]]
ArtifactDir = str | os.PathLike | Callable[[object], str | os.PathLike]


def make_client_fn(artifact_dir: ArtifactDir, load_data: LoadData, **client_kwargs):
    """A Flower ``client_fn(context) -> Client`` building an :class:`OnnxTrainClient`.

    ``artifact_dir`` is a folder, or a function of the Flower ``Context`` returning one (e.g.
    from ``context.run_config``). ``load_data(context)`` returns ``(train_data, eval_data)``
    for this node (e.g. by ``context.node_config["partition-id"]``). Flower calls
    ``client_fn`` for every message: within one process the client is kept per run and node;
    after every ``fit`` the optimizer state, the checkpoint properties (fp16 artifacts' loss
    scale) and the shuffling state are also stored in ``context.state`` (local to the node,
    never sent), so a client rebuilt in a new process (Flower's deployment engine runs each
    message in one) goes on as the kept client would. ``client_kwargs`` go to :class:`OnnxTrainClient`.

    Example:
        >>> client_fn = make_client_fn(artifacts, lambda context: ((x, y), None), learning_rate=3e-3)
        >>> flwr.client.start_client(server_address="127.0.0.1:8080", client_fn=client_fn)  # doctest: +SKIP
    """
    clients: dict[tuple[int, int], OnnxTrainClient] = {}

    def client_fn(context):
        key = (context.run_id, context.node_id)
        if key not in clients:
            train_data, eval_data = load_data(context)
            folder = artifact_dir(context) if callable(artifact_dir) else artifact_dir
            clients[key] = _restore_local_state(context.state, folder, train_data, eval_data, client_kwargs)
        clients[key]._local_records = context.state
        return clients[key].to_client()

    return client_fn


def _store_local_state(records, client: OnnxTrainClient) -> None:
    """Keep what a client rebuilt in a new process needs to go on as if it had stayed: the
    optimizer state, the checkpoint properties (fp16 artifacts' loss scale) and the shuffling."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    state = client.optimizer_state()
    if state is not None:
        arrays = {f"{p}\n{s}": Array.from_numpy_ndarray(np.ascontiguousarray(v))
                  for p, per in state.values.items() for s, v in per.items()}
        records[OPTIMIZER_ARRAYS_KEY] = ArrayRecord(arrays)
        records[OPTIMIZER_CONFIG_KEY] = ConfigRecord({"step": int(state.step),
                                                      "learning_rate": float(state.learning_rate),
                                                      "states": list(state.states)})
    records[CLIENT_CONFIG_KEY] = ConfigRecord({
        "properties": json.dumps(dict(client._state.properties.items())),  # noqa: SLF001 (same module)
        "shuffle": json.dumps(client._rng.bit_generator.state)})  # noqa: SLF001


def _restore_local_state(records, folder, train_data, eval_data, client_kwargs) -> OnnxTrainClient:
    optimizer = None
    if OPTIMIZER_ARRAYS_KEY in records and OPTIMIZER_CONFIG_KEY in records:
        config = records[OPTIMIZER_CONFIG_KEY]
        values: dict[str, dict[str, np.ndarray]] = {}
        for key, array in records[OPTIMIZER_ARRAYS_KEY].items():
            param, state = key.split("\n")
            values.setdefault(param, {})[state] = array.numpy()
        optimizer = ckpt.OptimizerRecord(int(config["step"]), float(config["learning_rate"]),
                                         list(config["states"]), values)
    local = records[CLIENT_CONFIG_KEY] if CLIENT_CONFIG_KEY in records else {}
    properties = json.loads(local["properties"]) if "properties" in local else None
    client = OnnxTrainClient(folder, train_data, eval_data, **client_kwargs, optimizer_state=optimizer,
                             properties=properties)
    if "shuffle" in local:
        client._rng.bit_generator.state = json.loads(local["shuffle"])  # noqa: SLF001 (same module)
    return client


def make_client_app(artifact_dir: ArtifactDir, load_data: LoadData, **client_kwargs) -> ClientApp:
    """A Flower ``ClientApp`` whose clients are :class:`OnnxTrainClient` (see :func:`make_client_fn`).

    Example (in the app's ``client_app.py``, run by ``flower-supernode``):
        >>> app = make_client_app(artifacts, lambda context: ((x, y), None), accuracy_output="logits")
        >>> type(app).__name__
        'ClientApp'
    """
    return ClientApp(client_fn=make_client_fn(artifact_dir, load_data, **client_kwargs))


# -- server side ------------------------------------------------------------------------


class _CentralEvaluator:
    """The eval model in an InferenceSession, with parameters fed as graph inputs."""

    def __init__(self, artifact_dir: pathlib.Path, data: Sequence[np.ndarray], accuracy_output: str | None,
                 checkpoint: str | os.PathLike | None, providers: list | None):
        import onnxruntime as ort

        source = checkpoint if checkpoint is not None else artifact_dir
        stored, federated = _federated_records(source, artifact_dir)
        records = stored.parameters
        self.specs = _specs(federated)
        names = {s.name for s in self.specs}
        self.frozen = {n: r.value for n, r in records.items() if n not in names}
        self.session = ort.InferenceSession(str(artifact_dir / "eval_model.onnx"),
                                            providers=providers or ["CPUExecutionProvider"])
        self.data_names = [i.name for i in self.session.get_inputs() if i.name not in records]
        # the eval model's element types, integers converted where they fit (int64 labels for
        # int32 ones), as onnxtrain.api's Module takes them
        specs = {spec.name: spec for spec in input_specs(self.session)}
        self.data = [as_input_array(specs[name], array)
                     for name, array in zip(self.data_names, _as_data(data, self.data_names, "evaluation data"))]
        self.outputs = [o.name for o in self.session.get_outputs()]
        if accuracy_output is not None and accuracy_output not in self.outputs:
            raise InputMismatchError(f"accuracy_output {accuracy_output!r} is not an eval-model output; "
                                     f"outputs are {self.outputs}")
        self.accuracy_output = accuracy_output

    def __call__(self, server_round: int, parameters, config) -> tuple[float, dict]:
        arrays = check_parameters(self.specs, parameters)
        feeds = {**self.frozen, **{s.name: a for s, a in zip(self.specs, arrays)}}
        count, loss_sum, correct = len(self.data[0]), 0.0, 0
        for idx in _batches(count, EVAL_BATCH_SIZE):
            batch = {n: a[idx] for n, a in zip(self.data_names, self.data)}
            results = dict(zip(self.outputs, self.session.run(None, {**feeds, **batch})))
            loss_sum += float(results[self.outputs[0]]) * len(self.data[0][idx])
            if self.accuracy_output is not None:
                correct += _accuracy(results[self.accuracy_output], self.data[-1][idx], self.accuracy_output)
        metrics = {} if self.accuracy_output is None else {"accuracy": correct / count}
        return loss_sum / count, metrics


def make_evaluate_fn(artifact_dir: str | os.PathLike, data: Sequence[np.ndarray], *,
                     accuracy_output: str | None = None, checkpoint: str | os.PathLike | None = None,
                     providers: list | None = None):
    """A server-side ``evaluate_fn(server_round, parameters, config) -> (loss, metrics)`` for FedAvg.

    Runs the artifacts' ``eval_model.onnx`` in an ``onnxruntime.InferenceSession`` on the
    central ``data`` (arrays in the eval model's input order, e.g. ``(images, labels)``),
    feeding the global parameters (and the checkpoint's other frozen ones) as graph
    inputs. With ``accuracy_output`` the metrics hold ``accuracy`` against the last array.

    Example:
        >>> evaluate = make_evaluate_fn(artifacts, (x_test, y_test), accuracy_output="logits")
        >>> loss, metrics = evaluate(0, read_parameters(artifacts), {})
        >>> 0.0 <= metrics["accuracy"] <= 1.0
        True
    """
    return _CentralEvaluator(pathlib.Path(artifact_dir), data, accuracy_output, checkpoint, providers)


def weighted_average(results: Sequence[tuple[int, Mapping]]) -> dict:
    """Example-weighted mean of every numeric metric that all clients report (Flower's
    ``fit_metrics_aggregation_fn`` / ``evaluate_metrics_aggregation_fn`` signature)."""
    total = sum(n for n, _ in results)
    if not results or total == 0:
        return {}
    keys = set.intersection(*(set(m) for _, m in results))
    numeric = [k for k in sorted(keys) if all(isinstance(m[k], (int, float)) for _, m in results)]
    return {k: sum(n * float(m[k]) for n, m in results) / total for k in numeric}


class OnnxTrainFedAvg(FedAvg):
    """Flower's FedAvg over onnxtrain parameters (build it with :func:`make_strategy`).

    Sends the parameter names with every instruction, checks every client's returned
    parameters against the checkpoint's federated parameters (a mismatching result counts as
    a failure and is listed in :attr:`rejected`), keeps the latest global parameters (at
    first the initial ones) in :attr:`global_parameters` and, with ``save_checkpoint_to``,
    writes them into a checkpoint after every round.
    """

    def __init__(self, specs: Sequence[ParameterSpec], *, base_checkpoint: str | os.PathLike,
                 save_checkpoint_to: str | os.PathLike | None = None, **fedavg_kwargs):
        names_json = json.dumps([s.name for s in specs])
        for key in ("on_fit_config_fn", "on_evaluate_config_fn"):
            user_fn = fedavg_kwargs.get(key)
            fedavg_kwargs[key] = (lambda rnd, fn=user_fn: {**(fn(rnd) if fn else {}), PARAMETER_NAMES_KEY: names_json})
        super().__init__(**fedavg_kwargs)
        self.specs = list(specs)
        self.base_checkpoint = base_checkpoint
        self.save_checkpoint_to = save_checkpoint_to
        initial = fedavg_kwargs.get("initial_parameters")
        self.global_parameters: list[np.ndarray] | None = None if initial is None else parameters_to_ndarrays(initial)
        self.rejected: list[tuple[int, str]] = []

    def aggregate_fit(self, server_round, results, failures):
        valid, failures = [], list(failures)
        for proxy, res in results:
            try:
                check_parameters(self.specs, parameters_to_ndarrays(res.parameters))
            except ParameterMismatchError as exc:
                logger.warning("round %d: rejected a client's parameters: %s", server_round, exc)
                self.rejected.append((server_round, str(exc)))
                failures.append((proxy, res))
                continue
            valid.append((proxy, res))
        parameters, metrics = super().aggregate_fit(server_round, valid, failures)
        if parameters is not None:
            self.global_parameters = parameters_to_ndarrays(parameters)
            if self.save_checkpoint_to is not None:
                save_global_parameters(self.global_parameters, self.base_checkpoint, self.save_checkpoint_to)
        return parameters, metrics


def make_strategy(initial_parameters_from: str | os.PathLike, *, evaluate_fn=None,
                  fit_config: Mapping | Callable[[int], Mapping] | None = None,
                  evaluate_config: Mapping | Callable[[int], Mapping] | None = None,
                  save_checkpoint_to: str | os.PathLike | None = None, min_clients: int = 2,
                  **fedavg_kwargs) -> OnnxTrainFedAvg:
    """Flower's FedAvg starting from the federated parameters of a checkpoint or artifact folder.

    Args:
        initial_parameters_from: artifact folder (its ``checkpoint``) or checkpoint file.
        evaluate_fn: server-side evaluation, e.g. from :func:`make_evaluate_fn`.
        fit_config / evaluate_config: a dict, or ``round -> dict``, sent to the clients
            (``local_epochs``, ``batch_size``, ``learning_rate`` steer :class:`OnnxTrainClient`).
        save_checkpoint_to: write the global parameters into this checkpoint after every round.
        min_clients: default for FedAvg's ``min_fit_clients``, ``min_evaluate_clients`` and
            ``min_available_clients``.
        fedavg_kwargs: any other ``flwr.server.strategy.FedAvg`` argument (client metrics are
            aggregated with :func:`weighted_average` unless given).

    Example:
        >>> central = make_evaluate_fn(artifacts, (x_test, y_test), accuracy_output="logits")
        >>> strategy = make_strategy(artifacts, evaluate_fn=central, fit_config={"local_epochs": 1}, min_clients=3)
        >>> strategy.on_fit_config_fn(1)["local_epochs"]
        1
        >>> flwr.server.start_server(server_address="127.0.0.1:8080", strategy=strategy,
        ...                          config=flwr.server.ServerConfig(num_rounds=5))  # doctest: +SKIP
    """
    for key, value in (("on_fit_config_fn", fit_config), ("on_evaluate_config_fn", evaluate_config)):
        if value is not None:
            fedavg_kwargs[key] = value if callable(value) else (lambda rnd, v=dict(value): dict(v))
    for key in ("min_fit_clients", "min_evaluate_clients", "min_available_clients"):
        fedavg_kwargs.setdefault(key, min_clients)
    for key in ("fit_metrics_aggregation_fn", "evaluate_metrics_aggregation_fn"):
        fedavg_kwargs.setdefault(key, weighted_average)
    _, federated = _federated_records(initial_parameters_from)
    return OnnxTrainFedAvg(_specs(federated), base_checkpoint=initial_parameters_from,
                           save_checkpoint_to=save_checkpoint_to, evaluate_fn=evaluate_fn,
                           initial_parameters=ndarrays_to_parameters(_values(federated, initial_parameters_from)),
                           **fedavg_kwargs)


def save_global_parameters(parameters: Sequence[np.ndarray] | Parameters, base: str | os.PathLike,
                           checkpoint_path: str | os.PathLike | None = None, *,
                           inference_model_path: str | os.PathLike | None = None,
                           output_names: Sequence[str] | None = None) -> None:
    """Write global parameters into a checkpoint and/or an inference model.

    ``base`` is the artifact folder (or a checkpoint file, for ``checkpoint_path`` only): its
    checkpoint supplies the frozen parameters and the layout. ``inference_model_path`` (with
    ``output_names``, e.g. ``["logits"]``) needs the artifact folder and exports the eval
    model with the parameters embedded, runnable in a plain ``InferenceSession``.

    Example (``strategy`` before any round holds the initial parameters):
        >>> strategy = make_strategy(artifacts)
        >>> save_global_parameters(strategy.global_parameters, artifacts, f"{out}/global_checkpoint",
        ...                        inference_model_path=f"{out}/global.onnx", output_names=["logits"])
        >>> len(read_parameters(f"{out}/global_checkpoint"))
        6
    """
    from onnxtrain.api import CheckpointState, Module

    if isinstance(parameters, Parameters):
        parameters = parameters_to_ndarrays(parameters)
    if checkpoint_path is None and inference_model_path is None:
        raise ValueError("give checkpoint_path, inference_model_path or both")
    folder = pathlib.Path(base)
    if inference_model_path is not None:  # everything is checked before anything is written
        if not output_names:
            raise ValueError("an inference model needs output_names, e.g. ['logits']")
        if not (folder / "eval_model.onnx").exists():
            raise CheckpointError(f"exporting an inference model needs the artifact folder with eval_model.onnx; "
                                  f"got {str(base)!r}")
    state = CheckpointState.load_checkpoint(_checkpoint_path(base))
    specs = _specs(_federated(state.parameters.values(), _running_statistics(base),
                              f"checkpoint {str(_checkpoint_path(base))!r}"))
    for spec, array in zip(specs, check_parameters(specs, parameters)):
        state.parameters[spec.name] = array
    if inference_model_path is not None:  # first: it checks the output names before it writes
        module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
        module.export_model_for_inferencing(inference_model_path, list(output_names))
    if checkpoint_path is not None:
        CheckpointState.save_checkpoint(state, checkpoint_path)


__all__ = ["EVAL_BATCH_SIZE", "PARAMETER_NAMES_KEY", "OnnxTrainClient", "OnnxTrainFedAvg", "ParameterMismatchError",
           "ParameterSpec", "check_parameters", "make_client_app", "make_client_fn", "make_evaluate_fn",
           "make_strategy", "parameter_specs", "read_parameters", "save_global_parameters", "weighted_average"]

