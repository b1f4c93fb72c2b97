"""`layerstream install/uninstall/doctor` on throwaway git checkouts laid out like AI-Toolkit: install ->
import -> attach -> uninstall -> byte-identical tree, in both modes; every failure is a message, never a
traceback. The stand-in checkout's files are written here; with AI_TOOLKIT_DIR the real memory_management
package is used instead."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import aitk_dirs
from layerstream import _native, cli

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


def _make_checkout(root: Path, source: str | None, git: bool = True) -> Path:
    if source is None:
        for rel, text in STANDIN.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    else:
        shutil.copytree(Path(source) / "toolkit" / "memory_management", root / "toolkit" / "memory_management")
        (root / "toolkit" / "__init__.py").write_text("")
    if git:
        (root / ".gitignore").write_text("__pycache__/\n")
        _commit_all(root)
    return root


def _commit_all(root: Path) -> None:
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "checkout")


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def _cli(*args):
    """`layerstream ARGS` in this process (a subprocess would import torch again for each call): its exit
    status, stdout and stderr. An exception the CLI does not turn into a message fails the test here."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as exc:  # argparse: --help, --version and usage errors
            code = exc.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _cli_process(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "layerstream", *map(str, args)], capture_output=True, text=True,
                          **kwargs)


def _run_probe(root: Path, **env):
    return subprocess.run([sys.executable, "-c", PROBE], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "LAYERSTREAM_BACKEND": "cpu", **env})


def _probe(root: Path, **env):
    result = _run_probe(root, **env)
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
    # The refusal is the traceback's last line: the hook's own ValueError, or (copy mode, the extension
    # imported directly) the ImportError's message.
    refusal = _native.setting_refusal("LAYERSTREAM_RING_MB", "-1", "the environment")
    assert refusal.startswith("LAYERSTREAM_RING_MB=-1 (the environment) is not accepted; it takes a positive")
    kind = "ValueError" if mode == "patch" else "ImportError"
    assert result.stderr.strip().splitlines()[-1] == f"{kind}: {refusal}"


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
    assert any(line.split()[1:3] == ["host", "RAM"] for line in lines)
    assert all(line.split()[0] in ("OK", "WARN", "SKIP", "FAIL") for line in lines)


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


# --- Item 7 of issue 24: uninstall removes only what install wrote; install succeeds only when the hook loads;
# every failure is one line with the fix and exit status 2.

HOOK = Path("toolkit/memory_management/manager_modules/__init__.py")


def _one_line_failure(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    first = result.stderr.splitlines()[0]
    for needle in needles:
        assert needle in first, first


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: "stand-in" if s is None else Path(s).name)
def test_uninstall_keeps_files_it_did_not_write(tmp_path, source):
    root = _make_checkout(tmp_path / "ai-toolkit", source)
    assert _cli("install", root, "--force").returncode == 0
    notes = root / HOOK.parent / "notes.txt"
    notes.write_text("mine\n")
    result = _cli("uninstall", root)
    assert result.returncode == 0, result.stderr
    assert notes.read_text() == "mine\n" and not (root / HOOK).exists()
    assert "left in place" in result.stdout and "notes.txt" in result.stdout
    assert "git status: clean" not in result.stdout
    assert _probe(root) == "stock"


def test_uninstall_refuses_a_changed_hook_and_shows_the_difference(tmp_path):
    root = _make_checkout(tmp_path / "ai-toolkit", None)
    assert _cli("install", root, "--force").returncode == 0
    hook = root / HOOK
    edited = hook.read_text() + "# my own line\n"
    hook.write_text(edited)
    result = _cli("uninstall", root)
    _one_line_failure(result, "changed since", "nothing was removed", "run uninstall again")
    assert "+# my own line" in result.stderr
    assert hook.read_text() == edited
    hook.unlink()  # the user removes it, as the message says; uninstall then finishes the rest
    result = _cli("uninstall", root)
    assert result.returncode == 0, result.stderr
    assert not (root / HOOK.parent).exists()
    assert not (root / "toolkit/memory_management/layerstream-install.json").exists()


def test_a_forks_own_manager_modules_package_is_never_touched(tmp_path):
    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    (root / HOOK).parent.mkdir()
    (root / HOOK).write_text("from ..manager_modules_impl import *  # a fork's own package\n")
    (root / HOOK.parent / "extra.py").write_text("X = 1\n")
    before = _tree_digest(root)
    _one_line_failure(_cli("install", root, "--force"), "was not written by layerstream", "move it out of the way")
    result = _cli("uninstall", root)
    assert result.returncode == 0 and "not installed" in result.stdout and "left alone" in result.stdout
    assert _tree_digest(root) == before


def test_install_inside_another_git_repository_installs_and_loads(tmp_path):
    """git apply, run in a subfolder of a repository, skips paths outside it and exits 0."""
    outer = tmp_path / "project"
    root = _make_checkout(outer / "vendor" / "ai-toolkit", None, git=False)
    (outer / ".gitignore").write_text("__pycache__/\n")
    _commit_all(outer)
    before = _tree_digest(root)
    result = _cli("install", root, "--force")
    assert result.returncode == 0, result.stderr
    assert (root / HOOK).is_file()
    assert _probe(root) == "layerstream"
    assert _cli("uninstall", root).returncode == 0
    for cache in root.rglob("__pycache__"):
        shutil.rmtree(cache)
    assert _tree_digest(root) == before


def _cli_without_write_access(*args):
    """The CLI as a user who cannot write the checkout (root writes anywhere: run it as nobody)."""
    if os.geteuid() != 0:
        return _cli_process(*args)
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot take write access away")
    path = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
                           "-m", "layerstream", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, cwd="/")


def _readable_by_everyone(root: Path) -> None:
    """nobody must read the checkout (pytest's temporary folders are private to their owner)."""
    for p in [*root.parents, root, *root.rglob("*")]:
        if str(p).startswith(tempfile.gettempdir() + os.sep):
            p.chmod(p.stat().st_mode | 0o555)


def test_read_only_checkout_gets_a_message_not_a_traceback(tmp_path):
    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    _readable_by_everyone(root)
    mm = root / "toolkit" / "memory_management"
    mm.chmod(0o555)
    try:
        before = _tree_digest(root)
        _one_line_failure(_cli_without_write_access("install", root, "--force"), "cannot write", "writable")
        assert _tree_digest(root) == before
        mm.chmod(0o755)
        assert _cli("install", root, "--force").returncode == 0
        _readable_by_everyone(root)
        mm.chmod(0o555)
        (root / HOOK.parent).chmod(0o555)
        _one_line_failure(_cli_without_write_access("uninstall", root), "cannot remove", "writable")
    finally:
        for folder in (mm, root / HOOK.parent):
            if folder.exists():
                folder.chmod(0o755)
    assert _cli("uninstall", root).returncode == 0


def test_a_leftover_folder_does_not_break_install_or_uninstall(tmp_path):
    """What `git apply -R` or deleting the hook by hand leaves: the folder with Python's bytecode cache."""
    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    cache = root / HOOK.parent / "__pycache__"
    cache.mkdir(parents=True)
    (cache / "__init__.cpython-311.pyc").write_bytes(b"stale")
    result = _cli("install", root, "--force")
    assert result.returncode == 0, result.stderr
    assert _probe(root) == "layerstream"
    result = _cli("uninstall", root)
    assert result.returncode == 0, result.stderr
    assert not (root / HOOK).exists() and not cache.exists()
    assert (root / HOOK.parent).is_dir()  # it was there before install
    assert _probe(root) == "stock"


def test_install_undoes_itself_when_the_hook_does_not_load(tmp_path):
    """A checkout whose toolkit.memory_management never imports manager_modules: the hook cannot take effect."""
    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    (root / "toolkit/memory_management/__init__.py").write_text("")
    before = _tree_digest(root)
    _one_line_failure(_cli("install", root, "--force"), "does not load layerstream", "undone")
    assert _tree_digest(root) == before


def test_layerstream_off_values_run_stock(tmp_path):
    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    assert _cli("install", root, "--force").returncode == 0
    for value in ("off", "False", "no"):  # "0": test_install_then_uninstall_restores_the_tree
        assert _probe(root, LAYERSTREAM=value) == "stock", value
    assert _probe(root, LAYERSTREAM="on") == "layerstream"
    result = _run_probe(root, LAYERSTREAM="maybe")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ValueError: LAYERSTREAM=maybe (the environment) is not accepted; it takes 1, on, true or yes (layerstream), "
        "or 0, off, false or no (AI-Toolkit's stock manager_modules.py), e.g. LAYERSTREAM=0 (unset: 1)")


def test_log_debug_runs_layerstream_not_stock(tmp_path):
    """LAYERSTREAM_LOG=debug was refused by the package, and the hook then ran stock with advice to reinstall."""
    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    assert _cli("install", root, "--force").returncode == 0
    result = _run_probe(root, LAYERSTREAM_LOG="debug")
    assert result.returncode == 0, result.stderr
    assert "ENGINE layerstream" in result.stdout and "could not be loaded" not in result.stderr


def test_windows_extension_in_use_says_close_ai_toolkit(tmp_path, monkeypatch):
    """On Windows a loaded .pyd cannot be deleted (PermissionError): say what to do."""
    from layerstream import install

    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    pyd = root / "toolkit/memory_management/manager_modules.cp311-win_amd64.pyd"
    pyd.write_bytes(b"MZ extension")
    manifest = {"layerstream": 1, "mode": "copy", "created_dirs": [],
                "files": {pyd.relative_to(root).as_posix(): hashlib.sha256(b"MZ extension").hexdigest()}}
    (root / "toolkit/memory_management/layerstream-install.json").write_text(json.dumps(manifest))
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.suffix == ".pyd":
            raise PermissionError(13, "Access is denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(install, "_WINDOWS", True, raising=False)
    with pytest.raises(install.InstallError, match="close AI-Toolkit first"):
        install.uninstall(root)
    assert pyd.exists()


# --- Issue 22: the command line, doctor, bench, logging, status.

COMMANDS = ["demo", "bench", "info", "install", "uninstall", "status", "set", "unset", "doctor"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_answers_help(command):
    result = _cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:") and "error" not in result.stderr


def test_version_and_bare_command():
    from importlib.metadata import version

    result = _cli_process("--version")  # the installed entry point, once
    assert result.returncode == 0 and result.stdout.strip() == f"layerstream {version('layerstream')}"
    bare = _cli()
    assert bare.returncode == 2 and "Traceback" not in bare.stderr and "required: command" in bare.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers of a machine without a GPU")
def test_doctor_without_a_gpu_skips_and_fails_for_ai_toolkit():
    plain = _cli("doctor")
    assert plain.returncode == 0, plain.stdout
    assert "SKIP  GPU" in plain.stdout and "skipped: no GPU" in plain.stdout
    aitk = _cli("doctor", "--aitk", "--weights-gb", "100000")
    assert aitk.returncode == 1
    lines = aitk.stdout.splitlines()
    assert any(line.startswith("FAIL") and " GPU " in line for line in lines)
    assert any(line.startswith("FAIL") and "host RAM" in line and "100000 GiB" in line for line in lines)
    if not torch.version.cuda:
        assert any(line.startswith("FAIL") and "CPU-only build" in line for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_refuses_a_full_size_cpu_run_without_force():
    result = _cli("bench", "--preset", "flux1", "--mode", "resident")
    _one_line_failure(result, "no GPU here", "--preset small", "--force")


LOGGING = (
    "import logging, sys\n"
    "if sys.argv[1] == 'configured':\n"
    "    logging.basicConfig(stream=sys.stderr, format='APP %(name)s %(message)s', level=logging.INFO)\n"
    "import layerstream\n"
    "logging.getLogger('layerstream').info('an info line')\n"
    "logging.getLogger('layerstream').warning('a warning line')\n"
)


@pytest.mark.parametrize("setting, app, want", [
    ("info", "none", ["layerstream INFO: an info line", "layerstream WARNING: a warning line"]),
    ("warning", "none", ["layerstream WARNING: a warning line"]),
    ("off", "none", ["a warning line"]),  # Python's own last-resort output for warnings, nothing of ours
    ("info", "configured", ["APP layerstream an info line", "APP layerstream a warning line"]),
])
def test_log_lines_reach_stderr_when_the_application_configured_none(setting, app, want):
    result = subprocess.run([sys.executable, "-c", LOGGING, app], capture_output=True, text=True,
                            env={**os.environ, "LAYERSTREAM_LOG": setting})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == want


def test_hook_warns_once_for_an_untested_manager(tmp_path):
    root = _make_checkout(tmp_path / "ai-toolkit", None, git=False)
    assert _cli("install", root, "--force").returncode == 0
    result = _run_probe(root)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("differs from the AI-Toolkit versions layerstream was tested with") == 1


@pytest.mark.skipif(not aitk_dirs(), reason="needs a real AI-Toolkit checkout: set AI_TOOLKIT_DIR")
@pytest.mark.parametrize("source", aitk_dirs(), ids=lambda s: Path(s).name)
def test_status_and_a_tested_manager(tmp_path, source):
    root = _make_checkout(tmp_path / "ai-toolkit", source)
    stock = _cli("status", root)
    assert stock.returncode == 1 and "installed    no (stock)" in stock.stdout
    assert _cli("install", root).returncode == 0
    (root / ".env").write_text("LAYERSTREAM_VRAM_BUDGET=auto\n")
    result = _run_probe(root)
    assert result.returncode == 0 and "differs from the AI-Toolkit versions" not in result.stderr
    status = _cli("status", root)
    assert status.returncode == 0, status.stdout
    out = status.stdout.splitlines()
    assert out[1].startswith(f"AI-Toolkit   {Path(source).name}")
    assert out[2] == "installed    patch mode (toolkit/memory_management/manager_modules/__init__.py)"
    assert out[3] == f"this Python  {sys.executable}: layerstream loads"


def test_the_patch_adds_the_file_install_writes(tmp_path):
    """patches/ai-toolkit.patch (for `git apply` by hand) and `layerstream install` give the same hook."""
    from layerstream import install

    root = _make_checkout(tmp_path / "ai-toolkit", None)
    _git(root, "apply", str(Path(__file__).resolve().parents[2] / "patches" / "ai-toolkit.patch"))
    assert (root / HOOK).read_text() == install.hook_text()
