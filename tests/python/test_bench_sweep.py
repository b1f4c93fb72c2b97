"""The benchmark's stock sweep (--stock-sweep) and its out-of-memory rows: a run that runs out of device memory
is a row of the table, not a crash, and the fastest stock run that fits is stock's best."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import aitk_dirs
from layerstream.bench import markdown_table, parse_args, run_mode, sweep
from layerstream.bench.train import Trainer

OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.2 GiB "
       "is free.")


def test_running_out_of_device_memory_is_a_row(monkeypatch):
    def run(self, mode, counters):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(Trainer, "run", run)
    args = parse_args(["--preset", "qwen-image-small", "--mode", "resident", "--rank", "4"])
    row = run_mode(args, "resident", torch.device("cpu"))
    assert (row["mode"], row["status"]) == ("resident", "oom")
    assert row["reason"] == "out of device memory (tried to allocate 2.00 GiB)"
    assert row["error"] == f"OutOfMemoryError: {OOM}" and row["peak_rss_bytes"] > 0
    assert markdown_table([row]).splitlines()[2].startswith(
        "| resident | oom: out of device memory (tried to allocate 2.00 GiB) | - / - | ")

    def broken(self, mode, counters):
        raise RuntimeError("something else")

    monkeypatch.setattr(Trainer, "run", broken)
    with pytest.raises(RuntimeError, match="something else"):  # only running out of memory is a row
        run_mode(args, "resident", torch.device("cpu"))


def test_the_sweep_picks_the_fastest_stock_run_that_fits():
    rows = [sweep.mark({"mode": "stock", "status": "skipped", "reason": "more than the cap"}, 0.1),
            sweep.mark({"mode": "stock", "status": "oom", "reason": "out of device memory"}, 0.25),
            sweep.mark({"mode": "stock", "status": "ok", "s_per_step_mean": 3.0}, 0.5),
            sweep.mark({"mode": "stock", "status": "ok", "s_per_step_mean": 2.0}, 1.0),
            {"mode": "layerstream", "status": "ok", "s_per_step_mean": 1.0}]
    assert sweep.pick_best(rows) is rows[3] and [r.get("stock_best", False) for r in rows] == [
        False, False, False, True, False]
    assert sweep.summary(rows, 24.0) == ("stock's best offload_percent under the 24 GiB cap: 1 at 2.000 s/step; "
                                         "out of memory at 0.25; skipped at 0.1; layerstream 1.000 s/step (2.00x "
                                         "as fast as stock's best)")
    assert sweep.summary(rows[4:], 24.0) == ""  # no sweep, no line
    none_fit = rows[1:2] + rows[4:]
    assert sweep.pick_best(none_fit) is None
    assert sweep.summary(none_fit, None).startswith("stock's best offload_percent uncapped: none finished; "
                                                    "out of memory at 0.25; layerstream 1.000 s/step")
    assert sweep.jobs(["stock", "layerstream"], [0.5, 1.0]) == [("stock", 0.5), ("stock", 1.0), ("layerstream", None)]


@pytest.mark.parametrize("value, message", [
    ("0,1", "--stock-sweep: 0 is not in (0, 1]"),
    ("0.5,half", "--stock-sweep: 'half' is not a number"),
])
def test_a_bad_sweep_is_refused_with_the_fix(capsys, value, message):
    with pytest.raises(SystemExit):
        parse_args(["--mode", "stock", "--stock-sweep", value])
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--mode", "layerstream", "--stock-sweep", "0.5"])
    assert "--stock-sweep runs the stock mode: add stock to --mode" in capsys.readouterr().err


def test_a_sweep_runs_each_offload_percent_in_its_own_process(tmp_path):
    """End to end on the CPU (simulator): one row per offload_percent, the bytes stock stages falling with it,
    the losses the same, stock's best named."""
    dirs = aitk_dirs()
    if not dirs:
        pytest.skip("the stock mode drives AI-Toolkit's manager.py: set AI_TOOLKIT_DIR")
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "layerstream.bench", "--preset", "qwen-image-small", "--mode", "stock",
           "--stock-sweep", "0.5,1", "--offload-percent", "0.25", "--rank", "4", "--warmup", "0", "--steps", "1",
           "--aitk-dir", dirs[0], "--json-out", str(out)]
    env = {**os.environ, "LAYERSTREAM_BACKEND": "sim", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    data = json.loads(out.read_text())
    half, full = data["results"]
    assert data["meta"]["stock_sweep"] == [0.5, 1.0]
    assert [(r["label"], r["offload_percent"], r["status"]) for r in (half, full)] == [
        ("stock, offload 0.5", 0.5, "ok"), ("stock, offload 1", 1.0, "ok")]
    assert half["losses"] == full["losses"]
    assert 0 < half["bytes_per_step"] < full["bytes_per_step"]  # the sweep's percent, not --offload-percent
    best = min((half, full), key=lambda r: r["s_per_step_mean"])
    assert [r.get("stock_best", False) for r in (half, full)] == [r is best for r in (half, full)]
    assert f"stock's best offload_percent uncapped: {best['offload_percent']:g} at " in result.stdout


@pytest.mark.parametrize("quantize", [None, "float8"])
def test_stock_runs_whose_resident_weights_exceed_the_cap_are_known_before_building(quantize):
    """At offload_percent p AI-Toolkit's manager leaves 1 - p of the linears on the device (on average): with
    more than the cap in them, a run would only spend minutes on the GPU to run out of memory."""
    from layerstream.bench import PRESETS
    from layerstream.bench.run import _stock_resident_bytes

    with torch.device("meta"):
        model = PRESETS["qwen-image"].model(False).to(torch.bfloat16)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    weights, biases = sum(m.weight.numel() for m in linears), sum(m.bias.nbytes for m in linears)
    args = parse_args(["--preset", "qwen-image", "--mode", "stock", "--offload-percent", "0.25"]
                      + (["--quantize", quantize] if quantize else []))
    per_value = 1 if quantize else 2  # codes of one byte at least; bf16
    assert _stock_resident_bytes(model, args) == pytest.approx(0.75 * (weights * per_value + biases))
    assert _stock_resident_bytes(model, parse_args(["--offload-percent", "1"])) == 0
