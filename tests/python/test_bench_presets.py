"""The benchmark's Qwen-Image- and Wan-shaped presets at toy size: AI-Toolkit's MemoryManager finds every weight
of them (every streamed layer an nn.Linear, the rest on the list of what its .to moves), and a checkpointed LoRA
training run, bf16 or torchao float8, loses exactly the same on the stock manager and on layerstream (the
simulator) as all resident. In-process, on the CPU: a few seconds per preset."""

from __future__ import annotations

import pytest
import torch

from conftest import aitk_dirs, clear_device_states, torchao_codes_and_scale
from layerstream import manager_modules as mm
from layerstream.aitk import load_memory_management
from layerstream.bench import PRESETS, build_model, parse_args, quantize_model, run_mode
from layerstream.bench.run import attach_manager

NEW_FAMILIES = ["qwen-image-small", "wan22-small"]


def _aitk_dir() -> str:
    dirs = aitk_dirs()
    if not dirs:
        pytest.skip("the stock and layerstream modes drive AI-Toolkit's manager.py: set AI_TOOLKIT_DIR")
    return dirs[0]


@pytest.mark.parametrize("preset", NEW_FAMILIES)
def test_the_manager_streams_every_linear_and_moves_everything_else(preset):
    """What AI-Toolkit's manager does not stream, its patched .to must move: the modules on its unmanaged list
    (norms, by their class name) and the parameters a block holds itself (Wan's scale_shift_table), which are
    on that list only when attach() is given them."""
    package = load_memory_management(_aitk_dir(), engine="stock")
    model = build_model(PRESETS[preset], checkpointing=True, seed=0)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    in_linears = {id(p) for m in linears for p in m.parameters()}
    others = [(name, p) for name, p in model.named_parameters() if id(p) not in in_linears]
    # The streamed weights are nearly all of the model; the rest are norms' weights and Wan's tables.
    assert all("norm" in name or name.endswith("scale_shift_table") for name, _ in others), others
    attach_manager(package, model, torch.device("cpu"), offload_percent=1.0, seed=0)
    assert all(hasattr(m, "_layer_memory_manager") for m in linears)
    unmanaged = model._memory_manager.unmanaged_modules
    moved = {id(x) for x in unmanaged if isinstance(x, torch.Tensor)}
    moved |= {id(p) for x in unmanaged if isinstance(x, torch.nn.Module) for p in x.parameters()}
    assert [name for name, p in others if id(p) not in moved] == []


@pytest.mark.parametrize("preset, quantize", [(p, None) for p in NEW_FAMILIES] + [("wan22-small", "float8")])
def test_checkpointed_losses_are_bitwise_alike_in_every_mode(preset, quantize, monkeypatch):
    """bf16, and torchao's float8 weights as AI-Toolkit quantizes them with layer offloading."""
    aitk = _aitk_dir()
    if quantize:
        pytest.importorskip("torchao.quantization", reason="--quantize float8 needs torchao")
    monkeypatch.setenv("LAYERSTREAM_BACKEND", "sim")
    monkeypatch.setenv("LAYERSTREAM_TIME_WAITS", "1")  # run_mode sets it when unset: restored after the test
    args = parse_args(["--preset", preset, "--rank", "4", "--lora-init-nonzero", "--warmup", "1", "--steps", "1",
                       "--aitk-dir", aitk] + (["--quantize", quantize] if quantize else []))
    assert args.checkpointing
    clear_device_states()
    rows = {mode: run_mode(args, mode, torch.device("cpu")) for mode in ("resident", "stock", "layerstream")}
    assert [r["status"] for r in rows.values()] == ["ok"] * 3, rows
    resident = rows["resident"]["losses"]
    assert len(resident) == 2 and resident[0] != resident[1]  # the first step trained the LoRA
    assert rows["stock"]["losses"] == resident
    assert rows["layerstream"]["losses"] == resident
    # Stock stages every weight at each call (its bytes counted at its calls); layerstream's engine copied.
    assert rows["stock"]["bytes_per_step"] > rows["stock"]["managed_bytes"] > 0
    assert rows["layerstream"]["bytes_per_step"] > 0
    assert mm.stats()["sim_races"] == 0
    clear_device_states()
    if quantize:  # the managed bytes are the stored ones: codes, scales and biases, not the bf16 they stand for
        model = build_model(PRESETS[preset], checkpointing=True, seed=0)
        quantize_model(model, quantize)
        stored = sum(sum(t.nbytes for t in torchao_codes_and_scale(m.weight)) + m.bias.nbytes
                     for m in model.modules() if type(m) is torch.nn.Linear)
        assert rows["stock"]["managed_bytes"] == rows["layerstream"]["managed_bytes"] == stored


def test_the_flows_samples_are_counted_apart_from_the_steps(monkeypatch):
    """--aitk-flow samples under no_grad between timed steps; that time is not in the steps' times, so their
    copies must not be in bytes_per_step (nor in the floor made from it). Stock stages every weight at every
    call, so its figures are exact: a sample copies the managed bytes once (one forward), and the steps' bytes
    are those of the same run without samples."""
    aitk = _aitk_dir()
    monkeypatch.setenv("LAYERSTREAM_BACKEND", "sim")
    monkeypatch.setenv("LAYERSTREAM_TIME_WAITS", "1")
    monkeypatch.setenv("LAYERSTREAM_VRAM_BUDGET", "min")  # every layer streams: a sample copies bytes too
    rows = {}
    for every in (0, 1):
        args = parse_args(["--preset", "qwen-image-small", "--rank", "4", "--warmup", "1", "--steps", "2",
                           "--aitk-dir", aitk, "--aitk-flow", "--buckets", "1", "--sample-every", str(every)])
        clear_device_states()
        rows[every] = {mode: run_mode(args, mode, torch.device("cpu")) for mode in ("stock", "layerstream")}
        assert [r["status"] for r in rows[every].values()] == ["ok"] * 2, rows[every]
    clear_device_states()
    plain, sampled = rows[0]["stock"], rows[1]["stock"]
    assert "samples_timed_window" not in plain
    assert sampled["samples_timed_window"] == 2  # after each of the two timed steps
    assert sampled["bytes_per_sample"] == sampled["managed_bytes"]
    assert sampled["bytes_per_step"] == plain["bytes_per_step"] > 0
    streamed = rows[1]["layerstream"]
    assert streamed["samples_timed_window"] == 2 and streamed["bytes_per_sample"] > 0
    assert streamed["losses"] == rows[0]["layerstream"]["losses"]  # a sample under no_grad trains nothing


def test_the_budget_line_says_what_was_lent_between_steps_only_where_something_was():
    """The benchmark's plan line (bench.report.budget_plans) adds the gap's lends of LAYERSTREAM_VRAM_GAP=lend
    when there were any, and is as before otherwise."""
    from layerstream.bench.report import budget_plans

    stats = {"vram_budget_planned": 1, "ring_bytes": 2 << 20, "resident_layers": 3, "resident_bytes": 6 << 20,
             "vram_budget_estimate": 4 << 20, "pressure_yields": 0, "pressure_yielded_bytes": 0}
    row = {"mode": "layerstream", "status": "ok", "engine_stats": stats, "bytes_per_step": 4 << 20}
    plain = budget_plans([row])
    assert plain.endswith("yielded to memory pressure 0 time(s), 0.0 MiB")
    row["engine_stats"] = dict(stats, gap_lends=2, gap_lent_bytes=5 << 20)
    assert budget_plans([row]) == plain + "; lent between steps 2 time(s), 5.0 MiB"


def test_the_allocator_line_sums_the_timed_steps_and_lists_each_steps_retries():
    """bench.report.allocator_churn: one line per CUDA row with torch's allocator counters over the timed steps
    (Trainer.run records them per step); nothing for a row without them (CPU) or a failed one."""
    from layerstream.bench.report import allocator_churn

    steps = [{"num_alloc_retries": 0, "num_device_alloc": 2, "num_device_free": 1, "num_ooms": 0},
             {"num_alloc_retries": 3, "num_device_alloc": 5, "num_device_free": 4, "num_ooms": 0}]
    rows = [{"mode": "layerstream", "status": "ok", "allocator_per_step": steps},
            {"mode": "resident", "status": "ok", "allocator_per_step": None},
            {"mode": "stock", "status": "oom: out of device memory", "allocator_per_step": steps}]
    assert allocator_churn(rows) == ("torch's allocator in the timed steps:\n  layerstream: 3 retries, 7 cudaMalloc, "
                                     "5 cudaFree over 2 timed steps (retries per step: 0, 3)")
    assert allocator_churn(rows[1:2]) == ""


def test_the_bucket_line_groups_the_timed_steps_by_the_bucket_they_took():
    """bench.report.bucket_times: with --aitk-flow step k takes bucket k % len(buckets), warm-up steps counted, so
    the timed steps after 3 warm-ups start at the first bucket; each bucket's median and fastest step."""
    from layerstream.bench.report import bucket_times

    rows = [{"mode": "resident", "status": "ok", "step_times_s": [0.6, 0.5, 0.4, 0.8, 0.52, 0.41, 0.7]},
            {"mode": "stock", "status": "oom: out of device memory", "step_times_s": None}]
    assert bucket_times(rows, 3, [1.0, 0.5625, 0.25]) == (
        "timed steps by bucket:\n  resident: 1 of the image tokens: median 0.700 s, fastest 0.600 (3 steps); "
        "0.5625 of the image tokens: median 0.510 s, fastest 0.500 (2 steps); "
        "0.25 of the image tokens: median 0.405 s, fastest 0.400 (2 steps)")
    assert bucket_times(rows, 1, [1.0]) == ""
