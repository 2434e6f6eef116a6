"""onnxtrain.integrations.deepspeed.initialize: ORTModule + our FusedAdam under DeepSpeed ZeRO-1.

Two gloo ranks (``_deepspeed_worker.py``, launched by tests/_launch.py) train the same model
with eager DeepSpeed (the config's optimizer built by DeepSpeed as torch's Adam/AdamW) and with
the helper (ORTModule, FusedAdam from the same config); both must agree within 1e-5. The
rest are one-process checks of the config translation.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (the optional extra `deepspeed`)")

from onnxtrain.integrations.deepspeed import DeepSpeedConfigError, fused_adam_from_config  # noqa: E402
from onnxtrain.torch.optim import AdamWMode  # noqa: E402
from tests._launch import launch_ranks, load_worker  # noqa: E402

WORLD_SIZE = 2
GLOBAL_BATCH = 8
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 300

_WORKER = Path(__file__).with_name("_deepspeed_worker.py")


worker = load_worker(_WORKER)


def _assert_close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("deepspeed")
    torch.manual_seed(0)
    data = {"state": copy.deepcopy(worker.MLP().state_dict()), "x": torch.randn(GLOBAL_BATCH, 12),
            "y": torch.randint(0, 4, (GLOBAL_BATCH,)), "steps": STEPS}
    torch.save(data, workdir / "setup.pt")
    return workdir, data


@pytest.fixture(scope="module")
def ranks(setup) -> list[dict]:
    workdir, _ = setup
    return launch_ranks(_WORKER, workdir, WORLD_SIZE, timeout_s=TIMEOUT_S, env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
@pytest.mark.parametrize("label", list(worker.OPTIMIZERS))
def test_helper_zero1_matches_eager_deepspeed(setup, ranks, label):
    _, data = setup
    for rank, result in enumerate(ranks):
        eager, helper = result[label, "eager"], result[label, "helper"]
        # what ran: ORTModule (one export, no fallback) and our FusedAdam inside DeepSpeed's ZeRO-1
        assert helper["module"] == "ORTModule" and helper["fallback_reason"] is None
        assert helper["export_count"] == 1
        assert helper["optimizer"] == eager["optimizer"] == "DeepSpeedZeroOptimizer"
        assert helper["basic_optimizer"] == "FusedAdam"
        assert eager["basic_optimizer"] == ("AdamW" if label == "AdamW" else "Adam")
        assert helper["lr"] == eager["lr"]  # the config's WarmupLR drove both
        for step in range(STEPS):
            _assert_close(helper["losses"][step], eager["losses"][step], f"rank {rank} {label}: loss {step}")
        for name, value in eager["params"].items():
            _assert_close(helper["params"][name], value, f"rank {rank} {label}: {name}")
            assert torch.equal(helper["params"][name], ranks[0][label, "helper"]["params"][name])
    trained = ranks[0][label, "helper"]["params"]
    assert all(not torch.equal(trained[n], v) for n, v in data["state"].items()), "nothing trained"


# -- the config translation, one process ----------------------------------------------------
def _one_step(optimizer_factory, seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Linear(5, 3)
    optimizer = optimizer_factory(net.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        net(torch.randn(4, 5)).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("entry, reference", [
    ({"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.5}},
     lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5, eps=1e-8)),
    ({"type": "adam", "params": {"lr": 0.1, "weight_decay": 0.5}},  # DeepSpeed: AdamW unless adam_w_mode false
     lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5, eps=1e-8)),
    ({"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False, "betas": [0.8, 0.9]}},
     lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.5, betas=(0.8, 0.9), eps=1e-8)),
    ({"type": "AdamW", "params": {}}, lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0, eps=1e-8)),
])
def test_fused_adam_from_config_follows_deepspeed_semantics(entry, reference):
    ours = _one_step(lambda p: fused_adam_from_config(p, entry))
    for got, want in zip(ours, _one_step(reference)):
        _assert_close(got, want, f"{entry}")


def test_fused_adam_from_config_modes_and_refusals():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_adam_from_config(params, {"type": "AdamW", "params": {"adam_w_mode": False}}).adam_w_mode \
        == AdamWMode.ADAMW_TORCH  # AdamW ignores adam_w_mode, as DeepSpeed does
    with pytest.raises(DeepSpeedConfigError, match=r"\['amsgrad'\] have no FusedAdam counterpart"):
        fused_adam_from_config(params, {"type": "Adam", "params": {"amsgrad": True}})
    with pytest.raises(DeepSpeedConfigError, match="must be Adam or AdamW, got 'Lamb'"):
        fused_adam_from_config(params, {"type": "Lamb"})


@pytest.mark.parametrize("config, replaced", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, True),
    ({"optimizer": {"type": "Adam"}}, True),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, False),  # the user chose torch's
    ({"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, False),
    ({"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "none"}}}, True),
    ({"optimizer": {"type": "Lamb"}}, False),
    ({}, False),
    # forms DeepSpeed accepts: its defaults written out, the deprecated bool and cpu_offload
    ({"optimizer": {"type": "AdamW", "params": None}, "zero_optimization": {"offload_optimizer": None}}, True),
    ({"optimizer": {"type": "Adam"}, "zero_optimization": True}, True),
    ({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": "2", "cpu_offload": True}}, False),
])
def test_which_configs_get_fused_adam(config, replaced, tmp_path):
    from onnxtrain.integrations.deepspeed import _load_config, _wants_our_adam, _zero_settings

    assert _wants_our_adam(_load_config(config), _zero_settings(_load_config(config))[1]) is replaced
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    assert _load_config(path) == config and _load_config(str(path)) == config
    loaded = _load_config(config)
    loaded.setdefault("optimizer", {})["type"] = "changed"
    assert config.get("optimizer", {}).get("type") != "changed"  # the caller's dict is not edited


def test_zero_stage3_is_refused_before_anything_happens():
    # measured: under ZeRO-3 the parameters are empty outside DeepSpeed's submodule forward
    # hooks, and the export fails ("torch.onnx.export could not export ...")
    from onnxtrain.integrations.deepspeed import initialize

    net = torch.nn.Linear(2, 2)
    with pytest.raises(DeepSpeedConfigError, match="ZeRO stage 3 partitions the parameters.*expected stage 0, 1 or 2"):
        initialize(net, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    assert type(net) is torch.nn.Linear and not dist.is_initialized()


def test_configs_are_read_as_deepspeed_reads_them(tmp_path):
    """A file with comments (DeepSpeed reads hjson), base64 JSON, the older ``config_params``
    keyword and a stage given as a string all reach the stage-3 check; unreadable configs get
    a DeepSpeedConfigError that names them."""
    import base64

    from onnxtrain.integrations.deepspeed import initialize

    stage3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "3"}}
    commented = tmp_path / "ds_config.json"
    commented.write_text('{\n  // ZeRO-3\n  "train_micro_batch_size_per_gpu": 1,\n  "zero_optimization": {"stage": 3},\n}\n')
    encoded = base64.urlsafe_b64encode(json.dumps(stage3).encode()).decode()
    net = torch.nn.Linear(2, 2)
    for kwargs in ({"config": stage3}, {"config_params": stage3}, {"config": commented}, {"config": encoded}):
        with pytest.raises(DeepSpeedConfigError, match="ZeRO stage 3 partitions the parameters"):
            initialize(net, **kwargs)
    duplicated = tmp_path / "duplicated.json"
    duplicated.write_text('{"zero_optimization": {"stage": 1}, "zero_optimization": {"stage": 3}}')
    for config, message in ((duplicated, "duplicated.json' is neither a readable JSON file"),
                            ("no-such-file.json", "'no-such-file.json' is neither a readable JSON file"),
                            ({"zero_optimization": {"stage": "x"}}, "'zero_optimization' is not valid"),
                            ({"optimizer": {"type": "Adam", "params": [1]}}, "'params' must be an object")):
        with pytest.raises(DeepSpeedConfigError, match=message):
            initialize(net, config=config)
    assert type(net) is torch.nn.Linear and not dist.is_initialized()


@pytest.mark.slow
def test_ort_trainer_builds_deepspeeds_engine_around_its_ortmodule(tmp_path):
    """ORTTrainer(args.deepspeed=<ZeRO-1 config>) crashed in accelerator.backward ('NoneType' has
    no attribute 'backward'): transformers builds DeepSpeed's engine only around the model it
    holds, never around ORTTrainer's ORTModule. Now the same losses as without DeepSpeed."""
    import subprocess
    import sys

    worker_path = Path(__file__).with_name("_ort_trainer_deepspeed_worker.py")
    run = subprocess.run([sys.executable, str(worker_path), str(tmp_path), "29573"], capture_output=True, text=True,
                         check=False, timeout=TIMEOUT_S, cwd=Path(__file__).parents[2])
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, run.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert len(result["deepspeed"]) == len(result["plain"]) == 4
    for ours, plain in zip(result["deepspeed"], result["plain"]):
        assert abs(ours - plain) <= 1e-4 * abs(plain), (result["deepspeed"], result["plain"])
    assert result["checkpoints"] == ["checkpoint-2", "checkpoint-4"] and result["reloaded"]
    assert 0 < result["eval_loss"] < 10
