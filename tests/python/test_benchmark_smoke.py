"""The side-by-side benchmark runs end to end on its small preset (on the CPU here), so it does not rot
between GPU sessions. Timings are not checked: they belong to the benchmark's own report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import aitk_dirs

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "flux_bench.py"


@pytest.mark.parametrize("mode", ["resident", "layerstream"])
def test_small_preset_runs_and_reports(tmp_path, mode):
    dirs = aitk_dirs()
    if mode == "layerstream" and not dirs:
        pytest.skip("the layerstream mode drives AI-Toolkit's manager.py: set AI_TOOLKIT_DIR")
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(BENCH), "--preset", "small", "--mode", mode, "--steps", "1", "--warmup", "1",
           "--json-out", str(out)]
    if dirs:
        cmd += ["--aitk-dir", dirs[0]]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["mode"] == mode and row["status"] == "ok"
    assert len(row["losses"]) == 2


def test_plot_script_draws_the_recorded_benchmark(tmp_path):
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib (in requirements-dev.txt)")
    repo = Path(__file__).resolve().parents[2]
    data = repo / "docs" / "data" / "flux1-all-2026-11-29.json"
    out = tmp_path / "bench.png"
    result = subprocess.run([sys.executable, str(repo / "benchmarks" / "plot_bench.py"), str(data), "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    empty = tmp_path / "empty.json"
    empty.write_text('{"results": [{"mode": "stock", "status": "skipped"}]}')
    failed = subprocess.run([sys.executable, str(repo / "benchmarks" / "plot_bench.py"), str(empty)],
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "no successful rows" in failed.stderr
