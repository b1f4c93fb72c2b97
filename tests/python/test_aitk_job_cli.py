"""`layerstream bench aitk-job`'s command line: what it refuses and how the user's allocations (--stress-gb) are
judged, without running a job (tests/python/test_aitk_jobs.py runs them)."""

from __future__ import annotations

import pytest

from layerstream.bench.aitk_job import RunResult
from layerstream.bench.aitk_job_cli import parse_args, stress_problems


@pytest.mark.parametrize("value", ["", "x", "2,,4", "0", "2,-1", "nan"])
def test_stress_sizes_that_are_not_sizes_are_refused_with_what_to_give(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--aitk-dir", "/nowhere", "--stress-gb", value])
    assert exit_info.value.code == 2
    assert f"--stress-gb {value!r}: give sizes in GiB above 0, comma-separated (e.g. 2,4,8)" in capsys.readouterr().err


def test_stress_sizes_are_taken_as_given():
    assert parse_args(["--aitk-dir", "/nowhere", "--stress-gb", "2,4,8"]).stress_gb == "2,4,8"
    assert parse_args(["--aitk-dir", "/nowhere"]).stress_gb is None


def _run(engine: str, ooms: dict | None) -> RunResult:
    run = RunResult(engine=engine, returncode=0, wall_s=1.0)
    if ooms is not None:
        run.stress = {"sizes_gb": [2.0], "made": {"between": 1, "inside": 1, "sample": 1}, "out_of_memory": ooms}
    return run


def test_layerstream_running_out_of_memory_more_often_than_stock_is_a_problem():
    none = {"between": 0, "inside": 0, "sample": 0}
    one = {"between": 0, "inside": 1, "sample": 0}
    assert stress_problems({"stock": _run("stock", none), "layerstream": _run("layerstream", one)}) == [
        "out of memory for the user's allocations: 1 under layerstream, 0 under stock"]
    assert stress_problems({"layerstream": _run("layerstream", one)}) == [
        "out of memory for the user's allocations: 1 under layerstream, not run under stock"]
    # As often as stock (a card too small for the allocation either way), or less often: no problem.
    assert stress_problems({"stock": _run("stock", one), "layerstream": _run("layerstream", one)}) == []
    assert stress_problems({"stock": _run("stock", one), "layerstream": _run("layerstream", none)}) == []
    assert stress_problems({"stock": _run("stock", None), "layerstream": _run("layerstream", None)}) == []
