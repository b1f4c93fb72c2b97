"""Windows-only behaviour of the built extensions (run by scripts/windows/test_wine.sh under Wine; on Linux
these skip with the reason), and a .env as Windows editors write it. The refusal of an old VC++ runtime is
checked by scripts/ci_windows.sh, which starts Python under Wine's own msvcp140.dll (a Windows process
cannot choose that for a child)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

windows = pytest.mark.skipif(os.name != "nt", reason="Windows only")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@windows
def test_the_extensions_load_with_the_current_vc_runtime():
    done = _run("import layerstream\nfrom layerstream import manager_modules as mm\nprint(mm.__file__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(".pyd")


@windows
def test_a_loaded_pyd_cannot_be_deleted_while_a_python_holds_it(tmp_path):
    # Why `layerstream uninstall` asks to close AI-Toolkit first: Windows refuses to delete a loaded module.
    from layerstream import _native
    copy = tmp_path / os.path.basename(_native.__file__)
    with open(_native.__file__, "rb") as f:  # not shutil.copy: Python 3.12 calls CopyFile2, missing in Wine 8
        copy.write_bytes(f.read())
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


def test_a_dotenv_written_on_windows_gives_the_settings_and_set_keeps_its_bom(tmp_path):
    # Notepad's "UTF-8 with BOM", CRLF line ends, and the space cmd's `echo NAME=value >> .env` leaves.
    from layerstream import dotenv_file, settings

    env = tmp_path / ".env"
    env.write_bytes("\ufeffLAYERSTREAM_VRAM_BUDGET=auto \r\nLAYERSTREAM_LOG=warning\r\n".encode())
    entries = settings.read_dotenv(env)
    assert {k: (v.value, v.line) for k, v in entries.items()} == {
        "LAYERSTREAM_VRAM_BUDGET": ("auto", 1), "LAYERSTREAM_LOG": ("warning", 2)}
    dotenv = pytest.importorskip("dotenv", reason="python-dotenv is not installed")
    assert dotenv.dotenv_values(env) == {"LAYERSTREAM_VRAM_BUDGET": "auto", "LAYERSTREAM_LOG": "warning"}
    dotenv_file.set_value(env, "LAYERSTREAM_VRAM_BUDGET", "min")  # the first line: replaced, the BOM kept
    assert env.read_bytes() == "\ufeffLAYERSTREAM_VRAM_BUDGET=min\r\nLAYERSTREAM_LOG=warning\r\n".encode()
    dotenv_file.unset_value(env, "LAYERSTREAM_VRAM_BUDGET")
    assert env.read_bytes() == "\ufeffLAYERSTREAM_LOG=warning\r\n".encode()
