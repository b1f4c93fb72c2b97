"""Settings (include/layerstream/settings.h): every LAYERSTREAM_* variable declared and parsed in one place, checked
when the module is imported and when a device state is created, readable and settable from Python, and documented
from the declaration."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import clear_device_states
from layerstream import _native
from layerstream import manager_modules as mm
from layerstream.settings import SPECS, TABLE

REPO = Path(__file__).resolve().parents[2]


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


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


# Every setting manager_modules reads, with values it refuses (negative, overflowing, non-finite, misspelled ...).
REFUSED = [
    ("RESIDENT_MB", "-1"), ("RING_MB", "-1"),
    ("RING_MB", "17592186044417"),  # 2^44 + 1 MiB: once wrapped around to a 1 MiB ring
    ("RING_MB", " 64"), ("CHUNK_MB", "0"), ("PINNED_CAP_MB", "99999999999999999999999"), ("SIM_DEVICE_MB", "1.5"),
    ("SIM_PINNABLE_MB", "-1"), ("VRAM_BUDGET", "inf"), ("VRAM_BUDGET", "1e-9"), ("VRAM_BUDGET", "nan"),
    ("VRAM_BUDGET", "-24GiB"), ("VRAM_BUDGET", "0x10GiB"), ("VRAM_BUDGET", "lots"), ("VRAM_BUDGET", "24 GiB "),
    ("VRAM_BUDGET", "24GiBs"), ("LOG_EVERY", "abc"), ("PREFETCH", "maybe"), ("TIME_WAITS", "2"),
    ("PREFETCH_LAYERS", "0"), ("DECODE_BLOCKS", "-3"), ("SIM_FAULTS", "seed"), ("SHARE_TIMEOUT_S", "inf"),
    ("SHARE_TIMEOUT_S", "-5"), ("SHARE_TOKEN", "job-1"), ("SHARE_HOST", "maybe"), ("BACKEND", "gpu"),
    ("VRAM_PEAK", "steps"), ("RING_POLICY", "LRU"), ("HOST_DTYPE", "fp8"), ("OSTRIS_DECODE", "sometimes"),
    ("VRAM_GAP", "middle"),
]


def _message(name, value, origin):
    """The refusal as the declaration composes it (test_refusals_read_as_written pins the words)."""
    spec = SPECS[f"LAYERSTREAM_{name}"]
    where = f" ({origin})" if origin else ""
    return (f"LAYERSTREAM_{name}={value}{where} is not accepted; it takes {spec.accepts}, e.g. "
            f"LAYERSTREAM_{name}={spec.example} (unset: {spec.default})")


def test_every_native_setting_has_a_refused_case():
    assert {f"LAYERSTREAM_{n}" for n, _ in REFUSED} == {s.name for s in TABLE if s.native}


def test_refusals_read_as_written():
    """The words a user sees, for three values of issue 49's trial."""
    assert _native.setting_refusal("LAYERSTREAM_RING_MB", "-5", ".env line 3") == (
        "LAYERSTREAM_RING_MB=-5 (.env line 3) is not accepted; it takes a positive whole number of MiB up to "
        "1073741824 (1 PiB), e.g. LAYERSTREAM_RING_MB=3072 (unset: on a GPU four of the largest layer, never more "
        "than the layers take (the CPU modes: 3x); with a VRAM budget its plan's)")
    assert _native.setting_refusal("LAYERSTREAM_VRAM_BUDGET", "lots", "the environment") == (
        "LAYERSTREAM_VRAM_BUDGET=lots (the environment) is not accepted; it takes auto (what the device has free, "
        "given back when the process needs it), min (no layer kept: the least device memory, the memory-first "
        "mode) or a size from 1 MiB to 1 PiB such as 24G, 24GB, 24GiB or '24 GiB' (case-insensitive, binary: 24GB "
        "is 24x2^30 bytes) or a number of bytes, e.g. LAYERSTREAM_VRAM_BUDGET=min (unset: auto)")
    assert _native.setting_refusal("LAYERSTREAM_HOST_DTYPE", "fp8") == (
        "LAYERSTREAM_HOST_DTYPE=fp8 is not accepted; it takes auto (lossless for frozen bfloat16 weights of 1 MiB "
        "or more where this device and host can decode and pack them, the rest as they are; an INFO line says "
        "which), same (weights as they are), lossless (bfloat16 weights packed exactly, about 0.75x their bytes) or "
        "float8_e4m3fn or float8_e5m2 (8-bit codes with a scale per output channel: half the bytes to copy, not "
        "exact; host RAM 1.5x the bfloat16 weights), e.g. LAYERSTREAM_HOST_DTYPE=lossless (unset: auto)")
    assert _native.setting_refusal("LAYERSTREAM_VRAM_BUDGE", "auto", ".env line 4") == (
        "LAYERSTREAM_VRAM_BUDGE=auto (.env line 4) is not a layerstream setting; did you mean "
        "LAYERSTREAM_VRAM_BUDGET? (the settings: docs/ai-toolkit.md, \"Modes and settings\")")
    assert _native.setting_refusal("LAYERSTREAM_CUDA", "OFF") is None  # the build's own variable


@pytest.mark.parametrize("name,value", REFUSED, ids=[f"{n}={v}" for n, v in REFUSED])
def test_a_bad_setting_is_refused_when_a_device_state_is_created(fresh, monkeypatch, name, value):
    monkeypatch.setenv(f"LAYERSTREAM_{name}", value)
    with pytest.raises(ValueError) as refused:
        attach_one()
    assert str(refused.value) == _message(name, value, "the environment")
    assert len(mm._DEVICE_STATE) == 0  # nothing was built with it
    monkeypatch.delenv(f"LAYERSTREAM_{name}")
    attach_one()  # the process goes on


@pytest.mark.parametrize("name,value", REFUSED, ids=[f"{n}={v}" for n, v in REFUSED])
def test_configure_refuses_the_same_values_and_changes_nothing(fresh, name, value):
    before = mm.settings()
    with pytest.raises(ValueError) as refused:
        mm.configure(**{name.lower(): value})
    assert str(refused.value) == _message(name, value, "")
    assert mm.settings() == before


@pytest.mark.parametrize("text", ["24G", "24GB", "24gb", "24 GiB", "24GiB", "24g", "24 gb", "0.0234375T",
                                  "24576MiB", "24576 mb", "25769803776"])
def test_sizes_take_what_people_type_and_are_binary(fresh, text):
    """24GB is what a "24 GB" card holds: 24 x 2^30 bytes, whatever the spelling (it was 24 x 10^9)."""
    mm.configure(vram_budget=text)
    assert mm.settings()["vram_budget"] == 24 << 30
    assert _native.setting_refusal("LAYERSTREAM_VRAM_BUDGET", text) is None


@pytest.mark.parametrize("key,value,takes", [
    ("ring_mb", True, "an int or str"), ("resident_mb", 2.0, "an int or str"),
    ("prefetch", 1, "a bool or str"), ("host_dtype", 8, "a str"), ("share_token", 42, "a str"),
    ("vram_budget", False, "an int, float or str"), ("share_timeout_s", [1], "an int, float or str"),
])
def test_configure_refuses_a_value_of_the_wrong_type(fresh, key, value, takes):
    """configure(ring_mb=True) was taken as a 1 MiB ring: a bool is no size, a float no count."""
    before = mm.settings()
    with pytest.raises(ValueError) as refused:
        mm.configure(**{key: value})
    spec = SPECS[f"LAYERSTREAM_{key.upper()}"]
    assert str(refused.value).startswith(
        f"configure({key}={value!r}): {key} takes {takes} ({spec.accepts}) or None (back to the environment), "
        f"not {type(value).__name__}")
    assert mm.settings() == before
    mm.configure(share_timeout_s=1.5, ring_mb=64, prefetch=False, vram_budget=2.5e10)  # the right types pass
    assert (mm.settings()["share_timeout_s"], mm.settings()["ring_mb"]) == (1.5, 64)


def test_a_bad_setting_fails_the_import_with_its_line_last_and_a_misspelled_name_is_named(tmp_path):
    """At import, before any layer: the refusal is the ImportError's own message, so the traceback's last line
    (all a log's last line shows) is it; a name that is no setting is warned about with the nearest one."""
    code = "import torch\nfrom layerstream import manager_modules"
    env = dict(os.environ, LAYERSTREAM_RESIDENT_MB="-1", LAYERSTREAM_PREFETCH_LAYER="4")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode != 0
    assert ("LAYERSTREAM_PREFETCH_LAYER is not a layerstream setting and is ignored; did you mean "
            "LAYERSTREAM_PREFETCH_LAYERS? (the settings: docs/ai-toolkit.md, \"Modes and settings\")") in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "ImportError: " + _message("RESIDENT_MB", "-1", "the environment")


def test_log_setting_is_checked_by_the_same_declaration(tmp_path):
    """LAYERSTREAM_LOG=debug was refused by the package (and the AI-Toolkit hook then ran stock); its values
    are the declaration's, and a bad one is refused with the same kind of line."""
    from layerstream import _logging

    assert set(_logging.LEVELS) == {"info", "warning", "debug", "off"}
    for value in _logging.LEVELS:
        assert _native.setting_refusal("LAYERSTREAM_LOG", value) is None
    done = subprocess.run([sys.executable, "-c", "import layerstream"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=dict(os.environ, LAYERSTREAM_LOG="loud"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: LAYERSTREAM_LOG=loud (the environment) is not accepted; it takes info, warning, debug or off, "
        "e.g. LAYERSTREAM_LOG=warning (unset: info)")


def _tool_names() -> set[str]:
    """LAYERSTREAM_* names that layerstream's build, tests and scripts read from the environment."""
    found = set()
    for pattern in ("scripts/*", "benchmarks/*", ".ci/*", "tests/python/*.py", "python/layerstream/*.py",
                    "python/layerstream/bench/*.py", "pyproject.toml", "docs/*.md", "README.md"):
        for path in REPO.glob(pattern):
            # These files' misspellings are on purpose.
            if path.is_file() and path.name not in (Path(__file__).name, "test_env_and_status.py",
                                                    "test_aitk_runpy_settings.py"):
                found |= set(re.findall(r"LAYERSTREAM_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    return found - set(SPECS)


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


@pytest.mark.parametrize("audience", ["user", "tuning", "tests"])
def test_the_docs_tables_are_the_declaration(audience):
    """docs/ai-toolkit.md's tables are rendered from the one declaration (settings.markdown_table prints the
    current one), and no other row names a setting."""
    from layerstream.settings import markdown_table

    text = (REPO / "docs" / "ai-toolkit.md").read_text()
    section = text.split("\n## Modes and settings\n", 1)[1].split("\n## ", 1)[0]
    assert markdown_table(audience) in section
    rows = re.findall(r"^\| `(LAYERSTREAM[A-Z0-9_]*)`", section, flags=re.M)
    assert sorted(rows) == sorted(SPECS)  # each setting in one row, none other


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
    with pytest.raises(ValueError, match=r"configure\(ring_mb=\[4\]\): ring_mb takes an int or str \(a positive"):
        mm.configure(ring_mb=[4])


def test_settings_lists_every_native_setting_at_its_declared_default(fresh):
    """settings() is derived from the declaration: one key per native setting, in the table's order, each at the
    declared default (a default that describes the unset setting, such as "no cap", reads None)."""
    mm.configure(**{key: None for key in mm.settings()})  # read again from the environment `fresh` emptied
    shown = mm.settings()
    natives = [spec for spec in TABLE if spec.native]
    assert list(shown) == [spec.name[len("LAYERSTREAM_"):].lower() for spec in natives]
    as_text = {True: "1", False: "0", None: None}
    for spec in natives:
        value = shown[spec.name[len("LAYERSTREAM_"):].lower()]
        if " " in spec.default or spec.name == "LAYERSTREAM_RING_MB":
            assert value is None, spec.name
        elif isinstance(value, bool):
            assert as_text[value] == spec.default, spec.name
        elif isinstance(value, float):
            assert value == float(spec.default), spec.name
        else:
            assert str(value) == spec.default, spec.name
    assert (shown["sim_device_mb"], shown["pinned_cap_mb"], shown["prefetch"]) == (65536, None, True)
