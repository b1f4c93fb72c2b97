"""Settings (src/torch/settings.h): every LAYERSTREAM_* variable parsed in one place, checked when the module is
imported and when a device state is created, readable and settable from Python, and documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import clear_device_states
from layerstream import manager_modules as mm

REPO = Path(__file__).resolve().parents[2]
MIB_RANGE = "MiB up to 1073741824 (1 PiB)"
BUDGET = ("is not understood; give 'min' (the default: the least device memory, no layer kept), 'auto' (free device "
          "memory minus a headroom, given back when the process needs it) or a size from 1MiB to 1PiB such as 24GiB, "
          "24GB, 20000MiB or a number of bytes")
SWITCH = "is not a switch: give 1, true, on or yes, or 0, false, off or no; unset it or give e.g."


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def without_location(message: str) -> str:
    """The message without the ' [file:line]' the native checks append."""
    return re.sub(r" \[[^\]]*:\d+\]$", "", message)


@pytest.fixture
def fresh(monkeypatch):
    """No LAYERSTREAM_* setting from the environment or configure(), and no device state, before and after."""
    for name in list(os.environ):
        if name.startswith("LAYERSTREAM_"):
            monkeypatch.delenv(name)
    clear_device_states()
    yield
    if hasattr(mm, "configure"):
        mm.configure(**{key: None for key in mm.settings()})
    clear_device_states()


def attach_one(device="cpu"):
    layer = torch.nn.Linear(8, 8)
    mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    return layer


# Every setting, with values it refuses (issue 24, item 8: negative, overflowing, non-finite, misspelled ...).
REFUSED = [
    ("RESIDENT_MB", "-1", f"is not a whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_RESIDENT_MB=4096"),
    ("RING_MB", "-1", f"is not a positive whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_RING_MB=3072"),
    ("RING_MB", "17592186044417",  # 2^44 + 1 MiB: wrapped around to a 1 MiB ring
     f"is not a positive whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_RING_MB=3072"),
    ("RING_MB", " 64",
     f"is not a positive whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_RING_MB=3072"),
    ("CHUNK_MB", "0", f"is not a positive whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_CHUNK_MB=256"),
    ("PINNED_CAP_MB", "99999999999999999999999",
     f"is not a positive whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_PINNED_CAP_MB=65536"),
    ("SIM_DEVICE_MB", "1.5",
     f"is not a positive whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_SIM_DEVICE_MB=2048"),
    ("SIM_PINNABLE_MB", "-1",
     f"is not a whole number of {MIB_RANGE}; unset it or give e.g. LAYERSTREAM_SIM_PINNABLE_MB=1"),
    ("VRAM_BUDGET", "inf", BUDGET),
    ("VRAM_BUDGET", "1e-9", BUDGET),
    ("VRAM_BUDGET", "nan", BUDGET),
    ("VRAM_BUDGET", "-24GiB", BUDGET),
    ("VRAM_BUDGET", "0x10GiB", BUDGET),
    ("LOG_EVERY", "abc",
     "is not a whole number of optimizer steps (0: never); unset it or give e.g. LAYERSTREAM_LOG_EVERY=100"),
    ("PREFETCH", "maybe", f"{SWITCH} LAYERSTREAM_PREFETCH=0"),
    ("TIME_WAITS", "2", f"{SWITCH} LAYERSTREAM_TIME_WAITS=1"),
    ("PREFETCH_LAYERS", "0",
     "is not a positive whole number of layers; unset it or give e.g. LAYERSTREAM_PREFETCH_LAYERS=16"),
    ("DECODE_BLOCKS", "-3", "is not a whole number of thread blocks from 0 (no limit) to 65536; unset it or give e.g. "
                            "LAYERSTREAM_DECODE_BLOCKS=64"),
    ("SIM_FAULTS", "seed", "is not a whole number (the seed of the simulator's fault injector); unset it or give e.g. "
                           "LAYERSTREAM_SIM_FAULTS=1234"),
    ("SHARE_TIMEOUT_S", "inf", "is not a positive number of seconds up to 31536000 (a year); unset it or give e.g. "
                               "LAYERSTREAM_SHARE_TIMEOUT_S=600"),
    ("SHARE_TIMEOUT_S", "-5", "is not a positive number of seconds up to 31536000 (a year); unset it or give e.g. "
                              "LAYERSTREAM_SHARE_TIMEOUT_S=600"),
    ("SHARE_TOKEN", "job-1", None),  # its own message, below
    ("SHARE_HOST", "maybe", "is not a setting layerstream knows: auto (the default), 1 or 0"),
    ("BACKEND", "gpu", "is not understood; use 'sim' or 'cpu' (or unset it)"),
    ("VRAM_PEAK", "steps", "is not understood; give cycles (the default: each training cycle's step and gap measured "
                           "apart) or window (the first steps' window, as before 2026-12-01)"),
    ("RING_POLICY", "LRU", "is not understood; give fifo (the default: a region goes at the ring's head) or lru (over "
                           "the memory used longest ago)"),
    ("HOST_DTYPE", "fp8", "is not a setting layerstream knows: use lossless (frozen bfloat16 weights kept and streamed "
                          "exactly, in about three quarters of their bytes), float8_e4m3fn or float8_e5m2 (frozen "
                          "weights kept and streamed as 8-bit codes with a scale per output channel), or unset it (or "
                          "'same') to stream weights as they are"),
]


def _message(name, value, tail):
    if tail is None:
        return ("LAYERSTREAM_SHARE_TOKEN must be letters, digits and underscores, not 'job-1'; e.g. "
                "LAYERSTREAM_SHARE_TOKEN=job_42")
    return f"LAYERSTREAM_{name}={value} {tail}"


@pytest.mark.parametrize("name,value,tail", REFUSED, ids=[f"{n}={v}" for n, v, _ in REFUSED])
def test_a_bad_setting_is_refused_when_a_device_state_is_created(fresh, monkeypatch, name, value, tail):
    monkeypatch.setenv(f"LAYERSTREAM_{name}", value)
    with pytest.raises(ValueError) as refused:
        attach_one()
    assert without_location(str(refused.value)) == _message(name, value, tail)
    assert len(mm._DEVICE_STATE) == 0  # nothing was built with it
    monkeypatch.delenv(f"LAYERSTREAM_{name}")
    attach_one()  # the process goes on


@pytest.mark.parametrize("name,value,tail", REFUSED, ids=[f"{n}={v}" for n, v, _ in REFUSED])
def test_configure_refuses_the_same_values_and_changes_nothing(fresh, name, value, tail):
    before = mm.settings()
    with pytest.raises(ValueError) as refused:
        mm.configure(**{name.lower(): value})
    assert without_location(str(refused.value)) == _message(name, value, tail)
    assert mm.settings() == before


def test_a_bad_setting_fails_the_import_and_a_misspelled_name_is_named(tmp_path):
    """At import, before any layer: the ValueError (the ImportError's cause) names the variable; a name that is
    no setting is warned about with the nearest one."""
    code = "import torch\nfrom layerstream import manager_modules"
    env = dict(os.environ, LAYERSTREAM_RESIDENT_MB="-1", LAYERSTREAM_PREFETCH_LAYER="4")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode != 0
    assert ("LAYERSTREAM_PREFETCH_LAYER is not a layerstream setting and is ignored; did you mean "
            "LAYERSTREAM_PREFETCH_LAYERS? (the settings: docs/ai-toolkit.md, \"Modes and settings\")") in done.stderr
    assert (f"ValueError: LAYERSTREAM_RESIDENT_MB=-1 is not a whole number of {MIB_RANGE}; unset it or give e.g. "
            "LAYERSTREAM_RESIDENT_MB=4096") in done.stderr


def _tool_names() -> set[str]:
    """LAYERSTREAM_* names that layerstream's build, tests and scripts read from the environment."""
    found = set()
    for pattern in ("scripts/*", "benchmarks/*", ".ci/*", "tests/python/*.py", "python/layerstream/*.py",
                    "python/layerstream/bench/*.py", "pyproject.toml", "docs/*.md", "README.md"):
        for path in REPO.glob(pattern):
            if path.is_file() and path.name != Path(__file__).name:  # this file's misspellings are on purpose
                found |= set(re.findall(r"LAYERSTREAM_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    settings = {f"LAYERSTREAM_{key.upper()}" for key in mm.settings()}
    return found - settings


def test_only_unknown_names_are_warned_about(tmp_path):
    """The names the project's own tools read pass in silence; any other is warned about once, with the
    nearest setting where one is close and without where none is."""
    tools = _tool_names()
    assert "LAYERSTREAM_TEST_DEADLINE_S" in tools and "LAYERSTREAM_CUDA" in tools
    code = "import torch\nfrom layerstream import manager_modules as mm\nprint(sorted(mm.settings()))"
    env = dict(os.environ, **{name: "1" for name in tools}, LAYERSTREAM_VRAM_BUDGE="24GiB",
               LAYERSTREAM_QQQ_ZZZ_UNRELATED="1")
    env["LAYERSTREAM_LOG"] = "warning"  # the Python package's own setting: "1" is not one of its values
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # The package's stderr handler (no application handler here) puts "layerstream WARNING: " before each line.
    warnings = sorted(line.removeprefix("layerstream WARNING: ") for line in done.stderr.splitlines()
                      if "is not a layerstream setting" in line)
    assert warnings == [
        "LAYERSTREAM_QQQ_ZZZ_UNRELATED is not a layerstream setting and is ignored (the settings: docs/ai-toolkit.md, "
        "\"Modes and settings\")",
        "LAYERSTREAM_VRAM_BUDGE is not a layerstream setting and is ignored; did you mean LAYERSTREAM_VRAM_BUDGET? "
        "(the settings: docs/ai-toolkit.md, \"Modes and settings\")",
    ]


def test_the_docs_table_lists_every_setting_and_no_other():
    text = (REPO / "docs" / "ai-toolkit.md").read_text()
    section = text.split("\n## Modes and settings\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(LAYERSTREAM_[A-Z0-9_]+)", section, flags=re.M))  # the table's rows
    settings = {f"LAYERSTREAM_{key.upper()}" for key in mm.settings()}
    assert sorted(settings - documented) == []  # undocumented
    assert sorted(documented - settings) == []  # stale


def test_an_empty_value_is_the_same_as_unset(fresh, monkeypatch):
    """An empty LAYERSTREAM_RING_MB once fixed the ring (its default size, never grown by the 3x rule): a layer
    twice as large as the first then did not rebuild the engine."""

    def engines_built():
        clear_device_states()
        torch.manual_seed(0)
        small, large = torch.nn.Linear(64, 64), torch.nn.Linear(64, 128)
        mm.LinearLayerMemoryManager.attach(small, Manager("cpu"))
        small(torch.randn(2, 64))
        mm.LinearLayerMemoryManager.attach(large, Manager("cpu"))
        large(torch.randn(2, 64))
        return mm._DEVICE_STATE[torch.device("cpu")].stats()["engines_built"]

    monkeypatch.setenv("LAYERSTREAM_BACKEND", "sim")
    unset = engines_built()
    assert unset == 2  # the ring grows for the larger layer
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "")
    assert engines_built() == unset
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "1")
    assert engines_built() == 1  # a fixed ring is not rebuilt for a layer that fits


@pytest.mark.parametrize("off", ["0", "false", "off", "no", "FALSE"])
def test_prefetch_is_a_switch_in_every_spelling(fresh, monkeypatch, off):
    """LAYERSTREAM_PREFETCH=false was ignored (only 0 turned prefetch off)."""

    def prefetches():
        clear_device_states()
        torch.manual_seed(1)
        # 256 KiB each: the 1 MiB ring holds few. Frozen: trainable layers are never copied ahead of need.
        layers = [torch.nn.Linear(256, 256).requires_grad_(False) for _ in range(6)]
        for layer in layers:
            mm.LinearLayerMemoryManager.attach(layer, Manager("cpu"))
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(2, 256)
                for layer in layers:
                    x = layer(x)
        return mm._DEVICE_STATE[torch.device("cpu")].stats()["prefetches"]

    monkeypatch.setenv("LAYERSTREAM_BACKEND", "sim")
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "1")
    assert prefetches() > 0
    monkeypatch.setenv("LAYERSTREAM_PREFETCH", off)
    assert prefetches() == 0


def test_configure_takes_precedence_until_given_back(fresh, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_BACKEND", "sim")
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "2")
    mm.configure(ring_mb=3, prefetch=False, vram_budget="auto")
    assert (mm.settings()["ring_mb"], mm.settings()["prefetch"], mm.settings()["vram_budget"]) == (3, False, "auto")
    clear_device_states()  # a device state created now reads the environment again: configure's values stay
    attach_one()(torch.randn(1, 8))
    assert mm._DEVICE_STATE[torch.device("cpu")].stats()["ring_bytes"] == 3 << 20
    mm.configure(ring_mb=None)
    assert mm.settings()["ring_mb"] == 2
    mm.configure(**mm.settings())  # what settings() returns, configure takes
    assert mm.settings()["ring_mb"] == 2
    with pytest.raises(ValueError, match=r"configure\(ring_mbb=...\): ring_mbb is not a layerstream setting; did you "
                                         r"mean ring_mb\? \(settings\(\) lists them\)"):
        mm.configure(ring_mbb=4)
    with pytest.raises(ValueError, match=r"configure\(ring_mb=...\): give a bool, int, float, str or None"):
        mm.configure(ring_mb=[4])
