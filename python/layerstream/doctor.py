"""`layerstream doctor`: what this machine offers layerstream, one line and one verdict per fact.

Verdicts: OK, WARN (works, but slower or limited), SKIP (not checked here, with the reason), FAIL
(layerstream cannot run as configured). Exit status 1 when any line FAILs. With ``aitk=True`` (``--aitk``)
the questions are those of training in AI-Toolkit: a CPU-only torch or no visible GPU is a FAIL.
"""

from __future__ import annotations

import os
import platform
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


def _cuda_backend_line(torch, aitk: bool) -> Line:
    """Whether this build of layerstream can stream to a GPU: a CUDA torch with a build without the CUDA
    backend (LAYERSTREAM_CUDA=OFF) refuses every layer attached to a GPU."""
    from layerstream import _native

    if _native.cuda_compiled():
        count = _native.cuda_device_count()
        detail = f"compiled; {count} device(s) visible" if count else \
            f"compiled; no device usable ({_native.cuda_unavailable_reason()})"
        return Line("OK", "CUDA backend", detail)
    if torch.version.cuda:
        return Line("FAIL" if aitk else "WARN", "CUDA backend",
                    f"not compiled, but torch has CUDA {torch.version.cuda}: layers attached to a GPU are refused. "
                    "Install the prebuilt wheel for this torch, or rebuild with the CUDA toolkit (nvcc) on PATH "
                    "(docs/install.md)")
    return Line("OK", "CUDA backend", "not compiled (a CPU-only torch: the CPU and simulator paths run)")


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

    if os.name == "nt":  # no POSIX shared memory (a Wine prefix still shows Linux's /dev/shm as Z:\dev\shm)
        return Line("OK", "/dev/shm", "not on Windows: several ranks on this host keep a host copy each")
    if not os.path.isdir("/dev/shm"):
        return Line("OK", "/dev/shm", "absent: several ranks on this host keep a host copy each")
    stat = os.statvfs("/dev/shm")
    free = stat.f_bavail * stat.f_frsize
    # Docker's default is 64 MiB: far too small for a model's weights; ranks then fall back to copies of their own.
    verdict = "OK" if free >= 16 * GiB else "WARN"
    return Line(verdict, "/dev/shm", f"{free / GiB:.1f} GiB free (the host copy torchrun ranks share lives there; "
                                     "docker: --shm-size)")


def _torch_line(torch, aitk: bool) -> Line:
    if torch.version.cuda:
        return Line("OK", "torch", f"{torch.__version__}, CUDA {torch.version.cuda}")
    detail = (f"{torch.__version__} is a CPU-only build: AI-Toolkit trains on the GPU only with a CUDA build of "
              "torch (install the one AI-Toolkit's README names, then rebuild layerstream)")
    return Line("FAIL" if aitk else "WARN", "torch", detail)


def host_ram() -> tuple[int, int] | None:
    """(total, available) bytes of host RAM, or None where this platform does not say."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
        return info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        pass
    if os.name == "nt":
        import ctypes

        class MemoryStatus(ctypes.Structure):
            _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong), ("total", ctypes.c_ulonglong),
                        ("avail", ctypes.c_ulonglong), ("pad", ctypes.c_ulonglong * 5)]

        status = MemoryStatus(length=ctypes.sizeof(MemoryStatus))
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return status.total, status.avail
    return None


# Host bytes per byte of bf16 weights, in each form LAYERSTREAM_HOST_DTYPE chooses (docs/ai-toolkit.md):
# as they are, pinned; lossless, the packed bytes only, pinned (0.751 measured on the FLUX shapes; the
# Parameter is a PackedWeight); float8, half the bytes pinned plus the Parameter's exact copy, pageable; auto
# (the default) at most as they are: it packs bfloat16 weights of 1 MiB or more where this machine can.
HOST_BYTES_PER_WEIGHT_BYTE = {"same": 1.0, "lossless": 0.76, "float8_e4m3fn": 1.5, "float8_e5m2": 1.5, "auto": 1.0}


def chosen_host_dtype() -> str:
    """LAYERSTREAM_HOST_DTYPE as this process sets it, else as layerstream's settings have it (AI-Toolkit's
    .env, where the extension resolves it); "auto" (the default) when unset or not a known form."""
    value = os.environ.get("LAYERSTREAM_HOST_DTYPE", "").strip().lower()
    if not value:
        try:
            from layerstream import manager_modules

            value = manager_modules.settings()["host_dtype"]
        except Exception:  # the extension does not load, or a setting is invalid
            value = "auto"
    return value if value in HOST_BYTES_PER_WEIGHT_BYTE else "auto"


def _host_ram_line(weights_gb: float | None, host_dtype: str = "same") -> Line:
    ram = host_ram()
    if ram is None:
        return Line("SKIP", "host RAM", "skipped: this platform does not report it")
    total, available = ram
    detail = f"{total / GiB:.1f} GiB, {available / GiB:.1f} GiB available"
    if weights_gb is None:
        return Line("OK", "host RAM", detail + " (layerstream keeps one copy of the managed weights there: "
                                               "--weights-gb N checks a model of N GiB)")
    factor = HOST_BYTES_PER_WEIGHT_BYTE[host_dtype]
    # The weights in the chosen form, plus what the trainer itself holds.
    need = weights_gb * GiB * factor * 1.1
    verdict = "OK" if available >= need else ("WARN" if total >= need else "FAIL")
    form = {"same": "as they are", "auto": "as they are at most (LAYERSTREAM_HOST_DTYPE=auto packs bfloat16 "
            "weights where this machine can: then about 0.76x)"}.get(host_dtype, f"LAYERSTREAM_HOST_DTYPE={host_dtype}")
    detail += (f"; {weights_gb:g} GiB of bf16 weights, {form}, need about {need / GiB:.1f} GiB "
               f"({factor:g}x the weights plus 10%)")
    lossless_need = weights_gb * GiB * HOST_BYTES_PER_WEIGHT_BYTE["lossless"] * 1.1
    if verdict != "OK" and host_dtype != "lossless" and available >= lossless_need:
        detail += (f"; LAYERSTREAM_HOST_DTYPE=lossless (exact) would need about {lossless_need / GiB:.1f} GiB, "
                   "which is available")
    elif verdict != "OK":
        detail += ": the weights do not fit in the RAM available (the system will swap or kill the trainer)"
    return Line(verdict, "host RAM", detail)


def _settings_lines() -> list[Line]:
    """The LAYERSTREAM settings of this environment, and of ./.env where this is an AI-Toolkit checkout: one
    FAIL line per setting that is not accepted (the line the AI-Toolkit hook would stop the job with)."""
    from pathlib import Path

    from layerstream import settings

    here = Path.cwd()
    dotenv = here / ".env" if (here / "toolkit" / "memory_management" / "manager.py").is_file() else None
    found = settings.problems(settings.run_settings(dotenv), dotenv)
    if found:
        return [Line("FAIL", "settings", line) for line in found]
    where = "this environment" + (" and ./.env" if dotenv is not None else "")
    return [Line("OK", "settings", f"the LAYERSTREAM settings of {where} are accepted")]


def _windows_line() -> Line | None:
    wsl = "microsoft" in platform.release().lower()
    if os.name != "nt" and not wsl:
        return None
    where = "WSL2" if wsl else "Windows"
    return Line("WARN", where, "the driver may spill VRAM into shared system memory (NVIDIA control panel: "
                               "CUDA - Sysmem Fallback Policy: Prefer No Sysmem Fallback) and pinned host memory "
                               "is limited under WSL2 (NVIDIA's CUDA on WSL notes); both show as slowness, not as errors")


def _gpu_lines(torch, aitk: bool) -> list[Line]:
    lines = []
    if not torch.cuda.is_available():
        if aitk:
            return [Line("FAIL", "GPU", "no CUDA device visible to torch: AI-Toolkit's training needs one")]
        return [Line("SKIP", "GPU", "skipped: no GPU (torch sees no CUDA device); the GPU checks did not run")]
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


def run(aitk: bool = False, weights_gb: float | None = None, host_dtype: str | None = None) -> int:
    if weights_gb is not None and not weights_gb > 0:
        raise ValueError(f"--weights-gb must be a positive number of GiB (e.g. --weights-gb 22), not {weights_gb}")
    if host_dtype is not None and host_dtype not in HOST_BYTES_PER_WEIGHT_BYTE:
        raise ValueError(f"--host-dtype must be one of {', '.join(HOST_BYTES_PER_WEIGHT_BYTE)}, not {host_dtype}")
    lines: list[Line] = []
    try:
        import torch
    except ImportError as exc:
        lines.append(Line("FAIL", "torch", f"not importable: {exc}"))
        torch = None
    if torch is not None:
        lines.append(_torch_line(torch, aitk))
        lines.append(_check_extension())
        lines.append(_cuda_backend_line(torch, aitk))
        lines.extend(_gpu_lines(torch, aitk))
    lines.extend(_settings_lines())
    lines.append(_host_ram_line(weights_gb, host_dtype or chosen_host_dtype()))
    windows = _windows_line()
    if windows is not None:
        lines.append(windows)
    lines.append(_memlock())
    lines.append(_shm())
    width = max(len(line.what) for line in lines)
    for line in lines:
        print(f"{line.verdict:4s}  {line.what:<{width}}  {line.detail}")
    return 1 if any(line.verdict == "FAIL" for line in lines) else 0
