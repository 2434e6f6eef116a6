"""Models exported from PyTorch 2.13: onnxtrain's gradients and AdamW trajectories equal PyTorch's.

Two exporters: the current one (``dynamo=True``, opset 18+), which writes BatchNormalization
in inference form (running statistics), so the PyTorch side runs in eval mode; and the
TorchScript exporter of older stacks at opset 14 in training mode (BatchNormalization with
batch statistics, ``training_mode=1``), compared with PyTorch in train mode.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bench.cell import flat_cross_entropy_block
from tests.torch_models import examples, export, export_legacy, torch

from onnxtrain import artifacts, onnxblock
from onnxtrain.api import CheckpointState, Module, Optimizer

F = torch.nn.functional
STEPS = 20
LR = 2e-3


def _torch_loss(name, model, inputs, labels):
    out = model(*[torch.tensor(a) for a in inputs])
    target = torch.tensor(labels, dtype=torch.long)
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.cross_entropy(out, target)


CASES = [("mlp", "dynamo"), ("cnn", "dynamo"), ("gpt", "dynamo"), ("bert", "dynamo"),
         ("mlp", "legacy14"), ("cnn", "legacy14"), ("gpt", "legacy14")]


@pytest.mark.parametrize(("name", "exporter"), CASES, ids=[f"{n}-{e}" for n, e in CASES])
def test_gradients_and_adamw_trajectory_match_pytorch(name, exporter, tmp_path):
    ex = examples()[name]
    rng = np.random.default_rng(0)
    sample = tuple(torch.tensor(a) for a in ex.inputs(4, rng))
    if exporter == "dynamo":
        model = ex.model.eval()
        onnx_model = export(model, sample, ex.input_names, ex.dynamic())
    else:
        model = ex.model.train()
        onnx_model = export_legacy(model, sample, ex.input_names)
    param_names = [n for n, _ in model.named_parameters()]
    initializers = {i.name for i in onnx_model.graph.initializer}
    assert set(param_names) <= initializers, sorted(set(param_names) - initializers)

    hyper = dict(betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    # training-mode BatchNorm (legacy export) updates its running statistics every step
    statistics = [n for n, _ in model.named_buffers() if "running" in n] if exporter == "legacy14" else []
    exported = {i.name: i for i in onnx_model.graph.initializer}
    with torch.no_grad():  # exporting ran a training-mode forward: start both from the exported values
        for stat in statistics:
            dict(model.named_buffers())[stat].copy_(torch.tensor(onnx.numpy_helper.to_array(exported[stat])))
    # ONNX updates the running variance with the biased batch variance, PyTorch with the unbiased
    # one: track what ONNX's rule gives from the batch statistics PyTorch's BatchNorms see
    onnx_running_var = {}
    for module_name, bn in model.named_modules():
        if isinstance(bn, torch.nn.BatchNorm2d) and statistics:
            key = f"{module_name}.running_var"
            onnx_running_var[key] = bn.running_var.detach().clone()

            def track(mod, args, _out, key=key):
                batch_var = args[0].detach().var(dim=(0, 2, 3), unbiased=False)
                onnx_running_var[key] = (1 - mod.momentum) * onnx_running_var[key] + mod.momentum * batch_var

            bn.register_forward_hook(track)
    artifacts.generate_artifacts(
        onnx_model, requires_grad=param_names, frozen_params=statistics,
        loss=flat_cross_entropy_block() if name == "gpt" else artifacts.LossType.CrossEntropyLoss,
        optimizer=onnxblock.optim.AdamW(mode="torch", **hyper), artifact_directory=tmp_path,
    )
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(LR)
    torch_optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **hyper)

    for step in range(STEPS):
        batch = (5, 7, 6)[step % 3]  # varying batch sizes: symbolic dims, no rebuild
        inputs, labels = ex.inputs(batch, rng), ex.labels(batch, rng)
        loss = module(*inputs, labels.astype(np.int32))
        torch_optimizer.zero_grad()
        torch_loss = _torch_loss(name, model, inputs, labels)
        torch_loss.backward()
        np.testing.assert_allclose(float(loss), torch_loss.item(), rtol=1e-4, err_msg=f"loss at step {step}")
        if step == 0:
            for pname, p in model.named_parameters():
                np.testing.assert_allclose(state.parameters[pname].grad, p.grad.numpy(), rtol=1e-4, atol=1e-5,
                                           err_msg=f"gradient of {pname}")
        optimizer.step()
        module.lazy_reset_grad()
        torch_optimizer.step()
    buffers = dict(model.named_buffers())
    for stat in statistics:
        expected = onnx_running_var[stat] if stat in onnx_running_var else buffers[stat]
        np.testing.assert_allclose(state.parameters[stat].data, expected.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=stat)


def test_eval_model_of_a_training_mode_export_evaluates(tmp_path):
    """Dropout and batch-statistics BatchNorm in a training-mode export become inference ops in eval_model."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Dropout(0.5), nn.Linear(4 * 6 * 6, 3))
    with torch.no_grad():  # non-trivial running statistics
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    x = np.random.default_rng(0).standard_normal((5, 1, 6, 6)).astype(np.float32)
    labels = np.array([0, 1, 2, 1, 0])
    onnx_model = export_legacy(model.train(), (torch.tensor(x),), ["image"])
    ops = {n.op_type for n in onnx_model.graph.node}
    assert {"Dropout", "BatchNormalization"} <= ops
    artifacts.generate_artifacts(onnx_model, requires_grad=[n for n, _ in model.named_parameters()],
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx").eval()
    eval_loss = module(x, labels.astype(np.int32))
    expected = F.cross_entropy(model.eval()(torch.tensor(x)), torch.tensor(labels)).item()
    np.testing.assert_allclose(float(eval_loss), expected, rtol=1e-5)


def test_translation_table_exports_training_batch_norm_for_artifacts(tmp_path):
    """With onnxtrain.torch.onnx_translation_table, a dynamo export of a training-mode CNN
    normalizes with batch statistics: the training model's first loss equals torch's."""
    import warnings

    from onnxtrain.torch import onnx_translation_table
    from tests.torch_models import CNN

    torch.manual_seed(0)
    model = CNN().train()
    x = torch.randn(6, 1, 8, 8)
    labels = torch.randint(0, 10, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(model, (x,), dynamo=True, optimize=False, input_names=["image"],
                                  custom_translation_table=onnx_translation_table()).model_proto
    artifacts.generate_artifacts(proto, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    loss = module(x.numpy(), labels.numpy().astype(np.int32))
    expected = torch.nn.functional.cross_entropy(model(x), labels).item()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q, k):
        return self.attention(q, k, k, need_weights=True)[0]


def _unflatten_norm():
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Unflatten(1, (2, 3)), torch.nn.LayerNorm((2, 3)),
                               torch.nn.Flatten(), torch.nn.Linear(6, 3))


@pytest.mark.parametrize(("make", "shapes", "opset"), [
    (_Attention, [(3, 5, 8), (3, 7, 8)], 13),  # the heads' Reshape to a computed shape
    (_unflatten_norm, [(3, 5)], 17),  # nn.Unflatten's shape: Add, Mod and Slice of Shape
], ids=["attention-opset13", "unflatten-layernorm-opset17"])
def test_torchscript_exports_whose_shapes_need_folding_train_as_pytorch(tmp_path, make, shapes, opset):
    """The TorchScript exporter (upstream's documented way) computes some shapes with arithmetic
    on constants: the gradient rules lacked the ranks and refused the model (passes/fold.py)."""
    import io as bytes_io

    torch.manual_seed(0)
    model = make()
    inputs = [torch.randn(*s) for s in shapes]
    names_in = [f"in{i}" for i in range(len(inputs))]
    buffer = bytes_io.BytesIO()
    torch.onnx.export(model, tuple(inputs), buffer, dynamo=False, opset_version=opset, input_names=names_in,
                      output_names=["y"], dynamic_axes={n: {0: "batch"} for n in names_in},
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    artifacts.generate_artifacts(onnx.load_from_string(buffer.getvalue()), loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    output = model(*inputs)
    target = torch.randn_like(output)
    expected = torch.nn.functional.mse_loss(output, target)
    expected.backward()
    loss = module(*[x.numpy() for x in inputs], target.detach().numpy())
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    for name, parameter in model.named_parameters():
        np.testing.assert_allclose(state.parameters[name].grad, parameter.grad.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pool", [
    torch.nn.AvgPool2d(2, stride=2, padding=1, ceil_mode=True),  # ONNX's inference: 5 rows of 7, kernels 4
    torch.nn.MaxPool2d(2, stride=2, padding=1, ceil_mode=True),
    torch.nn.MaxPool2d(3, stride=2, ceil_mode=True),  # floor mode needs a larger end padding
    torch.nn.AvgPool2d(3, stride=2, ceil_mode=True, count_include_pad=False),
], ids=["avg-pad", "max-pad", "max-grow", "avg-grow-exclude-pad"])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_ceil_mode_pools_train_as_pytorch(tmp_path, pool, exporter):
    """onnxruntime refused the training model, or the target's shape was ONNX's wrong one
    (passes/ceil_pool.py)."""
    import io as bytes_io

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), pool)
    x = torch.randn(3, 2, 7, 8)
    if exporter == "dynamo":
        proto = torch.onnx.export(model, (x,), dynamo=True, input_names=["x"], output_names=["y"],
                                  optimize=False).model_proto
    else:
        buffer = bytes_io.BytesIO()
        torch.onnx.export(model, (x,), buffer, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}}, do_constant_folding=False)
        proto = onnx.load_from_string(buffer.getvalue())
    artifacts.generate_artifacts(proto, loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    output = model(x)
    target = torch.randn_like(output)
    expected = torch.nn.functional.mse_loss(output, target)
    expected.backward()
    np.testing.assert_allclose(module(x.numpy(), target.numpy()), expected.item(), rtol=1e-5)
    for name, parameter in model.named_parameters():
        np.testing.assert_allclose(state.parameters[name].grad, parameter.grad.numpy(), rtol=1e-4, atol=1e-6)
