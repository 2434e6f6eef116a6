"""ORTModule and PyTorch's sharded data parallelism: FSDP2 shards an ORTModule's own parameters
(fully_shard(ORTModule(model))); an ORTModule around FSDP units, or inside FSDP1's flat
parameters, must not be exported (the export ran FSDP's unsharding under fake tensors and
left FSDP broken) and says why; so do DDP and tensor parallelism inside one.
torch.distributed.checkpoint's state dicts round-trip."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from onnxtrain.torch import ORTModule  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_optimizer_state_dicts_of_distributed_checkpoint_load_back():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    x = torch.randn(4, 6)
    model = ORTModule(_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(x).sum().backward()
    optimizer.step()
    saved = get_optimizer_state_dict(model, optimizer)
    assert sorted(saved["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # the plain model's names
    restored = ORTModule(_model())
    restored_optimizer = torch.optim.Adam(restored.parameters(), lr=1e-2)
    set_optimizer_state_dict(restored, restored_optimizer, saved)  # strict: every key found
    for before, after in zip(optimizer.state.values(), restored_optimizer.state.values()):
        torch.testing.assert_close(after["exp_avg"], before["exp_avg"])


_WORKER = textwrap.dedent("""
    import os, warnings
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from onnxtrain.errors import OnnxTrainError
    from onnxtrain.torch import ORTModule
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 6)
    for shard in (lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu")), fully_shard):
        sharded = shard(model())
        try:
            ORTModule(sharded)
            print("wrapped")
        except OnnxTrainError as exc:
            print("refused:", "fully_shard(ORTModule(model))" in str(exc))
        expected = model()(x)
        torch.testing.assert_close(sharded(x), expected)  # FSDP still works: nothing was traced
    # FSDP1 around an ORTModule: its parameters become flat-parameter views; runs in PyTorch, says why
    inner = ORTModule(model())
    outer = FullyShardedDataParallel(inner, device_id=torch.device("cpu"), use_orig_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(outer(x), model()(x))
    print("fsdp1 reason:", "FSDP1" in (inner.fallback_reason or ""), inner.export_count)
    # FSDP2 around an ORTModule runs in ONNX Runtime
    wrapped = fully_shard(ORTModule(model()))
    torch.testing.assert_close(wrapped(x), model()(x))
    print("fsdp2 exports:", wrapped.export_count, wrapped.fallback_reason)
    # tensor parallelism: DTensor parameters run in PyTorch, the reason says so (it named DTensorSpec)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    parallel = ORTModule(parallelize_module(model(), init_device_mesh("cpu", (1,)),
                                            {"0": ColwiseParallel(), "2": RowwiseParallel()}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(parallel(x), model()(x))
    print("tensor parallel reason:", "are DTensors (0.weight, 0.bias, 2.weight, 2.bias)" in parallel.fallback_reason)
    # DDP inside an ORTModule: refused when built (the export failed on DDP's compiler-disabled forward)
    try:
        ORTModule(torch.nn.parallel.DistributedDataParallel(model()))
        print("ddp wrapped")
    except OnnxTrainError as exc:
        print("ddp refused:", "DistributedDataParallel(ORTModule(model))" in str(exc))
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
def test_fsdp_around_or_inside_an_ortmodule(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "PORT": str(port), "OMP_NUM_THREADS": "1"}, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["refused: True", "refused: True", "fsdp1 reason: True 0",
                                          "fsdp2 exports: 1 None", "tensor parallel reason: True", "ddp refused: True"]
