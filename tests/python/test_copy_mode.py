"""Copy mode: the built manager_modules extension copied into toolkit/memory_management/ takes precedence
over the stock manager_modules.py by Python's import rules, and AI-Toolkit's manager.py runs on it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import aitk_dirs
from layerstream import manager_modules

DIRS = aitk_dirs()


@pytest.mark.skipif(not DIRS, reason="AI_TOOLKIT_DIR is not set (point it at an AI-Toolkit checkout)")
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_copied_extension_shadows_the_stock_file(tmp_path, aitk_dir):
    target = tmp_path / "toolkit" / "memory_management"
    shutil.copytree(Path(aitk_dir) / "toolkit" / "memory_management", target)
    (tmp_path / "toolkit" / "__init__.py").write_text("")
    assert (target / "manager_modules.py").exists()  # the stock file stays, as the fallback
    shutil.copy(manager_modules.__file__, target)
    code = (
        "import torch\n"
        "import toolkit.memory_management as mmgmt\n"
        "from toolkit.memory_management import manager_modules as m\n"
        "assert m.__file__.endswith(('.so', '.pyd')), m.__file__\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))\n"
        "mmgmt.MemoryManager.attach(model, torch.device('cpu'))\n"
        "assert model[0]._layer_memory_manager.path in ('cpu', 'streamed')\n"
        "print(tuple(model(torch.randn(3, 8)).shape))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "(3, 2)" in result.stdout
