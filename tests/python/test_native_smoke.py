"""The Python package imports, the bindings map errors as documented, and the demo's promises hold."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import layerstream
from layerstream import _native, demo


def test_package_imports_with_version():
    assert layerstream.__version__ == "0.1.0"
    assert isinstance(_native.cuda_compiled(), bool)
    if _native.cuda_device_count() == 0:
        assert _native.cuda_unavailable_reason() != ""


def _engine(**sim_kwargs):
    backend = _native.sim_backend(**sim_kwargs)
    engine = _native.TransferEngine(backend, ring_bytes=1 << 16, chunk_bytes=1 << 16)
    return backend, engine, _native.Stream(backend)


def test_fetch_through_the_bindings_is_byte_exact_and_accounted():
    backend, engine, stream = _engine(seed=3, delay_probability=0.5, max_delay_us=20, scramble_copies=True)
    payload = bytes(range(256)) * 40
    lid = engine.add_layer(len(payload))
    engine.host_view(lid)[:] = payload
    lease = engine.fetch(lid)
    engine.wait_ready(lease, stream)
    assert stream.read_device(engine.device_data(lease), lease.bytes) == payload
    engine.release(lease, stream)
    stats = engine.stats()
    assert stats["copies_h2d"] == 1
    assert stats["bytes_h2d"] == len(payload)
    assert stats["arena"]["bytes_requested"] == len(payload)
    assert _native.sim_race_count(backend) == 0


def test_invalid_arguments_raise_value_error_and_the_engine_survives():
    _, engine, stream = _engine()
    with pytest.raises(ValueError, match="at least one byte"):
        engine.add_layer(0)
    with pytest.raises(ValueError, match="does not fit the device ring"):
        engine.add_layer(1 << 20)
    lid = engine.add_layer(100)
    lease = engine.fetch(lid)
    engine.release(lease, stream)
    with pytest.raises(ValueError, match="use after release"):
        engine.device_data(lease)
    with pytest.raises(ValueError, match="already released"):
        engine.release(lease, stream)
    with pytest.raises(ValueError, match="pin_method"):
        _native.TransferEngine(_native.sim_backend(), ring_bytes=4096, pin_method="bogus")
    assert engine.fetch(lid).bytes == 100  # still working


def test_platform_failures_raise_runtime_error():
    backend = _native.sim_backend(device_capacity_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="out of device memory"):
        _native.TransferEngine(backend, ring_bytes=1 << 21)
    if not _native.cuda_compiled() or _native.cuda_device_count() == 0:
        with pytest.raises(RuntimeError):
            _native.cuda_backend(0)


def test_refused_pin_is_logged_once_through_python_logging(caplog):
    _native.reset_log_once()
    backend = _native.sim_backend(pinned_capacity_bytes=0)
    engine = _native.TransferEngine(backend, ring_bytes=1 << 16, chunk_bytes=1 << 14)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        ids = [engine.add_layer(1 << 14) for _ in range(3)]
    warnings = [r for r in caplog.records if "pageable" in r.getMessage()]
    assert len(warnings) == 1
    assert not engine.host_pinned(ids[0])
    stream = _native.Stream(backend)
    engine.host_view(ids[1])[:] = b"\x5a" * (1 << 14)
    lease = engine.fetch(ids[1])
    engine.wait_ready(lease, stream)
    assert stream.read_device(engine.device_data(lease), 1 << 14) == b"\x5a" * (1 << 14)
    engine.release(lease, stream)
    assert engine.stats()["bounce_chunks"] >= 1


def test_checkpointed_step_order_reads_every_layer_three_times():
    order = demo._step_order(4, 3)
    assert len(order) == 3 * 12
    assert all(order.count(i) == 3 for i in range(12))
    assert order[12:20] == [8, 9, 10, 11, 11, 10, 9, 8]  # last block: recompute, then backward


def test_demo_runs_on_sim_and_verifies_every_read(capsys):
    assert demo.run(["--backend", "sim", "--blocks", "4", "--hidden", "64", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "verified: 96 layer reads byte-identical" in out
    assert "race checker: 0 unordered accesses" in out
    ratio = float(out.split("of weights = ")[1].split("x")[0])
    assert 1.0 <= ratio <= 1.03  # host memory held: the weights' bytes, plus under 3% of chunk tail


def test_cli_entry_point_reports_errors_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "layerstream", "demo", "--backend", "cuda"] if _native.cuda_device_count() == 0
        else [sys.executable, "-m", "layerstream", "info"],
        capture_output=True, text=True, check=False,
    )
    if _native.cuda_device_count() == 0:
        assert result.returncode == 2
        assert "error: --backend cuda:" in result.stderr
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == 0
