"""benchmarks/ostris_bench.py end to end on the simulator: an OstrisLinear model held whole (`resident`, the
floor the engines are measured against), under AI-Toolkit's stock manager and under layerstream, computes the
same losses bit for bit, and the table carries the floor row. Needs an AI-Toolkit checkout with OstrisLinear
(AI_TOOLKIT_DIR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import aitk_dirs

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ostris_bench.py"
DIRS = [d for d in aitk_dirs() if (Path(d) / "toolkit" / "util" / "ostris_quant.py").is_file()]


@pytest.mark.skipif(not DIRS, reason="AI_TOOLKIT_DIR names no AI-Toolkit checkout with toolkit/util/ostris_quant.py")
def test_resident_stock_and_layerstream_rows_agree_bitwise_and_the_floor_is_reported(tmp_path):
    out, md = tmp_path / "rows.json", tmp_path / "rows.md"
    env = dict(os.environ, LAYERSTREAM_BACKEND="sim")
    cmd = [sys.executable, str(BENCH), "--preset", "flux2-small", "--qtypes", "uint3", "--modes",
           "resident,stock,layerstream", "--warmup", "1", "--steps", "1", "--deterministic", "--aitk-dir", DIRS[0],
           "--json-out", str(out), "--md-out", str(md)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == ["layerstream", "resident", "stock"]
    assert {m: r["status"] for m, r in rows.items()} == {m: "ok" for m in rows}
    # The same buffers and inputs in every mode: the losses are the unmanaged model's, bit for bit.
    assert rows["stock"]["losses"] == rows["resident"]["losses"]
    assert rows["layerstream"]["losses"] == rows["resident"]["losses"]
    assert rows["resident"]["paths"] == ["resident"] and rows["layerstream"]["paths"] == ["ostris"]
    # Only layerstream streams: the resident model moves nothing, layerstream at least each stored byte once.
    assert rows["resident"]["bytes_per_step"] == 0 and rows["resident"]["pinned_bytes"] == 0
    assert rows["layerstream"]["bytes_per_step"] >= rows["layerstream"]["stored_bytes"] > 0
    assert rows["layerstream"]["copy_wait_ms_per_step"] is not None and rows["stock"]["copy_wait_ms_per_step"] is None
    floor = [line for line in md.read_text().splitlines() if line.startswith("| uint3 | floor")]
    assert len(floor) == 1 and f"compute {rows['resident']['s_per_step_min']:.3f}" in floor[0]
