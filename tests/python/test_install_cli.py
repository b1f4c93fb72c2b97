"""`layerstream install/uninstall/doctor` on throwaway git checkouts laid out like AI-Toolkit: install ->
import -> attach -> uninstall -> byte-identical tree, in both modes; every failure is a message, never a
traceback. The stand-in checkout's files are written here; with AI_TOOLKIT_DIR the real memory_management
package is used instead."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import aitk_dirs

STANDIN = {
    "toolkit/__init__.py": "",
    "toolkit/memory_management/__init__.py": "from .manager import MemoryManager\n",
    "toolkit/memory_management/manager.py": (
        "import torch\n"
        "from .manager_modules import LinearLayerMemoryManager\n\n"
        "class MemoryManager:\n"
        "    def __init__(self, device):\n"
        "        self.process_device = torch.device(device)\n\n"
        "    @classmethod\n"
        "    def attach(cls, module, device, offload_percent=1.0, ignore_modules=[]):\n"
        "        manager = cls(device)\n"
        "        for child in module.modules():\n"
        "            if type(child).__name__ == 'Linear':\n"
        "                LinearLayerMemoryManager.attach(child, manager)\n"
    ),
    "toolkit/memory_management/manager_modules.py": (
        "class LinearLayerMemoryManager:\n"
        "    @classmethod\n"
        "    def attach(cls, module, manager):\n"
        "        module._stock_attached = True\n"
    ),
}

PROBE = (
    "import sys, torch\n"
    "import toolkit.memory_management as mmgmt\n"
    "mod = sys.modules['toolkit.memory_management.manager_modules']\n"
    "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
    "mmgmt.MemoryManager.attach(model, torch.device('cpu'))\n"
    "native = mod.__name__ == 'layerstream.manager_modules' or mod.__file__.endswith(('.so', '.pyd'))\n"
    "if hasattr(model[0], '_layer_memory_manager'):  # a real manager (not the stand-in stock)\n"
    "    model(torch.randn(3, 8, requires_grad=True)).sum().backward()\n"
    "print('ENGINE', 'layerstream' if native else 'stock', getattr(mod, '__file__', ''))\n"
)


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def _make_checkout(root: Path, source: str | None) -> Path:
    if source is None:
        for rel, text in STANDIN.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    else:
        shutil.copytree(Path(source) / "toolkit" / "memory_management", root / "toolkit" / "memory_management")
        (root / "toolkit" / "__init__.py").write_text("")
    (root / ".gitignore").write_text("__pycache__/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "checkout")
    return root


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "layerstream", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def _probe(root: Path, **env):
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "LAYERSTREAM_BACKEND": "cpu", **env})
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("ENGINE")).split()[1]


SOURCES = [None] + aitk_dirs()


@pytest.mark.parametrize("mode", ["patch", "copy"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda s: "stand-in" if s is None else Path(s).name)
def test_install_then_uninstall_restores_the_tree(tmp_path, mode, source):
    root = _make_checkout(tmp_path / "ai-toolkit", source)
    # A real clean git clone is pristine; build artifacts from the probe runs are ignored by .gitignore.
    before = _tree_digest(root)
    assert _probe(root) == "stock"
    args = ["install", root, "--mode", mode] + (["--force"] if source is None else [])
    result = _cli(*args)
    assert result.returncode == 0, result.stderr
    assert "installed layerstream" in result.stdout
    assert _probe(root) == "layerstream"
    assert _probe(root, LAYERSTREAM="0") == ("stock" if mode == "patch" else "layerstream")
    again = _cli(*args)
    assert again.returncode == 2 and "already installed" in again.stderr
    result = _cli("uninstall", root)
    assert result.returncode == 0, result.stderr
    assert "git status: clean" in result.stdout
    for cache in root.rglob("__pycache__"):
        shutil.rmtree(cache)
    assert _tree_digest(root) == before
    assert _probe(root) == "stock"


@pytest.mark.parametrize("mode", ["patch", "copy"])
def test_a_bad_setting_stops_the_installed_checkout_instead_of_running_stock(tmp_path, mode):
    """The patch's hook falls back to stock when layerstream cannot load; a bad LAYERSTREAM_* setting is no
    such case: the import fails with the setting's message (it used to warn and train on stock)."""
    root = _make_checkout(tmp_path / "ai-toolkit", None)
    assert _cli("install", root, "--mode", mode, "--force").returncode == 0
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "LAYERSTREAM_RING_MB": "-1"})
    assert result.returncode != 0 and "ENGINE" not in result.stdout
    assert ("ValueError: LAYERSTREAM_RING_MB=-1 is not a positive whole number of MiB up to 1073741824 (1 PiB); "
            "unset it or give e.g. LAYERSTREAM_RING_MB=3072") in result.stderr


def test_failures_are_messages_with_a_remedy(tmp_path):
    not_checkout = _cli("install", tmp_path)
    assert not_checkout.returncode == 2
    assert "is not an AI-Toolkit checkout" in not_checkout.stderr and "Traceback" not in not_checkout.stderr
    root = _make_checkout(tmp_path / "ai-toolkit", None)
    unknown = _cli("install", root)
    assert unknown.returncode == 2 and "unknown AI-Toolkit version" in unknown.stderr and "--force" in unknown.stderr
    nothing = _cli("uninstall", root)
    assert nothing.returncode == 0 and "not installed" in nothing.stdout
    bad_mode = _cli("install", root, "--mode", "symlink")
    assert bad_mode.returncode == 2 and "invalid choice" in bad_mode.stderr


@pytest.mark.skipif(not aitk_dirs(), reason="needs a known AI-Toolkit version: set AI_TOOLKIT_DIR")
def test_modified_checkouts_are_refused_without_force(tmp_path):
    root = _make_checkout(tmp_path / "ai-toolkit", aitk_dirs()[0])
    stock = root / "toolkit" / "memory_management" / "manager_modules.py"
    stock.write_text(stock.read_text() + "\n# a local edit\n")
    dirty = _cli("install", root)
    assert dirty.returncode == 2 and "local changes" in dirty.stderr and "--force" in dirty.stderr
    assert _cli("install", root, "--force").returncode == 0
    assert _cli("uninstall", root).returncode == 0
    manager = root / "toolkit" / "memory_management" / "manager.py"
    manager.write_text(manager.read_text() + "\n")
    edited = _cli("install", root)
    assert edited.returncode == 2 and "unknown AI-Toolkit version" in edited.stderr


def test_doctor_reports_every_line_with_a_verdict():
    result = _cli("doctor")
    assert result.returncode in (0, 1), result.stderr
    lines = result.stdout.strip().splitlines()
    assert any(line.split()[1] == "torch" for line in lines)
    assert any("manager_modules" in line for line in lines)
    assert any("ulimit" in line for line in lines)
    assert any(line.split()[1] == "/dev/shm" for line in lines)
    assert all(line.split()[0] in ("OK", "WARN", "FAIL") for line in lines)


TRAIN = (
    "import copy, random, sys, torch\n"
    "import toolkit.memory_management as mmgmt\n"
    "from models import TinyTransformer, apply_lora, train_lora\n"
    "mod = sys.modules['toolkit.memory_management.manager_modules']\n"
    "device = torch.device(sys.argv[1])\n"
    "torch.manual_seed(5)\n"
    "base = TinyTransformer(checkpointing='non_reentrant').requires_grad_(False)\n"
    "resident, managed = copy.deepcopy(base).to(device), copy.deepcopy(base)\n"
    "random.seed(0)\n"
    "mmgmt.MemoryManager.attach(managed, device, offload_percent=1.0)\n"
    "managed.to(device)\n"
    "linears = [m for m in managed.modules() if isinstance(m, torch.nn.Linear)]\n"
    "assert linears and all(hasattr(m, '_layer_memory_manager') for m in linears)\n"
    "assert all(m.weight.device.type == 'cpu' for m in linears)\n"
    "sync = getattr(mod, 'sync_grad_transfers', lambda: None)\n"
    "got = train_lora(managed, [lo.to(device) for lo in apply_lora(managed)], device, 6, sync)\n"
    "want = train_lora(resident, [lo.to(device) for lo in apply_lora(resident)], device, 6)\n"
    "native = mod.__name__ == 'layerstream.manager_modules' or mod.__file__.endswith(('.so', '.pyd'))\n"
    "print('ENGINE', 'layerstream' if native else 'stock')\n"
    "print('BITWISE', got == want)\n"
    "print('LOSSES', ' '.join(map(repr, got)))\n"
)


@pytest.mark.skipif(not aitk_dirs(), reason="needs a real AI-Toolkit checkout: set AI_TOOLKIT_DIR")
@pytest.mark.parametrize("mode", ["patch", "copy"])
def test_installed_checkout_trains_a_lora_through_its_own_memory_manager(tmp_path, mode):
    """The acceptance path of the install issue: `layerstream install` on a real AI-Toolkit checkout, then
    AI-Toolkit's own MemoryManager.attach drives a LoRA training (on the GPU where there is one); LAYERSTREAM=0
    runs stock in the same checkout (patch mode), and both learn the same thing."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = _make_checkout(tmp_path / "ai-toolkit", aitk_dirs()[-1])
    assert _cli("install", root, "--mode", mode).returncode == 0
    tests_dir = str(Path(__file__).parent)

    def train(**env):
        result = subprocess.run(
            [sys.executable, "-c", TRAIN, device], cwd=root, capture_output=True, text=True,
            env={**os.environ, "LAYERSTREAM_BACKEND": "cpu", "PYTHONPATH": tests_dir, **env})
        assert result.returncode == 0, result.stderr
        lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line[:1].isupper())
        return lines["ENGINE"], lines["BITWISE"], [float(v) for v in lines["LOSSES"].split()]

    engine, bitwise, losses = train()
    assert engine == "layerstream" and bitwise == "True"
    if mode == "patch":
        engine, _, stock_losses = train(LAYERSTREAM="0")
        assert engine == "stock"
        assert stock_losses == pytest.approx(losses, rel=1e-4)
    assert _cli("uninstall", root).returncode == 0
