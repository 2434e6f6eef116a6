"""onnxtrain's core works without PyTorch (an optional extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCK_TORCH = (
    "import sys\n"
    "class _NoTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.') or name == 'transformers':\n"
    "            raise ImportError(f'{name} is blocked for this test')\n"
    "sys.meta_path.insert(0, _NoTorch())\n"
)


def test_core_imports_and_generates_artifacts_without_torch(tmp_path):
    script = BLOCK_TORCH + (
        "import onnxtrain, onnxtrain.artifacts, onnxtrain.api, onnxtrain.onnxblock, onnxtrain.cli\n"
        "from tests.test_artifacts import regression_model\n"
        "from onnxtrain import artifacts\n"
        f"artifacts.generate_artifacts(regression_model(), loss=artifacts.LossType.MSELoss,\n"
        f"    optimizer=artifacts.OptimType.AdamW, artifact_directory={str(tmp_path)!r})\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
