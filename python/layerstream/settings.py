"""The LAYERSTREAM_* settings as users write them: in AI-Toolkit's ``.env`` or in the environment.

The declaration and the parsers are the native table (include/layerstream/settings.h, through ``_native``):
this module adds what only the Python side knows, where a value came from (``.env`` line N, or the
environment), and reads ``.env`` the way AI-Toolkit's run.py does (python-dotenv's ``load_dotenv()``, which
does not override a variable the environment already has). ``problems()`` gives one line per bad or unknown
setting; the AI-Toolkit hook, ``layerstream status`` and ``doctor`` all print those same lines.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from . import _native

_NAME = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*=\s*(.*?)\s*$")
_GLUED = re.compile(r"(?<=\S)(LAYERSTREAM[A-Z0-9_]*)=")


@dataclass(frozen=True)
class Spec:
    """One setting's declaration (see settings.h): ``audience`` is user, tuning or tests."""

    name: str
    type: str
    audience: str
    native: bool
    default: str
    accepts: str
    example: str
    doc: str


TABLE = [Spec(**row) for row in _native.settings_table()]
SPECS = {spec.name: spec for spec in TABLE}


@dataclass(frozen=True)
class DotenvEntry:
    value: str
    line: int  # 1-based


def _unquote(raw: str) -> str:
    """A value as python-dotenv reads it: quoted ('...' or "..."), or bare up to a ' #' comment."""
    if raw[:1] in ("'", '"'):
        end = raw.find(raw[0], 1)
        if end > 0:
            inner = raw[1:end]
            return inner.encode().decode("unicode_escape") if raw[0] == '"' and "\\" in inner else inner
    return re.split(r"\s+#", raw, maxsplit=1)[0].strip()


def _dotenv_lines(path: Path) -> list[str]:
    """The lines of a .env file as python-dotenv reads it (UTF-8, Notepad's BOM dropped); none when absent."""
    try:
        return path.read_bytes().decode("utf-8-sig", errors="replace").splitlines()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []


def read_dotenv(path: Path) -> dict[str, DotenvEntry]:
    """Every ``NAME=value`` of a .env file, with its line; a name given twice: the last (as python-dotenv)."""
    entries = {}
    for number, line in enumerate(_dotenv_lines(path), 1):
        if line.lstrip().startswith("#"):
            continue
        match = _NAME.match(line)
        if match:
            entries[match.group(1)] = DotenvEntry(_unquote(match.group(2)), number)
    return entries


def glued_lines(path: Path) -> list[str]:
    """Lines where a LAYERSTREAM setting follows other text (``HF_TOKEN=abcLAYERSTREAM_VRAM_BUDGET=auto``: what appending
    to a file without a final newline gives): the setting is then part of the other line's value."""
    found = []
    for number, line in enumerate(_dotenv_lines(path), 1):
        match = _GLUED.search(line, 1)
        if match is None or line.lstrip().startswith("#"):
            continue
        owner = _NAME.match(line)
        what = f"{owner.group(1)}'s value" if owner else "the text before it"
        found.append(f"{match.group(1)} on .env line {number} is part of {what} (the line before it lacked a "
                     "newline), so it is not set: put it on a line of its own (`layerstream set` does)")
    return found


@dataclass(frozen=True)
class Value:
    """A setting as a run sees it: its text and where it came from."""

    text: str
    origin: str  # ".env line N", "the environment"


def run_settings(dotenv: Path | None, environ: Mapping[str, str] | None = None,
                 loaded: bool = False) -> dict[str, Value]:
    """The LAYERSTREAM settings a run.py run sees, each with where it came from. ``loaded``: ``environ`` is
    the run's own, into which run.py already loaded ``dotenv`` (a value equal to its .env entry came from
    there); else (``layerstream status``) the run will add .env's entries for the names ``environ`` lacks,
    as python-dotenv's load_dotenv() does, which never overrides."""
    environ = os.environ if environ is None else environ
    from_file = {name: entry for name, entry in (read_dotenv(dotenv) if dotenv is not None else {}).items()
                 if name == "LAYERSTREAM" or name.startswith("LAYERSTREAM_")}
    values = {}
    for name, text in environ.items():
        if name == "LAYERSTREAM" or name.startswith("LAYERSTREAM_"):
            entry = from_file.get(name)
            came = entry is not None and entry.value == text and loaded
            values[name] = Value(text, f".env line {entry.line}" if came else "the environment")
    if not loaded:
        for name, entry in from_file.items():
            values.setdefault(name, Value(entry.value, f".env line {entry.line}"))
    return values


def refusal(name: str, value: Value) -> str | None:
    """The one line refusing ``value`` for ``name`` (an unknown name too), or None when it is accepted."""
    if not value.text:
        return None  # empty: the same as unset
    return _native.setting_refusal(name, value.text, value.origin)


def problems(values: Mapping[str, Value], dotenv: Path | None = None) -> list[str]:
    """One line for each setting that is not accepted or is no setting, in the table's order, then the
    unknown names, then .env lines where a setting was glued onto another line."""
    lines = []
    for name in [*(spec.name for spec in TABLE), *sorted(n for n in values if n not in SPECS)]:
        if name in values:
            line = refusal(name, values[name])
            if line:
                lines.append(line)
    if dotenv is not None:
        lines.extend(glued_lines(dotenv))
    return lines


def markdown_table(audience: str) -> str:
    """The docs' table of one audience's settings (docs/ai-toolkit.md, "Modes and settings"; a test checks that
    the docs hold exactly these)."""
    rows = ["| setting | unset | takes | what it does |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.default} | {s.accepts} | {s.doc} |" for s in TABLE if s.audience == audience]
    return "\n".join(rows)
