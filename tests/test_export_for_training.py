"""onnxtrain.torch.export_for_training: ONNX models whose gradients are PyTorch's."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from onnxtrain import artifacts  # noqa: E402
from onnxtrain.api import CheckpointState, Module  # noqa: E402
from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.torch import export_for_training  # noqa: E402
from tests.ortmodule.test_autograd_functions import RoundSTE  # noqa: E402
from tests.torch_models import MomentumEncoder, training_gradients  # noqa: E402

nn = torch.nn
BATCH = ({0: torch.export.Dim("batch", min=2, max=64)},)


class _NoGradTeacher(nn.Module):
    """A target computed under no_grad from the same layer: only the first use trains it."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            target = torch.tanh(self.layer(x))
        return self.layer(x) * target


def test_no_grad_regions_and_detach_stop_gradients_as_in_pytorch():
    torch.manual_seed(0)
    model = _NoGradTeacher()
    x = torch.randn(5, 4)
    weight = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    (model(x) * torch.tensor(weight)).sum().backward()
    expected = {n: p.grad.numpy() for n, p in model.named_parameters()}
    params = list(expected)

    ours = training_gradients(export_for_training(model, (x,), input_names=["x"], dynamic_shapes=BATCH), params,
                      {"x": x.numpy()}, weight)
    for name in params:
        np.testing.assert_allclose(ours[name], expected[name], rtol=1e-5, atol=1e-6)
    # torch.onnx.export inlines the region: its graph trains the teacher path too
    plain = torch.onnx.export(model, (x,), dynamo=True, input_names=["x"], optimize=False,
                              dynamic_shapes=BATCH).model_proto
    theirs = training_gradients(plain, params, {"x": x.numpy()}, weight)
    assert not np.allclose(theirs["layer.weight"], expected["layer.weight"], rtol=1e-3)


class _Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x):
        return RoundSTE.apply(self.layer(x))


def test_custom_functions_are_refused_unless_declared_exact():
    with pytest.raises(ExportError, match="RoundSTE.*export_for_training\\(\\.\\.\\., inline_autograd_functions"):
        export_for_training(_Quantized(), (torch.randn(2, 3),))
    proto = export_for_training(_Quantized(), (torch.randn(2, 3),), inline_autograd_functions=[RoundSTE])
    assert "Round" in {n.op_type for n in proto.graph.node}


def test_a_cumulative_average_batch_norm_is_refused_by_name():
    """``momentum=None``: the artifacts' BatchNormalization has a fixed momentum (ORTModule trains it)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, momentum=None))
    with pytest.raises(ExportError, match="^1: BatchNorm with momentum=None"):
        export_for_training(model, (torch.randn(5, 3),))
    export_for_training(model.eval(), (torch.randn(5, 3),))  # evaluating with the statistics: fine


def test_gradient_hooks_on_parameters_and_a_non_module_are_refused_by_name():
    """A parameter's register_hook (a gradient scaled by half) was exported without it: the
    artifacts trained with the unhooked gradient; a function for the model failed on
    named_modules."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    handle = model[0].weight.register_hook(lambda g: g * 0.5)
    with pytest.raises(ExportError, match=r"parameters \['0.weight'\] have gradient hooks"):
        export_for_training(model, (torch.randn(5, 3),))
    handle.remove()
    model[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ExportError, match=r"parameters \['2.bias'\] have gradient hooks"):
        export_for_training(model, (torch.randn(5, 3),))
    with pytest.raises(TypeError, match="takes a torch.nn.Module, got function"):
        export_for_training(lambda x: x, (torch.randn(5, 3),))


def test_names_and_path(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))  # train mode: batch statistics
    proto = export_for_training(model, (torch.randn(4, 3),), tmp_path / "sub" / "model.onnx", input_names=["features"],
                                output_names=["logits"], dynamic_shapes=BATCH)
    assert [i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}] == \
        ["features"]
    assert proto.graph.output[0].name == "logits"
    assert onnx.load(str(tmp_path / "sub" / "model.onnx")).graph.output[0].name == "logits"
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(["logits"], {"features": np.ones((6, 3), np.float32)})[0].shape == (6, 2)
    with pytest.raises(ExportError, match="2 input names given for 1 input"):
        export_for_training(model, (torch.randn(4, 3),), input_names=["a", "b"])
    with pytest.raises(ExportError, match="tuple"):
        export_for_training(model, torch.randn(4, 3))


class _PartlyFrozen(torch.nn.Module):
    """A frozen feature layer, a trainable head, and a float buffer (a fixed scale)."""

    def __init__(self):
        super().__init__()
        self.features, self.head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
        self.features.requires_grad_(False)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x):
        return self.head(torch.tanh(self.features(x)) * self.scale)


def test_artifacts_train_what_pytorch_trains_by_default(tmp_path):
    """Parameters with requires_grad=False stay frozen (they were trained), buffers stay constants."""
    torch.manual_seed(0)
    model = _PartlyFrozen()
    export_for_training(model, (torch.randn(5, 4),), tmp_path / "model.onnx", input_names=["x"],
                        dynamic_shapes=BATCH)
    artifacts.generate_artifacts(str(tmp_path / "model.onnx"), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert {n: p.requires_grad for n, p in state.parameters} == {
        "head.weight": True, "head.bias": True, "features.weight": False, "features.bias": False}
    from onnxtrain.api import Optimizer

    module = Module(tmp_path / "training_model.onnx", state)
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.5)
    reference = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    x, labels = torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0])
    for _ in range(2):
        module(x.numpy(), labels.numpy().astype(np.int32))
        optimizer.step()
        module.lazy_reset_grad()
        reference.zero_grad()
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        reference.step()
    for name, param in model.named_parameters():
        np.testing.assert_allclose(state.parameters[name].data, param.detach().numpy(), rtol=1e-5, atol=1e-6)


class _NeedsThreeSteps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x[:, 2:]).sum(1)  # a sequence of 2 would leave nothing


def test_a_dynamic_dim_the_model_cannot_take_is_explained():
    """torch's reason (the violated guard) reaches the message, not only its first line."""
    seq = torch.export.Dim("seq", min=2, max=32)
    with pytest.raises(ExportError, match=r"Constraints violated \(seq\).*Not all values of seq"):
        export_for_training(_NeedsThreeSteps(), (torch.randn(2, 5, 4),), dynamic_shapes=({1: seq},))


class _LastStepGru(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = torch.nn.GRU(8, 12, batch_first=True), torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_a_recurrent_model_trains_at_sequence_lengths_other_than_the_examples(tmp_path):
    """The exporter typed the GRU's output with the example's length: the gradient of the last
    step's selection then only ran at that length. Shapes come from the inputs' dims instead."""
    torch.manual_seed(0)
    model = _LastStepGru()
    dims = ({0: torch.export.Dim("batch", min=2), 1: torch.export.Dim("seq", min=2, max=32)},)
    export_for_training(model, (torch.randn(4, 5, 8),), tmp_path / "model.onnx", input_names=["x"],
                        dynamic_shapes=dims)
    artifacts.generate_artifacts(str(tmp_path / "model.onnx"), loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    for batch, length in ((4, 5), (3, 7)):
        x, labels = torch.randn(batch, length, 8), torch.randint(0, 3, (batch,))
        loss = float(module(x.numpy(), labels.numpy().astype(np.int32)))
        model.zero_grad()
        expected = torch.nn.functional.cross_entropy(model(x), labels)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
        for name, param in model.named_parameters():
            np.testing.assert_allclose(state.parameters[name].grad, param.grad.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=name)
        module.lazy_reset_grad()


def test_t5_attention_exports():
    """torch.onnx.export fails on Hugging Face T5 (a view after SDPA); export_for_training does not."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   dropout_rate=0.0)
    model = transformers.T5EncoderModel(config)
    proto = export_for_training(model, (torch.randint(0, 50, (2, 5)),), input_names=["ids"])
    assert proto.graph.output


def test_training_batch_norm_updates_its_running_statistics_and_evaluates_with_them(tmp_path):
    """A train-mode BatchNorm exports as BatchNormalization(training_mode=1): the artifacts train
    with batch statistics, update the running ones (the mean as PyTorch does, the variance with
    the biased batch variance, ONNX's rule) and the eval model normalizes with them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3, momentum=0.2), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    x = torch.randn(8, 1, 6, 6)
    labels = np.array([0, 1, 1, 0, 1, 0, 0, 1], np.int32)
    proto = export_for_training(model, (x,), input_names=["image"], dynamic_shapes=BATCH)
    artifacts.generate_artifacts(proto, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    assert "1.running_mean" in state.parameters and "1.running_var" in state.parameters
    np.testing.assert_array_equal(model[1].running_mean.numpy(), np.zeros(3, np.float32))  # the export ran it
    loss = module(x.numpy(), labels)
    expected = torch.nn.functional.cross_entropy(model(x), torch.tensor(labels, dtype=torch.long))  # updates buffers
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)

    bn = model[1]
    np.testing.assert_allclose(state.parameters["1.running_mean"].data, bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    count = 8 * 4 * 4
    unbiased = (bn.running_var.numpy() - 0.8) / 0.2  # PyTorch's update from 1: 0.8 * 1 + 0.2 * var
    np.testing.assert_allclose(state.parameters["1.running_var"].data, 0.8 + 0.2 * unbiased * (count - 1) / count,
                               rtol=1e-5)

    module.eval()
    bn.running_var.copy_(torch.tensor(state.parameters["1.running_var"].data))
    eval_loss = module(x.numpy(), labels)
    expected = torch.nn.functional.cross_entropy(model.eval()(x), torch.tensor(labels, dtype=torch.long))
    np.testing.assert_allclose(float(eval_loss), expected.item(), rtol=1e-5)


class _TiedLanguageModel(nn.Module):
    """An LM head sharing the embedding's weight (listed second, the exporter meets it first)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def test_tied_parameters_keep_their_first_name_and_get_both_uses_gradients():
    torch.manual_seed(0)
    model = _TiedLanguageModel()
    ids = torch.tensor([[1, 5, 7], [0, 11, 3]])
    proto = export_for_training(model, (ids,), input_names=["ids"])
    names_in_model = [n for n, _ in model.named_parameters()]
    assert sorted(t.name for t in proto.graph.initializer) == sorted(names_in_model)
    out = model(ids)
    weight = np.random.default_rng(0).standard_normal(tuple(out.shape)).astype(np.float32)
    ours = training_gradients(proto, names_in_model, {"ids": ids.numpy()}, weight)
    (out * torch.tensor(weight)).sum().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(ours[name], p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5-encoder", "swin", "bart", "bloom", "xlnet", "funnel",
                                  "modernbert", "convbert", "convnext", "wav2vec2", "whisper-encoder"])
def test_hugging_face_architectures_train_from_artifacts_with_torch_gradients(name):
    pytest.importorskip("transformers")
    from tests.ortmodule.test_hf_architectures import ARCHITECTURES, _Head

    make, data = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = _Head(make()).eval()
    x = data()
    proto = export_for_training(model, (x,), input_names=["x"])
    out = model(x)
    weight = np.random.default_rng(0).standard_normal(tuple(out.shape)).astype(np.float32)
    used = {t.name for t in proto.graph.initializer}  # (parameters the output does not read are gone)
    # (Whisper's sinusoidal positions are a frozen parameter: requires_grad=False)
    trained = [n for n, p in model.named_parameters() if n in used and p.requires_grad]
    ours = training_gradients(proto, trained, {"x": x.numpy()}, weight)
    (out * torch.tensor(weight)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    scale = max(float(g.abs().max()) for g in grads.values() if g is not None)
    for key, value in ours.items():
        np.testing.assert_allclose(value, grads[key].numpy(), rtol=1e-4, atol=1e-5 * scale, err_msg=key)


def test_a_parameter_left_without_gradient_path_is_refused():
    """nn.Embedding(max_norm=...) renormalizes its weight in place under no_grad: the exported
    graph cannot, and its Gather reads the cut; the artifacts would never train the weight."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2))
    with pytest.raises(ExportError, match="no gradient to 0.weight, which PyTorch's autograd reaches"):
        export_for_training(model, (torch.tensor([[1, 2, 3]]),))


class _CTCRecognizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.project = nn.Linear(6, 5)

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.project(x).log_softmax(-1)
        return nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="none",
                                      zero_infinity=True)


class _PackedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 4, bidirectional=True, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


@pytest.mark.parametrize("case", ["ctc", "packed"])
def test_the_ctc_loss_and_packed_sequences_export_with_pytorchs_gradients(case):
    """Captured as ORTModule captures them (a scan over the frames / the padded batch with masked
    scans): artifacts built from the export train with PyTorch's gradients."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "ctc":
        model = _CTCRecognizer()
        args = (torch.randn(12, 3, 6, generator=g), torch.randint(1, 5, (3, 4), generator=g),
                torch.tensor([12, 9, 6]), torch.tensor([4, 3, 2]))
        names = ["x", "targets", "input_lengths", "target_lengths"]
    else:
        model = _PackedEncoder()
        args = (torch.randn(3, 7, 6, generator=g), torch.tensor([4, 7, 2]))
        names = ["x", "lengths"]
    out = model(*args)
    weight = np.random.default_rng(0).standard_normal(tuple(out.shape)).astype(np.float32)
    (out * torch.tensor(weight)).sum().backward()
    expected = {n: p.grad.numpy() for n, p in model.named_parameters()}
    exported = export_for_training(model, args, input_names=names)
    ours = training_gradients(exported, list(expected), {n: a.numpy() for n, a in zip(names, args)}, weight)
    for name in expected:
        np.testing.assert_allclose(ours[name], expected[name], rtol=1e-4, atol=1e-5)



class _MovingAverage(torch.nn.Module):
    """Centres its input by an exponential moving average it keeps as a buffer."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.register_buffer("average", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            self.average.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.layer(x - self.average)


@pytest.mark.parametrize("factory", [lambda: MomentumEncoder(features=4), _MovingAverage],
                         ids=["momentum-encoder", "moving-average"])
def test_state_the_forward_updates_is_refused_by_name_and_left_as_it_was(factory):
    """A momentum encoder (its key encoder's parameters) or a moving average (a buffer), updated
    in the forward: the artifacts kept them as exported, and training lost every update after
    the first step's. The export's own run of the module leaves them as they were."""
    torch.manual_seed(0)
    model = factory()
    before = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    with pytest.raises(ExportError, match=r"forward changes \['(k\.weight|average)'"):
        export_for_training(model, (torch.randn(3, 4),))
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


class _Temperature(torch.nn.Module):
    """A learnable scalar (CLIP's logit_scale) next to a layer."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return (self.layer(x) * self.scale.exp()).logsumexp(-1).mean()


def test_a_scalar_parameter_trains_with_pytorchs_gradient(tmp_path):
    """requires_grad=None left a rank-0 parameter out of the checkpoint (a constant), silently."""
    torch.manual_seed(0)
    model, x = _Temperature(), torch.randn(5, 4)
    export_for_training(model, (x,), tmp_path / "model.onnx", input_names=["x"])
    artifacts.generate_artifacts(str(tmp_path / "model.onnx"), loss=None, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert sorted(n for n, p in state.parameters if p.requires_grad) == ["layer.bias", "layer.weight", "scale"]
    Module(tmp_path / "training_model.onnx", state)(x.numpy())
    model(x).backward()
    np.testing.assert_allclose(state.parameters["scale"].grad, model.scale.grad.numpy(), rtol=1e-5)


class _NormedQKV(torch.nn.Module):
    """RMSNorm, then a fused projection split in three (Phi-3's, nanoGPT's attention input)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(8)
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).split(8, dim=-1)
        return (q * k + v).pow(2).mean()


def test_a_split_after_rms_norm_trains_with_dynamic_shapes(tmp_path):
    """Shape inference cannot type RMSNorm's ReduceMean (its axes a Reshape until folded), so the
    split after it stayed SplitToSequence + SequenceAt, which have no gradient rule: refused."""
    torch.manual_seed(0)
    model = _NormedQKV()
    dims = ({0: torch.export.Dim("batch", min=2, max=8), 1: torch.export.Dim("seq", min=2, max=16)},)
    export_for_training(model, (torch.randn(2, 5, 8),), tmp_path / "model.onnx", input_names=["x"],
                        dynamic_shapes=dims)
    artifacts.generate_artifacts(str(tmp_path / "model.onnx"), loss=None, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    for shape in ((3, 7, 8), (2, 4, 8)):
        x = torch.randn(*shape)
        model.zero_grad()
        expected = model(x)
        expected.backward()
        module.lazy_reset_grad()
        np.testing.assert_allclose(module(x.numpy()), expected.item(), rtol=1e-5)
        for name, parameter in model.named_parameters():
            np.testing.assert_allclose(state.parameters[name].grad, parameter.grad.numpy(), rtol=1e-4, atol=1e-6)


class _AnswerSpan(torch.nn.Module):
    """Hugging Face's question-answering loss: positions past the sequence are ignored, by an
    ignore_index that is the (dynamic) sequence length."""

    def __init__(self, weighted=False):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, 6) if weighted else None)

    def forward(self, x, positions):
        logits = self.layer(x).squeeze(-1)
        ignored = logits.size(1)
        weight = self.class_weight[:ignored] if self.class_weight is not None else None
        return torch.nn.functional.cross_entropy(logits, positions.clamp(0, ignored), weight=weight,
                                                 ignore_index=ignored)


@pytest.mark.parametrize("weighted", [False, True])
def test_an_ignore_index_known_at_run_time_only_trains_as_pytorch(tmp_path, weighted):
    torch.manual_seed(0)
    model = _AnswerSpan(weighted)
    batch, seq = torch.export.Dim("batch", min=2, max=8), torch.export.Dim("seq", min=2, max=6)
    export_for_training(model, (torch.randn(2, 6, 4), torch.tensor([1, 5])), tmp_path / "model.onnx",
                        input_names=["x", "positions"], dynamic_shapes=({0: batch, 1: seq}, {0: batch}))
    artifacts.generate_artifacts(str(tmp_path / "model.onnx"), loss=None, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    for x, positions in ((torch.randn(3, 5, 4), torch.tensor([4, 9, 0])),  # 9: past the end, ignored
                         (torch.randn(2, 3, 4), torch.tensor([2, 1]))):
        model.zero_grad()
        expected = model(x, positions)
        expected.backward()
        module.lazy_reset_grad()
        np.testing.assert_allclose(module(x.numpy(), positions.numpy()), expected.item(), rtol=1e-5)
        for name, parameter in model.named_parameters():
            np.testing.assert_allclose(state.parameters[name].grad, parameter.grad.numpy(), rtol=1e-4, atol=1e-6)
