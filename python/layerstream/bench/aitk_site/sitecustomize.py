"""Loaded by the job harness (`layerstream bench aitk-job`) at the start of AI-Toolkit's run.py through
PYTHONPATH; AI-Toolkit's files stay as they are. It does two things a job cannot do from its YAML:

  AITK_JOB_CAP_GB     caps the process's VRAM (torch.cuda.set_per_process_memory_fraction) from the moment
                             the first optimizer is made: after the model is loaded and placed, before the first
                             sample and step, as a card of that size would have it during training;
  AITK_JOB_STATS      a JSON file written at exit: peak VRAM allocated and reserved (where CUDA was used);
  AITK_JOB_DETERMINISTIC=1   torch.use_deterministic_algorithms(True), for bitwise comparisons on a GPU.

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


def _write_stats(path: str) -> None:
    stats = {}
    try:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["peak_vram_allocated"] = torch.cuda.max_memory_allocated()
            stats["peak_vram_reserved"] = torch.cuda.max_memory_reserved()
    finally:
        with open(path, "w") as f:
            json.dump(stats, f)


_chain_next_sitecustomize()
if os.environ.get("AITK_JOB_CAP_GB"):
    _cap_at_first_optimizer(float(os.environ["AITK_JOB_CAP_GB"]) * 2**30)
if os.environ.get("AITK_JOB_DETERMINISTIC") == "1":
    import torch

    torch.use_deterministic_algorithms(True)
if os.environ.get("AITK_JOB_STATS"):
    atexit.register(_write_stats, os.environ["AITK_JOB_STATS"])
