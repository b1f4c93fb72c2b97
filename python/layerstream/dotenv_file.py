"""`layerstream set NAME=value` and `layerstream unset NAME`: edit one setting of AI-Toolkit's ``.env``.

The file is edited as bytes: every other line, comment and byte stays as it was, the file's line ending
(CRLF or LF) is kept, and a last line without a newline gets one before a line is added after it. A name
has one line: set replaces the first line that defines it and removes the others, unset removes them all.
The value is checked by the setting's own parser before anything is written; the new file replaces the old
one in one rename.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from . import settings

_BARE = re.compile(r"[A-Za-z0-9_.:/+@-]+")
_BOM = b"\xef\xbb\xbf"  # Notepad's "UTF-8 with BOM": kept where it is, not part of the first line's name


def _split_bom(data: bytes) -> tuple[bytes, bytes]:
    return (_BOM, data[len(_BOM):]) if data.startswith(_BOM) else (b"", data)


def _definition(name: str) -> re.Pattern[bytes]:
    return re.compile(rb"^[ \t]*(export[ \t]+)?" + re.escape(name.encode()) + rb"[ \t]*=")


def _line_ending(line: bytes) -> bytes:
    return line[len(line.rstrip(b"\r\n")):]


def _checked(name: str, value: str) -> str:
    """The value as written in .env (quoted where python-dotenv needs it), once the setting accepts it."""
    if name not in settings.SPECS:
        line = settings.refusal(name, settings.Value(value or "1", ""))
        raise ValueError(line or f"{name} is not a layerstream setting (the settings: docs/ai-toolkit.md)")
    if not value:
        raise ValueError(f"{name}= is empty, which is the same as unset: `layerstream unset {name}` removes it")
    line = settings.refusal(name, settings.Value(value, ""))
    if line:
        raise ValueError(line)
    if _BARE.fullmatch(value):
        return value
    if "'" in value or "\n" in value:
        raise ValueError(f"{name}={value!r}: a value with a quote or a line break cannot be written to .env")
    return f"'{value}'"


def _write(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".layerstream-new")
    temporary.write_bytes(data)
    if path.exists():
        shutil.copymode(path, temporary)
    os.replace(temporary, path)


def _shadowed(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        return ""
    return (f"\nnote: this shell's environment sets {name}={value}, which wins over .env for runs started from "
            "it (python-dotenv does not override)")


def set_value(path: Path, name: str, value: str) -> str:
    """Sets ``name`` to ``value`` in the .env file at ``path`` (created if absent); returns what it did."""
    written = _checked(name, value)
    bom, data = _split_bom(path.read_bytes() if path.exists() else b"")
    lines = data.splitlines(keepends=True)
    newline = b"\r\n" if b"\r\n" in data else b"\n"
    pattern = _definition(name)
    found = [i for i, line in enumerate(lines) if pattern.match(line)]
    if found:
        first = lines[found[0]]
        prefix = pattern.match(first).group(1) or b""
        lines[found[0]] = prefix + f"{name}={written}".encode() + _line_ending(first)
        for i in reversed(found[1:]):
            del lines[i]
        number, verb = found[0] + 1, "set on line"
    else:
        if lines and not _line_ending(lines[-1]):
            lines[-1] += newline
        lines.append(f"{name}={written}".encode() + newline)
        number, verb = len(lines), "added as line"
    _write(path, bom + b"".join(lines))
    removed = f" (removed {len(found) - 1} other line(s) that set it)" if len(found) > 1 else ""
    return f"{name}={written} {verb} {number} of {path}{removed}" + _shadowed(name)


def unset_value(path: Path, name: str) -> str:
    """Removes every line of the .env file at ``path`` that sets ``name``; returns what it did."""
    if name not in settings.SPECS:
        _checked(name, "")  # raises: no such setting, with the nearest one
    bom, data = _split_bom(path.read_bytes() if path.exists() else b"")
    lines = data.splitlines(keepends=True)
    pattern = _definition(name)
    kept = [line for line in lines if not pattern.match(line)]
    if len(kept) == len(lines):
        return f"{name} is not set in {path}; nothing to do" + _shadowed(name)
    _write(path, bom + b"".join(kept))
    return f"{name} removed from {path} ({len(lines) - len(kept)} line(s))" + _shadowed(name)
