"""README's "Use it in AI-Toolkit" commands, run as written on a copy of a real AI-Toolkit checkout, then a
start the way AI-Toolkit's run.py starts (python-dotenv's load_dotenv() first, then the toolkit): the log must
show layerstream active, with the setting the README puts into .env. Every line of the README's block is
either run here or named below as what this test's environment already did; a new line fails the test until
it is handled, so the README and this test cannot drift apart."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import aitk_dirs

README = Path(__file__).resolve().parents[2] / "README.md"

RUN = (
    "from dotenv import load_dotenv\n"
    "load_dotenv()  # what AI-Toolkit's run.py does first\n"
    "import os, sys, torch\n"
    "import toolkit.memory_management as mmgmt\n"
    "model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)).requires_grad_(False)\n"
    "mmgmt.MemoryManager.attach(model, torch.device('cpu'), offload_percent=1.0)\n"
    "model(torch.randn(2, 16, requires_grad=True)).sum().backward()\n"
    "print('MODULE', sys.modules['toolkit.memory_management.manager_modules'].__name__)\n"
    "print('BUDGET', os.environ.get('LAYERSTREAM_VRAM_BUDGET'))\n"
)


def readme_commands() -> list[str]:
    text = README.read_text()
    marker = text.index("<!-- readme-aitk")
    block = re.search(r"```bash\n(.*?)```", text[marker:], re.S)
    return [line.split(" #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.skipif(not aitk_dirs(), reason="needs a real AI-Toolkit checkout: set AI_TOOLKIT_DIR")
def test_readme_steps_give_a_run_whose_log_shows_layerstream_active(tmp_path):
    pytest.importorskip("dotenv", reason="AI-Toolkit's run.py loads .env with python-dotenv (pip install python-dotenv)")
    source = Path(aitk_dirs()[0])
    root = tmp_path / "ai-toolkit"
    shutil.copytree(source / "toolkit" / "memory_management", root / "toolkit" / "memory_management",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(source / "toolkit" / "__init__.py", root / "toolkit" / "__init__.py")
    shutil.copy(source / "run.py", root / "run.py")  # not run (it needs a job config); its .env call is below
    assert "load_dotenv()" in (root / "run.py").read_text(), "AI-Toolkit's run.py no longer loads .env this way"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSTREAM")}
    env["LAYERSTREAM_BACKEND"] = "cpu"  # no GPU in CI: the CPU mode of the same module

    commands = readme_commands()
    pips = [c for c in commands if c.startswith("pip install")]
    # The build tools before the package: without them, `pip install --no-build-isolation` stops at
    # "No module named 'scikit_build_core'".
    assert len(pips) == 2 and "scikit-build-core" in pips[0] and "--no-build-isolation" in pips[1], pips
    ran = []
    for command in commands:
        command = command.replace("/path/to/ai-toolkit", str(root))
        if command == f"cd {root}" or command.startswith("source ") or command.startswith("pip install"):
            continue  # this test runs in the environment that has layerstream and its build tools installed
        if command.startswith("layerstream "):
            args = shlex.split(command)[1:]
            result = subprocess.run([sys.executable, "-m", "layerstream", *args], cwd=root, env=env,
                                    capture_output=True, text=True)
        else:
            pytest.fail(f"README step not driven by this test: {command!r}")
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        ran.append((command, result.stdout))
    assert [c for c, _ in ran][0].startswith("layerstream install")
    assert (root / ".env").read_text() == "LAYERSTREAM_VRAM_BUDGET=auto\n"
    status = ran[-1][1].splitlines()  # its exit status was 0: nothing stands in the way
    assert f"this Python  {sys.executable}: layerstream loads" in status, status
    assert "  LAYERSTREAM_VRAM_BUDGET=auto  .env line 1" in status, status

    (root / "_start.py").write_text(RUN)
    result = subprocess.run([sys.executable, "_start.py"], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "MODULE layerstream.manager_modules" in result.stdout
    assert "BUDGET auto" in result.stdout  # from .env
    assert "layerstream INFO: layerstream manager_modules active on cpu" in result.stderr, result.stderr


def test_readme_headline_fits_one_screen_and_each_figure_has_its_benchmarks_row():
    """The headline (up to the first section) fits a terminal of 40 lines by 125 columns, has one row each for
    the three models AI-Toolkit offloads, and each side's three figures (s/step, peak VRAM, host RAM) stand
    together in one row of docs/benchmarks.md's tables: no figure without its measurement."""
    head = README.read_text().split("\n## ", 1)[0].splitlines()
    assert len(head) <= 40 and max(len(line) for line in head) <= 125
    table = [line for line in head if line.startswith("| ") and not line.startswith("| model")]
    assert [line.split("|")[1].split(",")[0].strip() for line in table] == [
        "FLUX.2 32B", "Qwen-Image 20B", "Wan 2.2 14B"]
    rows = [line for line in (README.parent / "docs" / "benchmarks.md").read_text().splitlines()
            if line.startswith("|")]

    def has_row(figures):
        return any(all(re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", row) for f in figures) for row in rows)

    for line in table:
        pairs = [re.findall(r"\d+\.\d+", cell) for cell in line.split("|")[2:5]]
        assert all(len(p) == 2 for p in pairs), line
        stock, layerstream = [p[0] for p in pairs], [p[1] for p in pairs]
        assert has_row(stock), (line, stock)
        assert has_row(layerstream), (line, layerstream)
