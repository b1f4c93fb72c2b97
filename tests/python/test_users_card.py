"""benchmarks/users_card.py: the users'-card model's arithmetic (docs/users-cards.md) on synthetic rows, and its
check over the recorded H200 runs printing one row per pair. Predictions are not asserted against timings."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "users_card.py"
spec = importlib.util.spec_from_file_location("users_card", SCRIPT)
card = importlib.util.module_from_spec(spec)
spec.loader.exec_module(card)

GiB = 1 << 30
RESIDENT = {"mode": "resident", "status": "ok", "s_per_step_mean": 0.6,
            "phases": {"forward_s": 0.1, "backward_s": 0.2}}  # scaled x2 to the mean: 0.2 and 0.4
STREAMED = {"mode": "layerstream", "status": "ok", "s_per_step_mean": 1.0, "bytes_per_step": 40e9,
            "phases": {"forward_bytes": 10e9, "backward_bytes": 10e9}}  # scaled x2: 20e9 each


def test_the_phases_are_the_resident_compute_and_the_rows_bytes_scaled_to_their_means():
    assert card.phases_of(RESIDENT, STREAMED) == [(pytest.approx(0.2), 20e9), (pytest.approx(0.4), 20e9)]
    assert card.phases_of({"s_per_step_mean": 0.6}, STREAMED) == [(0.6, 40e9)]  # no phase split: one phase


def test_each_phase_takes_the_longer_of_its_compute_and_its_copies_plus_the_decode():
    phases = [(0.2, 20e9), (0.4, 20e9)]
    # A card with a fifth of the compute at 25 GB/s: forward max(1.0, 0.8), backward max(2.0, 0.8).
    p = card.predict(phases, 0.0, 25e9, 0.2, 1.0)
    assert p["step_s"] == pytest.approx(3.0) and p["bound"] == ["compute", "compute"]
    assert (p["compute_s"], p["bus_s"], p["decode_s"]) == (pytest.approx(3.0), pytest.approx(1.6), 0.0)
    # At 10 GB/s the copies bind both phases: 2 s each.
    assert card.predict(phases, 0.0, 10e9, 0.2, 1.0)["step_s"] == pytest.approx(4.0)
    # Decoding 1.824e12 bf16 bytes takes 1 s at the H200's memory bandwidth, 4.8x that at 1 TB/s.
    rate = card.DECODE_BF16_BYTES_PER_S
    assert card.predict(phases, rate, 25e9, 0.2, card.H200_MEM_TBS)["decode_s"] == pytest.approx(1.0)
    assert card.predict(phases, rate, 25e9, 0.2, 1.0)["decode_s"] == pytest.approx(4.8)


def test_only_lossless_rows_decode_each_streamed_copy_once_and_each_resident_weight_at_each_use():
    lossless = {**STREAMED, "engine_stats": {"resident_bytes": 1e9}}
    assert card.decoded_bytes({"host_dtype": None}, STREAMED) == 0.0
    expected = (40e9 + 3 * 1e9) / card.PACKED_RATIO
    assert card.decoded_bytes({"host_dtype": "lossless"}, lossless) == pytest.approx(expected)
    packed = {**lossless, "host_memory": {"host_pinned_packed_bytes": 5}}  # the default, auto, packed
    assert card.decoded_bytes({"host_dtype": None}, packed) == pytest.approx(expected)
    assert card.decoded_bytes({"host_dtype": "lossless"}, {**lossless, "mode": "stock"}) == 0.0


def test_the_check_predicts_every_recorded_h200_pair():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [r.split(" | ")[0][2:] for r in rows] == [label for label, *_ in card.CHECKS]
