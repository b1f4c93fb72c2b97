"""The first hour of an AI-Toolkit user (issue 49): `layerstream set`/`unset` edit .env without touching any
other byte, `status` says what stands in the way (exit status 1) with commands quoted for the shell, and an
install that is interrupted leaves the checkout as it was."""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from layerstream import _native, install, settings
from test_install_cli import _cli, _make_checkout, _tree_digest

SET = "LAYERSTREAM_VRAM_BUDGET"


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A stand-in checkout, and no LAYERSTREAM setting in this process's environment (status reads it)."""
    for name in [n for n in os.environ if n == "LAYERSTREAM" or n.startswith("LAYERSTREAM_")]:
        monkeypatch.delenv(name)
    return _make_checkout(tmp_path / "ai toolkit", None, git=False)  # a space in the path, as on many desktops


def _set(root: Path, *args: str):
    return _cli("set", *args, root)


# --- set / unset: every other byte kept.

@pytest.mark.parametrize("before,after", [
    # No final newline (the README's `echo >> .env` glued the setting onto HF_TOKEN's value).
    (b"HF_TOKEN=abc", b"HF_TOKEN=abc\nLAYERSTREAM_VRAM_BUDGET=auto\n"),
    (b"", b"LAYERSTREAM_VRAM_BUDGET=auto\n"),
    # CRLF stays CRLF, the setting replaced where it is, comments and the last line's missing newline kept.
    (b"# mine\r\nLAYERSTREAM_VRAM_BUDGET=min\r\n# LAYERSTREAM_VRAM_BUDGET=24GB\r\nHF_TOKEN=x",
     b"# mine\r\nLAYERSTREAM_VRAM_BUDGET=auto\r\n# LAYERSTREAM_VRAM_BUDGET=24GB\r\nHF_TOKEN=x"),
    (b"A=1\r\nB=2", b"A=1\r\nB=2\r\nLAYERSTREAM_VRAM_BUDGET=auto\r\n"),
    # One line per name: the first is set, the others go; `export` and spacing before `=` are understood.
    (b"export LAYERSTREAM_VRAM_BUDGET = 20GB\nX=\xff\xfe\nLAYERSTREAM_VRAM_BUDGET=min\n  LAYERSTREAM_VRAM_BUDGET=1",
     b"export LAYERSTREAM_VRAM_BUDGET=auto\nX=\xff\xfe\n"),
    (b"LAYERSTREAM_VRAM_BUDGETS=1\nLAYERSTREAM_VRAM_BUDGET_X=2\n",
     b"LAYERSTREAM_VRAM_BUDGETS=1\nLAYERSTREAM_VRAM_BUDGET_X=2\nLAYERSTREAM_VRAM_BUDGET=auto\n"),
])
def test_set_changes_one_line_and_keeps_every_other_byte(root, before, after):
    if before:
        (root / ".env").write_bytes(before)
    result = _set(root, f"{SET}=auto")
    assert result.returncode == 0, result.stderr
    assert (root / ".env").read_bytes() == after


def test_set_keeps_the_file_mode_and_takes_what_people_type(root):
    dotenv = root / ".env"
    dotenv.write_bytes(b"HF_TOKEN=secret\n")
    dotenv.chmod(0o600)
    assert _set(root, f"{SET}=24 GiB").returncode == 0
    assert dotenv.read_bytes() == b"HF_TOKEN=secret\nLAYERSTREAM_VRAM_BUDGET='24 GiB'\n"
    assert stat.S_IMODE(dotenv.stat().st_mode) == 0o600
    dotenv_values = pytest.importorskip("dotenv").dotenv_values
    assert dotenv_values(dotenv)[SET] == "24 GiB"  # what AI-Toolkit's run.py will read


@pytest.mark.parametrize("assignment,line", [
    ("LAYERSTREAM_RING_MB=-5", _native.setting_refusal("LAYERSTREAM_RING_MB", "-5")),
    ("LAYERSTREAM_VRAM_BUDGE=auto", "LAYERSTREAM_VRAM_BUDGE=auto is not a layerstream setting; did you mean "
                                    "LAYERSTREAM_VRAM_BUDGET? (the settings: docs/ai-toolkit.md, \"Modes and settings\")"),
    ("LAYERSTREAM_LOG=", "LAYERSTREAM_LOG= is empty, which is the same as unset: `layerstream unset LAYERSTREAM_LOG` "
                         "removes it"),
    ("LAYERSTREAM_CUDA=OFF", "LAYERSTREAM_CUDA is not a layerstream setting (the settings: docs/ai-toolkit.md)"),
])
def test_set_refuses_what_the_setting_does_not_take_and_writes_nothing(root, assignment, line):
    (root / ".env").write_bytes(b"A=1")
    result = _set(root, assignment)
    assert result.returncode == 2
    assert result.stderr == f"layerstream set: error: {line}\n"
    assert (root / ".env").read_bytes() == b"A=1"


def test_unset_removes_every_line_of_the_name_only(root):
    (root / ".env").write_bytes(b"# LAYERSTREAM_LOG=off\r\nLAYERSTREAM_LOG=warning\r\nB=2\r\nLAYERSTREAM_LOG=info")
    result = _cli("unset", "LAYERSTREAM_LOG", root)
    assert result.returncode == 0, result.stderr
    assert (root / ".env").read_bytes() == b"# LAYERSTREAM_LOG=off\r\nB=2\r\n"
    again = _cli("unset", "LAYERSTREAM_LOG", root)
    assert again.returncode == 0 and "is not set" in again.stdout
    assert (root / ".env").read_bytes() == b"# LAYERSTREAM_LOG=off\r\nB=2\r\n"


def test_set_and_status_take_the_current_folder_by_default(root, monkeypatch):
    monkeypatch.chdir(root)
    assert _cli("set", "LAYERSTREAM_HOST_DTYPE=lossless").returncode == 0
    assert (root / ".env").read_bytes() == b"LAYERSTREAM_HOST_DTYPE=lossless\n"
    out = _cli("status").stdout
    assert f"checkout     {root}" in out and "  LAYERSTREAM_HOST_DTYPE=lossless  .env line 1" in out


# --- status: one line per problem, exit status 1.

def _installed(root: Path) -> Path:
    assert _cli("install", root, "--force").returncode == 0
    return root


@pytest.mark.parametrize("dotenv,problem", [
    (b"HF_TOKEN=x\nLAYERSTREAM_RING_MB=-5\n",
     _native.setting_refusal("LAYERSTREAM_RING_MB", "-5", ".env line 2")),
    (b"LAYERSTREAM_VRAM_BUDGE=auto\n",
     "LAYERSTREAM_VRAM_BUDGE=auto (.env line 1) is not a layerstream setting; did you mean LAYERSTREAM_VRAM_BUDGET? "
     "(the settings: docs/ai-toolkit.md, \"Modes and settings\")"),
    (b"HF_TOKEN=abcLAYERSTREAM_VRAM_BUDGET=auto\n",
     "LAYERSTREAM_VRAM_BUDGET on .env line 1 is part of HF_TOKEN's value (the line before it lacked a newline), so "
     "it is not set: put it on a line of its own (`layerstream set` does)"),
    (b"LAYERSTREAM=maybe\n", _native.setting_refusal("LAYERSTREAM", "maybe", ".env line 1")),
    (b"LAYERSTREAM_LOG=loud\n", _native.setting_refusal("LAYERSTREAM_LOG", "loud", ".env line 1")),
])
def test_status_names_a_bad_setting_and_exits_1(root, dotenv, problem):
    _installed(root)
    (root / ".env").write_bytes(dotenv)
    result = _cli("status", root)
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    assert lines[lines.index("problems") + 1:] == [f"  {problem}"]


def test_status_says_where_each_value_comes_from_and_lists_only_what_users_set(root, monkeypatch):
    _installed(root)
    (root / ".env").write_bytes(b"LAYERSTREAM_VRAM_BUDGET=24GB\nLAYERSTREAM_LOG=warning\n")
    monkeypatch.setenv("LAYERSTREAM_LOG", "info")  # the environment wins over .env (load_dotenv never overrides)
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "3072")
    result = _cli("status", root)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[lines.index("settings") + 1:] == [
        "  LAYERSTREAM                   unset: 1",
        "  LAYERSTREAM_VRAM_BUDGET=24GB  .env line 1",
        "  LAYERSTREAM_HOST_DTYPE        unset: auto",
        "  LAYERSTREAM_LOG=info          the environment",
        "  LAYERSTREAM_RING_MB=3072      the environment",
    ]
    assert "engine       layerstream" in lines


def test_status_of_a_stock_checkout_exits_1_with_the_command(root):
    result = _cli("status", root)
    assert result.returncode == 1
    assert result.stdout.splitlines()[-1] == f"  layerstream is not installed in this checkout: " \
                                             f"`layerstream install {shlex.quote(str(root))}`"


def test_status_checks_the_venv_the_web_ui_runs_jobs_with(root, tmp_path):
    """AI-Toolkit's UI runs jobs with the checkout's .venv (else venv): a job there runs stock when layerstream
    is only in the Python that runs `status`; status says so, with the command that fixes it."""
    _installed(root)
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    python = venv_bin / "python3"
    # An interpreter without layerstream: this Python told to ignore every site-packages.
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S -I \"$@\"\n")
    python.chmod(0o755)
    (root / "venv" / "bin").mkdir(parents=True)  # .venv is taken first, as AI-Toolkit's launcher does
    result = _cli("status", root)
    assert result.returncode == 1, result.stdout
    problem = result.stdout.splitlines()[-1]
    quoted = shlex.quote(str(python))
    assert problem.startswith(f"  the web UI runs jobs with {python}, where layerstream does not load (")
    assert problem.endswith(f"install it there: {quoted} -m pip install scikit-build-core pybind11 cmake ninja && "
                            f"{quoted} -m pip install --no-build-isolation {shlex.quote(status_source())}")
    assert quoted.startswith("'")  # the checkout's path has a space


def status_source() -> str:
    from layerstream import status

    return status._source()


def test_doctor_prints_the_same_line(root, monkeypatch):
    (root / ".env").write_bytes(b"LAYERSTREAM_HOST_DTYPE=fp8\n")
    monkeypatch.chdir(root)
    result = _cli("doctor")
    line = _native.setting_refusal("LAYERSTREAM_HOST_DTYPE", "fp8", ".env line 1")
    assert f"FAIL  settings" in result.stdout and line in result.stdout
    assert result.returncode == 1


# --- install: an interrupt or an error at any point leaves nothing behind.

@pytest.mark.parametrize("stop", [KeyboardInterrupt(), OSError(5, "Input/output error")])
def test_an_interrupted_install_undoes_itself(root, monkeypatch, stop):
    before = _tree_digest(root)

    def verify(checkout):
        raise stop

    monkeypatch.setattr(install, "_verify", verify)
    result = _cli("install", root, "--force")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    if isinstance(stop, KeyboardInterrupt):
        assert result.stderr == (f"layerstream install: error: interrupted; the installation was undone, {root} is "
                                 "as it was\n")
    else:
        assert result.stderr == "layerstream install: error: [Errno 5] Input/output error\n"
    assert _tree_digest(root) == before


def test_an_install_that_cannot_undo_says_what_is_left_and_how_to_finish(root, monkeypatch):
    def verify(checkout):
        raise KeyboardInterrupt()

    def remove(checkout, manifest):
        raise install.InstallError("cannot remove the hook: Permission denied")

    monkeypatch.setattr(install, "_verify", verify)
    monkeypatch.setattr(install, "_remove", remove)
    result = _cli("install", root, "--force")
    assert result.returncode == 2
    assert result.stderr == (
        "layerstream install: error: install stopped (KeyboardInterrupt) and could not undo itself (cannot remove "
        f"the hook: Permission denied); left in {root}: toolkit/memory_management/manager_modules/__init__.py, "
        "toolkit/memory_management/layerstream-install.json. Finish with "
        f"`layerstream uninstall {shlex.quote(str(root))}`\n")


def test_status_flags_a_hook_an_older_layerstream_wrote(root, monkeypatch):
    """A hook of an earlier version (one that ran stock on a bad setting) is named, with the commands that renew
    it; the checkout's hook is made one here by counting its bytes among the earlier versions'."""
    _installed(root)
    hook = root / install.HOOK
    monkeypatch.setattr(install, "LEGACY_HOOKS", install.LEGACY_HOOKS | {install.sha256_of(hook)})
    result = _cli("status", root)
    assert result.returncode == 1
    where = shlex.quote(str(root))
    assert result.stdout.splitlines()[-1] == (f"  the installed hook is an older layerstream's: run `layerstream "
                                              f"uninstall {where}` and `layerstream install {where}` to renew it")


@pytest.mark.parametrize("system,word,quoted", [
    ("posix", "/home/me/ai toolkit", "'/home/me/ai toolkit'"),
    ("posix", "/home/me/ai-toolkit", "/home/me/ai-toolkit"),
    ("posix", "it's", "'it'\"'\"'s'"),
    ("nt", r"C:\Users\me\ai toolkit", r'"C:\Users\me\ai toolkit"'),
    ("nt", r"C:\ai-toolkit\.venv\Scripts\python.exe", r"C:\ai-toolkit\.venv\Scripts\python.exe"),
    ("nt", r"C:\a&b", r'"C:\a&b"'),
])
def test_printed_commands_are_quoted_for_the_users_shell(monkeypatch, system, word, quoted):
    from layerstream import shell

    monkeypatch.setattr(shell.os, "name", system)
    assert shell.quote(word) == quoted
