"""ORTModule across a wrapped module's life, against eager PyTorch: tensors that require grad
outside the module's parameters, buffers the forward resets or grows, parameters replaced with
another shape, torch.func transforms over the module, and ORTModules nested in ORTModules."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402


def _assert_same_training(model, ref, params, ref_params, steps=3, make_input=None):
    """Train ``model`` (wrapped) and ``ref`` (eager) side by side with SGD; losses, gradients
    and parameters must agree at every step."""
    optimizer, ref_optimizer = torch.optim.SGD(params, lr=0.3), torch.optim.SGD(ref_params, lr=0.3)
    for step in range(steps):
        torch.manual_seed(step)
        x = make_input(step) if make_input else torch.randn(5, 4)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        loss, ref_loss = model(x).square().sum(), ref(x).square().sum()
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * float(q.grad.abs().max()))
        optimizer.step()
        ref_optimizer.step()


class Tempered(torch.nn.Module):
    """A learnable temperature kept as a plain tensor, not an ``nn.Parameter``."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.temperature = torch.tensor(2.0, requires_grad=True)

    def forward(self, x):
        return self.linear(x) / self.temperature


class ListedLayers(torch.nn.Module):
    """Layers held in a plain list: their parameters are not the module's."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 3)
        self.helpers = [torch.nn.Linear(3, 3)]

    def forward(self, x):
        return self.helpers[0](torch.tanh(self.first(x)))


def test_tensor_requiring_grad_outside_the_parameters_falls_back():
    # held as a constant in the graph it would get no gradient and never change
    torch.manual_seed(0)
    net = Tempered()
    ref = copy.deepcopy(net)
    model = ORTModule(net)
    with pytest.warns(ORTModuleFallbackWarning, match=r"require grad but are not its parameters \(temperature\)"):
        _assert_same_training(model, ref, [*net.parameters(), net.temperature], [*ref.parameters(), ref.temperature])
    with pytest.raises(ExportError, match="temperature.*Register them as parameters"):
        ORTModule(Tempered(), DebugOptions(fallback=False))(torch.randn(2, 4))


def test_parameters_of_listed_layers_are_named():
    with pytest.raises(ExportError, match=r"helpers\[0\]\.weight, helpers\[0\]\.bias"):
        ORTModule(ListedLayers(), DebugOptions(fallback=False))(torch.randn(2, 4))


class GradOnItsInput(torch.nn.Module):
    """Sets requires_grad on a view of its input, as Wav2Vec2's feature encoder does."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = x[:, None]
        h.requires_grad = True
        return self.linear(h)


def test_a_leaf_the_forward_makes_itself_is_no_obstacle():
    torch.manual_seed(0)
    net = GradOnItsInput()
    ref = copy.deepcopy(net)
    model = ORTModule(net, DebugOptions(fallback=False))
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()), steps=2)


class StatefulBuffer(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.mode = mode
        self.register_buffer("state", torch.arange(4.0)[:, None])

    def forward(self, x):
        if self.mode == "zero":
            self.state.zero_()
        elif self.mode == "assign":
            self.state = torch.full((4, 1), 0.5)
        elif self.mode == "grow":  # a cache that grows with each call
            self.state = torch.cat([self.state, x[:1, :1].detach()])
        return self.linear(x) * (1 + self.state.mean())


@pytest.mark.parametrize("mode", ["zero", "assign", "grow"])
def test_buffer_the_forward_sets_or_grows(mode):
    torch.manual_seed(0)
    net = StatefulBuffer(mode)
    ref = copy.deepcopy(net)
    model = ORTModule(net, DebugOptions(fallback=False))
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()))
    torch.testing.assert_close(net.state, ref.state)


def test_parameter_replaced_with_another_shape():
    # a classifier head grown after training started
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    ref = copy.deepcopy(net)
    model = ORTModule(net, DebugOptions(fallback=False))
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()), steps=1)
    torch.manual_seed(1)
    weight, bias = torch.randn(6, 4), torch.randn(6)
    net[2].weight, net[2].bias = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
    ref[2].weight, ref[2].bias = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()), steps=2)
    assert model.fallback_reason is None and model.export_count == 2


class _TiedLanguageModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.zeros(4))
        self.mix = torch.nn.Module()
        self.mix.register_buffer("shift", self.shift)  # one buffer in two places

    def forward(self, x):
        ids = (x.abs() * 3).long().clamp(max=9)[:, :2]
        return self.head(torch.tanh(self.emb(ids) + self.shift) * (1 + self.mix.shift)).mean(1) * 0.1


@pytest.mark.parametrize("how", ["new parameter", "load_state_dict(assign=True)"])
def test_untying_after_the_first_call_exports_again(how):
    """Tied places are one graph input: untying them later (a head of its own, or
    load_state_dict(assign=True), which gives every place its own tensor) kept running the tied
    graph, whose keys (names, shapes, dtypes) had not changed: one tensor read in both places,
    the other without gradient. Tying and untying are part of the call's key."""
    torch.manual_seed(0)
    net = _TiedLanguageModel()
    ref = copy.deepcopy(net)
    model = ORTModule(net, DebugOptions(fallback=False))
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()), steps=1)
    torch.manual_seed(1)
    head, shift = torch.randn(10, 4), torch.rand(4)
    for m in (net, ref):
        if how == "new parameter":
            m.head.weight = torch.nn.Parameter(head.clone())
            m.mix.shift = shift.clone()
        else:
            m.load_state_dict({**{k: v.clone() for k, v in m.state_dict().items()}, "head.weight": head.clone(),
                               "mix.shift": shift.clone()}, assign=True)
    assert net.head.weight is not net.emb.weight
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()), steps=2)
    assert model.export_count == 2
    net.head.weight = net.emb.weight  # the weights tied again, the buffers still apart: a third graph
    ref.head.weight = ref.emb.weight
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()), steps=1)
    assert model.export_count == 3


def test_torch_func_transforms_run_in_pytorch_for_their_calls_only():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    ref = copy.deepcopy(net)
    model = ORTModule(net)
    x = torch.randn(6, 4)
    model(x).sum().backward()
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss_of(module):
        return lambda p: torch.func.functional_call(module, p, (x,)).square().sum()

    with pytest.warns(ORTModuleFallbackWarning, match="torch.func transform"):
        got = torch.func.grad(loss_of(model))(params)
    with pytest.warns(ORTModuleFallbackWarning, match="torch.func transform"):
        per_sample = torch.func.vmap(model)(x.view(2, 3, 4))
    expected = torch.func.grad(loss_of(ref))(params)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
    torch.testing.assert_close(per_sample, torch.func.vmap(ref)(x.view(2, 3, 4)))
    assert model.fallback_reason is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # still in ONNX Runtime
    assert model.export_count == 1
    with pytest.raises(ExportError, match="torch.func transform"):
        torch.func.vmap(ORTModule(copy.deepcopy(ref), DebugOptions(fallback=False)))(x.view(2, 3, 4))


def test_functional_call_with_the_wrapped_modules_own_parameters():
    """Fast weights for a module that holds its parameters itself (ORTModule(nn.Linear)):
    functional_call finds no parameter of that name on the wrapper and sets the attribute, which
    the wrapped module refused ("cannot assign 'torch.FloatTensor' as parameter 'weight'")."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    ref = copy.deepcopy(net)
    model = ORTModule(net, DebugOptions(fallback=False))
    x = torch.randn(4, 3)
    model(x).sum().backward()
    originals = dict(net.named_parameters())
    fast = {k: (v.detach() * 0.5).requires_grad_() for k, v in ref.named_parameters()}
    eager_fast = {k: v.detach().clone().requires_grad_() for k, v in fast.items()}
    out = torch.func.functional_call(model, fast, (x,))
    expected = torch.func.functional_call(ref, eager_fast, (x,))
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for name, tensor in fast.items():
        torch.testing.assert_close(tensor.grad, eager_fast[name].grad)
    assert dict(net.named_parameters()) == originals  # put back
    torch.testing.assert_close(model(x), ref(x))
    assert model.export_count == 1


class Parent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh())
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("inner_called_first", [False, True])
def test_ortmodule_inside_an_ortmodule(inner_called_first):
    # the outer export traces the inner module's own forward; the inner stays usable on its own
    torch.manual_seed(0)
    parent = Parent()
    ref = copy.deepcopy(parent)
    parent.block = ORTModule(parent.block, DebugOptions(fallback=False))
    if inner_called_first:
        parent.block(torch.randn(3, 4))
    outer = ORTModule(parent, DebugOptions(fallback=False))
    _assert_same_training(outer, ref, list(parent.parameters()), list(ref.parameters()), steps=2)
    assert outer.export_count == 1 and parent.block.fallback_reason is None
    _assert_same_training(parent, ref, list(parent.parameters()), list(ref.parameters()), steps=1)
    assert parent.block.fallback_reason is None


def test_ortmodule_of_an_ortmodule():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    ref = copy.deepcopy(net)
    model = ORTModule(ORTModule(net), DebugOptions(fallback=False))
    _assert_same_training(model, ref, list(net.parameters()), list(ref.parameters()), steps=2)


def test_a_new_batch_size_re_exports_batch_norm_on_rows():
    # Linear -> BatchNorm1d on [batch, features]: the re-export at a second batch size made a backward
    # graph whose input (a row of ones for the sums over the batch) had no type; onnxruntime refused it
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    module = copy.deepcopy(ref)
    model = ORTModule(module, DebugOptions(fallback=False))
    sizes = [4, 8, 3]
    _assert_same_training(model, ref, list(module.parameters()), list(ref.parameters()), steps=len(sizes),
                          make_input=lambda step: torch.randn(sizes[step], 4))
    torch.testing.assert_close(module[1].running_var, ref[1].running_var)
    assert model.export_count == 2 and model.fallback_reason is None


def test_activation_checkpointing_around_an_ortmodule():
    # non-reentrant checkpointing counts the tensors a forward saves and compares the recomputation's:
    # the export's own tracing, on the calls that export, must not count
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    module = copy.deepcopy(ref)
    model = ORTModule(module, DebugOptions(fallback=False))
    for step, batch in enumerate([4, 4, 6]):
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(step))
        grads = []
        for block in (model, ref):
            block.zero_grad()
            leaf = x.clone().requires_grad_()
            checkpoint(block, leaf, use_reentrant=False).square().sum().backward()
            grads.append([leaf.grad, *(p.grad for p in block.parameters())])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert model.export_count == 2


class _TakesAView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, v):
        return x @ self.w + v.sum(0)


@pytest.mark.parametrize("view", [lambda w: w[:2], lambda w: w.t()], ids=["rows", "transposed"])
def test_a_view_of_the_modules_parameter_as_an_argument(view):
    # torch's export cannot take an input aliasing the module's state: it failed, and fell back for good
    torch.manual_seed(0)
    ref = _TakesAView()
    module = copy.deepcopy(ref)
    model = ORTModule(module, DebugOptions(fallback=False))
    x = torch.randn(3, 4)
    for m in (model, ref):
        m(x, view(m.w)).square().sum().backward()
    torch.testing.assert_close(module.w.grad, ref.w.grad, rtol=1e-5, atol=1e-5)


class _CausalWhenLong(torch.nn.Module):
    """Causal attention only over more than one position (transformers' ``is_causal = length > 1``)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=x.shape[1] > 1)


def test_a_call_that_cannot_export_dynamically_gets_its_own_shapes():
    # with dynamic=True (ORTTrainer's default) a model whose code needs a concrete length (in
    # transformers, a length-1 batch's is_causal) failed the export, and ran in PyTorch from then on
    torch.manual_seed(0)
    ref = _CausalWhenLong()
    module = copy.deepcopy(ref)
    model = ORTModule(module, DebugOptions(fallback=False), dynamic=True)
    for length in (5, 1, 7):
        x = torch.randn(2, length, 8)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    # no dynamic graph exports (the symbolic bool): each length gets a graph of its own shapes
    assert model.export_count == 3 and model.fallback_reason is None


def test_a_call_eager_also_rejects_raises_its_error_and_keeps_onnx_runtime():
    """A batch of one through a training BatchNorm, a wrong feature size: the module's own error,
    for that call only (a loop that skips the bad batch kept running in PyTorch for good), and
    without the capture's pages of fake-tensor tracebacks in the log."""
    torch.manual_seed(0)
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)))
    model(torch.randn(5, 8)).sum().backward()
    exports = model.export_count
    import logging

    logged = []
    handler = logging.Handler()
    handler.emit = logged.append
    fake_tensors = logging.getLogger("torch._subclasses.fake_tensor")
    fake_tensors.addHandler(handler)
    try:
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            model(torch.randn(1, 8))
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            model(torch.randn(4, 9))
    finally:
        fake_tensors.removeHandler(handler)
    assert not logged
    assert model.fallback_reason is None
    model(torch.randn(5, 8)).sum().backward()
    assert model.fallback_reason is None and model.export_count == exports  # the first graph again


def test_a_parents_strict_load_names_the_keys_as_state_dict_writes_them():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                ORTModule(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))))
    state = model.state_dict()
    state.pop("2.0.weight")
    state["2.9.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(state)
    assert '"2.0.weight"' in str(error.value) and '"2.9.weight"' in str(error.value)
    assert "_original_module" not in str(error.value)
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["2.0.weight"] and result.unexpected_keys == ["2.9.weight"]


def test_torch_jit_trace_records_the_wrapped_forward_and_keeps_onnx_runtime():
    """torch.jit.trace over an ORTModule made it export under the JIT tracer, which failed
    ('Tensor' object has no attribute 'node'): the module then ran in PyTorch for good (or the
    trace raised, with fallback=False). The trace records the module's own forward, as
    torch.export's does."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = ORTModule(copy.deepcopy(ref), DebugOptions(fallback=False))
    x = torch.randn(5, 4)
    model(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(torch.nn.Sequential(model, torch.nn.ReLU()), (x,), check_trace=False)
    torch.testing.assert_close(traced(x), torch.relu(ref(x)))
    assert model.fallback_reason is None and model.export_count == 1
    torch.testing.assert_close(model(x), ref(x))


def test_a_deleted_module_leaves_no_traced_graph_behind():
    """The export traced under saved-tensor hooks that kept tensors as they were: an op saving its
    own output (ReLU, Tanh) made a cycle through C++ that gc cannot break, so every export's fake
    autograd graph and fake tensor mode (and tensors the size of the module's buffers) stayed
    alive after the module was deleted."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake_modes():
        gc.collect()
        return sum(isinstance(o, FakeTensorMode) for o in gc.get_objects())

    def build_and_drop():
        wrapped = ORTModule(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Tanh()),
                            DebugOptions(fallback=False))
        wrapped(torch.randn(4, 8)).sum().backward()

    build_and_drop()
    before = fake_modes()
    for _ in range(3):
        build_and_drop()
    assert fake_modes() - before < 2
