"""The side-by-side training benchmark (`layerstream bench`, `python -m layerstream.bench`): cli.py says what it
measures and how to run it.

  presets.py, flux.py   the model shapes by name, and the FLUX-shaped transformer built from one
  lora.py               the LoRA, wrapped around the managed layers as AI-Toolkit's LoRA network does
  quant.py              library-quantized weights, as AI-Toolkit makes them
  measure.py            NVML energy, peak host RSS, pinned H2D bandwidth, step and phase timing
  timeline.py           one step under the profiler: copies against kernels
  counting.py           what the managers hold and move (stock's staged bytes counted at its calls)
  run.py                one mode, built, placed, trained and measured into one row
  report.py             the floors and the report (stdout table, JSON, markdown)
  cli.py                the command line: one mode in this process, several each in its own
  aitk_job.py           AI-Toolkit's run.py on a YAML job, stock vs layerstream (aitk_job_cli.py: `bench aitk-job`)
  aitk_models.py        the random-initialised models in diffusers' layout those jobs load
"""

from .cli import CPU_LIMIT_BYTES, MODES, main, parse_args, run_all
from .counting import StockCopyCounter, layerstream_stats, managed_tensors, stock_pinned_bytes, stored_tensors
from .flux import DoubleStreamBlock, FluxConfig, FluxShapedTransformer, SingleStreamBlock
from .lora import LoRAModule, apply_lora
from .measure import GiB, measure_h2d_bytes_per_s, peak_rss_bytes, phase_split
from .presets import DTYPE, PRESETS, build_model, preset_weight_bytes
from .quant import quantize_model
from .report import add_floors, budget_plans, markdown_table, phase_floor, reference_row, report
from .run import load_engine, run_mode
from .floor import breakdown, profile_step
from .timeline import draw_timeline

__all__ = [
    "CPU_LIMIT_BYTES", "DTYPE", "GiB", "MODES", "PRESETS", "DoubleStreamBlock", "FluxConfig", "FluxShapedTransformer",
    "LoRAModule", "SingleStreamBlock", "StockCopyCounter", "add_floors", "apply_lora", "breakdown", "budget_plans",
    "build_model", "draw_timeline",
    "layerstream_stats", "load_engine", "main", "managed_tensors", "markdown_table", "measure_h2d_bytes_per_s",
    "parse_args", "peak_rss_bytes", "phase_floor", "phase_split", "preset_weight_bytes", "profile_step",
    "quantize_model", "reference_row", "report", "run_all", "run_mode", "stock_pinned_bytes", "stored_tensors",
]
