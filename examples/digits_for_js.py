"""Write what the JavaScript digits examples and tests read: the CNN, its training artifacts
and scikit-learn's digits as one binary file plus a JSON index.

    python examples/digits_for_js.py OUT_DIR

writes ``OUT_DIR/cnn.onnx`` (``onnxtrain.demo.build_cnn``), ``OUT_DIR/artifacts/`` (what
``onnxtrain artifacts cnn.onnx --loss crossentropy --optimizer adamw --additional-output logits``
writes: training, eval and optimizer models and the checkpoint), ``OUT_DIR/digits.bin`` and
``OUT_DIR/digits.json``. The JSON names, for the ``train`` and ``test`` splits, the byte
offset, element type and dims of the ``images`` (float32 ``[N, 1, 8, 8]`` in [0, 1]) and
``labels`` (int32 ``[N]``) arrays inside the little-endian ``digits.bin``. The training
split is already shuffled (``onnxtrain.demo.load_digits``, seed 0), so batch ``k`` of size
``B`` is samples ``[k*B, (k+1)*B)`` on both the Python and the JavaScript side.

Example:
    >>> import tempfile, json, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> index = write_all(out)  # doctest: +ELLIPSIS
    artifacts written to .../artifacts
    >>> index["train"]["images"]["dims"], index["test"]["labels"]["dims"]
    ([1437, 1, 8, 8], [360])
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import onnx

DATA_FILE = "digits.bin"
INDEX_FILE = "digits.json"
ARTIFACTS = "artifacts"


def write_digits(out_dir: str | pathlib.Path, seed: int = 0) -> dict:
    """Write digits.bin and digits.json into ``out_dir``; return the index."""
    from onnxtrain.demo import load_digits

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    x_train, y_train, x_test, y_test = load_digits(seed)
    arrays = {("train", "images"): x_train, ("train", "labels"): y_train,
              ("test", "images"): x_test, ("test", "labels"): y_test}
    index: dict = {"train": {}, "test": {}}
    offset = 0
    with open(out_dir / DATA_FILE, "wb") as f:
        for (split, name), array in arrays.items():
            array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
            index[split][name] = {"offset": offset, "dtype": array.dtype.name, "dims": list(array.shape)}
            f.write(array.tobytes())
            offset += array.nbytes  # every array is 4-byte elements: offsets stay aligned for typed arrays
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return index


def write_artifacts(out_dir: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write cnn.onnx and, through the ``onnxtrain artifacts`` command, its training artifacts."""
    from onnxtrain import cli
    from onnxtrain.demo import build_cnn

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(build_cnn(seed), out_dir / "cnn.onnx")
    code = cli.main(["artifacts", str(out_dir / "cnn.onnx"), "--loss", "crossentropy", "--optimizer", "adamw",
                     "--additional-output", "logits", "-o", str(out_dir / ARTIFACTS)])
    if code != 0:
        raise RuntimeError(f"onnxtrain artifacts failed with exit code {code}")
    return out_dir / ARTIFACTS


def write_all(out_dir: str | pathlib.Path, seed: int = 0) -> dict:
    """The model, its artifacts and the data; return the data index."""
    write_artifacts(out_dir, seed)
    return write_digits(out_dir, seed)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/digits_for_js.py OUT_DIR")
    write_all(sys.argv[1])
    print(f"wrote the digits CNN, its artifacts and the data to {sys.argv[1]}")
