"""ORTModule and the wrapped module's plain Python attributes: a change the forward reads runs a
graph exported for the new value (as eager would compute), switching back reuses the earlier
graph, a forward that sets attributes while traced does not export on every call, an attribute
the forward does not read costs one export and is then left alone, and one that changes the
graph and keeps taking new values sends the module to PyTorch past ATTRIBUTE_EXPORT_LIMIT."""

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402
from onnxtrain.torch._attributes import AttributeRecord  # noqa: E402
from onnxtrain.torch.ortmodule import ATTRIBUTE_EXPORT_LIMIT  # noqa: E402


class Scaled(torch.nn.Module):
    """Reads a float, a flag and a string from itself and an int from a submodule."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)
        self.scale = 2.0
        self.residual = False
        self.activation = "tanh"
        self.inner = torch.nn.Module()
        self.inner.repeats = 1

    def forward(self, x):
        y = self.linear(x) * self.scale
        for _ in range(self.inner.repeats):
            y = torch.tanh(y) if self.activation == "tanh" else torch.relu(y)
        return y + x[:, :4] if self.residual else y


def _scaled_pair(debug_options: DebugOptions | None = None):
    """``Scaled`` eager and wrapped in ORTModule, with the same weights."""
    torch.manual_seed(0)
    eager = Scaled()
    wrapped = ORTModule(Scaled(), debug_options)
    wrapped.module.load_state_dict(eager.state_dict())
    return eager, wrapped


def _trained_step(model, x):
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_matches_eager(wrapped, eager, x):
    out, grads = _trained_step(wrapped, x)
    eager_out, eager_grads = _trained_step(eager, x)
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(grads, eager_grads):  # sums over saturated tanh: float32 rounding
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change", [
    ("scale", 0.5), ("residual", True), ("activation", "relu"), ("inner.repeats", 3),
], ids=["float", "bool", "str", "submodule-int"])
def test_a_changed_attribute_runs_a_graph_exported_for_it(change):
    eager, wrapped = _scaled_pair()
    x = torch.randn(5, 6)
    _assert_matches_eager(wrapped, eager, x)
    path, value = change
    for model in (eager, wrapped.module):
        owner = model.inner if path.startswith("inner.") else model
        setattr(owner, path.split(".")[-1], value)
    _assert_matches_eager(wrapped, eager, x)
    assert wrapped.export_count == 2


def test_switching_back_reuses_the_earlier_graph_and_eval_flags_count():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5))
    wrapped = ORTModule(module)
    x = torch.randn(64, 6)
    with torch.no_grad():
        dropped = wrapped(x)
        module[1].p = 0.0
        kept = wrapped(x)
        assert wrapped.export_count == 2
        torch.testing.assert_close(kept, module[0](x))  # p = 0: nothing dropped
        assert (dropped == 0).sum() > 50  # p = 0.5 did drop (the first graph)
        module[1].p = 0.5
        wrapped(x)
        assert wrapped.export_count == 2  # the first graph again
        module[1].eval()  # a submodule's training flag, the root's unchanged
        torch.testing.assert_close(wrapped(x), module[0](x))
        assert wrapped.export_count == 3


class CountsCalls(torch.nn.Module):
    """Sets an attribute in its forward (so while it is traced)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


def test_a_forward_that_sets_attributes_exports_once():
    wrapped = ORTModule(CountsCalls())
    x = torch.randn(4, 3)
    for _ in range(4):
        wrapped(x).sum().backward()
    assert wrapped.export_count == 1


@pytest.mark.parametrize("fallback", [True, False])
def test_a_graph_changing_attribute_past_the_limit_runs_in_pytorch(fallback):
    eager, wrapped = _scaled_pair(DebugOptions(fallback=fallback))
    x = torch.randn(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for step in range(ATTRIBUTE_EXPORT_LIMIT + 1):
            if step:  # a schedule stepped on every call
                eager.scale = wrapped.module.scale = float(step + 10)
            _assert_matches_eager(wrapped, eager, x)
        eager.scale = wrapped.module.scale = 11.0  # a value seen before: its graph, no new value
        _assert_matches_eager(wrapped, eager, x)
    assert wrapped.export_count == 1 + ATTRIBUTE_EXPORT_LIMIT and wrapped.fallback_reason is None
    eager.scale = wrapped.module.scale = 99.0
    if not fallback:
        with pytest.raises(ExportError, match=r"Scaled's scale \(now 99.0\) took more than 4 new values"):
            wrapped(x)
        return
    with pytest.warns(ORTModuleFallbackWarning, match="register it as a buffer"):
        _assert_matches_eager(wrapped, eager, x)  # PyTorch from now on
    assert wrapped.export_count == 1 + ATTRIBUTE_EXPORT_LIMIT and "scale" in wrapped.fallback_reason


def test_a_value_stored_on_the_module_every_step_costs_one_export():
    module = Scaled()
    module.last_loss = 0.0  # a training loop's bookkeeping, never read by the forward
    wrapped = ORTModule(module)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    x = torch.randn(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for step in range(10):
            optimizer.zero_grad()
            loss = wrapped(x).square().mean()
            loss.backward()
            optimizer.step()
            module.last_loss = loss.item()
    assert wrapped.export_count == 2  # the first, and the one that showed the same graph
    module.scale = 5.0  # the others are still watched
    wrapped(x)
    assert wrapped.export_count == 3


def test_new_shapes_and_new_values_export_once_each():
    module = Scaled()
    wrapped = ORTModule(module)
    wrapped(torch.randn(5, 6))
    wrapped(torch.randn(7, 6))  # a second shape: the dynamic export
    assert wrapped.export_count == 2
    module.scale = 3.0
    for batch in (5, 7, 9):  # one export for the new value serves every batch size
        wrapped(torch.randn(batch, 6))
    assert wrapped.export_count == 3


def test_the_record_holds_scalars_tuples_and_small_flat_containers_only():
    module = Scaled()
    module.table = [1, 2]  # a list of scalars: recorded (a copy)
    module.nested = [[1], [2]]  # nested: not recorded
    module.big = list(range(100))  # past 64 items: not recorded
    module.kernel = (3, 3)
    module.nan = float("nan")
    record = AttributeRecord(module)
    names = set(record.names())
    assert ("", "kernel") in names and ("", "scale") in names and ("inner", "repeats") in names
    assert ("", "table") in names and ("", "nested") not in names and ("", "big") not in names
    assert ("linear", "weight") not in names
    module.nan = float("nan")  # another NaN object: the same value
    module.scale = 2  # int for float: a different constant
    assert [(c.name, c.current) for c in record.changes()] == [("scale", 2)]
    del module.activation
    assert "activation: 'tanh' -> deleted" in [str(c) for c in record.changes()]
    module.table.append(3)  # changed in place
    assert ("table", [1, 2, 3]) in [(c.name, c.current) for c in record.changes()]


def test_a_replaced_submodule_runs_a_graph_exported_for_it():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrapped = ORTModule(eager)
    x = torch.randn(5, 6)
    torch.testing.assert_close(wrapped(x), eager(x))
    eager[1] = torch.nn.Tanh()  # no parameters: the parameter names stay the same
    torch.testing.assert_close(wrapped(x), eager(x))
    assert wrapped.export_count == 2


def test_a_replaced_submodule_is_not_kept_alive_by_the_graphs():
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrapped = ORTModule(model)
    x = torch.randn(5, 6)
    wrapped(x).sum().backward()
    old = weakref.ref(model[0])
    model[0] = torch.nn.Linear(6, 4)  # a new head, say: same names and shapes
    gc.collect()
    assert old() is None  # its parameters are not held either
    torch.testing.assert_close(wrapped(x), model(x))


def test_a_changed_hugging_face_config_runs_a_graph_exported_for_it():
    """A Hugging Face model reads its config in the forward (``output_hidden_states`` adds
    outputs): a config field set after the first call runs a graph exported for it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    eager = transformers.BertModel(config)
    wrapped = ORTModule(transformers.BertModel(config), DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    assert wrapped(input_ids=ids).hidden_states is None
    config.output_hidden_states = True  # the config both models share
    got, expected = wrapped(input_ids=ids), eager(input_ids=ids)
    assert len(got.hidden_states) == len(expected.hidden_states) == 3
    for ours, theirs in zip(got.hidden_states, expected.hidden_states):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ("config", "output_hidden_states") in AttributeRecord(wrapped.module).names()


def test_saving_a_hugging_face_model_does_not_export_again(tmp_path):
    """save_pretrained sets config.architectures (None -> a list, which a set of seen values
    could not hold: the next call crashed) and config.dtype: checkpoint metadata, not watched."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    wrapped = ORTModule(transformers.BertForSequenceClassification(config), DebugOptions(fallback=False))
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    wrapped(input_ids=ids).logits.sum().backward()
    assert config.architectures is None
    wrapped.module.save_pretrained(tmp_path)
    assert config.architectures == ["BertForSequenceClassification"]
    wrapped(input_ids=ids).logits.sum().backward()
    assert wrapped.export_count == 1


def test_an_attribute_that_becomes_unhashable_exports_again():
    eager, wrapped = _scaled_pair()
    x = torch.randn(5, 6)
    eager.tag = wrapped.module.tag = None
    _assert_matches_eager(wrapped, eager, x)
    eager.tag = wrapped.module.tag = ["a list the forward does not read"]
    _assert_matches_eager(wrapped, eager, x)
    assert wrapped.export_count == 2 and wrapped.fallback_reason is None


class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)

    def forward(self, x, options, temperature=1.0):
        return (self.linear(x) * options["gain"] / temperature).softmax(-1)


def test_a_python_number_argument_past_the_limit_names_itself_and_runs_in_pytorch():
    """Each value of a non-tensor argument is a graph of its own (a temperature annealed every
    step was an export per step, every graph kept): past the limit, PyTorch, and a message
    naming the argument."""
    wrapped = ORTModule(_Tempered())
    x = torch.randn(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for step in range(ATTRIBUTE_EXPORT_LIMIT + 1):
            wrapped(x, {"gain": 2.0}, temperature=1.0 + step).sum().backward()
        wrapped(x, {"gain": 2.0}, temperature=2.0)  # a value seen before: its graph
        wrapped(x, {"gain": 3.0}, temperature=2.0)  # another argument's first change
    assert wrapped.export_count == ATTRIBUTE_EXPORT_LIMIT + 2 and wrapped.fallback_reason is None
    with pytest.warns(ORTModuleFallbackWarning, match=r"argument 'temperature' \(now 9.0\), not a tensor, took more "
                                                     r"than 4 new values.*pass it as a tensor"):
        wrapped(x, {"gain": 2.0}, temperature=9.0)
    assert wrapped.export_count == ATTRIBUTE_EXPORT_LIMIT + 2 and not wrapped._variants
    strict = ORTModule(_Tempered(), DebugOptions(fallback=False))
    with pytest.raises(ExportError, match=r"positional argument 1\['gain'\] \(now 6.0\)"):
        for gain in range(1, 7):
            strict(x, {"gain": float(gain)})


def _double(module, inputs, output):
    return output * 2.0


def test_forward_hooks_added_or_removed_after_an_export_run_a_graph_exported_for_them():
    """A hook is part of the traced forward: adding or removing one after the export changes
    what the forward computes, as a changed attribute does."""
    eager, wrapped = _scaled_pair(DebugOptions(fallback=False))
    x = torch.randn(5, 6)
    _assert_matches_eager(wrapped, eager, x)
    with pytest.warns(UserWarning, match="forward hooks"):
        handles = [model.linear.register_forward_hook(_double) for model in (eager, wrapped.module)]
        _assert_matches_eager(wrapped, eager, x)
    assert wrapped.export_count == 2
    for handle in handles:
        handle.remove()
    _assert_matches_eager(wrapped, eager, x)  # the first graph again
    assert wrapped.export_count == 2
    global_handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, inputs, output: output + 1.0 if isinstance(module, torch.nn.Linear) else output)
    try:
        with pytest.warns(UserWarning, match="forward hooks"):
            _assert_matches_eager(wrapped, eager, x)
    finally:
        global_handle.remove()
    assert wrapped.export_count == 3


def test_a_backward_hook_added_after_an_export_runs_the_module_in_pytorch():
    eager, wrapped = _scaled_pair()
    x = torch.randn(5, 6)
    _assert_matches_eager(wrapped, eager, x)
    for model in (eager, wrapped.module):
        model.linear.register_full_backward_pre_hook(lambda module, grad_output: (grad_output[0] * 0.5,))
    with pytest.warns(ORTModuleFallbackWarning, match="backward hook"):
        _assert_matches_eager(wrapped, eager, x)
    assert wrapped.fallback_reason is not None


class _Adapters(torch.nn.Module):
    """PEFT's LoRA layers keep their state so: a dict of scales per adapter, a list of the
    adapters merged into the base weight."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(4, 4)
        self.delta = torch.nn.Linear(4, 4, bias=False)
        self.scaling = {"default": 2.0}
        self.merged = []

    def forward(self, x):
        y = self.base(x)
        return y if "default" in self.merged else y + self.delta(x) * self.scaling["default"]


def test_lists_and_dicts_changed_in_place_run_a_graph_exported_for_them():
    torch.manual_seed(0)
    eager = _Adapters()
    wrapped = ORTModule(_Adapters(), DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    x = torch.randn(3, 4)

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.square().sum().backward()
        return [out.detach()] + [p.grad for p in model.parameters()]

    for change in (None, lambda m: m.scaling.update(default=0.5), lambda m: m.merged.append("default"),
                   lambda m: m.merged.clear()):
        if change is not None:
            change(eager)
            change(wrapped.module)
        for ours, theirs in zip(step(wrapped), step(eager)):  # merged: the delta gets no gradient
            assert (ours is None) == (theirs is None)
            if theirs is not None:
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert wrapped.export_count == 3  # the last change returns to the second graph's values


def test_an_export_inside_parametrize_cached_neither_keeps_nor_leaves_cached_weights():
    """torch.nn.utils.parametrize.cached() on around the first call: the capture must not take a
    weight cached before as a constant, nor leave its fake weight in the cache."""
    from torch.nn.utils import parametrize

    class Symmetric(torch.nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(-1, -2)

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    parametrize.register_parametrization(layer, "weight", Symmetric())
    model, x = ORTModule(layer), torch.randn(3, 4)
    with parametrize.cached():
        before = layer.weight  # cached now
        y = model(x)
        weight = layer.weight
        assert weight is before and type(weight) is torch.Tensor
        (y.square().mean() + 0.01 * weight.square().sum()).backward()  # a weight penalty reads the cache
    assert model.export_count == 1 and model.fallback_reason is None
    with torch.no_grad():
        layer.parametrizations.weight.original.add_(1.0)
    torch.testing.assert_close(model(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
