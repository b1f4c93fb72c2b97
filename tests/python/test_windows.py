"""Windows-only behaviour of the built extensions (run by scripts/windows/test_wine.sh under Wine; on Linux
every test here skips with the reason)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

windows = pytest.mark.skipif(os.name != "nt", reason="Windows only")


def _under_wine() -> bool:
    return os.name == "nt" and hasattr(ctypes.WinDLL("ntdll.dll"), "wine_get_version")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@windows
def test_the_extensions_load_with_the_current_vc_runtime():
    done = _run("import layerstream\nfrom layerstream import manager_modules as mm\nprint(mm.__file__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(".pyd")


@pytest.mark.skipif(not _under_wine(), reason="needs Wine, whose built-in msvcp140.dll is an old VC++ runtime")
def test_an_old_vc_runtime_is_refused_with_the_fix_instead_of_crashing():
    # Wine's own msvcp140.dll stands for an old "Visual C++ Redistributable" on a user's PC.
    old = "msvcp140,msvcp140_1,msvcp140_2,msvcp140_atomic_wait,msvcp140_codecvt_ids=b"
    done = _run("import layerstream", WINEDLLOVERRIDES=f"{old};vcruntime140,vcruntime140_1=n,b;mscoree,mshtml=")
    assert done.returncode == 1, (done.returncode, done.stderr)  # a Python exception, not a crash
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: layerstream needs the Microsoft Visual C++ Redistributable 14.40"), last
    assert "msvcp140.dll" in last and "vc_redist.x64.exe" in last


@windows
def test_a_loaded_pyd_cannot_be_deleted_while_a_python_holds_it(tmp_path):
    # Why `layerstream uninstall` asks to close AI-Toolkit first: Windows refuses to delete a loaded module.
    import shutil
    from layerstream import _native
    copy = tmp_path / os.path.basename(_native.__file__)
    shutil.copy(_native.__file__, copy)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import importlib.util, sys\n"
         f"spec = importlib.util.spec_from_file_location('_native', {str(copy)!r})\n"
         "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
         "print('loaded', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "loaded"
        with pytest.raises(PermissionError):
            os.remove(copy)
    finally:
        holder.communicate("", timeout=120)
    os.remove(copy)  # once that Python has exited
    assert not copy.exists()
