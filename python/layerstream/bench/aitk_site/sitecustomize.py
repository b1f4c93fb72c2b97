"""Loaded by the job harness (`layerstream bench aitk-job`) at the start of AI-Toolkit's run.py through
PYTHONPATH; AI-Toolkit's files stay as they are. It does what a job cannot do from its YAML:

  AITK_JOB_CAP_GB     caps the process's VRAM (torch.cuda.set_per_process_memory_fraction) from the moment
                             the first optimizer is made: after the model is loaded and placed, before the first
                             sample and step, as a card of that size would have it during training;
  AITK_JOB_STATS      a JSON file written at exit: peak VRAM allocated and reserved (where CUDA was used), the
                             wall time of each outermost MemoryManager.attach call (stock's and layerstream's
                             alike: AI-Toolkit's manager.py calls it for the transformer and each text encoder) and
                             of each call of the trainer's sample() and save() (BaseSDTrainProcess's: the samples
                             and checkpoint saves between steps, and the first sample before the first step),
                             and after each sample how many transformer weights are PackedWeights (lossless host
                             storage) and how many of those a sample left holding plain values; on CUDA, after
                             each optimizer step, what torch's allocator asked of the driver since the one before
                             (`allocator_per_step`: cudaMalloc and cudaFree calls, allocation retries, out of
                             memory), for steps that differ in time while moving the same bytes;
  AITK_JOB_PROFILE    a text file written at exit: Python's cProfile of the trainer's first sample() call (before
                             the first step: it carries the warm-up), of its sample() calls after the first and of
                             its training steps (SDTrainer.hook_train_loop) after the second, the functions that
                             took the most time, for where a job's time goes;
  AITK_JOB_DETERMINISTIC=1   torch.use_deterministic_algorithms(True), for bitwise comparisons on a GPU;
  AITK_JOB_FLUX2_PARAMS      a JSON file of FLUX.2's transformer and VAE sizes (aitk_flux2.py), which AI-Toolkit's
                             Flux2Model then builds instead of its fixed ones;
  AITK_JOB_PAUSE             where the job waits for the harness's SIGINT (Ctrl-C): `step:N` in the first LoRA
                             forward with gradients after N optimizer steps (inside a training step), `save:N` in
                             the Nth write of optimizer.pt, halfway through its bytes (inside a checkpoint save).
                             Before it waits it writes AITK_JOB_PAUSE_FILE: the sha256 of every file in
                             AITK_JOB_PAUSE_DIR as they were before the save began (for `save`) or at the pause.
                             With no signal within 120 s it goes on.
  AITK_JOB_STRESS_GB         the user's own allocations while the job trains (e.g. `2,4,8`: GiB, comma-separated;
                             on the CUDA device, or the CPU where there is none): each size in turn, each freed
                             before the next, after every odd optimizer step (between steps), in the first LoRA
                             forward with gradients after every even one (inside a step) and in the first forward
                             of every sample after the first optimizer step (inside a sample, under the cap). An
                             out-of-memory error is caught, counted and printed, and the job goes on; the counts
                             go into AITK_JOB_STATS's file (`stress`).

A sitecustomize found earlier on sys.path (a venv's own) is not replaced: this one runs it first."""

import atexit
import json
import os


def _chain_next_sitecustomize() -> None:
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_layerstream_chained_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # kept alive: what it made (e.g. a torch.library.Library) stays
            spec.loader.exec_module(module)
            return


def _cap_at_first_optimizer(cap_bytes: float) -> None:
    import torch

    original = torch.optim.Optimizer.__init__

    def init(self, *args, **kwargs):
        torch.optim.Optimizer.__init__ = original
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
            torch.cuda.reset_peak_memory_stats(device)
            print(f"layerstream job harness: VRAM capped at {cap_bytes / 2**30:.1f} GiB from the first optimizer on",
                  flush=True)
        original(self, *args, **kwargs)

    torch.optim.Optimizer.__init__ = init


_ATTACHES: list = []  # {"module": class name, "seconds": wall time} per outermost MemoryManager.attach
_PHASES: dict = {"sample": [], "save": []}  # wall seconds of each outermost call of the trainer's sample / save
_PACKED: list = []  # after each sample: [PackedWeights in the transformer, how many of them hold plain values]
_STRESS: dict = {}  # AITK_JOB_STRESS_GB: the sizes, and per place the allocations made and out of memory
_ALLOCATOR: list = []  # per optimizer step on CUDA: torch's allocator counters' increase since the step before
ALLOCATOR_COUNTERS = {"num_device_alloc": "cudaMalloc", "num_device_free": "cudaFree",
                      "num_alloc_retries": "retries", "num_ooms": "out_of_memory"}


def _packed_weights(trainer) -> list | None:
    """How many of the trainer's transformer weights are layerstream's PackedWeights (lossless host storage),
    and how many of those hold plain values (written, or decoded for good: packed again at their next use)."""
    transformer = getattr(getattr(trainer, "sd", None), "unet", None)
    if transformer is None:
        return None
    packed = [p for p in transformer.parameters() if type(p).__name__ == "PackedWeight"]
    return [len(packed), sum(p._ls_packed.plain is not None for p in packed)]


def _time_outermost(function, record):
    """``function`` wrapped to call ``record(args, seconds)`` after each outermost call (a call made from inside
    another is part of it: manager.py attaches a model's children through attach itself)."""
    import functools
    import time

    depth = [0]

    @functools.wraps(function)
    def timed(*args, **kwargs):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                record(args, time.perf_counter() - start)

    return timed


def _time_phases() -> None:
    def patch_manager(module):
        manager = module.MemoryManager
        attach = _time_outermost(manager.__dict__["attach"].__func__, lambda args, seconds: _ATTACHES.append(
            {"module": type(args[1]).__name__, "seconds": seconds}))
        manager.attach = classmethod(attach)

    def after_sample(args, seconds):
        _PHASES["sample"].append(seconds)
        _PACKED.append(_packed_weights(args[0]))

    def patch_trainer(module):
        trainer = module.BaseSDTrainProcess
        trainer.sample = _time_outermost(trainer.sample, after_sample)
        trainer.save = _time_outermost(trainer.save, lambda args, seconds: _PHASES["save"].append(seconds))

    _after_import("toolkit.memory_management.manager", patch_manager)
    _after_import("jobs.process.BaseSDTrainProcess", patch_trainer)
    _count_allocator_per_step()


def _count_allocator_per_step() -> None:
    """After each optimizer step on CUDA, the increase of torch's allocator counters (ALLOCATOR_COUNTERS) since
    the step before (the first: since the process began) into _ALLOCATOR. Hooked in when run.py imports torch's
    optimizers (torch is not imported here for it)."""
    last = {name: 0 for name in ALLOCATOR_COUNTERS}

    def after_step(optimizer, args, kwargs):
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        stats = torch.cuda.memory_stats()
        now = {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTERS}
        _ALLOCATOR.append({label: now[name] - last[name] for name, label in ALLOCATOR_COUNTERS.items()})
        last.update(now)

    _after_import("torch.optim.optimizer", lambda module: module.register_optimizer_step_post_hook(after_step))


_PROFILES: dict = {}  # "first sample" / "sample" / "training step" -> cProfile.Profile
PHASE_ORDER = ("first sample", "sample", "training step")  # the order profile.txt has them in


def _profiled(function, name: str, skip: int, first: str | None = None):
    """``function`` run under the cProfile.Profile _PROFILES[name] from its (skip+1)th call on (the first calls
    warm up: kernels chosen, buffers made); ``first``: its first call under a profile of that name of its own."""
    import cProfile
    import functools

    profile, calls = _PROFILES.setdefault(name, cProfile.Profile()), [0]

    @functools.wraps(function)
    def run(*args, **kwargs):
        calls[0] += 1
        if calls[0] > skip:
            active = profile
        elif first is not None and calls[0] == 1:
            active = _PROFILES.setdefault(first, cProfile.Profile())
        else:
            return function(*args, **kwargs)
        active.enable()
        try:
            return function(*args, **kwargs)
        finally:
            active.disable()

    return run


def _profile_phases(path: str) -> None:
    def patch_trainer(module):
        trainer = module.BaseSDTrainProcess
        trainer.sample = _profiled(trainer.sample, "sample", skip=1, first="first sample")

    def patch_sd_trainer(module):
        trainer = module.SDTrainer
        trainer.hook_train_loop = _profiled(trainer.hook_train_loop, "training step", skip=2)

    def write():
        import io
        import pstats

        with open(path, "w") as f:
            for name, profile in sorted(_PROFILES.items(), key=lambda item: PHASE_ORDER.index(item[0])):
                for order, label, count in (("cumulative", "cumulative time", 40), ("tottime", "own time", 25)):
                    text = io.StringIO()
                    pstats.Stats(profile, stream=text).sort_stats(order).print_stats(count)
                    f.write(f"==== {name}: by {label}\n{text.getvalue()}\n")

    _after_import("jobs.process.BaseSDTrainProcess", patch_trainer)
    _after_import("extensions_built_in.sd_trainer.SDTrainer", patch_sd_trainer)
    atexit.register(write)


def _write_stats(path: str) -> None:
    stats = {"attach": _ATTACHES, **_PHASES, "packed_after_sample": _PACKED, "stress": _STRESS or None,
             "allocator_per_step": _ALLOCATOR}
    try:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["peak_vram_allocated"] = torch.cuda.max_memory_allocated()
            stats["peak_vram_reserved"] = torch.cuda.max_memory_reserved()
    finally:
        with open(path, "w") as f:
            json.dump(stats, f)


def _after_import(fullname: str, patch) -> None:
    """Runs ``patch(module)`` once the module ``fullname`` has been executed, wherever it is imported from (at
    once where it has been: AITK_JOB_DETERMINISTIC imports torch here)."""
    import importlib.abc
    import sys

    if fullname in sys.modules:
        patch(sys.modules[fullname])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != fullname:
                return None
            sys.meta_path.remove(self)
            spec = next((s for f in sys.meta_path if hasattr(f, "find_spec")
                         for s in [f.find_spec(name, path, target)] if s is not None), None)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _flux2_sizes(path: str) -> None:
    with open(path) as f:
        params = json.load(f)

    def patch(module):
        model_params, vae_params = module.Flux2Params, module.AutoEncoderParams
        module.Flux2Model.get_flux2_params = lambda self: model_params(**params["transformer"])
        module.AutoEncoderParams = lambda: vae_params(**params["vae"])  # load_model's name for the VAE's sizes

    _after_import("extensions_built_in.diffusion_models.flux2.flux2_model", patch)


def _digests(folder: str) -> dict:
    import hashlib

    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name.endswith((".safetensors", ".pt")):
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _wait_for_sigint(where: str, before: dict) -> None:
    import time

    marker = os.environ["AITK_JOB_PAUSE_FILE"]
    with open(marker + ".tmp", "w") as f:
        json.dump({"where": where, "before": before}, f)
    os.replace(marker + ".tmp", marker)
    print(f"layerstream job harness: waiting for SIGINT in the {where}", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _pause(spec: str) -> None:
    import torch

    where, count = spec.split(":")
    count, seen = int(count), [0]
    folder = os.environ.get("AITK_JOB_PAUSE_DIR", "")
    if where == "save":
        original = torch.save

        def save(obj, f, *args, **kwargs):
            if not (isinstance(f, (str, os.PathLike)) and os.path.basename(f) == "optimizer.pt"):
                return original(obj, f, *args, **kwargs)
            seen[0] += 1
            if seen[0] != count:
                return original(obj, f, *args, **kwargs)
            import io

            before, buffer = _digests(folder), io.BytesIO()
            original(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(f, "wb") as out:  # as torch.save(obj, path) does: the old file is gone from here on
                out.write(data[:len(data) // 2])
                out.flush()
                _wait_for_sigint("save", before)
                out.write(data[len(data) // 2:])

        torch.save = save
        return
    if where != "step":
        raise ValueError(f"AITK_JOB_PAUSE={spec!r}: use step:N or save:N")
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda *a: seen.__setitem__(0, seen[0] + 1))
    done = [False]

    def pre_hook(module, args):
        if done[0] or seen[0] < count or not torch.is_grad_enabled():
            return None
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            done[0] = True
            _wait_for_sigint("step", _digests(folder))
        return None

    register_module_forward_pre_hook(pre_hook)


def _stress(sizes_gb: list) -> None:
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    places = ("between", "inside", "sample")
    _STRESS.update(sizes_gb=sizes_gb, made=dict.fromkeys(places, 0), out_of_memory=dict.fromkeys(places, 0))
    state = {"steps": 0, "inside": False, "sample": False}

    def take(where: str) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        for gib in sizes_gb:
            try:
                block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
                block[-1] = 1  # touched: the memory is really there
                del block
                _STRESS["made"][where] += 1
            except torch.OutOfMemoryError:
                _STRESS["out_of_memory"][where] += 1
                print(f"layerstream job harness: the user's {gib:g} GiB {where} after optimizer step {state['steps']} "
                      "ran out of memory", flush=True)

    def after_step(optimizer, args, kwargs):
        state["steps"] += 1
        if state["steps"] % 2:
            take("between")
        else:
            state["inside"] = True

    def pre_hook(module, args):
        if state["inside"] and torch.is_grad_enabled() and any(
                p.requires_grad for p in module.parameters(recurse=False)):
            state["inside"] = False
            take("inside")
        elif (state["sample"] and not torch.is_grad_enabled()
              and next(module.parameters(recurse=False), None) is not None):
            state["sample"] = False
            take("sample")
        return None

    def patch_trainer(module):
        import functools

        trainer, sample = module.BaseSDTrainProcess, module.BaseSDTrainProcess.sample

        @functools.wraps(sample)
        def stressed_sample(*args, **kwargs):
            state["sample"] = state["steps"] > 0
            try:
                return sample(*args, **kwargs)
            finally:
                state["sample"] = False

        trainer.sample = stressed_sample

    register_optimizer_step_post_hook(after_step)
    register_module_forward_pre_hook(pre_hook)
    _after_import("jobs.process.BaseSDTrainProcess", patch_trainer)


_chain_next_sitecustomize()
if os.environ.get("AITK_JOB_STRESS_GB"):
    _stress([float(v) for v in os.environ["AITK_JOB_STRESS_GB"].split(",")])
if os.environ.get("AITK_JOB_FLUX2_PARAMS"):
    _flux2_sizes(os.environ["AITK_JOB_FLUX2_PARAMS"])
if os.environ.get("AITK_JOB_PAUSE"):
    _pause(os.environ["AITK_JOB_PAUSE"])
if os.environ.get("AITK_JOB_CAP_GB"):
    _cap_at_first_optimizer(float(os.environ["AITK_JOB_CAP_GB"]) * 2**30)
if os.environ.get("AITK_JOB_DETERMINISTIC") == "1":
    import torch

    torch.use_deterministic_algorithms(True)
if os.environ.get("AITK_JOB_STATS"):
    _time_phases()
    atexit.register(_write_stats, os.environ["AITK_JOB_STATS"])
if os.environ.get("AITK_JOB_PROFILE"):
    _profile_phases(os.environ["AITK_JOB_PROFILE"])
