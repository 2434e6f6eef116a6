"""The export registry ORTModule builds once per process matches torch.onnx's own."""

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import _exporter  # noqa: E402
from onnxtrain.torch._translations import translation_table  # noqa: E402


def _entries(functions):
    return {str(target): [(meta.onnx_function, meta.is_complex, meta.is_custom, meta.opset_introduced)
                          for meta in metas] for target, metas in functions.items()}


@pytest.mark.parametrize("opset", [18, 20])
def test_registry_holds_what_torch_onnx_registry_holds(opset):
    from torch.onnx._internal.exporter import _registration

    expected = _registration.ONNXRegistry.from_torchlib(opset)
    for op, function in translation_table().items():
        expected.register_op(op, function)
    ours = _exporter.registry(opset, translation_table())
    assert ours.opset_version == opset
    assert _entries(ours.functions) == _entries(expected.functions)
    batch_norm = next(iter(translation_table()))
    assert ours.get_decomps(batch_norm)[0].is_custom  # custom translations win dispatch


def test_each_export_gets_its_own_copy():
    first = _exporter.registry(20, translation_table())
    second = _exporter.registry(20, {})
    batch_norm = next(iter(translation_table()))
    assert any(m.is_custom for m in first.get_decomps(batch_norm))
    assert not any(m.is_custom for m in second.get_decomps(batch_norm))


def test_export_program_matches_torch_onnx_export():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.ReLU()).train()
    args = (torch.randn(5, 4),)
    ours = _exporter.export_program(model, args, None, translation_table()).model
    theirs = torch.onnx.export(model, args, dynamo=True, optimize=False, verbose=False,
                               custom_translation_table=translation_table()).model
    assert [n.op_type for n in ours.graph] == [n.op_type for n in theirs.graph]
    assert ours.opset_imports == theirs.opset_imports


def test_falls_back_to_torch_onnx_export_without_the_internal_api(monkeypatch):
    monkeypatch.setattr(_exporter, "_internal_export", lambda: None)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).train()
    program = _exporter.export_program(model, (torch.randn(5, 4),), None, translation_table())
    ops = [n.op_type for n in program.model.graph]
    assert "Gemm" in ops or "MatMul" in ops
    assert "BatchNormalization" not in ops  # onnxtrain's training-mode translation was used


def test_signatures_are_inferred_at_dispatch_as_torch_onnx_infers_them():
    from torch.onnx._internal.exporter import _registration

    expected = _registration.ONNXRegistry.from_torchlib(20)
    ours = _exporter.registry(20, {})
    for op in (torch.ops.aten.addmm.default, torch.ops.aten.relu.default, torch.ops.aten.native_layer_norm.default):
        theirs, mine = expected.get_decomps(op), ours.get_decomps(op)
        assert [m.onnx_function for m in mine] == [m.onnx_function for m in theirs]
        assert [str(m.signature) for m in mine] == [str(m.signature) for m in theirs]
        assert all(str(m.onnx_function._pt_onnx_signature) == str(m.signature) for m in mine)


def test_internal_api_that_differs_is_not_used(monkeypatch):
    """A core export without every keyword argument export_program passes: torch.onnx.export is used."""
    assert _exporter._internal_export() is not None
    monkeypatch.setattr(_exporter, "_CORE_EXPORT_PARAMETERS", {*_exporter._CORE_EXPORT_PARAMETERS, "renamed"})
    assert _exporter._internal_export() is None
    model = torch.nn.Linear(4, 3)
    program = _exporter.export_program(model, (torch.randn(5, 4),), None, translation_table())
    assert [n.op_type for n in program.model.graph]
