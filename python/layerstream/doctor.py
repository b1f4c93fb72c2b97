"""`layerstream doctor`: what this machine offers layerstream, one line and one verdict per fact.

Verdicts: OK, WARN (works, but slower or limited), FAIL (layerstream cannot run as configured).
Exit status 1 when any line FAILs.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass

GiB = 1 << 30


@dataclass
class Line:
    verdict: str
    what: str
    detail: str


def _check_extension() -> Line:
    try:
        from layerstream import manager_modules
    except ImportError as exc:
        return Line("FAIL", "manager_modules", f"does not load: {exc}")
    return Line("OK", "manager_modules", f"built for torch {manager_modules.__torch_version__} (the running one)")


def _memlock() -> Line:
    try:
        import resource  # POSIX only
    except ImportError:
        return Line("OK", "ulimit -l", "not applicable on this platform")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Line("OK", "ulimit -l", "unlimited")
    # CUDA pins through the driver, which is not bound by RLIMIT_MEMLOCK on most Linux systems; a low
    # limit still bites cudaHostRegister in some containers.
    verdict = "OK" if soft >= 64 * GiB else "WARN"
    return Line(verdict, "ulimit -l", f"{soft / GiB:.2f} GiB (raise it if pinning falls back to pageable memory)")


def _shm() -> Line:
    """/dev/shm holds the host copy the ranks of a host share (LAYERSTREAM_SHARE_HOST)."""
    import os

    if not os.path.isdir("/dev/shm"):
        return Line("OK", "/dev/shm", "absent: several ranks on this host keep a host copy each")
    stat = os.statvfs("/dev/shm")
    free = stat.f_bavail * stat.f_frsize
    # Docker's default is 64 MiB: far too small for a model's weights; ranks then fall back to copies of their own.
    verdict = "OK" if free >= 16 * GiB else "WARN"
    return Line(verdict, "/dev/shm", f"{free / GiB:.1f} GiB free (the host copy torchrun ranks share lives there; "
                                     "docker: --shm-size)")


def _gpu_lines(torch) -> list[Line]:
    lines = []
    if not torch.cuda.is_available():
        return [Line("WARN", "GPU", "no CUDA device visible to torch: layers run on the CPU, as upstream")]
    props = torch.cuda.get_device_properties(0)
    lines.append(Line("OK", "GPU", f"{props.name}, {props.total_memory / GiB:.1f} GiB, compute {props.major}.{props.minor}"))
    if shutil.which("nvidia-smi"):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip().splitlines()
        lines.append(Line("OK", "driver", driver[0] if driver else "unknown"))
    free, total = torch.cuda.mem_get_info()
    lines.append(Line("OK" if free > 4 * GiB else "WARN", "free VRAM", f"{free / GiB:.1f} of {total / GiB:.1f} GiB"))
    try:
        t0 = time.perf_counter()
        pinned = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
        pin_s = time.perf_counter() - t0
    except RuntimeError as exc:
        lines.append(Line("WARN", "pin 1 GiB", f"refused ({exc}); layerstream falls back to pageable memory"))
        return lines
    lines.append(Line("OK" if pinned.is_pinned() else "WARN", "pin 1 GiB", f"{pin_s * 1e3:.0f} ms"))
    device = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        device.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, GiB / (time.perf_counter() - t0) / 1e9)
    lines.append(Line("OK" if best >= 20 else "WARN", "H2D bandwidth",
                      f"{best:.1f} GB/s pinned (PCIe Gen4 x16 gives about 25, Gen5 about 55)"))
    return lines


def run(argv: list[str] | None = None) -> int:
    if argv:
        print(f"layerstream doctor takes no arguments (got {' '.join(argv)})")
        return 2
    lines: list[Line] = []
    try:
        import torch
    except ImportError as exc:
        lines.append(Line("FAIL", "torch", f"not importable: {exc}"))
        torch = None
    if torch is not None:
        cuda = torch.version.cuda or "none (CPU build)"
        lines.append(Line("OK", "torch", f"{torch.__version__}, CUDA {cuda}"))
        lines.append(_check_extension())
        lines.extend(_gpu_lines(torch))
    lines.append(_memlock())
    lines.append(_shm())
    width = max(len(line.what) for line in lines)
    for line in lines:
        print(f"{line.verdict:4s}  {line.what:<{width}}  {line.detail}")
    return 1 if any(line.verdict == "FAIL" for line in lines) else 0
