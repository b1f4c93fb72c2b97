#!/usr/bin/env python3
"""LoRA training step on a FLUX.1-shaped transformer: all resident, AI-Toolkit's stock offloading, layerstream.

The model has FLUX.1's block layout and layer shapes (19 double-stream and 38 single-stream blocks at hidden
3072, about 11.85B bf16 parameters) with random weights; no embedders, RoPE or final layer, because only the
block linears matter for what is measured: how long a training step takes when those weights stream over
PCIe. A rank-128 LoRA wraps every block linear the way AI-Toolkit's LoRA network does (after the memory
manager has attached, so the LoRA's ``org_forward`` is the manager's forward), and AdamW trains it.

Modes (``--mode``):
  resident     the whole model on the device: the compute time T_compute of a step
  stock        AI-Toolkit's own MemoryManager with its own manager_modules.py
  layerstream  AI-Toolkit's own MemoryManager with layerstream's manager_modules
  all          the three above, each in its own subprocess (clean peak-memory figures), then one table

Each mode reports s/step, peak VRAM, peak host RSS, pinned host bytes, bytes over the bus per step, the
first losses (the same weights, inputs and LoRA init in every mode, so they should agree) and the ratio to
the floor max(T_compute, bytes_per_step / pinned H2D bandwidth) (docs/benchmarks.md).

Examples (`layerstream bench` and `python benchmarks/flux_bench.py` are the same entry point):
  layerstream bench --preset flux1 --mode all --aitk-dir /path/to/ai-toolkit --md-out bench.md
  layerstream bench --preset flux1 --mode all --vram-cap-gb 24 --aitk-dir /path/to/ai-toolkit
  layerstream bench --preset small --mode resident          # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

try:
    from tqdm import tqdm
except ImportError:  # progress bars only
    tqdm = None

GiB = 1 << 30
MODES = ("resident", "stock", "layerstream")
CPU_LIMIT_BYTES = 2 * GiB  # larger presets refuse to run without a GPU unless --force
DTYPE = torch.bfloat16


# ---------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FluxConfig:
    hidden: int
    heads: int
    double_blocks: int
    single_blocks: int
    mlp_ratio: int
    img_tokens: int
    txt_tokens: int
    # FLUX.2's changes: a SwiGLU MLP (gate and value in one input linear), no biases, and the modulation
    # computed once for all blocks of a kind instead of by a linear in every block.
    swiglu: bool = False
    bias: bool = True
    shared_modulation: bool = False


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
}


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def _attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, 3*H) packed q|k|v -> attention output (B, L, H)."""
    batch, tokens, _ = qkv.shape
    q, k, v = qkv.view(batch, tokens, 3, heads, -1).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(batch, tokens, -1)


class _SwiGLU(nn.Module):
    """FLUX.2's MLP: one input linear for gate and value, SiLU(gate) * value, one output linear."""

    def __init__(self, h: int, mlp: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(h, 2 * mlp, bias=bias)
        self.down = nn.Linear(mlp, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * value)


def _mlp(cfg: FluxConfig) -> nn.Module:
    h, mlp = cfg.hidden, cfg.hidden * cfg.mlp_ratio
    if cfg.swiglu:
        return _SwiGLU(h, mlp, cfg.bias)
    return nn.Sequential(nn.Linear(h, mlp, bias=cfg.bias), nn.GELU(approximate="tanh"), nn.Linear(mlp, h, bias=cfg.bias))


class _Stream(nn.Module):
    """The per-stream (image or text) half of a double-stream block."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        h = cfg.hidden
        if not cfg.shared_modulation:
            self.mod = nn.Linear(h, 6 * h, bias=cfg.bias)
        self.norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.bias)
        self.proj = nn.Linear(h, h, bias=cfg.bias)
        self.mlp = _mlp(cfg)


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own weights, attending jointly over the concatenated tokens."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.heads = cfg.heads
        self.img = _Stream(cfg)
        self.txt = _Stream(cfg)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, img_m=None, txt_m=None):
        if img_m is None:  # modulation of its own (FLUX.1); FLUX.2 passes the shared one
            cond = F.silu(vec)
            img_m, txt_m = self.img.mod(cond), self.txt.mod(cond)
        img_mod = img_m.unsqueeze(1).chunk(6, dim=-1)
        txt_mod = txt_m.unsqueeze(1).chunk(6, dim=-1)
        img_qkv = self.img.qkv(_modulate(self.img.norm(img), img_mod[0], img_mod[1]))
        txt_qkv = self.txt.qkv(_modulate(self.txt.norm(txt), txt_mod[0], txt_mod[1]))
        attn = _attention(torch.cat((txt_qkv, img_qkv), dim=1), self.heads)
        txt_attn, img_attn = attn.split((txt.shape[1], img.shape[1]), dim=1)
        img = img + img_mod[2] * self.img.proj(img_attn)
        img = img + img_mod[5] * self.img.mlp(_modulate(self.img.norm(img), img_mod[3], img_mod[4]))
        txt = txt + txt_mod[2] * self.txt.proj(txt_attn)
        txt = txt + txt_mod[5] * self.txt.mlp(_modulate(self.txt.norm(txt), txt_mod[3], txt_mod[4]))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over the concatenated tokens; qkv and the MLP input share one fused linear."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        h, mlp = cfg.hidden, cfg.hidden * cfg.mlp_ratio
        self.heads = cfg.heads
        self.swiglu = cfg.swiglu
        self.split = (3 * h, 2 * mlp if cfg.swiglu else mlp)
        if not cfg.shared_modulation:
            self.mod = nn.Linear(h, 3 * h, bias=cfg.bias)
        self.norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.linear1 = nn.Linear(h, sum(self.split), bias=cfg.bias)
        self.linear2 = nn.Linear(h + mlp, h, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor, vec: torch.Tensor, m=None) -> torch.Tensor:
        if m is None:
            m = self.mod(F.silu(vec))
        shift, scale, gate = m.unsqueeze(1).chunk(3, dim=-1)
        qkv, mlp = self.linear1(_modulate(self.norm(x), shift, scale)).split(self.split, dim=-1)
        if self.swiglu:
            g, v = mlp.chunk(2, dim=-1)
            hidden = F.silu(g) * v
        else:
            hidden = self.act(mlp)
        out = self.linear2(torch.cat((_attention(qkv, self.heads), hidden), dim=-1))
        return x + gate * out


class FluxShapedTransformer(nn.Module):
    def __init__(self, cfg: FluxConfig, checkpointing: bool):
        super().__init__()
        self.checkpointing = checkpointing
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.double_blocks))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.single_blocks))
        self.shared = cfg.shared_modulation
        if self.shared:  # FLUX.2: one modulation per kind of block, computed once per forward
            h = cfg.hidden
            self.double_mod_img = nn.Linear(h, 6 * h, bias=cfg.bias)
            self.double_mod_txt = nn.Linear(h, 6 * h, bias=cfg.bias)
            self.single_mod = nn.Linear(h, 3 * h, bias=cfg.bias)

    def _run(self, block: nn.Module, *inputs):
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(block, *inputs, use_reentrant=False)
        return block(*inputs)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        double_mods, single_mods = (), ()
        if self.shared:
            cond = F.silu(vec)
            double_mods = (self.double_mod_img(cond), self.double_mod_txt(cond))
            single_mods = (self.single_mod(cond),)
        for block in self.double_blocks:
            img, txt = self._run(block, img, txt, vec, *double_mods)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = self._run(block, x, vec, *single_mods)
        return x[:, txt.shape[1]:]


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


def build_model(cfg: FluxConfig, checkpointing: bool, seed: int) -> FluxShapedTransformer:
    """The model in bf16 on the CPU, every parameter N(0, 0.02), frozen. Built on "meta" first so that
    nothing is allocated twice or initialised twice."""
    with torch.device("meta"):
        model = FluxShapedTransformer(cfg, checkpointing).to(DTYPE)
    model.to_empty(device="cpu")
    _init_parallel([lambda g, p=p: p.normal_(0.0, 0.02, generator=g) for p in model.parameters()], seed)
    return model.requires_grad_(False)


# ---------------------------------------------------------------------------------------------------------
# LoRA, wrapping the layers the way AI-Toolkit's LoRA network does
# ---------------------------------------------------------------------------------------------------------


class LoRAModule(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.lora_down = nn.Linear(base.in_features, rank, bias=False, dtype=DTYPE)
        self.lora_up = nn.Linear(rank, base.out_features, bias=False, dtype=DTYPE)
        self.scale = alpha / rank
        self.org_forward = None

    def init_weights(self, generator: torch.Generator, nonzero_up: bool) -> None:
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5), generator=generator)
        if nonzero_up:
            # Small, so the adapted model stays close to the base one, but nonzero, so that lora_down gets a
            # gradient too and the step exercises every backward path.
            self.lora_up.weight.normal_(0.0, 1e-3, generator=generator)
        else:
            nn.init.zeros_(self.lora_up.weight)

    def apply_to(self, base: nn.Linear) -> None:
        # Whatever forward the layer has now is wrapped: with a memory manager attached, that is the
        # manager's bouncing forward. The base layer is not registered as a submodule (nor is the LoRA in the
        # model), so the manager never sees the LoRA's linears and they stay on the device.
        self.org_forward = base.forward
        base.forward = self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.scale


def apply_lora(model: FluxShapedTransformer, rank: int, nonzero_up: bool, device: torch.device,
               seed: int) -> nn.ModuleList:
    """A LoRA on every linear inside the blocks; returns the network (the trainable parameters)."""
    targets = [m for blocks in (model.double_blocks, model.single_blocks)
               for m in blocks.modules() if isinstance(m, nn.Linear)]
    with torch.device("meta"):
        network = nn.ModuleList(LoRAModule(base, rank, alpha=float(rank)) for base in targets)
    network.to_empty(device="cpu")
    # Initialised on the CPU with CPU generators, so every mode and device starts from the same LoRA.
    _init_parallel([lambda g, lora=lora: lora.init_weights(g, nonzero_up) for lora in network], seed)
    network.to(device)
    for lora, base in zip(network, targets):
        lora.apply_to(base)
    return network


# ---------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Nvml:
    """The GPU's energy counter (NVML, millijoules since the driver loaded), read through ctypes so that no
    Python package is needed. None where NVML or the counter is missing (older GPUs, no driver)."""

    def __init__(self, index: int):
        import ctypes

        self._ctypes = ctypes
        self.handle = None
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != 0:
                return
            handle = ctypes.c_void_p()
            # NVML numbers GPUs as the driver does; torch's index matches unless CUDA_VISIBLE_DEVICES reorders.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0:
                self.handle = handle
        except (OSError, ValueError, AttributeError):
            self.handle = None

    def energy_mj(self) -> int | None:
        if self.handle is None:
            return None
        value = self._ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, self._ctypes.byref(value)) != 0:
            return None
        return value.value


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process.

    VmHWM first: the kernel tracks the true peak there. psutil has no peak RSS on Linux (memory_info().rss is
    the current value), so it is only the fallback elsewhere (peak_wset on Windows).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    info = psutil.Process().memory_info()
    return getattr(info, "peak_wset", info.rss)


def measure_h2d_bytes_per_s(size: int = GiB, repeats: int = 5) -> float:
    """Best of ``repeats`` copies of one pinned ``size``-byte tensor to the GPU, in bytes/s."""
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 0.0
    for _ in range(repeats):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, size / (start.elapsed_time(end) / 1e3))
    return best


def stored_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """What a weight or bias is stored as: a quantized weight (optimum-quanto) as its inner codes and scale,
    which are what is pinned and moved, not the dtype it dequantizes to."""
    return [t._data, t._scale] if hasattr(t, "_data") and hasattr(t, "_scale") else [t]


def managed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The weights and biases of the layers a memory manager took over, each storage once."""
    seen, tensors = set(), []
    for module in model.modules():
        if not hasattr(module, "_layer_memory_manager"):
            continue
        # _parameters directly: what the layer holds, whatever properties a subclass puts on top.
        for param in module._parameters.values():
            if param is None:
                continue
            for tensor in stored_tensors(param):
                if tensor.untyped_storage().data_ptr() not in seen:
                    seen.add(tensor.untyped_storage().data_ptr())
                    tensors.append(tensor)
    return tensors


def quantize_model(model: nn.Module, qtype: str) -> None:
    """optimum-quanto weights (AI-Toolkit's `quantize: true` default is qfloat8) on every linear, frozen."""
    import optimum.quanto as quanto

    quanto.quantize(model, weights=getattr(quanto, qtype))
    quanto.freeze(model)
    model.requires_grad_(False)


def stock_pinned_bytes(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(bytes torch's caching host allocator holds, exact bytes) for the pinned ones among ``tensors``.

    Every pin_memory() goes through that allocator, which rounds each block up to a power of two.
    """
    held = exact = 0
    for tensor in tensors:
        if tensor.is_pinned():
            nbytes = tensor.untyped_storage().nbytes()
            exact += nbytes
            held += 1 << max(nbytes - 1, 0).bit_length()
    return held, exact


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, sorted and merged."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def profile_timeline(step, device: torch.device, png: Path, title: str) -> dict:
    """Runs `step` once under torch.profiler (CUDA activity: every kernel and every copy of the process,
    layerstream's own streams included), draws copies against kernels over the step into `png`, and returns
    the busy times in ms: copies, kernels, both at once, and the step's span."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # device activity only: a small trace
        step()
        _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    copies, kernels = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]) / 1e3, (float(e["ts"]) + float(e["dur"])) / 1e3)  # ms
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            copies.append(span)
        elif e.get("cat") == "kernel":
            kernels.append(span)
    if not copies and not kernels:
        return {"error": "the profiler recorded no device activity"}
    t0 = min(s for s, _ in copies + kernels)
    copies = [(s - t0, e - t0) for s, e in copies]
    kernels = [(s - t0, e - t0) for s, e in kernels]
    busy_c, busy_k = _busy(copies), _busy(kernels)
    summary = {
        "span_ms": max(e for _, e in copies + kernels),
        "copy_busy_ms": sum(e - s for s, e in busy_c),
        "kernel_busy_ms": sum(e - s for s, e in busy_k),
        "both_ms": _overlap(busy_c, busy_k),
        "copies": len(copies), "kernels": len(kernels), "png": str(png),
    }
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(14, 2.6))
        ax.broken_barh([(s, e - s) for s, e in busy_k], (10, 8), color="tab:blue", label="GPU kernels")
        ax.broken_barh([(s, e - s) for s, e in busy_c], (0, 8), color="tab:orange", label="H2D copies")
        ax.set_yticks([4, 14], labels=["H2D copies", "kernels"])
        ax.set_xlabel("ms from the first device activity of the step")
        ax.set_title(f"{title}: one training step (copies busy {summary['copy_busy_ms']:.0f} ms, kernels busy "
                     f"{summary['kernel_busy_ms']:.0f} ms, both {summary['both_ms']:.0f} ms, span "
                     f"{summary['span_ms']:.0f} ms)", fontsize=9)
        fig.tight_layout()
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=110)
        plt.close(fig)
    except ImportError:
        summary["png"] = None
    print(f"timeline: {summary}", flush=True)
    return summary


def phase_split(model, inputs, optimizer, sync_grads, device, stats) -> dict:
    """One more step (not timed), synchronized between its forward and its backward: how long each took and,
    where the engine reports them, the bytes each copied. With the resident run's phases this gives the
    floor per phase (a forward that waits for the bus cannot lend its idle GPU to the backward)."""
    def copied() -> int | None:
        s = stats() if stats is not None else None
        return None if s is None else s.get("bytes_h2d")

    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    b0, t0 = copied(), time.perf_counter()
    loss = model(*inputs).float().pow(2).mean()
    _sync(device)
    b1, t1 = copied(), time.perf_counter()
    loss.backward()
    if sync_grads is not None:
        sync_grads()
    optimizer.step()
    _sync(device)
    b2, t2 = copied(), time.perf_counter()
    both = None not in (b0, b1, b2)
    return {"forward_s": t1 - t0, "backward_s": t2 - t1,
            "forward_bytes": b1 - b0 if both else None, "backward_bytes": b2 - b1 if both else None}


def _timed(step, device: torch.device):
    """step() between two device synchronizations: (its result, wall seconds)."""
    _sync(device)
    t0 = time.perf_counter()
    result = step()
    _sync(device)
    return result, time.perf_counter() - t0


def decode_blocks_sweep(args, mode, one_step, device, model, inputs, optimizer, sync_grads) -> list[dict] | None:
    """--decode-blocks-sweep: after the timed steps, the same model again at each limit on the lossless
    decode's thread blocks (one step to settle, then --steps timed, then a phase split): the settings
    side by side in one process, with the model built and packed once."""
    if not args.decode_blocks_sweep or mode != "layerstream" or args.host_dtype != "lossless":
        return None
    from layerstream import manager_modules as mm

    before = mm._decode_blocks()
    results = []
    try:
        for blocks in (int(b) for b in args.decode_blocks_sweep.split(",")):
            mm._set_decode_blocks(blocks)
            one_step()
            times = [_timed(one_step, device)[1] for _ in range(args.steps)]
            phases = phase_split(model, inputs, optimizer, sync_grads, device, None)
            results.append({"decode_blocks": blocks, "s_per_step_mean": sum(times) / len(times),
                            "s_per_step_min": min(times), "step_times_s": times, "phases": phases})
            print(f"[{mode}] decode blocks {blocks or 'all'}: {results[-1]['s_per_step_mean']:.3f} s/step "
                  f"(min {min(times):.3f}); forward {phases['forward_s']:.3f} s, backward "
                  f"{phases['backward_s']:.3f} s", flush=True)
    finally:
        mm._set_decode_blocks(before)
    return results


def _stored_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else sum(x.nbytes for x in stored_tensors(t))


class StockCopyCounter:
    """The bytes AI-Toolkit's stock manager stages onto the device, counted where it stages them. Its
    bouncing autograd functions (`_BouncingLinearFn`, `_BouncingConv2dFn` in manager_modules.py of 27a03a91
    and 323b4aaf) copy the layer's weight and bias at each forward and the weight at each backward. A
    backward autograd never runs (a frozen layer whose input needs no gradient, such as FLUX's modulation
    linears fed by the timestep embedding) copies nothing: counting calls gets that right where an estimate
    from passes over the weights cannot. On a CPU process device stock copies nothing; the count is what it
    would stage on a GPU."""

    def __init__(self, stock_module) -> None:
        self.bytes = 0
        self._restore: list[tuple[type, str, object]] = []
        for name in ("_BouncingLinearFn", "_BouncingConv2dFn"):
            fn = getattr(stock_module, name, None)
            if fn is None:
                continue
            for method in ("forward", "backward"):
                original = fn.__dict__[method]
                self._restore.append((fn, method, original))
                setattr(fn, method, staticmethod(self._counted(method, original.__func__)))

    def _counted(self, method: str, original):
        counter = self

        def forward(ctx, x, weight, bias, *rest):
            # Kept on ctx for the backward: reading ctx.saved_tensors here too would unpack a checkpointed
            # block's tensors twice, which torch.utils.checkpoint refuses.
            ctx.layerstream_weight_bytes = _stored_bytes(weight)
            counter.bytes += ctx.layerstream_weight_bytes + _stored_bytes(bias)
            return original(ctx, x, weight, bias, *rest)

        def backward(ctx, *grads):
            counter.bytes += getattr(ctx, "layerstream_weight_bytes", 0)  # the weight goes back up
            return original(ctx, *grads)

        return forward if method == "forward" else backward

    def stats(self) -> dict:
        """In the shape of layerstream's stats(), for the code that diffs them."""
        return {"bytes_h2d": self.bytes}

    def close(self) -> None:
        for fn, method, original in self._restore:
            setattr(fn, method, original)
        self._restore.clear()


def layerstream_stats() -> dict | None:
    """layerstream's telemetry, or None while its manager_modules has no stats() yet."""
    try:
        from layerstream import manager_modules

        return dict(manager_modules.stats())
    except Exception:  # the module or its stats() may not exist yet: report None, not a failed run
        return None


# ---------------------------------------------------------------------------------------------------------
# One mode
# ---------------------------------------------------------------------------------------------------------


def _skipped(mode: str, reason: str) -> dict:
    print(f"[{mode}] skipped: {reason}", flush=True)
    return {"mode": mode, "status": "skipped", "reason": reason}


def load_engine(args, engine: str):
    """(AI-Toolkit's memory_management package on ``engine``, None) or (None, why not)."""
    aitk_dir = args.aitk_dir or os.environ.get("AI_TOOLKIT_DIR")
    if not aitk_dir:
        return None, "needs an AI-Toolkit checkout: pass --aitk-dir or set AI_TOOLKIT_DIR"
    try:
        from layerstream.aitk import load_memory_management

        return load_memory_management(aitk_dir, engine=engine), None
    except Exception as exc:  # layerstream's module may be missing or half-built: skip the mode, say why
        return None, f"cannot load the {engine} engine: {type(exc).__name__}: {exc}"


def run_mode(args, mode: str, device: torch.device) -> dict:
    cfg = PRESETS[args.preset]
    package = None
    if mode != "resident":
        package, reason = load_engine(args, mode)
        if package is None:
            return _skipped(mode, reason)

    with torch.device("meta"):
        shapes_only = FluxShapedTransformer(cfg, args.checkpointing).to(DTYPE)
    weight_bytes = sum(p.nbytes for p in shapes_only.parameters())
    cap = int(args.vram_cap_gb * GiB) if args.vram_cap_gb and device.type == "cuda" else None
    if mode == "resident" and cap is not None and weight_bytes > cap:
        return _skipped(mode, f"{weight_bytes / GiB:.1f} GiB of weights do not fit in the {args.vram_cap_gb} GiB cap")

    t0 = time.perf_counter()
    model = build_model(cfg, args.checkpointing, seed=args.seed + 2)
    if args.quantize:
        quantize_model(model, args.quantize)
    build_s = time.perf_counter() - t0
    print(f"[{mode}] built {weight_bytes / GiB:.2f} GiB of bf16 weights"
          f"{f', quantized to {args.quantize}' if args.quantize else ''} in {build_s:.1f} s", flush=True)

    if mode == "layerstream" and args.host_dtype:
        os.environ["LAYERSTREAM_HOST_DTYPE"] = args.host_dtype  # read when attach creates the device state
    if mode == "layerstream":
        # How long compute waits for copies (two event records per fetch: well under 1% of a step).
        os.environ.setdefault("LAYERSTREAM_TIME_WAITS", "1")
    stock_counter = StockCopyCounter(package.manager_modules) if mode == "stock" else None
    # Cumulative counters of the bytes copied (layerstream's engine, or stock's staging calls), diffed over
    # the timed steps.
    counters = stock_counter.stats if stock_counter is not None else (
        layerstream_stats if mode == "layerstream" else None)
    t0 = time.perf_counter()
    if args.aitk_flow and device.type == "cuda":
        # AI-Toolkit's flow (extensions_built_in/diffusion_models/flux2/flux2_model.py): the transformer goes to
        # the GPU before MemoryManager.attach, and a text encoder comes to the GPU to cache the prompts' embeddings
        # and goes again; both leave their mark on the process's peak and on torch's cache.
        model.to(device)
        encoder = torch.empty(int(args.encoder_gb * GiB), dtype=torch.uint8, device=device)
        del encoder
    if package is None:
        model.to(device)
    else:
        print(f"[{mode}] attaching AI-Toolkit's MemoryManager to the model ...", flush=True)
        random.seed(args.seed)  # AI-Toolkit picks the layers left resident with random.random()
        package.MemoryManager.attach(model, device, offload_percent=args.offload_percent)
        model.to(device)  # the patched .to moves only the unmanaged modules
    network = apply_lora(model, args.rank, args.lora_init_nonzero, device, seed=args.seed + 1)
    place_s = time.perf_counter() - t0
    print(f"[{mode}] placed the model and applied LoRA in {place_s:.1f} s", flush=True)
    if cap is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    if args.aitk_flow and device.type == "cuda":
        # The table's peak is the training run's (the model's placement and the encoder are before it);
        # layerstream's budget measures its own window and reads none of torch's peak statistics.
        torch.cuda.reset_peak_memory_stats(device)

    inputs_gen = torch.Generator().manual_seed(args.seed)
    img, txt, vec = (torch.randn(shape, generator=inputs_gen, dtype=DTYPE).to(device)
                     for shape in ((1, cfg.img_tokens, cfg.hidden), (1, cfg.txt_tokens, cfg.hidden), (1, cfg.hidden)))
    # --aitk-flow: buckets of several resolutions, one after the other (AI-Toolkit's default 512/768/1024 is
    # 1/4, 9/16 and all of the image tokens).
    bucket_imgs = [img[:, :max(1, int(cfg.img_tokens * f))] for f in args.buckets] if args.aitk_flow else [img]
    current = [img]
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
    # AI-Toolkit's trainer joins the manager's gradient copies once per step, before the optimizer; do the same
    # (here only the LoRA trains and it lives on the device, so there is nothing to wait for, but it is called).
    sync_grads = getattr(package, "sync_grad_transfers", None)

    def one_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(current[0], txt, vec).float().pow(2).mean()
        loss.backward()
        if sync_grads is not None:
            sync_grads()
        optimizer.step()
        return loss

    losses, times = [], []
    stats_at_start = None
    nvml = _Nvml(device.index or 0) if device.type == "cuda" else None
    energy_start = None
    user_memory = []  # --user-alloc-gb: what "the user" holds on the device between some steps

    def sample() -> None:  # a sample under no_grad, as AI-Toolkit's sampling between steps
        with torch.no_grad():
            model(bucket_imgs[0], txt, vec)

    if args.aitk_flow:
        sample()  # AI-Toolkit samples before its first step by default
    for step in range(args.warmup + args.steps):
        current[0] = bucket_imgs[step % len(bucket_imgs)]
        if args.user_alloc_gb and device.type == "cuda":
            if step == args.user_alloc_at:
                user_memory.append(torch.empty(int(args.user_alloc_gb * GiB), dtype=torch.uint8, device=device))
                print(f"[{mode}] the user took {args.user_alloc_gb} GiB of the device before step {step}", flush=True)
            elif step == args.user_alloc_at + args.user_alloc_steps:
                user_memory.clear()
        if step == args.warmup and counters is not None:
            stats_at_start = counters()
        _sync(device)
        if step == args.warmup and nvml is not None:
            energy_start = nvml.energy_mj()
        loss, elapsed = _timed(one_step, device)
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(elapsed)
        print(f"[{mode}] step {step}{' (warmup)' if step < args.warmup else ''}: {elapsed:.3f} s, "
              f"loss {losses[-1]:.6g}", flush=True)
        if args.aitk_flow and args.sample_every and (step + 1) % args.sample_every == 0:
            sample()
    user_memory.clear()
    current[0] = img

    energy_end = nvml.energy_mj() if nvml is not None else None
    # The counters at the end of the timed steps: the steps below copy too, and counting them would add a
    # sixth step's bytes to five (seen: FLUX.1's bytes/step and floor read 6/5 of the truth).
    stats_end = counters() if counters is not None else None
    phases = phase_split(model, (img, txt, vec), optimizer, sync_grads, device,
                         counters if stats_end is not None else None)
    sweep = decode_blocks_sweep(args, mode, one_step, device, model, (img, txt, vec), optimizer, sync_grads)
    timeline = None
    if args.timeline_out and device.type == "cuda" and mode != "resident":
        # One more step (not timed) under the profiler: when the bus copied and when the GPU computed.
        out = Path(args.timeline_out)
        try:
            timeline = profile_timeline(one_step, device, out.with_name(f"{out.stem}-{mode}{out.suffix or '.png'}"),
                                        f"{args.preset} {mode}")
        except Exception as exc:  # the profiler is an extra: its failure must not lose the measured row
            timeline = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{mode}] timeline failed: {timeline['error']}", flush=True)
    joules_per_step = ((energy_end - energy_start) / 1e3 / len(times)
                       if energy_start is not None and energy_end is not None else None)
    managed = managed_tensors(model)
    managed_bytes = sum(t.nbytes for t in managed)
    row = {
        "mode": mode, "status": "ok", "device": str(device),
        "s_per_step_mean": sum(times) / len(times), "s_per_step_min": min(times), "step_times_s": times,
        "losses": losses, "weight_bytes": weight_bytes, "managed_bytes": managed_bytes,
        "lora_params": sum(p.numel() for p in network.parameters()), "build_s": build_s, "place_s": place_s,
        "peak_vram_allocated_bytes": None, "peak_vram_reserved_bytes": None, "peak_rss_bytes": peak_rss_bytes(),
        "pinned_bytes": None, "pinned_bytes_exact": None, "bytes_per_step": None, "engine_stats": None,
        "joules_per_step": joules_per_step, "timeline": timeline, "phases": phases,
        "aitk_flow": bool(args.aitk_flow),
    }
    if sweep is not None:
        row["decode_blocks_sweep"] = sweep
    if device.type == "cuda":
        row["peak_vram_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_vram_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if mode == "resident":
        row["pinned_bytes"] = row["pinned_bytes_exact"] = row["bytes_per_step"] = 0
        row["phases"]["forward_bytes"] = row["phases"]["backward_bytes"] = 0
    elif mode == "stock":
        row["pinned_bytes"], row["pinned_bytes_exact"] = stock_pinned_bytes(managed)
        # Counted at stock's own staging calls over the timed steps (see StockCopyCounter).
        row["bytes_per_step"] = (stats_end["bytes_h2d"] - stats_at_start["bytes_h2d"]) / len(times)
        stock_counter.close()
    else:
        stats = stats_end
        row["engine_stats"] = stats
        if stats is not None:
            row["pinned_bytes"] = stats.get("pinned_bytes")
            if stats_at_start is not None and "bytes_h2d" in stats:
                row["bytes_per_step"] = (stats["bytes_h2d"] - stats_at_start["bytes_h2d"]) / len(times)
            if stats_at_start is not None and stats.get("copy_waits_timed"):
                row["copy_wait_ms_per_step"] = (stats["copy_wait_us"] - stats_at_start["copy_wait_us"]) / 1e3 / len(times)
    return row


# ---------------------------------------------------------------------------------------------------------
# Floor, report, driver
# ---------------------------------------------------------------------------------------------------------


def reference_row(path: str | None) -> dict | None:
    """The resident row of an earlier run's --json-out (the same preset and settings, uncapped), for the
    floors of a run without one; a file without one is a ValueError."""
    if not path:
        return None
    rows = json.loads(Path(path).read_text())["results"]
    row = next((r for r in rows if r.get("mode") == "resident" and r.get("status") == "ok"), None)
    if row is None:
        raise ValueError(f"--reference-json {path}: no finished resident row in it; give the --json-out of a run "
                         "with --mode resident")
    return row


def add_floors(rows: list[dict], h2d_bytes_per_s: float | None, reference: dict | None = None) -> float | None:
    """Fill t_bus_s, floor_s and ratio_to_floor of each finished row; returns T_compute (None without a
    resident run, in `rows` or else `reference`: a resident row of an earlier run). The ratio uses the mean
    step time."""
    resident = next((r for r in rows if r["mode"] == "resident" and r["status"] == "ok"), reference)
    t_compute = resident["s_per_step_mean"] if resident else None
    for row in rows:
        if row["status"] != "ok":
            continue
        moved = row["bytes_per_step"]
        row["t_bus_s"] = moved / h2d_bytes_per_s if moved is not None and h2d_bytes_per_s else None
        bounds = [t for t in (t_compute, row["t_bus_s"]) if t is not None]
        row["floor_s"] = max(bounds) if bounds else None
        row["ratio_to_floor"] = row["s_per_step_mean"] / row["floor_s"] if row["floor_s"] else None
        row["phase_floor_s"] = phase_floor(resident, row, h2d_bytes_per_s)
        row["ratio_to_phase_floor"] = (row["s_per_step_mean"] / row["phase_floor_s"]
                                       if row["phase_floor_s"] else None)
    return t_compute


def phase_floor(resident: dict | None, row: dict, h2d_bytes_per_s: float | None) -> float | None:
    """max(compute, bus) per phase, summed: the resident run's forward and backward (optimizer included)
    times against the bytes this row copied in each. The forward is mostly copies with little compute and
    the backward the other way round, so this bound is above max(T_compute, bytes / bandwidth)."""
    ref, mine = (resident or {}).get("phases"), row.get("phases")
    if not ref or not mine or not h2d_bytes_per_s:
        return None
    if mine.get("forward_bytes") is None or mine.get("backward_bytes") is None:
        return None
    # The phase step's resident compute, scaled to the timed steps' mean (the extra synchronize and one
    # step's noise are not the steady state).
    scale = resident["s_per_step_mean"] / (ref["forward_s"] + ref["backward_s"])
    fwd, bwd = ref["forward_s"] * scale, ref["backward_s"] * scale
    return (max(fwd, mine["forward_bytes"] / h2d_bytes_per_s) +
            max(bwd, mine["backward_bytes"] / h2d_bytes_per_s))


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| mode | s/step mean (min) | peak VRAM GiB alloc / reserved | peak RSS GiB | pinned GiB (exact) "
        "| GiB/step over bus | floor s | x floor | phase floor s | x phase floor | J/step "
        "| compute waited for copies ms/step | first loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['status']}: {r['reason']} | | | | | | | | | | | |")
            continue
        exact = "" if r["pinned_bytes_exact"] is None else f" ({_fmt(r['pinned_bytes_exact'], GiB)})"
        lines.append(
            f"| {r['mode']} | {_fmt(r['s_per_step_mean'], digits=3)} ({_fmt(r['s_per_step_min'], digits=3)}) "
            f"| {_fmt(r['peak_vram_allocated_bytes'], GiB)} / {_fmt(r['peak_vram_reserved_bytes'], GiB)} "
            f"| {_fmt(r['peak_rss_bytes'], GiB)} | {_fmt(r['pinned_bytes'], GiB)}{exact} "
            f"| {_fmt(r['bytes_per_step'], GiB)} | {_fmt(r['floor_s'], digits=3)} "
            f"| {_fmt(r['ratio_to_floor'])} | {_fmt(r.get('phase_floor_s'), digits=3)} "
            f"| {_fmt(r.get('ratio_to_phase_floor'))} | {_fmt(r.get('joules_per_step'), digits=0)} "
            f"| {_fmt(r.get('copy_wait_ms_per_step'), digits=1)} | {r['losses'][0]:.6g} |"
        )
    return "\n".join(lines)


def report(args, rows: list[dict], h2d_bytes_per_s: float | None, t_compute: float | None) -> None:
    cfg = PRESETS[args.preset]
    meta = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "preset": args.preset, "config": asdict(cfg), "checkpointing": args.checkpointing, "rank": args.rank,
        "lora_init_nonzero": args.lora_init_nonzero, "offload_percent": args.offload_percent,
        "host_dtype": args.host_dtype, "quantize": args.quantize,
        "vram_cap_gb": args.vram_cap_gb, "warmup": args.warmup, "steps": args.steps, "seed": args.seed,
        "h2d_bytes_per_s": h2d_bytes_per_s, "t_compute_s": t_compute,
    }
    table = markdown_table(rows)
    summary = (
        f"pinned H2D: {_fmt(h2d_bytes_per_s, 1e9)} GB/s (1 GB = 1e9 B); T_compute: {_fmt(t_compute, digits=3)} s; "
        "floor = max(T_compute, bytes over the bus / bandwidth); phase floor = the same per phase (forward; "
        "backward with the optimizer), summed, from one more step synchronized between them; x floor uses the "
        "mean step time"
    )
    print()
    print(table)
    print(summary)
    losses = "\n".join(f"  {r['mode']}: {', '.join(f'{x:.6g}' for x in r['losses'])}"
                       for r in rows if r["status"] == "ok")
    if losses:
        print("losses per step (warmup included):\n" + losses)
    plans = budget_plans(rows)
    if plans:
        print(plans)
        losses += "\n\n" + plans
    sweeps = "\n".join(
        f"  {r['mode']}, decode blocks {x['decode_blocks'] or 'all'}: {x['s_per_step_mean']:.3f} s/step (min "
        f"{x['s_per_step_min']:.3f}), forward {x['phases']['forward_s']:.3f} s, backward {x['phases']['backward_s']:.3f} s"
        for r in rows for x in r.get("decode_blocks_sweep") or [])
    if sweeps:
        print("decode blocks sweep (after the timed steps, same process):\n" + sweeps)
        losses += "\n\ndecode blocks sweep:\n\n" + sweeps
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str) + "\n")
    if args.md_out:
        Path(args.md_out).write_text(
            f"# flux_bench: {args.preset}, mode {args.mode}\n\n"
            f"- command: `{meta['command']}`\n- date: {meta['date']}\n- GPU: {meta['gpu'] or 'none (CPU)'}\n"
            f"- torch: {meta['torch']}\n- config: {meta['config']}, checkpointing {args.checkpointing}, LoRA rank "
            f"{args.rank}, offload_percent {args.offload_percent}, VRAM cap {args.vram_cap_gb or 'none'} GiB"
            f"{f', layerstream host dtype {args.host_dtype}' if args.host_dtype else ''}"
            f"{f', weights quantized to {args.quantize} (optimum-quanto)' if args.quantize else ''}\n\n"
            f"{table}\n\n{summary}\n\nlosses per step (warmup included):\n\n{losses}\n"
        )


def budget_plans(rows: list[dict]) -> str:
    """One line per row whose VRAM budget planned: its ring, what it kept resident, and its replay's estimate
    of the bytes per step beside the bytes measured."""
    lines = []
    for r in rows:
        s = r.get("engine_stats") or {}
        if r.get("status") != "ok" or not s.get("vram_budget_planned"):
            continue
        measured = r.get("bytes_per_step")
        lines.append(
            f"  {r['mode']}: VRAM budget plan: ring {s.get('ring_bytes', 0) / 2**20:.1f} MiB, "
            f"{s.get('resident_layers', 0)} layers ({s.get('resident_bytes', 0) / 2**20:.1f} MiB) resident; "
            f"estimated {s.get('vram_budget_estimate', 0) / 2**20:.1f} MiB/step over the bus, measured "
            f"{'-' if measured is None else f'{measured / 2**20:.1f}'}"
            f"; yielded to memory pressure {s.get('pressure_yields', 0)} time(s), "
            f"{s.get('pressure_yielded_bytes', 0) / 2**20:.1f} MiB")
    return "budget plans:\n" + "\n".join(lines) if lines else ""


def _strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the given value-taking options (``--x v`` and ``--x=v`` forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out


def run_all(argv: list[str], modes: list[str]) -> list[dict]:
    """Every mode in its own process: peak VRAM and RSS are per-process high-water marks."""
    child_argv = _strip_options(argv, ("--mode", "--json-out", "--md-out"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="flux_bench_") as tmp:
        for mode in modes:
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, "-m", "layerstream.bench", *child_argv, "--mode", mode, "--json-out", str(out),
                   "--child"]
            print(f"== {mode}: {shlex.join(cmd)}", flush=True)
            code = subprocess.run(cmd).returncode
            if out.is_file():
                rows.append(json.loads(out.read_text())["results"][0])
            else:
                rows.append({"mode": mode, "status": "failed",
                             "reason": f"exit code {code}, no result (see its output above)"})
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    # allow_abbrev=False: `--mode all` rewrites the command line for its children by exact option names.
    parser = argparse.ArgumentParser(prog="layerstream bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="flux1")
    parser.add_argument("--mode", default="all",
                        help=f"one of {', '.join(MODES)}, a comma-separated list of them, or all")
    parser.add_argument("--aitk-dir", help="AI-Toolkit checkout (default: $AI_TOOLKIT_DIR)")
    parser.add_argument("--offload-percent", type=float, default=1.0,
                        help="AI-Toolkit's offload_percent: the fraction of linears the manager takes over")
    parser.add_argument("--vram-cap-gb", type=float, help="cap this process's VRAM at this many GiB")
    parser.add_argument("--reference-json", help="the --json-out of an earlier run with a resident row: its "
                        "compute times give the floors of this run when it has no resident mode of its own")
    parser.add_argument("--timeline-out", help="GPU: profile one extra step per streamed mode and draw its copies "
                                                   "against its kernels into FILE-<mode>.png")
    parser.add_argument("--quantize", choices=("qfloat8", "qint8"),
                        help="quantize every linear with optimum-quanto (weights only, frozen) in every mode")
    parser.add_argument("--host-dtype", choices=("lossless", "float8_e4m3fn", "float8_e5m2"),
                        help="layerstream mode only: LAYERSTREAM_HOST_DTYPE, frozen weights kept and streamed "
                             "packed exactly in about 12 bits per value (lossless) or as 8-bit codes with a scale "
                             "per output channel (float8; the other modes stream bf16)")
    parser.add_argument("--decode-blocks-sweep",
                        help="with --host-dtype lossless: after the timed steps, --steps more at each of these "
                             "limits on the decode's thread blocks (comma-separated; 0: no limit), in one process")
    parser.add_argument("--rank", type=int, default=128, help="LoRA rank (alpha = rank)")
    parser.add_argument("--lora-init-nonzero", action="store_true",
                        help="start lora_up at N(0, 1e-3) instead of zero, so lora_down gets gradients too")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="gradient checkpointing per block")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (on the H200 the third step of a process is still slow in every "
                             "mode, resident included: 2026-11-30)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aitk-flow", action="store_true",
                        help="as AI-Toolkit runs: the model on the GPU before attach, a text-encoder-sized "
                             "allocation made and freed before training, a no_grad sample before the first step "
                             "and every --sample-every steps, steps cycling through --buckets")
    parser.add_argument("--encoder-gb", type=float, default=9.5,
                        help="--aitk-flow: the text encoder's GiB on the device before training (T5-XXL bf16: 9.5)")
    parser.add_argument("--sample-every", type=int, default=4, help="--aitk-flow: a sample every N steps (0: none)")
    parser.add_argument("--buckets", type=lambda v: [float(f) for f in v.split(",")], default=[1.0, 0.5625, 0.25],
                        help="--aitk-flow: the image tokens of each bucket as fractions of the preset's "
                             "(default 1,0.5625,0.25: AI-Toolkit's 1024/768/512)")
    parser.add_argument("--user-alloc-gb", type=float, default=0.0,
                        help="GPU: before step --user-alloc-at the user takes this many GiB of the device, for "
                             "--user-alloc-steps steps (memory pressure)")
    parser.add_argument("--user-alloc-at", type=int, default=4)
    parser.add_argument("--user-alloc-steps", type=int, default=2)
    parser.add_argument("--force", action="store_true",
                        help=f"run a preset of more than {CPU_LIMIT_BYTES // GiB} GiB of weights without a GPU "
                             "(hours of CPU time and as much host RAM per mode)")
    parser.add_argument("--json-out", help="write the results as JSON")
    parser.add_argument("--md-out", help="write the table as markdown, with the command, date, GPU and torch")
    # Set by `--mode all` for its children: the parent measures the bandwidth and the floor once for all.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.modes = list(MODES) if args.mode == "all" else args.mode.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--mode: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)} or all")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def preset_weight_bytes(preset: str) -> int:
    with torch.device("meta"):
        return sum(p.nbytes for p in FluxShapedTransformer(PRESETS[preset], False).to(DTYPE).parameters())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    weight_bytes = preset_weight_bytes(args.preset)
    if not cuda and not args.force and weight_bytes > CPU_LIMIT_BYTES:
        print(f"layerstream bench: error: no GPU here, and --preset {args.preset} builds {weight_bytes / GiB:.1f} GiB "
              f"of weights on the CPU (hours per mode). Use --preset small or flux2-small, or pass --force",
              file=sys.stderr)
        return 2
    reference = None if args.child else reference_row(args.reference_json)  # before the runs: fail fast
    if len(args.modes) > 1:
        rows = run_all(argv, args.modes)
    else:
        device = torch.device("cuda") if cuda else torch.device("cpu")
        torch.manual_seed(args.seed)
        rows = [run_mode(args, args.modes[0], device)]
        gc.collect()  # the LoRA wrappers and the layers reference each other: free the model before measuring
        if cuda:
            torch.cuda.empty_cache()
    if args.child:
        Path(args.json_out).write_text(json.dumps({"results": rows}, default=str) + "\n")
        return 0
    h2d = measure_h2d_bytes_per_s() if cuda else None
    t_compute = add_floors(rows, h2d, reference)
    report(args, rows, h2d, t_compute)
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
