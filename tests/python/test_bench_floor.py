"""The floor breakdown's arithmetic (python/layerstream/bench/floor.py): the spans read from a profiler trace,
the step's exact split into copies alone, kernels alone, both and neither, and the gap to the floor item by
item, the items summing to the gap. Synthetic traces: no GPU, no timing."""

from __future__ import annotations

import pytest

from layerstream.bench import floor


def _x(cat, name, ts_us, dur_us, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "args": args}


DECODE = "void layerstream::(anonymous namespace)::decode_values(layerstream::(anonymous namespace)::Args)"


def test_union_overlap_and_subtract_of_spans():
    assert floor.union([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]  # touching spans merge
    assert floor.total([(0, 2), (1, 3), (5, 7)]) == 5
    assert floor.overlap([(0, 4), (6, 10)], [(2, 7), (9, 12)]) == 2 + 1 + 1
    assert floor.overlap([(0, 1)], []) == 0
    assert floor.subtract([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == [(0, 2), (3, 5), (7, 9)]
    assert floor.subtract([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]


def test_the_trace_gives_copies_compute_decodes_and_the_allocator():
    events = [
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 400, bytes=4_000_000),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 50, bytes=99),  # a download: not the bus floor's
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 500, 100, bytes=1_000_000),
        _x("kernel", "ampere_bf16_s16816gemm", 300, 500),
        _x("kernel", DECODE, 700, 200),
        _x("cuda_runtime", "cudaMalloc", 950, 30),
        _x("cuda_runtime", "cudaLaunchKernel", 100, 5),
        {"ph": "i", "name": "marker", "ts": 0},
    ]
    spans = floor.spans_of_trace(events)
    assert spans["copies"] == [(0.0, 0.4), (0.5, 0.6)] and spans["copy_bytes"] == 5_000_000
    assert spans["compute"] == [(0.3, 0.8)] and spans["decode"] == [(0.7, 0.9)]
    assert spans["allocator"] == [(0.95, 0.98)]
    # No runtime calls in a trace at all: the allocator's time is unknown, not zero.
    assert floor.spans_of_trace(events[:5])["allocator"] is None
    assert not floor.is_decode("decode_values(float)")  # someone else's kernel of that name


def test_the_step_splits_exactly_into_both_copies_alone_kernels_alone_and_neither():
    spans = {"copies": [(0.0, 4.0), (5.0, 6.0)], "copy_bytes": 5_000_000, "compute": [(3.0, 8.0)],
             "decode": [(7.0, 9.0)], "allocator": [(9.5, 9.8)]}
    a = floor.summarize(spans, wall_ms=10.0)
    assert a["copy_busy_ms"] == 5.0 and a["kernel_busy_ms"] == 6.0  # kernels 3-9
    assert a["compute_ms"] == 5.0 and a["decode_ms"] == 1.0  # the decode alone 8-9
    assert a["both_ms"] == 2.0  # 3-4 and 5-6
    assert a["copy_only_ms"] == 3.0 and a["kernel_only_ms"] == 4.0
    assert a["decode_bus_idle_ms"] == 1.0
    assert a["neither_ms"] == 10.0 - 9.0
    assert a["both_ms"] + a["copy_only_ms"] + a["kernel_only_ms"] + a["neither_ms"] == a["wall_ms"]
    assert a["allocator_ms"] == pytest.approx(0.3)


def _items(b):
    return {i["item"]: i["ms"] for i in b["items"]}


def test_a_compute_bound_gap_is_compute_above_the_floor_decodes_waits_allocator_and_other():
    a = floor.summarize({"copies": [(0.0, 4.0), (5.0, 6.0)], "copy_bytes": 5_000_000, "compute": [(3.0, 8.0)],
                         "decode": [(7.0, 9.0)], "allocator": [(9.5, 9.8)]}, wall_ms=10.0)
    # 5 MB at 2.5 GB/s: 2 ms of bus; the resident run computes in 4.5 ms: compute-bound.
    b = floor.breakdown(a, 2.5e9, 0.0045, step_mean_s=0.0105)
    assert (b["status"], b["bound"], b["floor_ms"], b["bus_ms"]) == ("ok", "compute", 4.5, 2.0)
    assert b["gap_ms"] == pytest.approx(5.5)
    items = _items(b)
    assert items == pytest.approx({
        "compute kernels above the floor's compute": 0.5, "decode kernels, no other kernel running": 1.0,
        "un-overlapped copies: the GPU idle, waiting for them": 3.0, "allocator: cudaMalloc and cudaFree": 0.3,
        "other: neither busy (host, launches, syncs)": 0.7})
    assert sum(items.values()) == pytest.approx(b["gap_ms"])
    assert b["timed_mean_minus_profiled_ms"] == pytest.approx(0.5)
    assert (b["copy_busy_ms"], b["kernel_busy_ms"], b["both_ms"]) == (5.0, 6.0, 2.0)
    # Without a resident run the floor's compute is this step's compute kernels.
    own = floor.breakdown(a, 2.5e9, None)
    assert own["compute_from"] == "this step's kernels" and own["floor_ms"] == 5.0
    assert _items(own)["compute kernels above the floor's compute"] == 0.0
    assert sum(_items(own).values()) == pytest.approx(own["gap_ms"]) == pytest.approx(5.0)


def test_a_bus_bound_gap_is_slow_copies_unoverlapped_compute_decodes_allocator_and_other():
    a = floor.summarize({"copies": [(0.0, 4.0), (5.0, 6.0)], "copy_bytes": 5_000_000, "compute": [(3.0, 8.0)],
                         "decode": [(7.0, 9.0)], "allocator": None}, wall_ms=10.0)
    b = floor.breakdown(a, 1.25e9, 0.002)  # 4 ms of bus against 2 of compute
    assert (b["bound"], b["floor_ms"], b["gap_ms"]) == ("bus", 4.0, 6.0)
    items = _items(b)
    assert items == {
        "copy engine busy above bytes / bandwidth": 1.0,
        "un-overlapped compute: the bus idle while kernels run": 3.0, "decode kernels, the bus idle": 1.0,
        "allocator: cudaMalloc and cudaFree": None, "other: neither busy (host, launches, syncs)": 1.0}
    assert sum(v for v in items.values() if v is not None) == b["gap_ms"]


def test_copies_without_their_sizes_in_the_trace_take_the_timed_steps_mean_bytes():
    a = floor.summarize({"copies": [(0.0, 4.0)], "copy_bytes": 0, "compute": [(0.0, 1.0)], "decode": [],
                         "allocator": []}, wall_ms=4.0)
    b = floor.breakdown(a, 1e9, 0.001, mean_bytes=3e6)
    assert (b["bus_ms"], b["bus_from"], b["bound"], b["gap_ms"]) == (3.0, "the timed steps' mean bytes", "bus", 1.0)
    assert floor.breakdown(a, 1e9, 0.001)["bus_from"] == "the profiled step's copies"


def test_without_cuda_or_bandwidth_nothing_is_measured_and_the_line_says_so():
    assert floor.breakdown(None, 5e10, 0.5) == {"status": "not measured: no CUDA"}
    a = floor.summarize({"copies": [], "copy_bytes": 0, "compute": [(0.0, 1.0)], "decode": [],
                         "allocator": []}, wall_ms=1.0)
    assert floor.breakdown(a, None, None) == {"status": "not measured: no host-to-device bandwidth"}
    assert floor.describe("resident (0.100 s/step)", {"status": "not measured: no CUDA"}) == (
        "  resident (0.100 s/step): not measured: no CUDA")
    b = floor.breakdown(a, 1e9, None)
    line = floor.describe("layerstream (0.001 s/step)", b, wait_ms=0.25)
    assert line.startswith("  layerstream (0.001 s/step): profiled step 1 ms: copy engine busy 0 ms, kernels 1 ms")
    assert "compute-bound" in line and line.endswith("layerstream's own count of compute waiting for copies: 0 ms/step")
