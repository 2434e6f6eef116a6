"""ORTModule inside PyTorch Lightning (onnxtrain.integrations.lightning).

Every ORTModule run is compared with the same eager Lightning run (same seed, data, optimizer):
one process in fp32 and in ``bf16-mixed``, two DDP processes (gloo, launched as torchrun
would, tests/_launch.py), a checkpoint saved by a wrapped run that loads into the plain
module and resumes training. The model, data and runs live in ``_lightning_worker.py``, which
is also the DDP ranks' script.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from onnxtrain.integrations.lightning import (  # noqa: E402
    LightningIntegrationError,
    ORTModuleCallback,
    unwrap_modules,
    wrap_modules,
)
from onnxtrain.torch import ORTModule  # noqa: E402
from onnxtrain.torch.ortmodule import MemoryOptionsError  # noqa: E402
from tests._launch import launch_ranks, load_worker  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
# bf16-mixed: both runs round to bf16 where autocast does, but ORT sums in another order, so a
# bf16 rounding may go the other way (one bf16 ulp is 2**-8 relative); 4 Adam steps of lr 1e-2.
# Observed here: 1.8e-4 (losses, relative) and 6.5e-4 (parameters); ~10x and ~3x margins.
BF16_LOSS_RTOL, BF16_PARAM_ATOL = 2e-3, 2e-3
WORLD_SIZE = 2
TIMEOUT_S = 240

_WORKER = Path(__file__).with_name("_lightning_worker.py")


worker = load_worker(_WORKER)


def _assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _assert_states_close(actual: dict, expected: dict, what: str, **tolerance) -> None:
    assert list(actual) == list(expected), what
    for key in expected:
        _assert_close(actual[key], expected[key], f"{what}: {key}", **tolerance)


@pytest.fixture(scope="module", autouse=True)
def _restore_global_flags():
    """Lightning's deterministic=True and seed_everything set process-wide state: undo it."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    environ = dict(os.environ)
    yield
    torch.use_deterministic_algorithms(deterministic)
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One-process fits: eager and ORTModule in fp32 and bf16-mixed. The fp32 ORTModule run
    builds its model in ``configure_model`` (wrapped at ``on_fit_start``) and then validates."""
    root = tmp_path_factory.mktemp("lightning")
    result = {}
    for precision in ("32-true", "bf16-mixed"):
        for label, wrap in (("eager", False), ("ORTModule", True)):
            run = worker.fit(root / f"{label}_{precision}", wrap=wrap, precision=precision, devices=1,
                             build_in_configure=wrap and precision == "32-true")
            if precision == "32-true":
                run["validated"] = run["trainer"].validate(run["model"], worker.loader(), verbose=False)
            result[label, precision] = run
    return result


def test_one_process_ortmodule_run_matches_eager(runs):
    eager, ort = runs["eager", "32-true"], runs["ORTModule", "32-true"]
    assert ort["wrapped"] == ["model"]  # built in configure_model, wrapped at on_fit_start
    assert isinstance(ort["model"].model, ORTModule) and ort["fallback_reason"] is None
    assert ort["export_count"] == 1  # the fit: training mode only (no sanity check)
    assert ort["model"].model.export_count == 2  # then eval mode for validate (under inference_mode)
    assert len(eager["losses"]) == worker.STEPS
    _assert_close(torch.tensor(ort["losses"]), torch.tensor(eager["losses"]), "logged losses")
    worker.pl.seed_everything(0, verbose=False)
    initial = worker.snapshot(worker.LitModel())
    assert all(not torch.equal(eager["state"][k], v) for k, v in initial.items()), "nothing trained"
    _assert_states_close(ort["state"], eager["state"], "final parameters")
    _assert_close(torch.tensor(ort["validated"][0]["val_loss"]), torch.tensor(eager["validated"][0]["val_loss"]),
                  "validation loss")


def test_bf16_mixed_ortmodule_run_matches_eager_autocast(runs):
    eager, ort = runs["eager", "bf16-mixed"], runs["ORTModule", "bf16-mixed"]
    assert ort["fallback_reason"] is None and ort["export_count"] == 1
    # Lightning's precision plugin ran the model under torch.autocast: bf16 logits in both
    assert set(ort["model"].output_dtypes) == set(eager["model"].output_dtypes) == {torch.bfloat16}
    _assert_close(torch.tensor(ort["losses"]), torch.tensor(eager["losses"]), "bf16 losses",
                  rtol=BF16_LOSS_RTOL, atol=0)
    _assert_states_close(ort["state"], eager["state"], "bf16 final parameters", rtol=0, atol=BF16_PARAM_ATOL)
    # and autocast made a difference the tolerance would not hide
    fp32 = runs["eager", "32-true"]["losses"]
    assert max(abs(a - b) for a, b in zip(eager["losses"], fp32)) > 10 * RTOL


def test_checkpoint_loads_into_the_plain_module_and_resumes_wrapped(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # the first epoch (half the steps) with ORTModule, saved by Lightning's ModelCheckpoint
    saver = ModelCheckpoint(dirpath=tmp_path, filename="half")
    first = worker.fit(tmp_path / "first", wrap=True, devices=1, max_steps=-1, max_epochs=1,
                       enable_checkpointing=True, callbacks=[saver])
    path = tmp_path / "half.ckpt"
    assert Path(saver.best_model_path) == path and first["trainer"].global_step == worker.STEPS // 2

    saved = torch.load(path, weights_only=False)
    plain = worker.LitModel.load_from_checkpoint(path)  # no ORTModule anywhere
    assert not any(isinstance(m, ORTModule) for m in plain.modules())
    assert list(saved["state_dict"]) == list(plain.state_dict()) == list(first["state"])
    _assert_states_close(worker.snapshot(plain), first["state"], "loaded into the plain module", rtol=0, atol=0)

    # resume training from it (weights, Adam state, loop state) in the plain module, and in
    # the wrapped one (its weights zeroed first: the checkpoint must restore them). Lightning
    # resumes an epoch-end checkpoint as mid-epoch, so the reference is the plain resume, not
    # an uninterrupted run.
    reference = worker.fit(tmp_path / "plain", wrap=False, devices=1, ckpt_path=path)
    model = first["model"]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    resumed = worker.fit(tmp_path / "resumed", wrap=True, model=model, devices=1, ckpt_path=path)
    assert model.model.export_count == 1  # still the first export: weights are graph inputs
    assert resumed["wrapped"] == []  # already wrapped
    assert resumed["trainer"].global_step == reference["trainer"].global_step == worker.STEPS
    assert len(resumed["losses"]) == worker.STEPS // 2
    _assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"]), "losses after resuming")
    _assert_states_close(resumed["state"], reference["state"], "resumed wrapped vs resumed plain")
    assert any(not torch.equal(resumed["state"][k], v) for k, v in first["state"].items()), "nothing trained"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch_ranks(_WORKER, tmp_path_factory.mktemp("lightning_ddp"), WORLD_SIZE, timeout_s=TIMEOUT_S)


def test_ddp_two_processes_match_eager_ddp_and_the_global_batch(ranks, runs, tmp_path):
    for rank, result in enumerate(ranks):
        ort, eager = result["ORTModule"], result["eager"]
        assert ort["world_size"] == eager["world_size"] == WORLD_SIZE
        assert ort["wrapped"] == ["model"] and ort["fallback_reason"] is None and ort["export_count"] == 1
        _assert_states_close(ort["state"], eager["state"], f"rank {rank}: DDP ORTModule vs DDP eager")
        for key, value in ort["state"].items():  # DDP kept the replicas identical
            assert torch.equal(value, ranks[0]["ORTModule"]["state"][key]), (rank, key)
    first = ranks[0]
    _assert_close(torch.tensor(first["ORTModule"]["losses"]), torch.tensor(first["eager"]["losses"]),
                  "DDP logged (rank-averaged) losses")

    # one eager process on the global batch (both ranks' samples in each step) is the same run
    single = worker.fit(tmp_path, wrap=False, devices=1, batch_size=worker.BATCH * WORLD_SIZE)
    _assert_close(torch.tensor(first["ORTModule"]["losses"]), torch.tensor(single["losses"]),
                  "DDP ORTModule vs one process on the global batch: losses")
    _assert_states_close(first["ORTModule"]["state"], single["state"], "DDP ORTModule vs the global batch")


# -- the helpers, without a Trainer --------------------------------------------------------
class _Parts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 2)
        self.loss_fn = torch.nn.MSELoss()


def test_wrap_modules_picks_children_with_parameters_and_is_idempotent():
    root = _Parts()
    params = list(root.parameters())
    keys = list(root.state_dict())
    assert wrap_modules(root) == ["encoder", "head"]
    assert isinstance(root.encoder, ORTModule) and isinstance(root.head, ORTModule)
    assert not isinstance(root.loss_fn, ORTModule)
    assert wrap_modules(root) == [] and wrap_modules(root, "head") == []
    assert list(root.parameters()) == params and list(root.state_dict()) == keys  # same tensors, same names
    assert unwrap_modules(root) == ["encoder", "head"]
    assert type(root.encoder) is torch.nn.Sequential and type(root.head) is torch.nn.Linear


def test_wrap_modules_dotted_names_and_options():
    root = _Parts()
    layer = root.encoder[1]
    assert wrap_modules(root, ["encoder.1"], memory_opt_level=1) == ["encoder.1"]
    wrapped = root.encoder[1]
    assert isinstance(wrapped, ORTModule) and wrapped.module is layer
    assert wrapped._memory_options.resolved_level() == 1
    with pytest.raises(LightningIntegrationError, match=r"'encoder' in ORTModule: it contains ORTModule encoder\.1"):
        wrap_modules(root, "encoder")
    assert unwrap_modules(root) == ["encoder.1"] and root.encoder[1] is layer
    assert wrap_modules(root, "encoder") == ["encoder"]
    with pytest.raises(LightningIntegrationError, match=r"'encoder\.0' in ORTModule: it is inside 'encoder'"):
        wrap_modules(root, "encoder.0")
    # one inside the other in the same call (both were wrapped, nested)
    unwrap_modules(root)
    for names in (["encoder", "encoder.0"], ["encoder.0", "encoder"]):
        with pytest.raises(LightningIntegrationError, match=r"'encoder\.0' is inside 'encoder'"):
            wrap_modules(root, names)
        assert not any(isinstance(m, ORTModule) for m in root.modules())


def test_containers_stand_for_their_elements_and_frozen_models_keep_their_wrappers():
    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)])
            self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)})

        def forward(self, x):
            for i in range(len(self.layers)):
                x = torch.tanh(self.layers[i](x))
            return self.heads["a"](x)

    root = Layers()
    x = torch.randn(5, 3)
    expected = root(x)
    assert wrap_modules(root) == ["layers.0", "layers.1", "heads.a"]  # ModuleList/ModuleDict have no forward
    torch.testing.assert_close(root(x), expected)
    assert all(root.layers[i].export_count == 1 for i in range(2)) and root.heads["a"].export_count == 1
    unwrap_modules(root)
    with pytest.raises(LightningIntegrationError, match=r"'layers' \(ModuleList\) in ORTModule: it has no forward"):
        wrap_modules(root, "layers")
    # a wrapped container with a forward still indexes, iterates and counts as the container
    wrapped = ORTModule(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
    assert len(wrapped) == 2 and [type(m) for m in wrapped] == [torch.nn.Linear, torch.nn.ReLU] and bool(wrapped)
    assert bool(ORTModule(torch.nn.Linear(2, 2)))
    # a model frozen for inference (LightningModule.freeze()): its wrapped children stay, its plain ones are picked
    root = _Parts()
    wrap_modules(root, "head")
    root.requires_grad_(False)
    assert wrap_modules(root) == ["encoder"] and isinstance(root.head, ORTModule)
    assert wrap_modules(root) == []


def test_sync_batchnorm_conversion_through_a_wrapper_keeps_the_tree():
    """SyncBatchNorm.convert_sync_batchnorm (Lightning's sync_batchnorm=True) rebuilds the tree
    through named_children and add_module, which lists the wrapper's own slot."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    keys = list(net.state_dict())
    wrapped = ORTModule(net)
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(wrapped)
    assert converted is wrapped and wrapped.module is net and isinstance(net[1], torch.nn.SyncBatchNorm)
    assert list(wrapped.state_dict()) == keys and "_original_module" not in dict(net.named_children())
    with pytest.raises(TypeError, match="cannot swap the module it wraps"):
        wrapped.add_module("_original_module", torch.nn.Linear(2, 2))


def test_missing_modules_are_named_in_the_error(tmp_path):
    root = _Parts()
    with pytest.raises(LightningIntegrationError, match=r"no submodule 'decoder'.*children: \['encoder', 'head'"):
        wrap_modules(root, ["head", "decoder"])
    assert not any(isinstance(m, ORTModule) for m in root.modules())  # nothing changed, head included
    with pytest.raises(MemoryOptionsError):
        wrap_modules(root, ["head", "encoder"], memory_budget=-1)
    assert not any(isinstance(m, ORTModule) for m in root.modules())
    assert wrap_modules(root, ["head", "head"]) == ["head"]
    with pytest.raises(LightningIntegrationError, match="no child module with parameters"):
        wrap_modules(torch.nn.Sequential(torch.nn.ReLU()))
    assert wrap_modules(_Parts(), "decoder", missing_ok=True) == []

    # through the Trainer: skipped at setup (configure_model may build it), refused at fit start
    run = worker.trainer(tmp_path, callbacks=[ORTModuleCallback("decoder")], devices=1)
    with pytest.raises(LightningIntegrationError, match="no submodule 'decoder'"):
        run.fit(worker.LitModel(), worker.loader())


def test_importing_onnxtrain_does_not_import_lightning_or_deepspeed():
    script = ("import sys, onnxtrain, onnxtrain.integrations\n"
              "assert 'lightning' not in sys.modules and 'deepspeed' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
