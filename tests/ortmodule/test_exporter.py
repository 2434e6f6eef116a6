"""The export registry ORTModule builds once per process matches torch.onnx's own."""

import copy
import threading

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
    ours = _exporter.export_program(_exporter.capture(model, args, None), translation_table()).model
    theirs = torch.onnx.export(model, args, dynamo=True, optimize=False, verbose=False,
                               custom_translation_table=translation_table()).model
    assert [n.op_type for n in ours.graph] == [n.op_type for n in theirs.graph]
    assert ours.opset_imports == theirs.opset_imports


def test_falls_back_to_torch_onnx_export_without_the_internal_api(monkeypatch):
    monkeypatch.setattr(_exporter, "_internal_export", lambda: None)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).train()
    program = _exporter.export_program(_exporter.capture(model, (torch.randn(5, 4),), None), translation_table())
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
    program = _exporter.export_program(_exporter.capture(model, (torch.randn(5, 4),), None), translation_table())
    assert [n.op_type for n in program.model.graph]


# Run in a fresh interpreter: whether torchlib's functions are compiled at import or deferred is
# decided by whichever import of torchlib comes first in a process.
_TORCHLIB_FUNCTIONS_SCRIPT = """
import pickle, sys
import onnxscript
import torch
if sys.argv[1] == "deferred":
    from onnxtrain.torch import _exporter
    _exporter.torchlib_functions(20)
    assert onnxscript.script is onnxscript._internal.main.script  # restored after the import
else:
    import onnxscript.function_libs.torch_lib.ops
from onnxscript.function_libs.torch_lib import registration
import dataclasses


def comparable(value):  # a signature's type constraints are sets: their str() order varies by process
    if dataclasses.is_dataclass(value):
        return tuple((f.name, comparable(getattr(value, f.name))) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return tuple((str(k), comparable(v)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(str(comparable(v)) for v in value))
    if isinstance(value, (list, tuple)):
        return tuple(comparable(v) for v in value)
    return str(value)


scripted = {f"{name}#{i}": f for name, overloads in registration.default_registry.items()
            for i, f in enumerate(overloads.overloads + overloads.complex) if isinstance(f, onnxscript.OnnxFunction)}
deferred = {key: "_compile_deferred" in f.__dict__ for key, f in scripted.items()}  # before any compiles
functions = {key: (deferred[key], f.__name__, f.name, f.opset.version, f.function_ir.domain, comparable(f.op_signature),
                   f.to_function_proto().SerializeToString()) for key, f in scripted.items()}
pickle.dump(functions, sys.stdout.buffer)
"""


def _torchlib_functions_in_fresh_process(mode: str) -> dict:
    import pickle
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TORCHLIB_FUNCTIONS_SCRIPT, mode], capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return pickle.loads(done.stdout)


def test_deferred_torchlib_functions_compile_to_what_the_import_compiles():
    """Every scripted torchlib function the exporter's registry holds, compiled on first use,
    is the function onnxscript compiles at import: same name, opset, signature and FunctionProto."""
    deferred = _torchlib_functions_in_fresh_process("deferred")
    compiled = _torchlib_functions_in_fresh_process("compiled")
    assert len(compiled) > 20
    assert sorted(deferred) == sorted(compiled)
    assert all(entry[0] for entry in deferred.values())  # they were deferred until read here
    assert not any(entry[0] for entry in compiled.values())
    assert {k: v[1:] for k, v in deferred.items()} == {k: v[1:] for k, v in compiled.items()}


def test_scripting_deferred_restores_onnxscript_script_when_the_import_fails(monkeypatch):
    import sys

    import onnxscript

    original = onnxscript.script
    monkeypatch.delitem(sys.modules, _exporter.TORCHLIB_OPS_MODULE, raising=False)
    with pytest.raises(RuntimeError, match="import failed"):
        with _exporter.scripting_deferred():
            assert onnxscript.script is not original
            raise RuntimeError("import failed")
    assert onnxscript.script is original
    # once torchlib is imported, nothing is swapped
    monkeypatch.setitem(sys.modules, _exporter.TORCHLIB_OPS_MODULE, object())
    with _exporter.scripting_deferred():
        assert onnxscript.script is original


def test_a_deferred_function_that_fails_to_compile_raises_on_every_use():
    calls = []

    def broken(python_function):
        calls.append(python_function)
        raise SyntaxError("not onnxscript")

    def python_function(x):
        """doc"""
        return x

    deferred = _exporter._deferred_function_class()(python_function, broken)
    assert deferred.__name__ == "python_function" and deferred.__doc__ == "doc"
    for _ in range(2):
        with pytest.raises(SyntaxError):
            deferred.function_ir  # noqa: B018
    assert calls == [python_function, python_function]


def test_a_deferred_function_compiles_once_when_two_threads_first_use_it_together():
    import threading
    import time

    calls = []

    class Compiled:
        pass

    def compile_slowly(python_function):
        calls.append(python_function)
        time.sleep(0.2)  # the second thread asks meanwhile
        compiled = Compiled()
        compiled.function_ir = "ir"
        return compiled

    def python_function(x):
        return x

    deferred = _exporter._deferred_function_class()(python_function, compile_slowly)
    results = []
    threads = [threading.Thread(target=lambda: results.append(deferred.function_ir)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["ir", "ir"] and calls == [python_function]
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        deferred.missing  # noqa: B018


def test_ops_torch_registers_later_are_in_the_registry():
    """The torchlib table is built once; an op registered with torch afterwards (importing
    torch.ao's quantization registers the quantized_decomposed ops) still gets its entries."""
    import subprocess
    import sys

    script = (
        "from onnxtrain.torch import _exporter\n"
        "_exporter.torchlib_functions(20)\n"
        "import torch.ao.quantization.fx._decomposed\n"
        "from torch.onnx._internal.exporter import _registration\n"
        "expected = _registration.ONNXRegistry.from_torchlib(20)\n"
        "ours = _exporter.registry(20, {})\n"
        "names = lambda functions: {str(t) for t in functions if 'quantized_decomposed' in str(t)}\n"
        "assert names(expected.functions) and names(ours.functions) == names(expected.functions), "
        "(names(ours.functions), names(expected.functions))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _at_once(calls) -> list:
    """Run the argument-less ``calls`` in threads released together; their results (every call
    must succeed)."""
    import threading

    barrier = threading.Barrier(len(calls))
    outputs, errors = {}, {}

    def run(i):
        barrier.wait()
        try:
            outputs[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    return [outputs[i] for i in range(len(calls))]


def _small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def test_two_modules_exported_in_two_threads_at_once_both_run_in_onnxruntime():
    """torch's export keeps process-wide state while it runs: two first calls at the same moment
    broke each other's export (both modules fell back to PyTorch for good). Exports take turns."""
    from onnxtrain.torch import DebugOptions, ORTModule

    x = torch.randn(8, 16)
    modules = [ORTModule(_small_model(seed), DebugOptions(fallback=False)) for seed in (1, 2)]
    outputs = _at_once([lambda module=module: module(x) for module in modules])
    for module, output, seed in zip(modules, outputs, (1, 2)):
        assert module.fallback_reason is None
        torch.testing.assert_close(output, _small_model(seed)(x), rtol=1e-5, atol=1e-6)


def test_another_threads_export_does_not_send_a_call_to_pytorch(monkeypatch):
    """torch.compiler.is_exporting() is process-wide: while one thread exported, a call in
    another thread took it for an outer export tracing it and ran the module in PyTorch, whose
    parameters that export had swapped for fake tensors (a hang, or "fake_mode.in_kernel_invocation
    must be False"). Only an export tracing this thread's call counts."""
    from onnxtrain.torch import DebugOptions, ORTModule

    wrapped = ORTModule(_small_model(0), DebugOptions(fallback=False))
    x = torch.randn(8, 16)
    wrapped(x)
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)  # another thread is exporting
    assert type(wrapped(x).grad_fn).__name__ == "ORTFunctionBackward"  # ONNX Runtime ran it


def test_one_module_first_called_in_two_threads_at_once_builds_once():
    """The second thread waits for the first one's build and uses it (both exported, and one of
    them sometimes failed inside torch's fake tensor mode)."""
    from onnxtrain.torch import DebugOptions, ORTModule

    eager = _small_model(0)
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    inputs = [torch.randn(8, 16), torch.randn(8, 16)]
    outputs = _at_once([lambda x=x: wrapped(x) for x in inputs])
    assert wrapped.export_count == 1
    for x, output in zip(inputs, outputs):
        torch.testing.assert_close(output, eager(x), rtol=1e-5, atol=1e-6)
    twin = copy.deepcopy(wrapped)  # each copy builds under its own lock
    torch.testing.assert_close(twin(inputs[0]), eager(inputs[0]), rtol=1e-5, atol=1e-6)


def test_a_built_module_waits_while_an_export_has_swapped_shared_parameters():
    """Two models sharing a submodule (tied layers): while one exports, torch's export has fake
    tensors in the shared parameters' places, and the other, already built, read them ("Cannot
    access data pointer of Tensor") and exported itself again on their account. It now waits
    for the export before reading its parameters."""
    from onnxtrain.torch import DebugOptions, ORTModule
    from onnxtrain.torch._exporter import EXPORT_LOCK

    shared = _small_model(0)
    wrapped = ORTModule(torch.nn.Sequential(shared, torch.nn.Linear(4, 2)), DebugOptions(fallback=False))
    x = torch.randn(8, 16)
    with torch.no_grad():
        expected = wrapped(x)
    linear = shared[0]
    real_weight = linear.weight
    done = threading.Event()
    results = []

    def call():
        with torch.no_grad():
            results.append(wrapped(x))
        done.set()

    with EXPORT_LOCK:  # another thread's export, with the shared weight swapped out
        linear.weight = torch.nn.Parameter(torch.empty_like(real_weight, device="meta"))
        thread = threading.Thread(target=call)
        thread.start()
        assert not done.wait(0.3)
        linear.weight = real_weight
    thread.join(timeout=60)
    assert wrapped.export_count == 1
    torch.testing.assert_close(results[0], expected)
