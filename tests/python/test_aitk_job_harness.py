"""`layerstream bench aitk-job` without running a job (tests/python/test_aitk_jobs.py runs them): what its command
line refuses, the resident engine's job, how the user's allocations (--stress-gb) are judged, which of the log's progress bars AI-Toolkit's
s/it is read from, and the step times read from AI-Toolkit's loss_log.db."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from layerstream.bench.aitk_job import (ACTIVE_LINE, JobOptions, RunResult, allocator_line, job_config, job_env,
                                        parse_log, read_step_times)
from layerstream.bench.aitk_job_cli import TABLE_HEADER, parse_args, stress_problems, summary_row


@pytest.mark.parametrize("value", ["", "x", "2,,4", "0", "2,-1", "nan"])
def test_stress_sizes_that_are_not_sizes_are_refused_with_what_to_give(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--aitk-dir", "/nowhere", "--stress-gb", value])
    assert exit_info.value.code == 2
    assert f"--stress-gb {value!r}: give sizes in GiB above 0, comma-separated (e.g. 2,4,8)" in capsys.readouterr().err


def test_stress_sizes_are_taken_as_given():
    assert parse_args(["--aitk-dir", "/nowhere", "--stress-gb", "2,4,8"]).stress_gb == "2,4,8"
    assert parse_args(["--aitk-dir", "/nowhere"]).stress_gb is None


@pytest.mark.parametrize("value", ["gpu", "stock,stock", "stock,,layerstream", ""])
def test_engines_that_are_not_engines_are_refused_with_what_to_give(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--aitk-dir", "/nowhere", "--engines", value])
    assert exit_info.value.code == 2
    assert (f"--engines {value!r}: give each of stock, layerstream, resident at most once, comma-separated "
            "(e.g. resident,stock,layerstream)") in capsys.readouterr().err


def test_the_resident_engine_runs_the_job_without_offloading_or_layerstream(tmp_path):
    assert parse_args(["--aitk-dir", "/nowhere", "--engines", "resident, stock"]).engines == "resident,stock"
    opts = JobOptions(arch="zimage", transformer_percent=0.5, te_percent=0.25)
    offloaded = job_config(opts, "job", tmp_path / "m", tmp_path / "d", tmp_path / "t")["config"]["process"][0]
    resident = job_config(opts, "job", tmp_path / "m", tmp_path / "d", tmp_path / "t",
                          offload=False)["config"]["process"][0]
    assert offloaded["model"]["layer_offloading"] is True
    assert offloaded["model"]["layer_offloading_transformer_percent"] == 0.5
    assert offloaded["model"]["layer_offloading_text_encoder_percent"] == 0.25
    assert resident["model"]["layer_offloading"] is False
    assert "layer_offloading_transformer_percent" not in resident["model"]
    # Everything else is the same job.
    for key in set(offloaded) - {"model"}:
        assert resident[key] == offloaded[key], key
    for engine, value in (("stock", "0"), ("resident", "0"), ("layerstream", None)):
        env = job_env(engine, opts, None, tmp_path / "stats.json", None, tmp_path / "hub")
        assert env.get("LAYERSTREAM") == value, engine


def _run(engine: str, ooms: dict | None) -> RunResult:
    run = RunResult(engine=engine, returncode=0, wall_s=1.0)
    if ooms is not None:
        run.stress = {"sizes_gb": [2.0], "made": {"between": 1, "inside": 1, "sample": 1}, "out_of_memory": ooms}
    return run


def test_layerstream_running_out_of_memory_more_often_than_stock_is_a_problem():
    none = {"between": 0, "inside": 0, "sample": 0}
    one = {"between": 0, "inside": 1, "sample": 0}
    assert stress_problems({"stock": _run("stock", none), "layerstream": _run("layerstream", one)}) == [
        "out of memory for the user's allocations: 1 under layerstream, 0 under stock"]
    assert stress_problems({"layerstream": _run("layerstream", one)}) == [
        "out of memory for the user's allocations: 1 under layerstream, not run under stock"]
    # As often as stock (a card too small for the allocation either way), or less often: no problem.
    assert stress_problems({"stock": _run("stock", one), "layerstream": _run("layerstream", one)}) == []
    assert stress_problems({"stock": _run("stock", one), "layerstream": _run("layerstream", none)}) == []
    assert stress_problems({"stock": _run("stock", None), "layerstream": _run("layerstream", None)}) == []


# The end of a job's log as AI-Toolkit's run.py writes it (tqdm redraws with carriage returns): the training bar
# (described by the job's name, its rate followed by the postfix), then the final save and sample, whose bars
# (the sampler's and each prompt's) end with rates of their own.
END_OF_A_JOB = (
    "job_wan22_14b:  88%|########8 | 7/8 [00:08<00:00,  1.19it/s, lr: 1.0e-04 loss: 1.776e+00]\r"
    "job_wan22_14b: 100%|##########| 8/8 [00:09<00:00,  1.15it/s, lr: 1.0e-04 loss: 1.813e+00]\r"
    "job_wan22_14b: 100%|##########| 8/8 [00:09<00:00,  1.13s/it, lr: 1.0e-04 loss: 1.813e+00]\n"
    "Saved checkpoint to /tmp/runs/job_wan22_14b/job_wan22_14b.safetensors\n"
    "Generating Samples:   0%|          | 0/2 [00:00<?, ?it/s]\n"
    "100%|##########| 2/2 [00:01<00:00,  1.87it/s]\n"
    "Generating Samples: 100%|##########| 2/2 [00:03<00:00,  1.62s/it]\n")


def test_s_per_it_is_the_training_bars_last_rate_not_the_samplers():
    assert parse_log(END_OF_A_JOB, "job_wan22_14b") == (1.13, False)
    # In it/s, as tqdm shows a fast bar, turned into s/it.
    faster = END_OF_A_JOB.replace("1.13s/it, lr", "1.25it/s, lr") + ACTIVE_LINE + "\n"
    assert parse_log(faster, "job_wan22_14b") == (0.8, True)
    # A second job in the same log has a bar of its own: each is read from its own.
    second = END_OF_A_JOB + "job_wan22_14b_second: 100%|##########| 8/8 [00:07<00:00,  2.00s/it, lr: 1.0e-04]\n"
    assert parse_log(second, "job_wan22_14b") == (1.13, False)
    assert parse_log(second, "job_wan22_14b_second") == (2.0, False)
    # No training bar with a rate (a job that failed before its first step): none, whatever else the log has.
    assert parse_log("job_wan22_14b:   0%|          | 0/8 [00:00<?, ?it/s]\n" + END_OF_A_JOB.split("Saved")[1],
                     "job_wan22_14b") == (None, False)


def test_a_runs_row_has_a_cell_under_every_heading_of_the_table():
    run = RunResult(engine="layerstream", returncode=0, wall_s=85.3, losses={1: 1.0, 2: 0.9}, s_per_it=0.84,
                    median_step_s=0.843, first_step_s=62.6, last_step_s=73.65, peak_rss_bytes=2**30, active=True,
                    attaches=[{"module": "WanTransformer3DModel", "seconds": 6.1}], sample_s=[17.2, 4.1],
                    save_s=[1.2], peak_vram_allocated=2 * 2**30, bus_gb_per_step=14.9, copy_wait_ms_per_step=15.2)
    cells = [c.strip() for c in summary_row(JobOptions(arch="wan22_14b", size="full"), run).split("|")[1:-1]]
    headings = [h.strip() for h in TABLE_HEADER.split("|")[1:-1]]
    assert dict(zip(headings, cells)) == {
        "arch": "wan22_14b", "size": "full", "quantize": "none", "engine": "layerstream", "exit": "0",
        "steps logged": "2", "s/it (AI-Toolkit)": "0.840", "median step s": "0.843", "first to last step s": "11.05",
        "start to first step s": "62.6", "attach s": "WanTransformer3DModel 6.1", "sample s": "17.2 + 4.1",
        "save s": "1.2", "wall s": "85.3", "peak VRAM GiB": "2.00", "peak RSS GiB": "1.00",
        "GB copied per step": "14.9", "compute waited ms per step": "15", "layerstream active": "yes"}
    assert len(cells) == len(headings)


def test_step_times_are_the_intervals_between_consecutive_logged_steps(tmp_path):
    db = tmp_path / "loss_log.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE steps (step INTEGER PRIMARY KEY, wall_time REAL)")
        # Steps 1-3 and 5-6 (a resumed job's log has such a hole): the 3 -> 5 span holds two steps, not one.
        con.executemany("INSERT INTO steps VALUES (?, ?)", [(1, 110.0), (2, 110.5), (3, 111.25), (5, 120.0), (6, 121.0)])
    run = RunResult(engine="stock", returncode=0, wall_s=0.0, losses={})
    read_step_times(db, 100.0, run)
    assert (run.first_step_s, run.last_step_s) == (10.0, 21.0)
    assert run.step_intervals_s == [0.5, 0.75, 1.0]
    assert run.median_step_s == 0.75
    empty = RunResult(engine="stock", returncode=0, wall_s=0.0, losses={})
    read_step_times(tmp_path / "no.db", 100.0, empty)
    assert (empty.first_step_s, empty.step_intervals_s, empty.median_step_s) == (None, [], None)


# torch's allocator counters faked (this machine may have no GPU): 3 cudaMalloc in the first optimizer step,
# none in the second, 2 more and a cudaFree and a retry in the third.
FAKE_ALLOCATOR = """
import torch
counters = iter([{"num_device_alloc": 3}, {"num_device_alloc": 3},
                 {"num_device_alloc": 5, "num_device_free": 1, "num_alloc_retries": 1}])
torch.cuda.is_available = lambda: True
torch.cuda.is_initialized = lambda: True
torch.cuda.memory_stats = lambda: next(counters)
w = torch.nn.Parameter(torch.zeros(2))
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(3):
    w.sum().backward()
    opt.step()
"""


def test_the_allocators_counts_are_recorded_per_optimizer_step(tmp_path):
    import layerstream.bench.aitk_job as aitk_job

    site = Path(aitk_job.__file__).parent / "aitk_site"
    stats = tmp_path / "stats.json"
    env = {**os.environ, "PYTHONPATH": str(site), "AITK_JOB_STATS": str(stats)}
    subprocess.run([sys.executable, "-c", FAKE_ALLOCATOR], env=env, check=True, timeout=300)
    per_step = json.loads(stats.read_text())["allocator_per_step"]
    assert per_step == [{"cudaMalloc": 3, "cudaFree": 0, "retries": 0, "out_of_memory": 0},
                        {"cudaMalloc": 0, "cudaFree": 0, "retries": 0, "out_of_memory": 0},
                        {"cudaMalloc": 2, "cudaFree": 1, "retries": 1, "out_of_memory": 0}]
    assert allocator_line(per_step) == ("torch's allocator over 3 optimizer steps: cudaMalloc 3 0 2; cudaFree 0 0 1; "
                                        "1 allocation retries, 0 out of memory")
