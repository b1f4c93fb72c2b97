"""`layerstream bench aitk-job`: AI-Toolkit's own trainer, its unchanged `run.py`, on a real YAML job, once
with its stock manager (LAYERSTREAM=0) and once with layerstream, and what the two runs left compared.

The job is what a user writes (modelled on AI-Toolkit's config/examples): a LoRA on a model class that offloads
(`model.arch`: zimage, qwen_image, wan22_14b, flux2), `layer_offloading: true` with transformer and text-encoder
percents, gradient checkpointing, a sample every few steps, a save every few steps, a fixed seed, optionally
`quantize` (qfloat8, which AI-Toolkit turns into torchao float8 under offloading, or an OstrisLinear qtype such
as uint4). The model is built here with random weights in diffusers' layout (aitk_models.py), the dataset is
random images with captions in two resolution buckets. Each run works on its own writable copy of the
AI-Toolkit checkout, into which layerstream is installed as README's "Use it in AI-Toolkit" says
(`layerstream install /path/to/ai-toolkit`); LAYERSTREAM=0 runs the stock code of the same copy.

Compared, stock against layerstream: exit status; the loss of every step (AI-Toolkit's own loss log,
`logging.use_ui_logger`, full precision); the saved LoRA files (bytes); the sample images (pixels); that the
log shows layerstream active. Reported: AI-Toolkit's s/it, the median step (from one logged step to the next:
the training step without the samples and saves that the progress bar's moving average carries, where most
steps have neither), time from start to the first step, the wall time of each MemoryManager.attach, peak host
RSS, on a GPU peak VRAM, and for layerstream the medians of its per-step log line (GB copied to the device, ms
compute waited for copies). `--resume` stops the job after a save with Ctrl-C (SIGINT) and starts it again;
`--ctrl-c step`/`save` stops it inside a training step or halfway through a checkpoint write and reports what
of the saved files survived.

Run it in AI-Toolkit's Python (the venv that has AI-Toolkit's requirements and layerstream):
  layerstream bench aitk-job --aitk-dir /path/to/ai-toolkit --arch zimage                  # CPU, tiny
  layerstream bench aitk-job --aitk-dir /path/to/ai-toolkit --arch wan22_14b --size full \\
      --device cuda --cap-gb 24 --steps 10 --resolution 512                               # GPU, real shapes
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..install import MANIFEST
from .aitk_models import seed_hub_cache

SITE_DIR = Path(__file__).resolve().parent / "aitk_site"
ACTIVE_LINE = "layerstream manager_modules active on"
QUANTIZE = ("none", "qfloat8", "uint4")
PROMPTS = ["a red cube on a wooden table", "a lighthouse at night, long exposure"]


@dataclass
class JobOptions:
    arch: str
    size: str = "tiny"
    te_size: str = "tiny"
    layers: int | None = None
    quantize: str = "none"
    steps: int = 6
    save_every: int = 2
    sample_every: int = 3
    sample_steps: int = 2
    resolution: int = 64
    images: int = 4
    num_frames: int = 1
    device: str = "cpu"
    dtype: str = "bf16"
    rank: int = 4
    seed: int = 42
    transformer_percent: float = 1.0
    te_percent: float = 1.0


@dataclass
class RunResult:
    engine: str
    returncode: int
    wall_s: float
    losses: dict = field(default_factory=dict)     # step -> loss
    loras: dict = field(default_factory=dict)      # file name -> sha256 of its bytes
    samples: dict = field(default_factory=dict)    # step/index -> sha256 of its pixels
    active: bool = False
    peak_rss_bytes: int = 0
    peak_vram_allocated: int | None = None
    peak_vram_reserved: int | None = None
    s_per_it: float | None = None
    first_step_s: float | None = None
    last_step_s: float | None = None
    # The median time from one logged step to the next (AI-Toolkit's loss_log.db): the training step alone where
    # most steps neither sample nor save; AI-Toolkit's s/it (a moving average of its progress bar) also carries
    # the samples and saves between steps.
    median_step_s: float | None = None
    # Every such interval, in step order (the JSON keeps them: how the steps vary, not only their median).
    step_intervals_s: list = field(default_factory=list)
    # MemoryManager.attach's outermost calls (the transformer, each text encoder): module class and wall seconds.
    attaches: list = field(default_factory=list)
    # Wall seconds of each call of the trainer's sample() (the first one before the first step included) and
    # save() (each checkpoint save), stock's and layerstream's alike.
    sample_s: list = field(default_factory=list)
    save_s: list = field(default_factory=list)
    # After each sample: [the transformer's PackedWeights (layerstream's lossless host storage), how many of them
    # hold plain values], or None where the trainer has no transformer to count.
    packed_after_sample: list = field(default_factory=list)
    # The user's own allocations while the job trained (run_engine's ``stress_gb``; aitk_site's
    # AITK_JOB_STRESS_GB): {"sizes_gb", "made": {place: count}, "out_of_memory": {place: count}} for the places
    # between, inside (a training step) and sample; None without them.
    stress: dict | None = None
    # On CUDA, per optimizer step: what torch's allocator asked of the driver since the step before
    # ({"cudaMalloc", "cudaFree", "retries", "out_of_memory"}; aitk_site's allocator_per_step); empty elsewhere.
    allocator_per_step: list = field(default_factory=list)
    # layerstream's per-step line in the job's log (LAYERSTREAM_LOG_EVERY=1, which the harness sets for its
    # runs): the medians over the logged steps of the bytes copied to the device and of the time compute waited
    # for copies (LAYERSTREAM_TIME_WAITS=1); None for stock.
    bus_gb_per_step: float | None = None
    copy_wait_ms_per_step: float | None = None
    log: str = ""
    second: RunResult | None = None  # the job run.py ran next in the same process (--second-job)
    # Stopped with SIGINT where the job paused (run_engine's ``pause``): where, and the sha256 of every saved file
    # before (AITK_JOB_PAUSE_FILE); None when it never paused.
    paused: dict | None = None
    killed: bool = False  # it did not exit within STOP_TIMEOUT_S of the SIGINT and was killed


# ---------------------------------------------------------------------------------------------- inputs


def make_dataset(folder: Path, count: int, resolution: int, seed: int, frames: int = 1) -> Path:
    """Random images (``frames`` 1) or short clips (MPEG-4 at 16 fps, written with OpenCV, which AI-Toolkit
    reads them with) with a caption each, half square and half 3:2 (two of AI-Toolkit's buckets)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        w, h = (resolution, resolution) if i % 2 == 0 else (resolution * 3 // 2, resolution)
        if frames == 1:
            from PIL import Image

            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"item{i}.png")
        else:
            import cv2

            writer = cv2.VideoWriter(str(folder / f"item{i}.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 16, (w, h))
            base = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            for f in range(frames):  # a drifting pattern, so consecutive frames differ
                writer.write(np.roll(base, 2 * f, axis=1))
            writer.release()
        (folder / f"item{i}.txt").write_text(f"random noise number {i}")
    return folder


# The runs a job is compared in: AI-Toolkit's own offloading (stock, LAYERSTREAM=0), layerstream's, and the
# same job with layer offloading off and no VRAM cap (resident: the model on the GPU, the step's compute floor).
ENGINES = ("stock", "layerstream", "resident")


def job_config(opts: JobOptions, name: str, model_dir: Path, data_dir: Path, training_folder: Path,
               offload: bool = True) -> dict:
    """The job, as config/examples writes one (train_lora_*_24gb.yaml), sized by ``opts``; ``offload`` False:
    ``layer_offloading: false`` (the resident engine)."""
    model = {
        "name_or_path": str(model_dir), "arch": opts.arch, "quantize": opts.quantize != "none",
        "layer_offloading": offload,
    }
    if offload:
        model.update(layer_offloading_transformer_percent=opts.transformer_percent,
                     layer_offloading_text_encoder_percent=opts.te_percent)
    if opts.quantize != "none":
        model.update(qtype=opts.quantize, quantize_te=False)
    if opts.arch == "wan22_14b":
        model["model_kwargs"] = {"train_high_noise": True, "train_low_noise": True}
    train = {
        "batch_size": 1, "steps": opts.steps, "gradient_accumulation": 1, "train_unet": True,
        "train_text_encoder": False, "gradient_checkpointing": True, "noise_scheduler": "flowmatch",
        "optimizer": "adamw", "lr": 1e-4, "dtype": opts.dtype, "timestep_type": "linear",
    }
    if opts.arch == "wan22_14b":
        train["switch_boundary_every"] = 1  # both experts train within a few steps
    return {
        "job": "extension",
        "config": {
            "name": name,
            "process": [{
                "type": "sd_trainer",
                "training_folder": str(training_folder),
                "device": opts.device,
                "network": {"type": "lora", "linear": opts.rank, "linear_alpha": opts.rank},
                "save": {"dtype": "float16", "save_every": opts.save_every, "max_step_saves_to_keep": 100},
                "datasets": [{
                    "folder_path": str(data_dir), "caption_ext": "txt", "caption_dropout_rate": 0.0,
                    "resolution": [opts.resolution], "num_frames": opts.num_frames, "num_workers": 0,
                }],
                "train": train,
                "model": model,
                "sample": {
                    "sampler": "flowmatch", "sample_every": opts.sample_every, "width": opts.resolution,
                    "height": opts.resolution, "num_frames": opts.num_frames, "fps": 16, "prompts": PROMPTS,
                    "neg": "", "seed": opts.seed, "walk_seed": True, "guidance_scale": 4.0,
                    "sample_steps": opts.sample_steps, "format": "png" if opts.num_frames == 1 else "webp",
                },
                "logging": {"log_every": 1, "use_ui_logger": True},
            }],
        },
        "meta": {"name": "[name]", "version": "1.0"},
    }


def prepare_checkout(source: Path, dest: Path, python: str = sys.executable) -> Path:
    """A writable copy of the AI-Toolkit checkout with layerstream installed by README's command, run by the
    Python of AI-Toolkit's venv (``python``)."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", ".git", "output", "venv"))
    for folder, _, files in os.walk(dest):  # the snapshot may be read-only (CI's copy of shared/)
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    result = subprocess.run([python, "-m", "layerstream", "install", str(dest)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(dest, ignore_errors=True)  # a later run must not take the copy without the hook for one
        raise RuntimeError(f"layerstream install {dest} failed:\n{result.stdout}{result.stderr}")
    return dest


# ---------------------------------------------------------------------------------------------- one run


def job_env(engine: str, opts: JobOptions, stubs: Path | None, stats_file: Path, cap_gb: float | None,
            hub_cache: Path, deterministic: bool = False, model: Path | None = None,
            profile: Path | None = None, stress_gb: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITK_JOB_")}
    paths = [str(SITE_DIR)] + ([str(stubs)] if stubs else []) + [p for p in [env.get("PYTHONPATH")] if p]
    # Offline, with a hub cache that holds only what the model folder serves for fixed repo ids (aitk_models).
    env.update(PYTHONPATH=os.pathsep.join(paths), SEED=str(opts.seed), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(hub_cache), AITK_JOB_STATS=str(stats_file),
               PYTHONUNBUFFERED="1")
    if opts.device == "cpu":
        env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # torchao's kernels need CUDA libraries
    if cap_gb:
        env["AITK_JOB_CAP_GB"] = str(cap_gb)
    if deterministic:
        env.update(AITK_JOB_DETERMINISTIC="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if profile is not None:
        env["AITK_JOB_PROFILE"] = str(profile)
    if stress_gb:
        env["AITK_JOB_STRESS_GB"] = stress_gb
    if model is not None and (model / "flux2_params.json").is_file():  # FLUX.2's sizes (aitk_flux2.py)
        env["AITK_JOB_FLUX2_PARAMS"] = str(model / "flux2_params.json")
    if engine in ("stock", "resident"):
        env["LAYERSTREAM"] = "0"
    else:
        env.pop("LAYERSTREAM", None)
        # layerstream's line per optimizer step (what it copied, how long compute waited for copies: a few
        # microseconds a layer call to time) in the job's log, unless the caller set these.
        env.setdefault("LAYERSTREAM_LOG_EVERY", "1")
        env.setdefault("LAYERSTREAM_TIME_WAITS", "1")
        if opts.device == "cpu":
            env.setdefault("LAYERSTREAM_BACKEND", "sim")  # the simulator stands in for the GPU's copies
    return env


STOP_TIMEOUT_S = 120  # how long a job may take to exit after Ctrl-C before it counts as hung and is killed


def _wait(proc: subprocess.Popen, interrupt, timeout_s: float) -> tuple[int, int, bool]:
    """Waits for the job, sending SIGINT once ``interrupt()`` is true; returns (exit status, peak RSS bytes,
    whether it was killed: past ``timeout_s``, or past STOP_TIMEOUT_S after the SIGINT)."""
    deadline = time.monotonic() + timeout_s
    sent = killed = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024, killed
        if not sent and interrupt is not None and interrupt():
            proc.send_signal(signal.SIGINT)
            sent = True
            deadline = min(deadline, time.monotonic() + STOP_TIMEOUT_S)
        if time.monotonic() > deadline and not killed:
            proc.kill()
            killed = True
        time.sleep(0.05)


def _sigint_as_a_terminal_sends_it() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_job(checkout: Path, configs: list[Path], env: dict, log_path: Path, python: str = sys.executable,
            interrupt=None, timeout_s: float = 3600) -> tuple[int, int, float, bool]:
    """AI-Toolkit's run.py on the jobs (several run one after another in its one process); the output into
    ``log_path``. Returns (status, peak RSS, start time, killed)."""
    start = time.time()
    with open(log_path, "ab") as log:
        # Ctrl-C as a terminal delivers it: a harness started in the background by a shell without job control
        # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler in run.py.
        proc = subprocess.Popen([python, "run.py", *map(str, configs)], cwd=checkout, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_sigint_as_a_terminal_sends_it if os.name == "posix" else None)
        code, rss, killed = _wait(proc, interrupt, timeout_s)
    return code, rss, start, killed


# ---------------------------------------------------------------------------------------------- outputs


def read_losses(save_root: Path) -> dict[int, float]:
    """Every step's loss from AI-Toolkit's own loss log (loss_log.db, as the UI reads it)."""
    db = save_root / "loss_log.db"
    if not db.is_file():
        return {}
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT step, value_real FROM metrics WHERE key = 'loss/loss' ORDER BY step").fetchall()
    return {int(step): float(value) for step, value in rows}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def safetensors_digest(path: Path) -> str:
    """sha256 of a safetensors file's data section, byte for byte, and of its header with the keys sorted:
    safetensors writes the ``__metadata__`` map in an order that changes from process to process (two stock runs
    of one job give different file bytes), while every tensor's bytes, offsets and every metadata value are
    the run's outcome."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    return _sha256(json.dumps(header, sort_keys=True).encode() + data[8 + size:])


def lost_files(before: dict[str, str], save_root: Path) -> list[str]:
    """The files of ``before`` (name -> sha256 of the bytes, as the job's pause recorded them) that are gone from
    ``save_root`` or no longer hold those bytes."""
    return [name for name, digest in sorted(before.items())
            if not (save_root / name).is_file() or _sha256((save_root / name).read_bytes()) != digest]


def read_loras(save_root: Path) -> dict[str, str]:
    return {p.name: safetensors_digest(p) for p in sorted(save_root.glob("*.safetensors"))}


def read_samples(save_root: Path) -> dict[str, str]:
    """Each sample's pixels, keyed by step and index (the file names also carry a time stamp)."""
    from PIL import Image, ImageSequence

    out = {}
    for path in sorted((save_root / "samples").glob("*")):
        match = re.search(r"__(\d+)_(\d+)\.\w+$", path.name)
        if not match:
            continue
        with Image.open(path) as image:
            pixels = b"".join(frame.convert("RGB").tobytes() for frame in ImageSequence.Iterator(image))
        out[f"step{int(match.group(1))}_{match.group(2)}"] = _sha256(pixels)
    return out


def parse_log(text: str, job_name: str) -> tuple[float | None, bool]:
    """AI-Toolkit's own last reported seconds per iteration on the training progress bar of the job
    ``job_name`` (tqdm's, described by the job's name: ``job_x:  50%|...| 4/8 [00:05<00:04,  1.08s/it, lr: ...]``;
    the bars of the sampler and its prompts, which follow the last step, are not it) and whether layerstream was
    active."""
    bar = re.compile(re.escape(job_name) + r":\s+\d+%\|[^|]*\|\s*\d+/\d+ \[[^,\]]*,\s*(\d+(?:\.\d+)?)(s/it|it/s)[,\]]")
    rates = bar.findall(text)
    s_per_it = None
    if rates:
        value, unit = rates[-1]
        s_per_it = float(value) if unit == "s/it" else 1.0 / float(value)
    return s_per_it, ACTIVE_LINE in text


NUMBER = r"([0-9][0-9.eE+-]*)"
STEP_LINE = re.compile(r"layerstream, per step over the last [0-9]+ steps .*? copies \(" + NUMBER + r" GB, ")
WAIT = re.compile(r"compute waited " + NUMBER + r" ms for copies")


def step_telemetry(text: str) -> tuple[float | None, float | None]:
    """The medians of layerstream's per-step lines in a job's log (LAYERSTREAM_LOG_EVERY=1): GB copied to the
    device per step, and ms compute waited for copies per step (None where the lines do not say)."""
    copied, waited = [], []
    for line in text.splitlines():
        step = STEP_LINE.search(line)
        if step is None:
            continue
        copied.append(float(step.group(1)))
        wait = WAIT.search(line)
        if wait is not None:
            waited.append(float(wait.group(1)))
    return (float(statistics.median(copied)) if copied else None,
            float(statistics.median(waited)) if waited else None)


def collect(engine: str, save_root: Path, log_path: Path, stats_file: Path, code: int, rss: int,
            start: float) -> RunResult:
    log = log_path.read_text(errors="replace")
    s_per_it, active = parse_log(log, save_root.name)
    result = RunResult(engine=engine, returncode=code, wall_s=time.time() - start, losses=read_losses(save_root),
                       loras=read_loras(save_root), samples=read_samples(save_root), active=active,
                       peak_rss_bytes=rss, s_per_it=s_per_it, log=log)
    result.bus_gb_per_step, result.copy_wait_ms_per_step = step_telemetry(log)
    if stats_file.is_file():
        stats = json.loads(stats_file.read_text() or "{}")
        result.peak_vram_allocated = stats.get("peak_vram_allocated")
        result.peak_vram_reserved = stats.get("peak_vram_reserved")
        result.attaches = stats.get("attach", [])
        result.sample_s, result.save_s = stats.get("sample", []), stats.get("save", [])
        result.packed_after_sample = stats.get("packed_after_sample", [])
        result.stress = stats.get("stress")
        result.allocator_per_step = stats.get("allocator_per_step", [])
    read_step_times(save_root / "loss_log.db", start, result)
    return result


def read_step_times(db: Path, start: float, result: RunResult) -> None:
    """The logged steps' times from AI-Toolkit's loss_log.db (its ``steps`` table: step, wall_time) into
    ``result``: the first and last step's seconds after ``start``, the intervals between consecutive steps and
    their median. Nothing where the job logged no step."""
    if not db.is_file():
        return
    with sqlite3.connect(db) as con:
        steps = con.execute("SELECT step, wall_time FROM steps ORDER BY step").fetchall()
    if not steps:
        return
    result.first_step_s = float(min(t for _, t in steps)) - start
    result.last_step_s = float(max(t for _, t in steps)) - start
    result.step_intervals_s = [float(t1 - t0) for (s0, t0), (s1, t1) in zip(steps, steps[1:]) if s1 == s0 + 1]
    if result.step_intervals_s:
        result.median_step_s = float(statistics.median(result.step_intervals_s))


def allocator_line(per_step: list) -> str:
    """One line of what torch's allocator asked of the driver in each optimizer step (RunResult's
    allocator_per_step), for steps whose times differ while they move the same bytes."""
    def counts(label: str) -> str:
        return " ".join(str(step.get(label, 0)) for step in per_step)

    retries = sum(step.get("retries", 0) for step in per_step)
    ooms = sum(step.get("out_of_memory", 0) for step in per_step)
    return (f"torch's allocator over {len(per_step)} optimizer steps: cudaMalloc {counts('cudaMalloc')}; "
            f"cudaFree {counts('cudaFree')}; {retries} allocation retries, {ooms} out of memory")


def differences(a: RunResult, b: RunResult) -> list[str]:
    """What differs between two runs' outcomes (empty when the exit status, every loss, every LoRA file and
    every sample are the same)."""
    out = []
    if a.returncode != b.returncode:
        out.append(f"exit status {a.engine} {a.returncode} != {b.engine} {b.returncode}")
    if a.losses != b.losses:
        steps = sorted(set(a.losses) | set(b.losses))
        bad = [s for s in steps if a.losses.get(s) != b.losses.get(s)]
        out.append(f"losses differ at steps {bad[:8]} (first: {a.losses.get(bad[0])} vs {b.losses.get(bad[0])})")
    if a.loras != b.loras:
        out.append(f"LoRA files differ: {sorted(k for k in set(a.loras) | set(b.loras) if a.loras.get(k) != b.loras.get(k))}")
    if a.samples != b.samples:
        out.append(f"samples differ: {sorted(k for k in set(a.samples) | set(b.samples) if a.samples.get(k) != b.samples.get(k))}")
    if (a.second is None) != (b.second is None):
        out.append("only one run has a second job")
    elif a.second is not None:
        out += [f"second job: {d}" for d in differences(a.second, b.second) if not d.startswith("exit status")]
    return out


# ---------------------------------------------------------------------------------------------- a whole job


@dataclass
class Workspace:
    """Everything one comparison writes: the model, the dataset, one checkout and training folder per run."""
    root: Path
    source: Path
    stubs: Path | None = None
    python: str = sys.executable  # AI-Toolkit's venv, with layerstream installed

    def model(self, opts: JobOptions) -> Path:
        key = f"{opts.arch}-{opts.size}-{opts.te_size}-{opts.layers}"
        folder = self.root / "models" / key
        if not (folder / "layerstream_model.json").is_file():  # built by AI-Toolkit's diffusers/transformers
            code = ("import sys; from layerstream.bench.aitk_models import build_model; "
                    "build_model(sys.argv[1], sys.argv[2], size=sys.argv[3], te_size=sys.argv[4], "
                    "layers=None if sys.argv[5] == 'None' else int(sys.argv[5]), seed=0, aitk_dir=sys.argv[6])")
            env = dict(os.environ)
            if self.stubs:  # transformers imports torchvision, which needs the stand-in where it cannot load
                env["PYTHONPATH"] = os.pathsep.join([str(self.stubs)] + [p for p in [env.get("PYTHONPATH")] if p])
            subprocess.run([self.python, "-c", code, opts.arch, str(folder), opts.size, opts.te_size,
                            str(opts.layers), str(self.source)], check=True, env=env)
        return folder

    def dataset(self, opts: JobOptions) -> Path:
        folder = self.root / "data" / f"{opts.resolution}-{opts.images}-{opts.num_frames}"
        if not folder.is_dir():
            make_dataset(folder, opts.images, opts.resolution, seed=0, frames=opts.num_frames)
        return folder

    def checkout(self) -> Path:
        folder = self.root / "ai-toolkit"
        # Reused only where layerstream's install finished (its record is there): a copy without the hook would
        # run stock for both engines.
        if not (folder / MANIFEST).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            prepare_checkout(self.source, folder, self.python)
        return folder


def run_engine(ws: Workspace, opts: JobOptions, engine: str, run_name: str, cap_gb: float | None = None,
               interrupt_after_save: int | None = None, second_job: bool = False,
               deterministic: bool = False, pause: str | None = None, profile: bool = False,
               stress_gb: str | None = None) -> RunResult:
    """One run of the job; ``run_name`` names its training folder, so a second call with the same name resumes
    it (AI-Toolkit continues from the newest save there). ``interrupt_after_save``: SIGINT once the save of that
    step is on disk (LoRA and optimizer state). ``second_job``: run.py is given a second job (the same one under
    another name) that it starts in the same process when the first is done. ``pause``: SIGINT where the job
    waits for it (``step:N`` inside the training step after N optimizer steps, ``save:N`` halfway through the
    Nth write of optimizer.pt: aitk_site's AITK_JOB_PAUSE); the result's ``paused`` has the files before.
    ``profile``: profile.txt in the run's folder, Python's profile of its samples and training steps.
    ``stress_gb``: the user's own allocations of these sizes (GiB, comma-separated) between steps, inside steps
    and inside samples (aitk_site's AITK_JOB_STRESS_GB); the result's ``stress`` counts them.
    ``engine``: one of ENGINES; ``resident`` runs without ``cap_gb`` (a model that needs offloading under the cap
    does not fit there without it: the row is the step's compute on this GPU, not a user's card)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    if engine == "resident":
        cap_gb = None
    checkout, model, data = ws.checkout(), ws.model(opts), ws.dataset(opts)
    training = ws.root / "runs" / run_name
    training.mkdir(parents=True, exist_ok=True)
    import yaml

    name = f"job_{opts.arch}"
    names = [name, f"{name}_second"] if second_job else [name]
    configs = []
    for job_name in names:
        configs.append(training / f"{job_name}.yaml")
        config = job_config(opts, job_name, model, data, training, offload=engine != "resident")
        configs[-1].write_text(yaml.safe_dump(config, sort_keys=False))
    save_root = training / name
    log_path = training / "run.log"
    stats = training / f"stats-{int(time.time() * 1000)}.json"

    interrupt = None
    if interrupt_after_save is not None:
        lora = save_root / f"{name}_{interrupt_after_save:09d}.safetensors"
        optimizer = save_root / "optimizer.pt"

        def interrupt() -> bool:
            if not lora.is_file() or not optimizer.is_file():
                return False
            text = log_path.read_text(errors="replace")
            marker = text.rfind(f"Saving at step {interrupt_after_save}")
            return marker >= 0 and "Saved optimizer to" in text[marker:]

    hub_cache = seed_hub_cache(ws.root / "hub-cache", model)
    env = job_env(engine, opts, ws.stubs, stats, cap_gb, hub_cache, deterministic, model,
                  training / "profile.txt" if profile else None, stress_gb)
    marker = training / f"paused-{int(time.time() * 1000)}.json"
    if pause is not None:
        env.update(AITK_JOB_PAUSE=pause, AITK_JOB_PAUSE_FILE=str(marker), AITK_JOB_PAUSE_DIR=str(save_root))
        interrupt = marker.is_file
    code, rss, start, killed = run_job(checkout, configs, env, log_path, ws.python, interrupt)
    result = collect(engine, save_root, log_path, stats, code, rss, start)
    result.killed = killed
    if marker.is_file():
        result.paused = json.loads(marker.read_text())
    if second_job:
        result.second = collect(engine, training / names[1], log_path, stats, code, rss, start)
    return result
