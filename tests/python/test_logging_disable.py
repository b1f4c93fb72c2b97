"""layerstream's log lines survive ``logging.disable``: AI-Toolkit's captioner extensions call
``logging.disable(logging.WARNING)`` when run.py imports them, which used to hide every layerstream line from a
job's log. Other loggers stay silenced, and LAYERSTREAM_LOG still decides layerstream's own level."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from layerstream import _logging

# A fresh process as run.py has it: layerstream imported (its stderr fallback handler installed, no handler of
# the application), then an extension disables logging up to WARNING. The lines take the two routes layerstream
# logs by: the torch glue's (logging.getLogger("layerstream").log) and the core's sink.
CHILD = (
    "import logging, layerstream\n"
    "from layerstream import _logging\n"
    "logging.disable(logging.WARNING)\n"
    "logging.getLogger('layerstream').log(logging.INFO, 'manager_modules active on %s', 'cpu')\n"
    "_logging._sink(logging.WARNING, 'a warning of layerstream')\n"
    "logging.getLogger('diffusers').warning('silenced by the application')\n"
    "logging.warning('silenced too')\n"
)


def run_child(log_setting: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LAYERSTREAM_LOG"}
    if log_setting is not None:
        env["LAYERSTREAM_LOG"] = log_setting
    result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_lines_reach_stderr_under_logging_disable_and_nothing_else_does():
    err = run_child(None)
    assert "layerstream INFO: manager_modules active on cpu" in err
    assert "layerstream WARNING: a warning of layerstream" in err
    assert "silenced" not in err


def test_layerstream_log_setting_still_decides():
    err = run_child("warning")
    assert "manager_modules active" not in err
    assert "layerstream WARNING: a warning of layerstream" in err
    assert "layerstream" not in run_child("off")


def test_the_applications_handlers_receive_the_lines_under_logging_disable(caplog):
    caplog.set_level(logging.INFO, logger="layerstream")
    logging.disable(logging.WARNING)
    try:
        _logging._sink(logging.INFO, "the VRAM plan")
        logging.getLogger("layerstream").debug("below layerstream's level")
        logging.getLogger("aitk.other").warning("silenced")
    finally:
        logging.disable(logging.NOTSET)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("layerstream", logging.INFO, "the VRAM plan")]
