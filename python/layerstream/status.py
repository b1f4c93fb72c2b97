"""`layerstream status PATH`: whether an AI-Toolkit checkout runs on layerstream, and with which settings.

Settings are what a run started by AI-Toolkit's run.py sees: this environment, plus the checkout's .env for
the variables the environment does not set (run.py calls python-dotenv's load_dotenv(), which does not
override). They come from ``manager_modules.settings()`` where the module has it, else from the variables.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import install


def read_dotenv(path: Path) -> dict[str, str]:
    """The checkout's .env as python-dotenv reads it (its own parser where installed; else KEY=VALUE lines)."""
    if not path.is_file():
        return {}
    try:
        from dotenv import dotenv_values
    except ImportError:
        values = {}
        for line in path.read_text(encoding="utf-8-sig").splitlines():  # Notepad's BOM; not the locale's code page
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, _, value = line.removeprefix("export ").partition("=")
                values[key.strip()] = value.strip().strip("'\"")
        return values
    return {k: v for k, v in dotenv_values(path).items() if v is not None}


def run_environment(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(the environment a run.py run sees, the .env values among it that apply)."""
    from_file = {k: v for k, v in read_dotenv(root / ".env").items() if k not in os.environ}
    return {**os.environ, **from_file}, from_file


def report(path: str | Path) -> str:
    checkout = install.inspect(path)
    manifest = install.Manifest.load(checkout.root)
    env, from_file = run_environment(checkout.root)
    lines = [f"checkout      {checkout.root}",
             f"AI-Toolkit    {checkout.version or 'unknown version (manager.py matches no tested one)'}"]
    if manifest is None:
        lines.append("mode          not installed (stock); `layerstream install PATH` installs")
        return "\n".join(lines)
    lines.append(f"mode          {manifest.mode} ({', '.join(manifest.files)})")
    switch = env.get("LAYERSTREAM", "1")
    found = install.probe(checkout, {k: v for k, v in env.items() if k.startswith("LAYERSTREAM")})
    if found.layerstream:
        lines.append(f"loads         yes, in {sys.executable}: {found.detail}")
    else:
        lines.append(f"loads         NO, in {sys.executable}: {found.detail}")
    lines.append(f"LAYERSTREAM   {switch}" + ("" if manifest.mode == "patch" else " (copy mode ignores it)"))
    if found.settings is not None:
        settings = found.settings
        lines.append("settings      (manager_modules.settings())")
    else:
        settings = {k: v for k, v in sorted(env.items()) if k.startswith("LAYERSTREAM_")}
        lines.append("settings      (the LAYERSTREAM_* variables; the rest are at their defaults, docs/ai-toolkit.md)")
    for key, value in sorted(settings.items()):
        # settings() names its fields as Settings does (vram_budget); the line names the variable.
        name = key if key.startswith("LAYERSTREAM") else f"LAYERSTREAM_{key.upper()}"
        origin = "  (.env)" if name in from_file else ""
        lines.append(f"  {name}={value}{origin}")
    return "\n".join(lines)
