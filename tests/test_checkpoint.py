"""The checkpoint file format: round trips, nominal checkpoints, corruption, atomic writes."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from onnxtrain import checkpoint as ckpt
from onnxtrain.checkpoint import OptimizerRecord, read_checkpoint, write_checkpoint
from onnxtrain.errors import CheckpointError


def _params():
    rng = np.random.default_rng(0)
    return {
        "fc1.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "fc1.bias": rng.standard_normal(4).astype(np.float32),
        "emb": rng.standard_normal((5, 2)).astype(np.float16),
        "f64": rng.standard_normal(3),
        "count": np.array(7, np.int64),
        "mask": np.array([True, False]),
        "empty": np.zeros((0, 3), np.float32),
    }


def _assert_same(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k])


def test_round_trip_parameters_properties_optimizer(tmp_path):
    path = tmp_path / "checkpoint"
    params = _params()
    opt = OptimizerRecord(step=5, learning_rate=0.01, states=["momentum0", "momentum1"],
                          values={"fc1.weight": {"momentum0": np.ones((4, 3), np.float32),
                                                 "momentum1": np.full((4, 3), 2, np.float32)}})
    props = {"epoch": 3, "note": "text", "best": 0.91, "big": 2 ** 40, "tiny": 1e-300}
    write_checkpoint(path, params, requires_grad={"fc1.weight", "fc1.bias"}, properties=props, optimizer=opt)
    data = read_checkpoint(path)
    _assert_same({k: r.value for k, r in data.parameters.items()}, params)
    assert [k for k, r in data.parameters.items() if r.requires_grad] == ["fc1.weight", "fc1.bias"]
    assert data.properties == props and type(data.properties["best"]) is float
    assert not data.nominal
    assert data.optimizer.step == 5 and data.optimizer.learning_rate == 0.01
    assert data.optimizer.states == ["momentum0", "momentum1"]
    np.testing.assert_array_equal(data.optimizer.values["fc1.weight"]["momentum1"], np.full((4, 3), 2, np.float32))


def test_file_is_plain_safetensors_with_documented_layout(tmp_path):
    path = tmp_path / "checkpoint"
    write_checkpoint(path, {"w": np.ones((2, 2), np.float32)}, requires_grad={"w"},
                     optimizer=OptimizerRecord(1, 0.1, ["momentum0"], {"w": {"momentum0": np.zeros((2, 2), np.float32)}}))
    tensors = load_file(str(path))
    assert set(tensors) == {"param/w", "optimizer/w/momentum0"}
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "onnxtrain.checkpoint" and meta["version"] == "1"
    state = json.loads(meta["state"])
    assert state["parameters"] == [{"name": "w", "requires_grad": True, "dtype": "float32", "shape": [2, 2]}]
    assert state["optimizer"] == {"step": 1, "learning_rate": 0.1, "states": ["momentum0"]}
    assert state["nominal"] is False and state["properties"] == {}


def test_reads_a_checkpoint_written_by_safetensors_itself(tmp_path):
    path = tmp_path / "checkpoint"
    state = {"parameters": [{"name": "w", "requires_grad": False, "dtype": "float32", "shape": [3]}],
             "nominal": False, "properties": {"k": "v"}}
    save_file({"param/w": np.arange(3, dtype=np.float32)}, str(path),
              metadata={"format": "onnxtrain.checkpoint", "version": "1", "state": json.dumps(state)})
    data = read_checkpoint(path)
    np.testing.assert_array_equal(data.parameters["w"].value, [0, 1, 2])
    assert data.properties == {"k": "v"}


def test_nominal_checkpoint_has_no_tensors(tmp_path):
    path = tmp_path / "checkpoint"
    params = _params()
    write_checkpoint(path, params, requires_grad={"fc1.weight"}, nominal=True)
    assert load_file(str(path)) == {}
    data = read_checkpoint(path)
    assert data.nominal
    for name, rec in data.parameters.items():
        assert rec.value is None
        assert rec.shape == params[name].shape and rec.dtype == params[name].dtype
    assert os.path.getsize(path) < 2048


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="directory"):
        read_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="directory"):
        write_checkpoint(tmp_path, {"w": np.ones(2, np.float32)}, set())


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_a_path_that_is_not_a_regular_file_is_named(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    with pytest.raises(CheckpointError, match="is not a regular file"):
        read_checkpoint(fifo)
    if os.path.exists("/dev/zero"):  # reading it would never end
        with pytest.raises(CheckpointError, match="is not a regular file"):
            read_checkpoint("/dev/zero")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(CheckpointError, match="cannot be read: Too many levels of symbolic links"):
        read_checkpoint(tmp_path / "loop")


@pytest.mark.parametrize("damage", ["truncate_header", "truncate_data", "truncate_one_byte", "garbage", "empty",
                                    "flip_header_length"])
def test_corrupt_file(tmp_path, damage):
    path = tmp_path / "checkpoint"
    write_checkpoint(path, _params(), requires_grad=set())
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    damaged = {
        "truncate_header": data[: 8 + header_len // 2],
        "truncate_data": data[: 8 + header_len + 10],
        "truncate_one_byte": data[:-1],
        "garbage": np.random.default_rng(0).bytes(len(data)),
        "empty": b"",
        "flip_header_length": (header_len + 5).to_bytes(8, "little") + data[8:],
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(CheckpointError, match="checkpoint"):
        read_checkpoint(path)


def _save_raw(path, tensors, **metadata):
    save_file(tensors, str(path), metadata=metadata)


def test_wrong_format_tag_and_version(tmp_path):
    path = tmp_path / "checkpoint"
    _save_raw(path, {"w": np.ones(2, np.float32)}, format="pt")
    with pytest.raises(CheckpointError, match="not an onnxtrain checkpoint"):
        read_checkpoint(path)
    save_file({"w": np.ones(2, np.float32)}, str(path))  # no metadata at all
    with pytest.raises(CheckpointError, match="not an onnxtrain checkpoint"):
        read_checkpoint(path)
    _save_raw(path, {}, format="onnxtrain.checkpoint", version="2", state="{}")
    with pytest.raises(CheckpointError, match="version"):
        read_checkpoint(path)
    _save_raw(path, {}, format="onnxtrain.checkpoint", version="1", state="{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        read_checkpoint(path)


def _meta(name="w", shape=(2,), dtype="float32", **extra):
    state = {"parameters": [{"name": name, "requires_grad": True, "dtype": dtype, "shape": list(shape)}], **extra}
    return {"format": "onnxtrain.checkpoint", "version": "1", "state": json.dumps(state)}


def test_metadata_and_tensors_disagree(tmp_path):
    path = tmp_path / "checkpoint"
    save_file({}, str(path), metadata=_meta())
    with pytest.raises(CheckpointError, match="holds no tensor 'param/w'"):
        read_checkpoint(path)
    save_file({"param/w": np.ones(3, np.float32)}, str(path), metadata=_meta())
    with pytest.raises(CheckpointError, match=r"shape \[3\].*\[2\]"):
        read_checkpoint(path)
    save_file({"param/w": np.ones(2, np.float64)}, str(path), metadata=_meta())
    with pytest.raises(CheckpointError, match="float64"):
        read_checkpoint(path)
    save_file({"param/w": np.ones(2, np.float32), "param/v": np.ones(2, np.float32)}, str(path), metadata=_meta())
    with pytest.raises(CheckpointError, match="does not describe"):
        read_checkpoint(path)
    save_file({"param/w": np.ones(2, np.float32), "optimizer/w/momentum0": np.ones(2, np.float32)}, str(path),
              metadata=_meta(optimizer={"step": 1, "learning_rate": 0.1, "states": ["momentum0", "momentum1"]}))
    with pytest.raises(CheckpointError, match="momentum1"):
        read_checkpoint(path)


def test_invalid_arguments(tmp_path):
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        write_checkpoint(tmp_path / "c", {"w": np.ones(2, np.float32)}, requires_grad={"v"})
    with pytest.raises(CheckpointError, match="property 'flag'"):
        write_checkpoint(tmp_path / "c", {"w": np.ones(2, np.float32)}, set(), properties={"flag": True})
    with pytest.raises(CheckpointError, match="property 'x'"):
        write_checkpoint(tmp_path / "c", {"w": np.ones(2, np.float32)}, set(), properties={"x": [1]})
    with pytest.raises(CheckpointError, match="complex64"):
        write_checkpoint(tmp_path / "c", {"w": np.ones(2, np.complex64)}, set())
    assert not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- atomic writes

def test_interrupted_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint"
    old = {"w": np.arange(1000, dtype=np.float32)}
    write_checkpoint(path, old, {"w"}, properties={"version": "old"})
    before = path.read_bytes()

    # Write half of the tensor bytes, then fail as a full disk or a crash would.
    def broken_write(f, data):
        f.write(memoryview(data[: data.size // 2]))
        raise OSError("simulated crash mid-write")

    monkeypatch.setattr(ckpt, "_write_chunks", broken_write)
    with pytest.raises(CheckpointError, match="simulated crash"):
        write_checkpoint(path, {"w": np.zeros(1000, np.float32)}, {"w"}, properties={"version": "new"})
    assert path.read_bytes() == before
    data = read_checkpoint(path)
    np.testing.assert_array_equal(data.parameters["w"].value, old["w"])
    assert data.properties == {"version": "old"}
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]  # the temporary file was removed


def test_killed_process_mid_write_keeps_the_old_checkpoint(tmp_path):
    """A real crash: the writing process dies (os._exit) after part of the data is on disk."""
    path = tmp_path / "checkpoint"
    write_checkpoint(path, {"w": np.ones(4096, np.float32)}, {"w"})
    script = textwrap.dedent(f"""
        import os, numpy as np
        from onnxtrain import checkpoint as ckpt
        def dying_write(f, data):
            f.write(memoryview(data[: data.size // 3])); f.flush(); os._exit(17)
        ckpt._write_chunks = dying_write
        ckpt.write_checkpoint({str(path)!r}, {{"w": np.zeros(4096, np.float32)}}, {{"w"}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 17, proc.stderr
    leftovers = [n for n in os.listdir(tmp_path) if n != "checkpoint"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".checkpoint.")  # the orphaned temp file
    np.testing.assert_array_equal(read_checkpoint(path).parameters["w"].value, np.ones(4096, np.float32))


def test_write_replaces_atomically_and_creates_folders(tmp_path, monkeypatch):
    path = tmp_path / "a" / "b" / "checkpoint"
    write_checkpoint(path, {"w": np.ones(3, np.float32)}, set())
    calls = []
    real_replace = os.replace
    monkeypatch.setattr(ckpt.os, "replace", lambda src, dst: (calls.append((src, dst)), real_replace(src, dst)))
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    write_checkpoint(path, {"w": np.zeros(3, np.float32)}, set())
    assert len(calls) == 1 and os.path.dirname(calls[0][0]) == str(path.parent) and calls[0][1] == path
    assert synced  # the data was fsynced before the rename
    np.testing.assert_array_equal(read_checkpoint(path).parameters["w"].value, np.zeros(3))


def test_write_keeps_file_modes_and_names_a_failed_sync(tmp_path, monkeypatch):
    # a new checkpoint gets open()'s mode (0666 less the umask), not a temporary file's 0600;
    # one written over keeps its own; a failing fsync is a CheckpointError, the old file intact
    path = tmp_path / "checkpoint"
    umask = os.umask(0o022)
    os.umask(umask)
    write_checkpoint(path, {"w": np.ones(3, np.float32)}, set())
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    os.chmod(path, 0o640)
    write_checkpoint(path, {"w": np.zeros(3, np.float32)}, set())
    assert stat.S_IMODE(path.stat().st_mode) == 0o640

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt.os, "fsync", failing_fsync)
    with pytest.raises(CheckpointError, match="cannot write checkpoint.*Input/output error"):
        write_checkpoint(path, {"w": np.full(3, 7, np.float32)}, set())
    np.testing.assert_array_equal(read_checkpoint(path).parameters["w"].value, np.zeros(3))
    assert os.listdir(tmp_path) == ["checkpoint"]


def test_large_tensor_is_written_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "WRITE_CHUNK_BYTES", 1000)
    big = np.random.default_rng(0).standard_normal(10_001).astype(np.float32)
    write_checkpoint(tmp_path / "c", {"big": big}, set())
    np.testing.assert_array_equal(read_checkpoint(tmp_path / "c").parameters["big"].value, big)


def test_accepts_onnx_ir_tensors(tmp_path):
    import onnx_ir as ir

    tensor = ir.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), name="w")
    write_checkpoint(tmp_path / "c", {"w": tensor}, {"w"})
    np.testing.assert_array_equal(read_checkpoint(tmp_path / "c").parameters["w"].value, tensor.numpy())
    write_checkpoint(tmp_path / "n", {"w": tensor}, {"w"}, nominal=True)
    rec = read_checkpoint(tmp_path / "n").parameters["w"]
    assert rec.value is None and rec.shape == (2, 3) and rec.dtype == np.float32


def _state_meta(parameter=None, **extra):
    entry = {"name": "w", "requires_grad": True, "dtype": "float32", "shape": [2], **(parameter or {})}
    return {"format": "onnxtrain.checkpoint", "version": "1", "state": json.dumps({"parameters": [entry], **extra})}


_ADAM = {"step": 3, "learning_rate": 0.001, "states": []}


@pytest.mark.parametrize("parameter, extra, message", [
    ({"name": 7}, {}, "malformed parameter entry"),
    ({"requires_grad": "false"}, {}, "malformed parameter entry"),  # bool("false") would be True
    ({"shape": "2"}, {}, "malformed parameter entry"),
    ({"shape": [-2]}, {}, "malformed parameter entry"),
    ({"dtype": "complex64"}, {}, "malformed parameter entry"),
    ({}, {"optimizer": {**_ADAM, "step": "3"}}, "malformed optimizer metadata"),
    ({}, {"optimizer": {**_ADAM, "step": 2.9}}, "malformed optimizer metadata"),
    ({}, {"optimizer": {**_ADAM, "step": True}}, "malformed optimizer metadata"),
    ({}, {"optimizer": {**_ADAM, "learning_rate": "0.001"}}, "malformed optimizer metadata"),
    ({}, {"optimizer": {**_ADAM, "learning_rate": float("nan")}}, "malformed optimizer metadata"),
    ({}, {"optimizer": {**_ADAM, "states": ["momentum0"]}}, "took 3 steps with states"),
    ({}, {"properties": {"flag": True}}, r"properties \['flag'\] are not int, float or str"),
    ({}, {"properties": {"tags": [1, 2]}}, r"properties \['tags'\]"),
])
def test_metadata_is_read_strictly(tmp_path, parameter, extra, message):
    """Hand-edited metadata is refused, never coerced (as the JavaScript reader does)."""
    path = tmp_path / "checkpoint"
    save_file({"param/w": np.ones(2, np.float32)}, str(path), metadata=_state_meta(parameter, **extra))
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(path)


def test_a_nominal_parameter_too_large_to_allocate_is_named(tmp_path):
    from onnxtrain.api import CheckpointState

    path = tmp_path / "checkpoint"
    save_file({}, str(path), metadata=_state_meta({"shape": [2**40, 2**20]}, nominal=True))
    with pytest.raises(CheckpointError, match=r"nominal parameter 'w' of shape \[1099511627776, 1048576\]"):
        CheckpointState.load_checkpoint(path)


def test_inf_and_nan_properties_round_trip_as_valid_json(tmp_path):
    """JSON has no inf or nan (the JavaScript runtime's JSON.parse refuses Python's Infinity):
    they are null in "properties", their values in "nonfinite_properties"."""
    path = tmp_path / "checkpoint"
    properties = {"epoch": 3, "best_loss": float("inf"), "floor": float("-inf"), "ratio": float("nan"), "note": "x"}
    write_checkpoint(path, _params(), requires_grad=set(), properties=properties)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    state_text = header["__metadata__"]["state"]
    assert "Infinity" not in state_text and "NaN" not in state_text
    state = json.loads(state_text)
    assert list(state["properties"]) == list(properties) and state["properties"]["best_loss"] is None
    assert state["nonfinite_properties"] == {"best_loss": "inf", "floor": "-inf", "ratio": "nan"}
    read = read_checkpoint(path).properties
    assert list(read) == list(properties)
    assert read["best_loss"] == float("inf") and read["floor"] == float("-inf") and np.isnan(read["ratio"])
    assert read["epoch"] == 3 and read["note"] == "x"


@pytest.mark.parametrize("nonfinite", [{"best": "infinity"}, {"epoch": "inf"}, {"absent": "nan"}])
def test_a_malformed_nonfinite_property_is_refused(tmp_path, nonfinite):
    path = tmp_path / "checkpoint"
    write_checkpoint(path, _params(), requires_grad=set(), properties={"epoch": 3, "best": float("inf")})
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    state = json.loads(header["__metadata__"]["state"])
    state["nonfinite_properties"] = nonfinite
    header["__metadata__"]["state"] = json.dumps(state)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + size:])
    with pytest.raises(CheckpointError, match="nonfinite|null"):
        read_checkpoint(path)


def test_writing_through_a_symbolic_link_updates_the_file_it_names(tmp_path):
    """``latest -> run3/checkpoint``: saving to ``latest`` writes run3/checkpoint and keeps the link
    (the rename replaced the link with a new file, and run3/checkpoint stayed stale)."""
    (tmp_path / "run3").mkdir()
    target = tmp_path / "run3" / "checkpoint"
    write_checkpoint(target, {"w": np.ones(3, np.float32)}, {"w"}, properties={"epoch": 3})
    (tmp_path / "latest").symlink_to(pathlib.Path("run3") / "checkpoint")
    write_checkpoint(tmp_path / "latest", {"w": np.zeros(3, np.float32)}, {"w"}, properties={"epoch": 4})
    assert (tmp_path / "latest").is_symlink()
    assert read_checkpoint(target).properties == {"epoch": 4}
    assert sorted(os.listdir(tmp_path / "run3")) == ["checkpoint"]
