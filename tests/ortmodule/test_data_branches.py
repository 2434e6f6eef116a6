"""Forwards that branch on their data (``if labels.max() >= vocab: raise ...``, ``assert
(x > 0).all()``, ``if mask.any(): ...``) train in ONNX Runtime along the branches a call's data
takes, instead of failing the export (the capture cannot know a traced tensor's truth).

The capture answers each ``bool(tensor)`` False, or True where False led to a raise (a failed
assertion), and the graph computes each condition as an extra output. A call whose conditions
differ from the answers runs in PyTorch, as written: a check raises as in eager, a rare branch
computes what eager computes."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402


class CheckedLabels(torch.nn.Module):
    """A classification head that checks its labels as Hugging Face's CTC heads do."""

    def __init__(self, classes=5):
        super().__init__()
        self.classes = classes
        self.linear = torch.nn.Linear(6, classes)

    def forward(self, x, labels):
        if labels.max() >= self.classes:
            raise ValueError(f"Label values must be < vocab_size: {self.classes}")
        assert (labels >= 0).all(), "negative labels"
        torch._assert(torch.isfinite(x).all(), "non-finite input")  # (its truth test runs inside torch)
        return torch.nn.functional.cross_entropy(self.linear(x), labels)


class DataBranch(torch.nn.Module):
    """Two computations, chosen by the sign of the input's sum."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > 0:
            return torch.tanh(self.first(x))
        return self.second(x) * 2.0


class GlobalTokens(torch.nn.Module):
    """Longformer's test: extra work only where some token is marked global (``.item()`` of a
    boolean tensor, a Python bool)."""

    def __init__(self):
        super().__init__()
        self.local, self.extra = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, marks):
        out = self.local(x)
        is_global = (marks > 0).flatten().any().item()
        if is_global:
            out = out + self.extra(x) * marks.unsqueeze(-1)
        return out


def _step(model, *args):
    model.zero_grad()
    out = model(*args)
    out.square().sum().backward()
    return out.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for grad, expected in zip(ours[1], theirs[1], strict=True):
        assert (grad is None) == (expected is None)
        if grad is not None:
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


def test_checks_that_pass_train_in_onnx_runtime_and_failing_ones_raise_as_in_eager():
    eager, wrapped = eager_and_wrapped(CheckedLabels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for _ in range(3):
            x, labels = torch.randn(8, 6), torch.randint(0, 5, (8,))
            _assert_same(_step(wrapped, x, labels), _step(eager, x, labels))
    assert wrapped.export_count == 1 and wrapped.fallback_reason is None
    # the assertions' answers are True (False raised while capturing), the check's False
    graph = next(iter(wrapped._variants.values()))[0].graph
    assert graph.assumptions == (False, True, True)
    x = torch.randn(8, 6)
    with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"), \
            pytest.raises(ValueError, match="Label values must be < vocab_size"):
        wrapped(x, torch.tensor([0, 1, 2, 3, 4, 5, 0, 1]))
    with pytest.raises(AssertionError, match="negative labels"):
        wrapped(x, torch.tensor([0, 1, 2, -1, 4, 3, 0, 1]))
    with pytest.raises(AssertionError, match="non-finite input"):
        wrapped(torch.full((8, 6), float("nan")), torch.arange(8) % 5)
    _assert_same(_step(wrapped, x, torch.arange(8) % 5), _step(eager, x, torch.arange(8) % 5))  # still in ORT
    assert wrapped.fallback_reason is None and wrapped.export_count == 1


def _answers(wrapped) -> list:
    return [v.graph.assumptions for variants in wrapped._variants.values() for v in variants if not v.unusable]


def test_a_branch_on_the_data_computes_what_eager_computes_either_way():
    eager, wrapped = eager_and_wrapped(DataBranch)
    negative, positive = -torch.rand(5, 4), torch.rand(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        _assert_same(_step(wrapped, negative), _step(eager, negative))  # the traced branch (answer False)
    assert _answers(wrapped) == [(False,)]
    with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"):
        _assert_same(_step(wrapped, positive), _step(eager, positive))  # the other one: in PyTorch
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)  # said once
        _assert_same(_step(wrapped, negative), _step(eager, negative))  # back on the traced branch
        for _ in range(3):
            _assert_same(_step(wrapped, positive), _step(eager, positive))
        assert wrapped.export_count == 1
        # three calls in a row on the other branch: the next call exports along it (once), so
        # data that keeps taking it runs in ONNX Runtime, the other branch's calls in PyTorch
        _assert_same(_step(wrapped, positive), _step(eager, positive))
        assert _answers(wrapped) == [(True,)] and wrapped.export_count == 2
        _assert_same(_step(wrapped, negative), _step(eager, negative))
        _assert_same(_step(wrapped, positive), _step(eager, positive))
    assert wrapped.export_count == 2 and wrapped.fallback_reason is None
    with torch.no_grad():  # inference calls check their branches too
        torch.testing.assert_close(wrapped(positive), eager(positive))
        torch.testing.assert_close(wrapped(negative), eager(negative))
    assert wrapped.fallback_reason is None


def test_without_fallback_a_call_off_the_traced_branches_raises():
    wrapped = ORTModule(DataBranch(), DebugOptions(fallback=False))
    wrapped(-torch.rand(5, 4))
    with pytest.raises(ExportError, match="branches on the data"):
        wrapped(torch.rand(5, 4))


def test_a_boolean_read_with_item_is_answered_too():
    eager, wrapped = eager_and_wrapped(GlobalTokens)
    x, none, some = torch.randn(2, 5, 4), torch.zeros(2, 5), torch.tensor([[1.0, 0, 0, 0, 0], [0, 0, 1, 0, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        _assert_same(_step(wrapped, x, none), _step(eager, x, none))
    with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"):
        _assert_same(_step(wrapped, x, some), _step(eager, x, some))
    assert wrapped.fallback_reason is None and wrapped.export_count == 1


class HookedBranch(DataBranch):
    """The positive branch registers a gradient hook (which no graph can run)."""

    def forward(self, x):
        if x.sum() > 0:
            h = self.first(x)
            if h.requires_grad:
                h.register_hook(lambda grad: grad * 0.5)
            return torch.tanh(h)
        return self.second(x) * 2.0


def test_a_branch_that_does_not_export_keeps_the_traced_graph():
    eager, wrapped = eager_and_wrapped(HookedBranch)
    negative, positive = -torch.rand(5, 4), torch.rand(5, 4)
    _assert_same(_step(wrapped, negative), _step(eager, negative))
    with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"):
        _assert_same(_step(wrapped, positive), _step(eager, positive))
    for x in (positive, positive, positive, negative, positive):  # the export along the positive branch fails
        _assert_same(_step(wrapped, x), _step(eager, x))
    assert wrapped.fallback_reason is None and wrapped.export_count == 1 and _answers(wrapped) == [(False,)]


def test_data_that_keeps_to_a_branch_that_does_not_export_stops_running_the_graph(monkeypatch):
    """Once the export along the branch the data keeps taking has failed, calls run in PyTorch
    without running the graph first, except now and then (1, 2, 4, ... up to 64 calls apart) to
    see whether the data came back: when it has, calls run in ONNX Runtime again."""
    from onnxtrain.torch import ortmodule

    runs = []

    class CountedFunction:
        @staticmethod
        def apply(*args):
            runs.append(args)
            return ortmodule_function.apply(*args)

    ortmodule_function = ortmodule.ORTFunction
    monkeypatch.setattr(ortmodule, "ORTFunction", CountedFunction)
    eager, wrapped = eager_and_wrapped(HookedBranch)
    negative, positive = -torch.rand(5, 4), torch.rand(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ORTModuleFallbackWarning)
        for x in (negative, positive, positive, positive, positive):  # the export along positive fails
            _assert_same(_step(wrapped, x), _step(eager, x))
        assert len(runs) == 5 and wrapped.export_count == 1
        for _ in range(20):
            _assert_same(_step(wrapped, positive), _step(eager, positive))
        assert len(runs) == 5 + 3  # the graph ran again after 2, 4 and 8 calls without it
        for _ in range(ortmodule._LONGEST_SKIP + 1):  # the data comes back: found at the next look
            before = len(runs)
            _assert_same(_step(wrapped, negative), _step(eager, negative))
            if len(runs) > before:
                break
        for _ in range(3):
            _assert_same(_step(wrapped, negative), _step(eager, negative))
    assert len(runs) == before + 4 and wrapped.fallback_reason is None


class AdaptiveHead(torch.nn.Module):
    """A language-model head with an adaptive softmax over 20 classes in three clusters."""

    def __init__(self):
        super().__init__()
        self.project = torch.nn.Linear(6, 8)
        self.adaptive = torch.nn.AdaptiveLogSoftmaxWithLoss(8, 20, [5, 12], div_value=2.0)

    def forward(self, x, target):
        result = self.adaptive(torch.tanh(self.project(x)), target)
        return result.output, result.loss


def test_an_adaptive_softmax_trains_in_onnx_runtime():
    """PyTorch picks each cluster's rows (``nonzero``) and skips empty clusters: the capture runs
    every tail on every row instead, with the same values and gradients; a target out of range
    raises as in eager."""
    eager, wrapped = eager_and_wrapped(AdaptiveHead)
    # every cluster, then the head's only (its tails get no gradient in eager: the call runs in
    # PyTorch), then every cluster again
    targets = [torch.tensor([0, 3, 6, 11, 13, 19, 5]), torch.tensor([1, 2, 3, 4, 0, 2, 1]),
               torch.tensor([4, 7, 12, 0, 18, 6, 2])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for target in targets:
            x = torch.randn(7, 6)
            results = []
            for model in (wrapped, eager):
                model.zero_grad(set_to_none=True)
                output, loss = model(x, target)
                (loss + output.square().sum()).backward()
                results.append([output.detach(), loss.detach(), *(p.grad for p in model.parameters())])
            for ours, theirs in zip(*results, strict=True):
                assert (ours is None) == (theirs is None)
                if ours is not None:
                    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    said = [str(w.message) for w in caught if issubclass(w.category, ORTModuleFallbackWarning)]
    assert len(said) == 1 and "branches on the data" in said[0]  # the head-only batch, in PyTorch
    assert wrapped.export_count == 1 and wrapped.fallback_reason is None
    lenient = ORTModule(AdaptiveHead())
    lenient(torch.randn(7, 6), targets[0])
    with pytest.warns(ORTModuleFallbackWarning), pytest.raises(RuntimeError, match="Target values should be in"):
        lenient(torch.randn(7, 6), torch.tensor([0, 1, 2, 3, 4, 5, 20]))


class LabelledRows(torch.nn.Module):
    """DeBERTa's classification loss: only rows with a label (>= 0) count, and a batch without
    any gives a zero loss: ``if index.size(0) > 0``, a size the data decides."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x, labels):
        logits = self.linear(x)
        index = (labels >= 0).nonzero()
        if index.size(0) > 0:
            kept = torch.gather(logits, 0, index.expand(index.size(0), logits.size(1)))
            return torch.nn.functional.cross_entropy(kept, torch.gather(labels, 0, index.view(-1)))
        return torch.tensor(0).to(logits)


def test_a_branch_on_a_size_the_data_decides_is_answered_too():
    """The tracer refuses a condition on such a size (``GuardOnDataDependentSymNode``), so the
    module ran in PyTorch; it is answered as PyTorch's size-oblivious reasoning does (nonempty)."""
    eager, wrapped = eager_and_wrapped(LabelledRows)
    x = torch.randn(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for labels in (torch.tensor([0, 2, -1, 1, -1]), torch.tensor([1, 1, 0, 2, 0])):
            _assert_same(_step(wrapped, x, labels), _step(eager, x, labels))
    assert _answers(wrapped) == [(True,)] and wrapped.export_count == 1
    unlabelled = torch.full((5,), -1)
    with pytest.warns(ORTModuleFallbackWarning, match="a size it decides"):
        loss = wrapped(x, unlabelled)
    assert loss.item() == 0.0 and not loss.requires_grad  # eager's constant
    assert wrapped.fallback_reason is None


class NumberBranch(torch.nn.Module):
    """Branches on numbers read with ``.item()``: a float's sign and an integer's size."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x, ids):
        y = self.linear(x)
        if y.sum().item() > 0:
            y = y * 2.0
        if ids.max().item() >= 3:
            y = torch.tanh(y)
        return y


def test_a_branch_on_a_number_read_with_item_is_answered_too():
    eager, wrapped = eager_and_wrapped(NumberBranch)
    x = torch.randn(5, 4)
    x = x if eager.linear(x).sum() > 0 else -x  # (no bias: -x takes the other branch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for ids in (torch.tensor([0, 4]), torch.tensor([1, 3, 2])):
            _assert_same(_step(wrapped, x, ids), _step(eager, x, ids))
    # the first call's guesses (False) exported again along its branches; the second length's
    # dynamic export took the first call's branches at once
    assert _answers(wrapped) == [(True, True)] * 2 and wrapped.export_count == 3
    with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"):
        _assert_same(_step(wrapped, -x, torch.tensor([0, 1])), _step(eager, -x, torch.tensor([0, 1])))
    assert wrapped.fallback_reason is None


class ExpertLoop(torch.nn.Module):
    """A mixture of experts as a loop that skips an expert no row chose (``if rows.numel() == 0``)."""

    def __init__(self, experts=3):
        super().__init__()
        self.gate = torch.nn.Linear(4, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(experts))

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == i)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out


def test_a_loop_of_experts_skipping_empty_ones_trains_in_onnx_runtime():
    eager, wrapped = eager_and_wrapped(ExpertLoop)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for rows in (24, 20, 16):  # (the second length exports with a dynamic batch)
            x = torch.randn(rows, 4)
            _assert_same(_step(wrapped, x), _step(eager, x))
    assert _answers(wrapped) == [(False, False, False)] * 2 and wrapped.export_count == 2
    alike = torch.zeros(12, 4)  # every row chooses the same two experts: the third is skipped, in PyTorch
    with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"):
        _assert_same(_step(wrapped, alike), _step(eager, alike))
    assert wrapped.fallback_reason is None and wrapped.export_count == 2


@pytest.mark.parametrize("fallback", [True, False])
def test_a_first_call_off_the_guessed_branches_exports_along_its_own(fallback):
    """The capture's answers are guesses until a call takes them: a first call whose data takes
    other branches (a head that always marks a global token) exports along them and runs in
    ONNX Runtime, instead of running in PyTorch until three calls agree."""
    eager, wrapped = eager_and_wrapped(GlobalTokens, debug_options=DebugOptions(fallback=fallback))
    x, some = torch.randn(2, 5, 4), torch.tensor([[1.0, 0, 0, 0, 0], [0, 0, 1, 0, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for _ in range(2):
            _assert_same(_step(wrapped, x, some), _step(eager, x, some))
    assert _answers(wrapped) == [(True,)] and wrapped.export_count == 2
    if fallback:  # now a call off the branches a call took runs in PyTorch
        with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"):
            _assert_same(_step(wrapped, x, torch.zeros(2, 5)), _step(eager, x, torch.zeros(2, 5)))
    assert wrapped.fallback_reason is None


def test_debertas_classification_loss_trains_in_onnx_runtime():
    transformers = pytest.importorskip("transformers")
    config = transformers.DebertaV2Config(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=32, max_position_embeddings=20, num_labels=3,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    eager, wrapped = eager_and_wrapped(lambda: transformers.DebertaV2ForSequenceClassification(config))
    ids, labels = torch.randint(0, 50, (4, 7)), torch.tensor([0, 2, -100, 1])
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for model in (wrapped, eager):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for ours, theirs in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    assert wrapped.fallback_reason is None


class TrimmedPadding(torch.nn.Module):
    """Trims a batch's padding to its longest sequence, a number read from the data
    (``int(lengths.max())``, ``range(n)``, a tensor as a list index) and used as a size."""

    def __init__(self, read="int"):
        super().__init__()
        self.read = read
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, lengths):
        if self.read == "int":
            longest = int(lengths.max())
        elif self.read == "range":
            longest = len(range(lengths.max().item()))
        else:  # the tensor as a list index (Tensor.__index__)
            longest = list(range(x.shape[1] + 1))[lengths.max()]
        kept = torch.arange(longest) < lengths[:, None]
        return (self.linear(x[:, :longest]) * kept[..., None]).sum(1)


@pytest.mark.parametrize("read", ["int", "range", "index"])
def test_a_number_read_from_the_data_as_a_size_trains_in_onnx_runtime(read):
    eager, wrapped = eager_and_wrapped(lambda: TrimmedPadding(read))
    x = torch.randn(3, 6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for lengths in ([4, 2, 1], [1, 4, 4], [3, 4, 2]):  # longest 4 every time: one graph
            lengths = torch.tensor(lengths)
            _assert_same(_step(wrapped, x, lengths), _step(eager, x, lengths))
    assert _answers(wrapped) == [(True,)] and wrapped.export_count == 1 and wrapped.fallback_reason is None
    longer = torch.tensor([5, 2, 3])  # another number: this call runs in PyTorch
    with pytest.warns(ORTModuleFallbackWarning, match="branches on the data"):
        _assert_same(_step(wrapped, x, longer), _step(eager, x, longer))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        for _ in range(3):  # the third call in a row with it exports the graph for it
            _assert_same(_step(wrapped, x, longer), _step(eager, x, longer))
        assert wrapped.export_count == 2
        for lengths in (longer, torch.tensor([4, 4, 1])):  # either number, its own graph or PyTorch
            _assert_same(_step(wrapped, x, lengths), _step(eager, x, lengths))
    assert wrapped.fallback_reason is None
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x, longer), eager(x, longer))


def test_without_fallback_a_call_reading_another_number_raises():
    eager, wrapped = eager_and_wrapped(TrimmedPadding, debug_options=DebugOptions(fallback=False))
    x = torch.randn(3, 6, 4)
    _assert_same(_step(wrapped, x, torch.tensor([4, 2, 1])), _step(eager, x, torch.tensor([4, 2, 1])))
    with pytest.raises(ExportError, match="branches on the data"):
        wrapped(x, torch.tensor([5, 2, 1]))
