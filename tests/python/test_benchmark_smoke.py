"""The side-by-side benchmark runs end to end on its small preset (on the CPU here), so it does not rot
between GPU sessions. Timings are not checked: they belong to the benchmark's own report."""

from __future__ import annotations

import json
import os
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
    if row["device"] == "cpu":  # the floor breakdown needs CUDA's profiler activity; the row and the print say so
        assert row["floor_breakdown"] == {"status": "not measured: no CUDA"}
        assert f"  {mode} ({row['s_per_step_mean']:.3f} s/step): not measured: no CUDA" in result.stdout


def test_flux2_shapes_and_options_run_in_one_call(tmp_path):
    """The FLUX.2-shaped model (SwiGLU, no bias, shared modulation), two modes in one call, host float8
    storage, lossless packing and optimum-quanto weights: every option the GPU runs use, at toy size."""
    dirs = aitk_dirs()
    if not dirs:
        pytest.skip("the layerstream mode drives AI-Toolkit's manager.py: set AI_TOOLKIT_DIR")
    pytest.importorskip("optimum.quanto", reason="--quantize needs optimum-quanto")
    base = [sys.executable, str(BENCH), "--preset", "flux2-small", "--steps", "1", "--warmup", "1",
            "--aitk-dir", dirs[0]]
    runs = {
        "bf16": ["--mode", "resident,layerstream", "--host-dtype", "same"],  # plain: what the others compare with
        "host-float8": ["--mode", "layerstream", "--host-dtype", "float8_e4m3fn"],
        "host-lossless": ["--mode", "layerstream", "--host-dtype", "lossless"],
        "qfloat8": ["--mode", "layerstream", "--quantize", "qfloat8"],
    }
    rows = {}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.json"
        # On the CPU wherever it runs (a GPU machine too): the simulator's losses and resident's compare
        # only when both compute on one device. The memory-first mode: every layer crosses the bus each step.
        env = {**os.environ, "LAYERSTREAM_BACKEND": "sim", "CUDA_VISIBLE_DEVICES": "", "LAYERSTREAM_VRAM_BUDGET": "min"}
        result = subprocess.run(base + extra + ["--json-out", str(out)], capture_output=True, text=True,
                                timeout=600, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        rows[name] = json.loads(out.read_text())["results"]
    resident, streamed = rows["bf16"]
    assert (resident["mode"], streamed["mode"]) == ("resident", "layerstream")
    assert streamed["losses"] == resident["losses"]  # the simulator computes exactly what resident does
    # The phase step splits a step's copies between its forward and its backward (the checkpointed
    # recompute and the backward share theirs); resident copies nothing.
    phases = streamed["phases"]
    assert phases["forward_bytes"] > 0 and phases["backward_bytes"] > 0
    # One more step than the timed one: its copies differ by what the predictor learned meanwhile (seen:
    # 3% fewer).
    assert phases["forward_bytes"] + phases["backward_bytes"] == pytest.approx(streamed["bytes_per_step"], rel=0.05)
    assert resident["phases"]["forward_bytes"] == resident["phases"]["backward_bytes"] == 0
    # float8 host storage moves about half the bytes of bf16 per step (codes + a float32 scale per row).
    ratio = rows["host-float8"][0]["bytes_per_step"] / streamed["bytes_per_step"]
    assert 0.5 <= ratio < 0.53, ratio
    assert rows["host-float8"][0]["pinned_bytes"] < 0.55 * streamed["pinned_bytes"]
    # Lossless packing: the same losses as resident, in about three quarters of the bytes.
    lossless = rows["host-lossless"][0]
    assert lossless["losses"] == resident["losses"]
    ratio = lossless["bytes_per_step"] / streamed["bytes_per_step"]
    assert 0.7 <= ratio < 0.8, ratio
    assert lossless["pinned_bytes"] < 0.8 * streamed["pinned_bytes"]
    quantized = rows["qfloat8"][0]
    assert quantized["status"] == "ok" and quantized["bytes_per_step"] < 0.55 * streamed["bytes_per_step"]


def test_plot_script_draws_the_recorded_benchmark(tmp_path):
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib (in requirements-dev.txt)")
    repo = Path(__file__).resolve().parents[2]
    data = repo / "benchmarks" / "data" / "flux1-all-2026-11-29.json"
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


def test_the_phase_floor_is_the_sum_of_each_phases_bound():
    """max(compute, bus) per phase, summed, with the resident phases scaled to the resident mean step."""
    from layerstream.bench import phase_floor

    resident = {"s_per_step_mean": 1.2, "phases": {"forward_s": 0.2, "backward_s": 0.4}}  # scaled x2
    row = {"phases": {"forward_bytes": 1e9, "backward_bytes": 1e9}}
    assert phase_floor(resident, row, 1e10) == pytest.approx(0.4 + 0.8)   # compute-bound in both
    assert phase_floor(resident, row, 2e9) == pytest.approx(0.5 + 0.8)    # the forward waits for the bus
    assert phase_floor(resident, row, 1e9) == pytest.approx(1.0 + 1.0)    # both wait
    assert phase_floor(None, row, 1e9) is None
    assert phase_floor(resident, row, None) is None
    assert phase_floor(resident, {"phases": {"forward_bytes": None, "backward_bytes": 1}}, 1e9) is None


def test_a_reference_run_gives_the_floors_of_a_run_without_resident(tmp_path):
    from layerstream.bench import add_floors, reference_row

    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"results": [
        {"mode": "resident", "status": "ok", "s_per_step_mean": 0.5, "bytes_per_step": 0,
         "phases": {"forward_s": 0.1, "backward_s": 0.4, "forward_bytes": 0, "backward_bytes": 0}}]}))
    row = {"mode": "layerstream", "status": "ok", "s_per_step_mean": 1.0, "bytes_per_step": 2e9,
           "phases": {"forward_s": 0.5, "backward_s": 0.5, "forward_bytes": 1e9, "backward_bytes": 1e9}}
    assert add_floors([row], 2e9, reference_row(str(ref))) == 0.5
    assert row["floor_s"] == pytest.approx(1.0)              # max(0.5 compute, 1.0 bus)
    assert row["phase_floor_s"] == pytest.approx(0.5 + 0.5)  # max(0.1, 0.5) + max(0.4, 0.5)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"results": [row]}))
    with pytest.raises(ValueError, match="no finished resident row"):
        reference_row(str(empty))


@pytest.mark.parametrize("which", ["first", "last"])
def test_stocks_copies_are_counted_per_call_not_estimated(which):
    """The benchmark counts the bytes the stock manager stages at each of its forward and backward calls.
    A frozen layer whose input needs no gradient is never called backward and copies its weight once."""
    dirs = aitk_dirs()
    if not dirs:
        pytest.skip("the stock manager comes from an AI-Toolkit checkout: set AI_TOOLKIT_DIR")
    import torch
    from layerstream.aitk import load_memory_management
    from layerstream.bench import StockCopyCounter

    aitk = dirs[0] if which == "first" else dirs[-1]
    package = load_memory_management(aitk, engine="stock")
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 12), torch.nn.Linear(12, 8, bias=False)  # float32: 4 bytes per element
    model = torch.nn.ModuleDict({"a": a, "b": b}).requires_grad_(False)
    package.MemoryManager.attach(model, torch.device("cpu"), offload_percent=1.0)
    scale = torch.nn.Parameter(torch.ones(12))  # trainable: b's input needs a gradient, a's does not
    counter = StockCopyCounter(package.manager_modules)
    try:
        out = b(a(torch.randn(3, 16)) * scale)
        assert counter.bytes == (16 * 12 + 12) * 4 + 12 * 8 * 4  # both forwards: weights and a's bias
        out.sum().backward()
        assert counter.bytes == (16 * 12 + 12) * 4 + 2 * 12 * 8 * 4  # b's backward only: its weight again
        assert scale.grad is not None
    finally:
        counter.close()
    before = counter.bytes
    b(a(torch.randn(3, 16)) * scale).sum().backward()  # closed: stock's functions are its own again
    assert counter.bytes == before


def test_stress_allocations_alternate_between_and_inside_steps_and_count_out_of_memory(monkeypatch):
    """--stress-gb's schedule (run on the CPU here; the benchmark uses it on a GPU only): even steps allocate
    inside the middle linear's forward once (a checkpoint's recomputation takes nothing), odd steps before the
    step, sizes in turn; an out-of-memory error is counted and the step goes on."""
    import torch

    from layerstream.bench import train

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    stress = train._Stress([1 / 2**30, 2 / 2**30], model, torch.device("cpu"), "test")
    x = torch.ones(1, 4)
    stress.before_step(0)
    model(x)
    model(x)  # the recomputation: nothing more
    stress.before_step(1)
    model(x)
    real_empty = torch.empty

    def short_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(torch, "empty", short_of_memory)
    stress.before_step(2)
    model(x)
    stress.before_step(3)
    monkeypatch.setattr(torch, "empty", real_empty)
    stress.close()
    model(x)
    assert stress.result() == {"sizes_gb": [1 / 2**30, 2 / 2**30], "made": {"between": 1, "inside": 1},
                               "out_of_memory": {"between": 1, "inside": 1}}
