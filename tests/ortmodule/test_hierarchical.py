"""HierarchicalORTModule: the parts of a model ORTModule can run go to ONNX Runtime, the rest
stays in PyTorch, and training is eager's."""

from __future__ import annotations

import copy

import pytest

from tests.ortmodule._unsupported import without_dft_rule  # noqa: F401  (a fixture)
from tests.ortmodule.test_autograd_functions import RoundSTE
from tests.torch_models import MLP, MomentumEncoder, torch

from onnxtrain.torch import DebugOptions, HierarchicalORTModule, ORTModule, ORTModuleFallbackWarning


# every test here: hfft's DFT has no gradient rule, so ORTModule cannot build _Spectral
pytestmark = pytest.mark.usefixtures("without_dft_rule")


class _Spectral(torch.nn.Module):
    """torch.fft.hfft's one-sided inverse DFT, whose rule is out (the fixture above): ORTModule cannot build it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 6)

    def forward(self, x):
        return torch.fft.hfft(self.proj(x).to(torch.complex64))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x))) + x


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(_Block(), _Block())
        self.bn = torch.nn.BatchNorm1d(16)
        self.act = torch.nn.GELU()
        self.spectral = _Spectral()
        self.head = torch.nn.Linear(10, 3)
        self.shared = _Block()  # called twice per forward
        self.drop = torch.nn.Dropout(0.3)  # stays in PyTorch: draws from torch's generator

    def forward(self, x):
        h = self.shared(self.shared(self.act(self.bn(self.encoder(x)))))
        return self.head(self.drop(self.spectral(h)))


def _close_gradients(model, eager):
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        # a bias right before a training-mode BatchNorm has a zero gradient: compare to the scale of all
        scale = max(r.grad.abs().max() for r in eager.parameters())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_the_parts_that_build_run_in_onnx_runtime_and_training_is_eagers():
    torch.manual_seed(0)
    eager = _Net()
    model = HierarchicalORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, eager)]  # made before the first call
    x = torch.randn(8, 16)
    for step in range(3):
        # the same dropout masks: recording the calls at the first one left torch's generator as it was
        torch.manual_seed(step)
        out = model(x)
        torch.manual_seed(step)
        ref = eager(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        for optimizer in optimizers:
            optimizer.zero_grad()
        out.square().mean().backward()
        ref.square().mean().backward()
        _close_gradients(model, eager)
        for optimizer in optimizers:
            optimizer.step()

    assert model.wrapped == ["encoder", "bn", "spectral.proj", "head", "shared"]
    assert set(model.unsupported) == {"", "spectral"}
    assert all(r.startswith("UnsupportedOpError: ") and "DFT" in r for r in model.unsupported.values())
    net = model.module
    assert isinstance(net.encoder, ORTModule) and isinstance(net.shared, ORTModule)
    assert isinstance(net.act, torch.nn.GELU)  # no parameters: a session call would cost more than the op
    assert not isinstance(net.spectral, ORTModule) and isinstance(net.spectral.proj, ORTModule)
    assert net.shared.export_count == 1 and net.encoder.export_count == 1  # built once, at the first call
    # the first call's recording left the BatchNorm statistics as one call leaves them
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(model.state_dict()[key], eager.state_dict()[key], msg=key)


class _WideBatchesTakeAnotherPath(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        return _Spectral.forward(self, x)[..., :16] if x.shape[0] > 8 else h  # (hfft: no gradient rule here)


def test_a_part_that_falls_back_later_leaves_wrapped_for_unsupported():
    """A chosen part whose later build fails runs in PyTorch from then on: wrapped still listed
    it, and unsupported did not say why."""
    model = HierarchicalORTModule(torch.nn.Sequential(torch.nn.Linear(16, 16), _WideBatchesTakeAnotherPath()))
    model(torch.randn(4, 16)).sum().backward()
    assert model.wrapped == [""] and model.unsupported == {}
    with pytest.warns(ORTModuleFallbackWarning):
        model(torch.randn(12, 16)).sum().backward()
    assert model.wrapped == []
    assert list(model.unsupported) == [""] and model.unsupported[""].startswith("fell back on a later call: ")


def test_a_whole_module_that_builds_becomes_one_ortmodule():
    model = HierarchicalORTModule(MLP())
    model(torch.randn(4, 12)).sum().backward()
    assert model.wrapped == [""] and model.unsupported == {}
    assert isinstance(model.module, ORTModule) and model.module.export_count == 1


def test_plain_ortmodule_of_the_same_model_falls_back_entirely():
    """What HierarchicalORTModule is for: ORTModule runs none of _Net in ONNX Runtime."""
    model = ORTModule(_Net())
    with pytest.warns(ORTModuleFallbackWarning, match="DFT"):
        model(torch.randn(8, 16)).sum().backward()
    assert model.fallback_reason is not None  # every later call runs in PyTorch


def test_names_and_state_dict_are_the_models():
    torch.manual_seed(0)
    eager = _Net()
    model = HierarchicalORTModule(copy.deepcopy(eager))
    model(torch.randn(8, 16))
    assert list(model.state_dict()) == list(eager.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert "encoder" in dict(model.named_modules())
    eager.head.weight.data.fill_(0.5)
    model.load_state_dict(eager.state_dict())
    torch.testing.assert_close(model.module.head.module.weight, eager.head.weight)
    assert model.head is model.module.head  # attributes are the model's


def test_a_forward_that_changes_its_input_in_place_changes_it_once():
    class Doubling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)
            return self.fc(x)

    torch.manual_seed(0)
    eager = Doubling()
    model = HierarchicalORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    x_model, x_eager = x.clone(), x.clone()
    torch.testing.assert_close(model(x_model), eager(x_eager))
    torch.testing.assert_close(x_model, x_eager)


@pytest.mark.parametrize("wrapper", [ORTModule, HierarchicalORTModule])
def test_parameters_the_forward_changes_in_place_change_as_in_eager(wrapper):
    """ORTModule wrote buffers back but not frozen parameters (the key encoder stayed as it
    was); HierarchicalORTModule's recording run updated them once more."""
    torch.manual_seed(0)
    eager = MomentumEncoder()
    model = wrapper(copy.deepcopy(eager))
    x = torch.randn(4, 8)
    for _ in range(3):
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dict(model.named_parameters())["k.weight"], eager.k.weight)


def test_a_parent_loads_its_own_state_dict_and_the_wrapper_passes_attributes_on():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    parent = torch.nn.ModuleDict({"h": HierarchicalORTModule(net)})
    parent.load_state_dict(parent.state_dict())  # before the first call
    model = parent["h"]
    model(torch.randn(3, 4)).sum().backward()
    parent.load_state_dict(parent.state_dict())  # and after
    assert isinstance(model.module, ORTModule) and model[0] is net[0]  # the wrapped Sequential still indexes
    model.scale = 2.0
    model.register_buffer("offset", torch.zeros(2))
    assert net.scale == 2.0 and "offset" in dict(net.named_buffers()) and "offset" in model.state_dict()


class _Quantized(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
        self.q = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(RoundSTE.apply(self.q(self.enc(x)) * 4) / 4)


def test_the_parts_are_chosen_for_training_even_when_the_first_call_is_a_validation_pass():
    """Under torch.no_grad() the custom Function is no obstacle (an inference graph): choosing
    there made the whole model one ORTModule, which fell back whole at the first training call."""
    torch.manual_seed(0)
    eager = _Quantized()
    model = HierarchicalORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    x = torch.randn(6, 8)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager.eval()(x), rtol=1e-5, atol=1e-6)
    model.train()
    eager.train()
    model(x).sum().backward()  # fallback=False: a part that cannot train would raise
    eager(x).sum().backward()
    assert model.wrapped == ["enc", "q", "head"]
    _close_gradients(model, eager)


def test_a_deep_copy_is_a_hierarchical_module_that_trains_on_its_own():
    """copy.deepcopy (EMA, AveragedModel) found the wrapped module's __deepcopy__ through the
    wrapper's attribute forwarding: the copy was the inner ORTModule (after a first call), or the
    bare PyTorch model where the model's class has a __deepcopy__ of its own."""
    class OwnCopy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(12, 5)

        def forward(self, x):
            return self.lin(x)

        def __deepcopy__(self, memo):
            twin = OwnCopy()
            twin.load_state_dict(self.state_dict())
            return twin

    torch.manual_seed(0)
    x = torch.randn(8, 12)
    for model in (HierarchicalORTModule(MLP()), HierarchicalORTModule(OwnCopy())):
        model(x).sum().backward()
        twin = copy.deepcopy(model)
        assert type(twin) is HierarchicalORTModule and twin.wrapped == model.wrapped
        torch.testing.assert_close(twin(x), model(x))
        with torch.no_grad():
            next(twin.parameters()).add_(1.0)
        assert not torch.equal(twin(x), model(x))  # its own parameters
