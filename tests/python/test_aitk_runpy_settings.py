"""A bad setting in AI-Toolkit's .env, through AI-Toolkit's own run.py (unchanged, on a copy of the checkout with
layerstream installed): the job stops, and the last line of its log, the error AI-Toolkit's web UI shows, is
the setting's one line (its name, its value, `.env line N`, what it takes). It used to be `ImportError:
initialization failed`, or a job silently trained on stock. Runs in AI-Toolkit's own environment
(scripts/aitk_venv.sh, named by AITK_JOBS_VENV, as tests/python/test_aitk_jobs.py does)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import AITK_PYTHON, AITK_STUBS, aitk_dirs, aitk_jobs_skip_reason
from layerstream import _native
from layerstream.settings import TABLE

REPO = Path(__file__).resolve().parents[2]
STUBS, PYTHON = AITK_STUBS, AITK_PYTHON


pytestmark = pytest.mark.skipif(aitk_jobs_skip_reason() is not None, reason=aitk_jobs_skip_reason() or "")

# A job whose process type imports AI-Toolkit's trainer, and with it toolkit.memory_management: the hook runs
# there, before any model is loaded.
JOB = """job: extension
config:
  name: settings_check
  process:
    - type: sd_trainer
      training_folder: {folder}
      device: cpu
      network: {{type: lora, linear: 4, linear_alpha: 4}}
      save: {{dtype: float16, save_every: 10}}
      datasets: []
      train: {{batch_size: 1, steps: 1}}
      model: {{name_or_path: /nonexistent, arch: zimage, layer_offloading: true}}
"""

# A value each setting refuses; the hook's own switch and the package's log level among them.
BAD = {spec.name: "-5" if spec.type in ("MiB", "count", "seconds") else "lots" for spec in TABLE}
BAD.update({"LAYERSTREAM_SHARE_TOKEN": "job-1", "LAYERSTREAM": "maybe", "LAYERSTREAM_VRAM_BUDGE": "auto"})


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("runpy") / "ai-toolkit"
    shutil.copytree(aitk_dirs()[0], root, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    for folder, _, files in os.walk(root):  # the snapshot may be read-only
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    (root / "job.yaml").write_text(JOB.format(folder=root / "output"))
    done = subprocess.run([str(PYTHON), "-m", "layerstream", "install", str(root)], capture_output=True, text=True,
                          env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not (k == "LAYERSTREAM" or k.startswith("LAYERSTREAM_"))}
    paths = [str(STUBS)] if STUBS.is_dir() else []
    env.update(PYTHONPATH=os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    return env


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_setting_is_the_last_line_of_the_job_log(checkout, name):
    value = BAD[name]
    (checkout / ".env").write_text(f"HF_TOKEN=x\n{name}={value}\n")
    log = checkout / "output" / f"{name}.log"
    done = subprocess.run([str(PYTHON), "run.py", "job.yaml", "--log", str(log)], cwd=checkout, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    line = _native.setting_refusal(name, value, ".env line 2")
    assert line is not None and line.startswith(f"{name}={value} (.env line 2) is not ")
    # The log run.py writes (stdout and stderr, as the web UI reads them) and stderr both end with it.
    assert log.read_text().strip().splitlines()[-1] == f"ValueError: {line}", log.read_text()[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"ValueError: {line}"
    assert f"Error running job: {line}" in done.stdout
