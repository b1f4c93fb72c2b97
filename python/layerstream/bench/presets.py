"""The presets (model shapes by name) and the model built from one: bf16 on the CPU, random weights, frozen."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from .flux import FluxConfig
from .qwen import QwenImageConfig
from .shaped import ShapedTransformer
from .wan import WanConfig

try:
    from tqdm import tqdm
except ImportError:  # progress bars only
    tqdm = None

DTYPE = torch.bfloat16

PRESETS = {
    "flux1": FluxConfig(hidden=3072, heads=24, double_blocks=19, single_blocks=38, mlp_ratio=4,
                        img_tokens=4096, txt_tokens=512),
    "medium": FluxConfig(hidden=3072, heads=24, double_blocks=2, single_blocks=4, mlp_ratio=4,
                         img_tokens=4096, txt_tokens=512),
    "small": FluxConfig(hidden=256, heads=4, double_blocks=2, single_blocks=4, mlp_ratio=4,
                        img_tokens=64, txt_tokens=16),
    # FLUX.2 [dev] shapes: 32.0B parameters (blocks and the shared modulation), 59.6 GiB of bf16.
    "flux2": FluxConfig(hidden=6144, heads=48, double_blocks=8, single_blocks=48, mlp_ratio=3,
                        img_tokens=4096, txt_tokens=512, swiglu=True, bias=False, shared_modulation=True),
    "flux2-small": FluxConfig(hidden=256, heads=4, double_blocks=2, single_blocks=4, mlp_ratio=3,
                              img_tokens=64, txt_tokens=16, swiglu=True, bias=False, shared_modulation=True),
    # Qwen-Image shapes (60 dual-stream blocks at 3072, 24 heads of 128, MLP 4x): 20.4B parameters, 38.0 GiB of
    # bf16; a 1024x1024 image (4096 tokens) and 512 text tokens.
    "qwen-image": QwenImageConfig(hidden=3072, heads=24, blocks=60, mlp_ratio=4, img_tokens=4096, txt_tokens=512),
    "qwen-image-medium": QwenImageConfig(hidden=3072, heads=24, blocks=2, mlp_ratio=4, img_tokens=4096,
                                         txt_tokens=512),
    "qwen-image-small": QwenImageConfig(hidden=128, heads=2, blocks=2, mlp_ratio=4, img_tokens=32, txt_tokens=8),
    # Wan 2.2 14B shapes (one of A14B's two experts; 40 blocks at 5120, 40 heads of 128, FFN 13824): 14.2B
    # parameters, 26.5 GiB of bf16; 81 frames at 480x832 (32,760 video tokens) and 512 text tokens.
    "wan22": WanConfig(hidden=5120, heads=40, blocks=40, ffn=13824, img_tokens=32760, txt_tokens=512),
    # The same at 41 frames (11 x 30 x 52 = 17,160 video tokens): 81 frames' activations alone (12.5 GiB of block
    # inputs kept for the checkpoints, 10 GiB saved in a block's recompute) do not fit a 24 GiB GPU.
    "wan22-41f": WanConfig(hidden=5120, heads=40, blocks=40, ffn=13824, img_tokens=17160, txt_tokens=512),
    "wan22-medium": WanConfig(hidden=5120, heads=40, blocks=2, ffn=13824, img_tokens=32760, txt_tokens=512),
    "wan22-small": WanConfig(hidden=128, heads=2, blocks=2, ffn=352, img_tokens=48, txt_tokens=8),
}


def _init_parallel(jobs, seed: int) -> None:
    """Run ``job(generator)`` for each job, job i with its own CPU generator seeded ``seed + i``.

    Per-job seeds make the result independent of thread scheduling, and the thread pool matters: torch's CPU
    normal_ runs on one core (about 150M elements/s), i.e. over a minute for FLUX.1's 11.85B parameters.
    """
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def run(indexed):
        index, job = indexed
        with torch.no_grad():  # grad mode is per thread: in-place init of a parameter needs it off here
            job(torch.Generator().manual_seed(seed + index))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = pool.map(run, enumerate(jobs))
        if tqdm is not None:
            done = tqdm(done, total=len(jobs), desc="initialising weights", unit="tensor", file=sys.stderr)
        list(done)


def build_model(cfg, checkpointing: bool, seed: int) -> ShapedTransformer:
    """The model of a preset's config in bf16 on the CPU, every parameter N(0, 0.02), frozen. Built on "meta"
    first so that nothing is allocated twice or initialised twice."""
    with torch.device("meta"):
        model = cfg.model(checkpointing).to(DTYPE)
    model.to_empty(device="cpu")
    _init_parallel([lambda g, p=p: p.normal_(0.0, 0.02, generator=g) for p in model.parameters()], seed)
    return model.requires_grad_(False)


def preset_weight_bytes(preset: str) -> int:
    with torch.device("meta"):
        return sum(p.nbytes for p in PRESETS[preset].model(False).to(DTYPE).parameters())
