"""The training of one mode on its placed model: LoRA steps as AI-Toolkit's trainer takes them (warm-up, then
timed), the phase split, the decode-blocks sweep and the profiled step (floor breakdown, timeline) after them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .measure import GiB, _Nvml, _sync, _timed, allocator_counters, allocator_delta, phase_split
from .presets import DTYPE
from .floor import profile_step
from .timeline import draw_timeline


@dataclass
class Steps:
    """What the warm-up and timed steps measured; the counters are the mode's cumulative bytes copied (None
    for resident) at the first timed step and at the end of the timed steps. --aitk-flow's samples between
    the timed steps copy too: sample_bytes is what they copied and sample_wait_us how long their compute waited
    for copies (their time is not in the steps' times, so neither are these in the per-step figures), samples
    how many ran there."""
    losses: list[float]
    times: list[float]
    stats_at_start: dict | None
    stats_end: dict | None
    joules_per_step: float | None
    sample_bytes: float = 0.0
    samples: int = 0
    sample_wait_us: float = 0.0
    # torch's allocator in each timed step (measure.ALLOCATOR_COUNTERS; None off CUDA): retries mean the step
    # ran against the memory limit and the allocator emptied its cache to go on.
    allocator: list | None = None
    # --stress-gb: the allocations made between and inside steps, and those that ran out of memory.
    stress: dict | None = None


class _Stress:
    """--stress-gb: the user's allocations between and inside steps. Before every odd step one of the sizes (in
    turn) is allocated and freed; inside every even step one is allocated and freed in the forward of the model's
    middle linear (once a step: a checkpointed block's recomputation is skipped). An out-of-memory error is
    caught, counted and printed; the step goes on."""

    def __init__(self, sizes_gb, model, device, mode):
        self.sizes, self.device, self.mode = sizes_gb, device, mode
        self.made = {"between": 0, "inside": 0}
        self.ooms = {"between": 0, "inside": 0}
        self.turn = 0
        self.pending = None  # the size the current step's forward takes, until it has
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.hook = linears[len(linears) // 2].register_forward_pre_hook(self._inside) if linears else None

    def _take(self, gib: float, where: str, step: int) -> None:
        try:
            block = torch.empty(int(gib * GiB), dtype=torch.uint8, device=self.device)
            block[-1] = 1  # touched: the memory is really there
            del block
            self.made[where] += 1
        except torch.OutOfMemoryError:
            self.ooms[where] += 1
            print(f"[{self.mode}] stress: {gib:g} GiB {where} step {step} ran out of memory", flush=True)

    def _next_size(self) -> float:
        gib = self.sizes[self.turn % len(self.sizes)]
        self.turn += 1
        return gib

    def _inside(self, module, args):
        if self.pending is not None:
            gib, step, self.pending = self.pending[0], self.pending[1], None
            self._take(gib, "inside", step)

    def before_step(self, step: int) -> None:
        self.pending = None
        if step % 2 == 1:
            self._take(self._next_size(), "between", step)
        else:
            self.pending = (self._next_size(), step)

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()

    def result(self) -> dict:
        return {"sizes_gb": self.sizes, "made": self.made, "out_of_memory": self.ooms}


class Trainer:
    """The inputs, the optimizer and one training step of a placed model with its LoRA network."""

    def __init__(self, args, cfg, model, network, package, device: torch.device):
        self.args, self.model, self.device = args, model, device
        inputs_gen = torch.Generator().manual_seed(args.seed)
        self.img, self.txt, self.vec = (
            torch.randn(shape, generator=inputs_gen, dtype=DTYPE).to(device)
            for shape in ((1, cfg.img_tokens, cfg.hidden), (1, cfg.txt_tokens, cfg.hidden), (1, cfg.hidden)))
        # --aitk-flow: buckets of several resolutions, one after the other (AI-Toolkit's default 512/768/1024 is
        # 1/4, 9/16 and all of the image tokens).
        self.bucket_imgs = ([self.img[:, :max(1, int(cfg.img_tokens * f))] for f in args.buckets]
                            if args.aitk_flow else [self.img])
        self.current = self.img
        self.optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
        # AI-Toolkit's trainer joins the manager's gradient copies once per step, before the optimizer; do the
        # same (here only the LoRA trains and it lives on the device, so there is nothing to wait for, but it is
        # called).
        self.sync_grads = getattr(package, "sync_grad_transfers", None)

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.img, self.txt, self.vec

    def one_step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.current, self.txt, self.vec).float().pow(2).mean()
        loss.backward()
        if self.sync_grads is not None:
            self.sync_grads()
        self.optimizer.step()
        return loss

    def sample(self) -> None:  # a sample under no_grad, as AI-Toolkit's sampling between steps
        with torch.no_grad():
            self.model(self.bucket_imgs[0], self.txt, self.vec)

    def phase_split(self, counters) -> dict:
        return phase_split(self.model, self.inputs, self.optimizer, self.sync_grads, self.device, counters)

    def run(self, mode: str, counters) -> Steps:
        """--warmup untimed steps, then --steps timed ones (with --aitk-flow's samples and buckets, and
        --user-alloc-gb's memory taken between them)."""
        args, device = self.args, self.device
        losses, times = [], []
        stats_at_start = None
        nvml = _Nvml(device.index or 0) if device.type == "cuda" else None
        energy_start = None
        user_memory = []  # --user-alloc-gb: what "the user" holds on the device between some steps
        sample_bytes, sample_wait_us, samples = 0.0, 0.0, 0  # --aitk-flow's samples in the timed window (Steps)
        allocator = []  # torch's allocator in each timed step (Steps.allocator)
        stress = _Stress(args.stress_gb, self.model, device, mode) if args.stress_gb and device.type == "cuda" else None
        if args.aitk_flow:
            self.sample()  # AI-Toolkit samples before its first step by default
        for step in range(args.warmup + args.steps):
            self.current = self.bucket_imgs[step % len(self.bucket_imgs)]
            if stress is not None:
                stress.before_step(step)
            if args.user_alloc_gb and device.type == "cuda":
                if step == args.user_alloc_at:
                    user_memory.append(torch.empty(int(args.user_alloc_gb * GiB), dtype=torch.uint8, device=device))
                    print(f"[{mode}] the user took {args.user_alloc_gb} GiB of the device before step {step}",
                          flush=True)
                elif step == args.user_alloc_at + args.user_alloc_steps:
                    user_memory.clear()
            if step == args.warmup and counters is not None:
                stats_at_start = counters()
            _sync(device)
            if step == args.warmup and nvml is not None:
                energy_start = nvml.energy_mj()
            counted = allocator_counters(device)
            loss, elapsed = _timed(self.one_step, device)
            losses.append(loss.item())
            did = allocator_delta(counted, allocator_counters(device))
            if step >= args.warmup:
                times.append(elapsed)
                if did is not None:
                    allocator.append(did)
            churn = (f", allocator: {did['num_alloc_retries']} retries, {did['num_device_alloc']} cudaMalloc, "
                     f"{did['num_device_free']} cudaFree" if did else "")
            print(f"[{mode}] step {step}{' (warmup)' if step < args.warmup else ''}: {elapsed:.3f} s, "
                  f"loss {losses[-1]:.6g}{churn}", flush=True)
            if args.aitk_flow and args.sample_every and (step + 1) % args.sample_every == 0:
                # After the first timed step the counters run until the end: a sample's copies are counted
                # apart from the steps'.
                before = counters() if stats_at_start is not None else None
                self.sample()
                after = counters() if before is not None else None
                if before is not None and after is not None:
                    sample_bytes += after.get("bytes_h2d", 0) - before.get("bytes_h2d", 0)
                    sample_wait_us += after.get("copy_wait_us", 0) - before.get("copy_wait_us", 0)
                    samples += 1
        user_memory.clear()
        if stress is not None:
            stress.close()
        self.current = self.img
        energy_end = nvml.energy_mj() if nvml is not None else None
        # The counters at the end of the timed steps: the steps after these copy too, and counting them would
        # add a sixth step's bytes to five (seen: FLUX.1's bytes/step and floor read 6/5 of the truth).
        stats_end = counters() if counters is not None else None
        joules_per_step = ((energy_end - energy_start) / 1e3 / len(times)
                           if energy_start is not None and energy_end is not None else None)
        return Steps(losses, times, stats_at_start, stats_end, joules_per_step, sample_bytes, samples,
                     sample_wait_us, allocator if device.type == "cuda" else None,
                     stress.result() if stress is not None else None)

    def decode_blocks_sweep(self, mode: str) -> list[dict] | None:
        """--decode-blocks-sweep: after the timed steps, the same model again at each limit on the lossless
        decode's thread blocks (one step to settle, then --steps timed, then a phase split): the settings
        side by side in one process, with the model built and packed once."""
        args = self.args
        if not args.decode_blocks_sweep or mode != "layerstream" or args.host_dtype != "lossless":
            return None
        from layerstream import manager_modules as mm

        before = mm._testing.decode_blocks()
        results = []
        try:
            for blocks in (int(b) for b in args.decode_blocks_sweep.split(",")):
                mm._testing.set_decode_blocks(blocks)
                self.one_step()
                times = [_timed(self.one_step, self.device)[1] for _ in range(args.steps)]
                phases = self.phase_split(None)
                results.append({"decode_blocks": blocks, "s_per_step_mean": sum(times) / len(times),
                                "s_per_step_min": min(times), "step_times_s": times, "phases": phases})
                print(f"[{mode}] decode blocks {blocks or 'all'}: {results[-1]['s_per_step_mean']:.3f} s/step "
                      f"(min {min(times):.3f}); forward {phases['forward_s']:.3f} s, backward "
                      f"{phases['backward_s']:.3f} s", flush=True)
        finally:
            mm._testing.set_decode_blocks(before)
        return results

    def profiled_step(self, mode: str) -> tuple[dict | None, dict | None]:
        """One more step (not timed) under the profiler, on CUDA: (its busy times for the floor breakdown, the
        --timeline-out drawing's summary)."""
        args = self.args
        try:
            profiled = profile_step(self.one_step, self.device)
        except Exception as exc:  # the profiler is an extra: its failure must not lose the measured row
            print(f"[{mode}] profiled step failed: {type(exc).__name__}: {exc}", flush=True)
            return {"error": f"{type(exc).__name__}: {exc}"}, None
        if profiled is None:
            return None, None
        activity, spans = profiled
        if not args.timeline_out or mode == "resident":
            return activity, None
        out = Path(args.timeline_out)
        # A stock sweep's runs each draw their own (FILE-stock-0.5.png).
        name = mode if args.offload_percent == 1.0 or mode == "layerstream" else f"{mode}-{args.offload_percent:g}"
        try:
            return activity, draw_timeline(activity, spans, out.with_name(f"{out.stem}-{name}{out.suffix or '.png'}"),
                                           f"{args.preset} {name}")
        except Exception as exc:
            print(f"[{mode}] timeline failed: {type(exc).__name__}: {exc}", flush=True)
            return activity, {"error": f"{type(exc).__name__}: {exc}"}
