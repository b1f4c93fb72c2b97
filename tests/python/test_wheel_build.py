"""The release wheel's pieces that run without a GPU: the torch label scripts/build_wheel.sh gives a wheel
(pip must install the relabelled wheel and see the new version), and doctor's line for a build without the
CUDA backend under a CUDA torch. The whole script runs on the GPU machine (scripts/gpu_check.sh wheel)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _relabel_module():
    spec = importlib.util.spec_from_file_location("relabel_wheel", ROOT / "scripts" / "relabel_wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toy_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, as pip would build it, with a RECORD that pip checks on install."""
    import base64
    import hashlib

    files = {
        "toypkg/__init__.py": b"VALUE = 7\n",
        "toypkg-1.2.3.dist-info/METADATA": b"Metadata-Version: 2.1\nName: toypkg\nVersion: 1.2.3\n",
        "toypkg-1.2.3.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    files["toypkg-1.2.3.dist-info/RECORD"] = (record + "toypkg-1.2.3.dist-info/RECORD,,\n").encode()
    path = folder / "toypkg-1.2.3-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_relabelled_wheel_installs_with_the_torch_in_its_version(tmp_path):
    relabel = _relabel_module().relabel
    out = Path(relabel(str(_toy_wheel(tmp_path)), "torch2.13.0.cu130", str(tmp_path / "out")))
    assert out.name == "toypkg-1.2.3+torch2.13.0.cu130-py3-none-any.whl"
    target = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q",
                             "--target", str(target), str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr  # pip checks every RECORD hash and the name/version match
    info = target / "toypkg-1.2.3+torch2.13.0.cu130.dist-info"
    assert "Version: 1.2.3+torch2.13.0.cu130" in (info / "METADATA").read_text()
    assert (target / "toypkg" / "__init__.py").read_bytes() == b"VALUE = 7\n"


def test_relabel_refuses_a_label_pep_440_does_not_allow(tmp_path):
    relabel = _relabel_module().relabel
    with pytest.raises(ValueError, match="not a PEP 440 local label"):
        relabel(str(_toy_wheel(tmp_path)), "torch2.13.0+cu130", str(tmp_path / "out"))


class _FakeTorch:
    class version:
        cuda = "13.0"


def test_doctor_fails_a_build_without_cuda_under_a_cuda_torch(monkeypatch):
    from layerstream import _native, doctor

    monkeypatch.setattr(_native, "cuda_compiled", lambda: False)
    line = doctor._cuda_backend_line(_FakeTorch, aitk=True)
    assert line.verdict == "FAIL" and line.what == "CUDA backend"
    assert "not compiled, but torch has CUDA 13.0" in line.detail and "docs/install.md" in line.detail
    assert doctor._cuda_backend_line(_FakeTorch, aitk=False).verdict == "WARN"
    _FakeTorch.version.cuda = None
    try:
        assert doctor._cuda_backend_line(_FakeTorch, aitk=True).verdict == "OK"
    finally:
        _FakeTorch.version.cuda = "13.0"


def test_doctor_reports_the_compiled_backend(monkeypatch):
    from layerstream import _native, doctor

    monkeypatch.setattr(_native, "cuda_compiled", lambda: True)
    monkeypatch.setattr(_native, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(_native, "cuda_unavailable_reason", lambda: "no CUDA driver")
    line = doctor._cuda_backend_line(_FakeTorch, aitk=True)
    assert (line.verdict, line.detail) == ("OK", "compiled; no device usable (no CUDA driver)")


def _configure_with_a_cuda_torch(tmp_path: Path, cuda_setting: str, cudacxx: str | None):
    """CMake's configure step (no build) with a stand-in for a CUDA build of torch: `import torch` in the
    build's Python reports CUDA 13.0 and points at the real torch's CMake files."""
    import shutil

    import pybind11
    import torch

    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not on PATH (pip install cmake)")
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import types\n"
        f"__version__ = '{torch.__version__.split('+')[0]}+cu130'\n"
        "version = types.SimpleNamespace(cuda='13.0')\n"
        f"utils = types.SimpleNamespace(cmake_prefix_path={torch.utils.cmake_prefix_path!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CMAKE_ARGS")}
    env["PYTHONPATH"] = str(tmp_path / "fake")
    if cudacxx is not None:
        env["CUDACXX"] = cudacxx
    return subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(tmp_path / "build"), "-G", "Ninja", "-DLAYERSTREAM_BUILD_PYTHON=ON",
         f"-DLAYERSTREAM_CUDA={cuda_setting}", f"-DPython_EXECUTABLE={sys.executable}",
         f"-DCMAKE_PREFIX_PATH={pybind11.get_cmake_dir()}"],
        capture_output=True, text=True, env=env)


def test_a_source_build_with_a_cuda_torch_and_no_nvcc_stops_with_the_fix(tmp_path):
    result = _configure_with_a_cuda_torch(tmp_path, "AUTO", cudacxx=str(tmp_path / "no-nvcc-here"))
    assert result.returncode != 0
    text = " ".join((result.stdout + result.stderr).split())
    assert "has CUDA but no CUDA compiler (nvcc) was found" in text, text[-2000:]
    assert "LAYERSTREAM_CUDA=OFF builds the CPU/simulator backend only" in text


def test_a_source_build_with_cuda_turned_off_on_purpose_goes_on_with_a_warning(tmp_path):
    result = _configure_with_a_cuda_torch(tmp_path, "OFF", cudacxx=None)
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, text[-2000:]
    assert "has CUDA but LAYERSTREAM_CUDA=OFF: this build has no CUDA backend" in text
