"""AI-Toolkit's own trainer (its unchanged run.py) on real YAML jobs, stock against layerstream, on the CPU:
layerstream on the simulator must leave exactly what the stock manager leaves (every step's loss, every saved
LoRA file byte for byte, every sample's pixels), its activity must show in the job's log, and a job stopped
with Ctrl-C after a save must continue from that save. The jobs run in AI-Toolkit's own environment
(scripts/aitk_venv.sh), named by AITK_JOBS_VENV; layerstream.bench.aitk_job is the harness."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import AITK_PYTHON, AITK_STUBS, aitk_dirs, aitk_jobs_skip_reason
from layerstream.bench.aitk_job import (ACTIVE_LINE, STOP_TIMEOUT_S, JobOptions, Workspace, differences, lost_files,
                                        read_loras, run_engine)

REPO = Path(__file__).resolve().parents[2]
STUBS, PYTHON = AITK_STUBS, AITK_PYTHON


pytestmark = [pytest.mark.skipif(aitk_jobs_skip_reason() is not None, reason=aitk_jobs_skip_reason() or ""),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("aitk_jobs")
    ws = Workspace(root=root, source=Path(aitk_dirs()[0]), stubs=STUBS, python=str(PYTHON))
    ws.done = {}  # tag -> (stock, layerstream): a training folder is run once (a second run would resume it)
    yield ws
    if os.environ.get("AITK_JOBS_KEEP") != "1":
        shutil.rmtree(root, ignore_errors=True)


def _both(ws: Workspace, opts: JobOptions, tag: str, **kwargs):
    if tag not in ws.done:
        stock = run_engine(ws, opts, "stock", f"{tag}-stock", **kwargs)
        ours = run_engine(ws, opts, "layerstream", f"{tag}-layerstream", **kwargs)
        ws.done[tag] = (stock, ours)
    stock, ours = ws.done[tag]
    for run in (stock, ours):
        assert run.returncode == 0, f"{run.engine} run.py failed:\n{run.log[-6000:]}"
    return stock, ours


def _assert_complete(opts: JobOptions, run, name: str):
    """Every step's loss, a LoRA at every save and at the end, both prompts' samples at every sample step."""
    assert sorted(run.losses) == list(range(1, opts.steps)), run.losses  # AI-Toolkit logs no loss at step 0
    assert _saves(opts, name) == set(run.loras), sorted(run.loras)
    samples = {f"step{s}_{i}" for s in range(0, opts.steps + 1, opts.sample_every) for i in range(2)}
    assert samples == set(run.samples), sorted(run.samples)
    # AI-Toolkit's s/it, from its training bar (the sampler's bars after the last step are not it).
    assert run.s_per_it is not None and run.s_per_it > 0, run.log[-3000:]
    # The training step's own time, from AI-Toolkit's loss_log.db: at most the span of the logged steps.
    assert 0 < run.median_step_s <= run.last_step_s - run.first_step_s, (run.median_step_s, run.first_step_s)
    # layer_offloading attaches the transformer (and the text encoder) through MemoryManager.attach, timed.
    assert run.attaches and all(a["seconds"] > 0 for a in run.attaches), run.attaches
    # The trainer's sample() once per sample step (the first before step 1), save() once per LoRA saved, timed.
    assert len(run.sample_s) == len(range(0, opts.steps + 1, opts.sample_every)), run.sample_s
    assert len(run.save_s) == len(range(opts.save_every, opts.steps, opts.save_every)) + 1, run.save_s
    assert all(t > 0 for t in run.sample_s + run.save_s), (run.sample_s, run.save_s)


def _saves(opts: JobOptions, name: str) -> set[str]:
    """The LoRA files of a finished job: one per save step and the final one; Wan 2.2 saves one per expert."""
    experts = ["_high_noise", "_low_noise"] if opts.arch == "wan22_14b" else [""]
    steps = [f"_{s:09d}" for s in range(opts.save_every, opts.steps, opts.save_every)] + [""]
    return {f"{name}{step}{expert}.safetensors" for step in steps for expert in experts}


def _trainer_syncs_grads(ws: Workspace) -> bool:
    """Whether this AI-Toolkit's SDTrainer calls sync_grad_transfers() every step (27a03a91 does, 323b4aaf not):
    layerstream's per-step line comes from that call."""
    trainer = ws.source / "extensions_built_in" / "sd_trainer" / "SDTrainer.py"
    return trainer.is_file() and "sync_grad_transfers()" in trainer.read_text()


def _assert_same_outcome(opts: JobOptions, stock, ours, ws: Workspace):
    _assert_complete(opts, stock, f"job_{opts.arch}")
    assert ACTIVE_LINE in ours.log, ours.log[-4000:]
    assert ACTIVE_LINE not in stock.log
    assert stock.bus_gb_per_step is None
    if _trainer_syncs_grads(ws):
        # The harness's LAYERSTREAM_LOG_EVERY=1: layerstream's line for every step, with what it copied (0 GB
        # once the default budget keeps a tiny model resident) and how long compute waited for copies.
        assert ours.bus_gb_per_step is not None and ours.copy_wait_ms_per_step is not None, ours.log[-4000:]
    assert differences(stock, ours) == []


ARCH_OPTIONS = {
    "zimage": JobOptions(arch="zimage"),
    "qwen_image": JobOptions(arch="qwen_image"),
    "wan22_14b": JobOptions(arch="wan22_14b"),
    "flux2": JobOptions(arch="flux2"),
}


@pytest.mark.parametrize("arch", sorted(ARCH_OPTIONS))
def test_job_layerstream_leaves_what_stock_leaves(workspace, arch):
    opts = ARCH_OPTIONS[arch]
    if arch == "flux2" and not (workspace.source / "extensions_built_in/diffusion_models/flux2").is_dir():
        pytest.skip(f"{workspace.source} has no FLUX.2 model class (AI-Toolkit 27a03a91 has)")
    profile = arch == "qwen_image"  # one job under --profile: the profiler changes nothing it computes
    # One job with the user's own allocations between steps, inside steps and inside samples (--stress-gb; on
    # the CPU they are host tensors: what is checked here is that they happen where the harness says, count
    # right, and change nothing the job computes).
    stress = "0.001,0.002" if arch == "zimage" else None
    stock, ours = _both(workspace, opts, arch, profile=profile, stress_gb=stress)
    _assert_same_outcome(opts, stock, ours, workspace)
    if stress:
        # 6 optimizer steps: between after steps 1, 3 and 5; inside steps 3 and 5 (after 2 and 4; after 6 there
        # is none); inside the samples after step 3 and at the end (the one before step 1 is before the cap).
        for run in (stock, ours):
            assert run.stress == {"sizes_gb": [0.001, 0.002], "made": {"between": 6, "inside": 4, "sample": 4},
                                  "out_of_memory": {"between": 0, "inside": 0, "sample": 0}}, run.stress
    else:
        assert stock.stress is None and ours.stress is None
    if profile:
        for run in (stock, ours):
            text = (workspace.root / "runs" / f"{arch}-{run.engine}" / "profile.txt").read_text()
            # The first sample, the later ones and the steps, each by cumulative and by own time, the profiled
            # functions among their rows.
            assert [line for line in text.splitlines() if line.startswith("====")] == [
                "==== first sample: by cumulative time", "==== first sample: by own time",
                "==== sample: by cumulative time", "==== sample: by own time",
                "==== training step: by cumulative time", "==== training step: by own time"], text[:2000]
            assert "(sample)" in text and "(hook_train_loop)" in text, text[:4000]


def test_lossless_zimage_job_leaves_what_stock_leaves_and_samples_keep_the_weights_packed(workspace, monkeypatch):
    """LAYERSTREAM_HOST_DTYPE=lossless (the default's form for frozen bf16 weights of 1 MiB or more; here every
    one, the tiny model's are smaller) in AI-Toolkit's own flow: its samples move the transformer to its own
    dtype (MemoryManager's to() calls the model's to(dtype=...)), which must leave each packed weight packed,
    not decoded for good and packed again; and every outcome is stock's."""
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossless")
    opts = ARCH_OPTIONS["zimage"]
    stock, ours = _both(workspace, opts, "zimage-lossless")
    _assert_same_outcome(opts, stock, ours, workspace)
    assert len(ours.packed_after_sample) == len(stock.packed_after_sample) == len(ours.sample_s)
    assert all(count == [0, 0] for count in stock.packed_after_sample), stock.packed_after_sample
    assert all(packed > 0 and plain == 0 for packed, plain in ours.packed_after_sample), ours.packed_after_sample


@pytest.mark.parametrize("qtype", ["qfloat8", "uint4"])
def test_quantized_job_layerstream_leaves_what_stock_leaves(workspace, qtype):
    opts = replace(ARCH_OPTIONS["zimage"], quantize=qtype)
    _assert_same_outcome(opts, *_both(workspace, opts, f"zimage-{qtype}"), workspace)


def test_the_resident_engine_trains_without_offloading(workspace):
    """The harness's resident engine (the jobs' compute floor on a GPU): the same job with layer_offloading off,
    so AI-Toolkit attaches no memory manager and layerstream is not loaded. Up to the first sample inside training
    it computes what stock computes (the samples before the first step and every loss until then); after that
    sample AI-Toolkit's own paths differ with and without offloading (seen here: the losses after step 3 differ
    in their last bits), which the harness prints as a note."""
    opts = ARCH_OPTIONS["zimage"]
    stock, _ = _both(workspace, opts, "zimage")
    resident = run_engine(workspace, opts, "resident", "zimage-resident")
    assert resident.returncode == 0, resident.log[-6000:]
    _assert_complete(opts, replace(resident, attaches=[{"module": "-", "seconds": 1.0}]), "job_zimage")
    assert resident.attaches == [] and stock.attaches, (resident.attaches, stock.attaches)
    assert not resident.active and stock.active is False
    before = range(1, opts.sample_every + 1)
    assert [resident.losses[s] for s in before] == [stock.losses[s] for s in before]
    assert [resident.samples[f"step0_{i}"] for i in range(2)] == [stock.samples[f"step0_{i}"] for i in range(2)]


def test_comparison_fails_when_one_run_differs(workspace):
    """The comparison above can fail: one byte of one saved LoRA's tensors, or one loss, changed is a
    difference."""
    opts = ARCH_OPTIONS["zimage"]
    stock, ours = _both(workspace, opts, "zimage")
    path = workspace.root / "runs" / "zimage-layerstream" / "job_zimage" / f"job_zimage_{opts.save_every:09d}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    try:
        assert differences(stock, replace(ours, loras=read_loras(path.parent))) == [
            f"LoRA files differ: ['{path.name}']"]
    finally:
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    changed = replace(ours, losses={**ours.losses, 1: ours.losses[1] + 1e-9})
    assert differences(stock, changed)[0].startswith("losses differ at steps [1]")


def test_second_job_in_the_same_process_starts_and_trains_alike(workspace):
    """run.py given two jobs runs the second in the same process once the first is done (the seed's "second run
    that hung"): with layerstream it completes and leaves what stock's second job leaves."""
    opts = ARCH_OPTIONS["zimage"]
    stock, ours = _both(workspace, opts, "zimage-two-jobs", second_job=True)
    for run in (stock, ours):
        _assert_complete(opts, run, "job_zimage")
        _assert_complete(opts, run.second, "job_zimage_second")
    assert differences(stock, ours) == []


def test_job_stopped_after_a_save_continues_from_it(workspace):
    """Ctrl-C (SIGINT) once the step-2 save is on disk: run.py stops ("Job stopped") and the save is intact; the
    same command again continues from step 2 (that LoRA and optimizer state) to the end. Stock and layerstream
    leave the same losses, LoRA files and samples. (The resumed steps' losses are not the uninterrupted run's,
    under either manager: AI-Toolkit's checkpoints hold no random-number state, docs/aitk-jobs.md.)"""
    opts = ARCH_OPTIONS["zimage"]
    resumed = {}
    for engine in ("stock", "layerstream"):
        name = f"zimage-{engine}-interrupted"
        first = run_engine(workspace, opts, engine, name, interrupt_after_save=opts.save_every)
        assert "Job stopped" in first.log, first.log[-4000:]
        kept = {k: v for k, v in first.loras.items() if k == f"job_zimage_{opts.save_every:09d}.safetensors"}
        assert kept, sorted(first.loras)
        second = run_engine(workspace, opts, engine, name)
        assert second.returncode == 0, second.log[-6000:]
        resumed_log = second.log[len(first.log):]
        assert f"Found step {opts.save_every} in metadata, starting from there" in resumed_log, resumed_log[-4000:]
        assert all(second.loras[k] == v for k, v in kept.items()), "the save of the stopped run changed"
        # AI-Toolkit logs no loss for the step a run starts from, and the stopped run's loss log may not have
        # been written out for its last steps: the steps after the save are the resumed run's own.
        after = {k: v for k, v in second.losses.items() if k > opts.save_every}
        assert sorted(after) == list(range(opts.save_every + 1, opts.steps)), second.losses
        assert _saves(opts, "job_zimage") == set(second.loras), sorted(second.loras)
        samples = {f"step{k}_{i}" for k in range(opts.sample_every, opts.steps + 1, opts.sample_every) for i in range(2)}
        assert samples <= set(second.samples), sorted(second.samples)
        resumed[engine] = replace(second, losses=after)
    assert differences(resumed["stock"], resumed["layerstream"]) == []


@pytest.mark.parametrize("where", ["step", "save"])
def test_ctrl_c_loses_no_saved_file_and_the_job_resumes(workspace, where):
    """Ctrl-C (a real SIGINT to run.py) inside a training step, and halfway through a checkpoint's write of
    optimizer.pt (the job waits there for it: aitk_site's AITK_JOB_PAUSE). run.py must exit ("Job stopped") within
    STOP_TIMEOUT_S, and every file saved before must hold its bytes, under stock and layerstream alike. In a
    step nothing is lost. In a save AI-Toolkit itself loses the previous optimizer.pt, stock too: it overwrites it
    in place (docs/ai-toolkit.md, "Ctrl-C during a save"); the LoRA files are intact. Started again, the job
    continues from the newest LoRA to the end (after a stopped save, with a fresh optimizer: AI-Toolkit says
    "Failed to load optimizer state"), stock and layerstream leaving the same losses, LoRA files and samples."""
    opts = ARCH_OPTIONS["zimage"]
    pause, resume_at = ("step:3", opts.save_every) if where == "step" else ("save:2", 2 * opts.save_every)
    lost, resumed = {}, {}
    for engine in ("stock", "layerstream"):
        name = f"zimage-{engine}-ctrl-c-{where}"
        first = run_engine(workspace, opts, engine, name, pause=pause)
        assert first.paused is not None and first.paused["where"] == where, first.log[-4000:]
        assert not first.killed, f"{engine}: run.py still running {STOP_TIMEOUT_S} s after Ctrl-C:\n{first.log[-4000:]}"
        assert first.returncode == 0 and "Job stopped" in first.log, first.log[-4000:]
        before = first.paused["before"]
        assert f"job_zimage_{opts.save_every:09d}.safetensors" in before and "optimizer.pt" in before, before
        lost[engine] = lost_files(before, workspace.root / "runs" / name / "job_zimage")
        second = run_engine(workspace, opts, engine, name)
        assert second.returncode == 0, second.log[-6000:]
        resumed_log = second.log[len(first.log):]
        assert f"Found step {resume_at} in metadata, starting from there" in resumed_log, resumed_log[-4000:]
        assert ("Failed to load optimizer state" in resumed_log) == (where == "save"), resumed_log[-4000:]
        after = {k: v for k, v in second.losses.items() if k > resume_at}
        assert sorted(after) == list(range(resume_at + 1, opts.steps)), second.losses
        assert _saves(opts, "job_zimage") == set(second.loras), sorted(second.loras)
        resumed[engine] = replace(second, losses=after)
    assert lost["stock"] == lost["layerstream"] == ([] if where == "step" else ["optimizer.pt"]), lost
    assert differences(resumed["stock"], resumed["layerstream"]) == []
