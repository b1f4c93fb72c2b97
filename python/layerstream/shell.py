"""Commands printed for the user to copy: each word quoted for the shell they will paste it into."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path


def quote(word: str | os.PathLike) -> str:
    """POSIX quoting (shlex), or on Windows double quotes (cmd and PowerShell both take them) where the word
    has a space or a character either shell treats specially."""
    word = str(word)
    if os.name == "nt":
        return f'"{word}"' if not word or re.search(r"[\s&|<>^()%!'`;,$@{}]", word) else word
    return shlex.quote(word)


def command(*words: str | os.PathLike) -> str:
    return " ".join(quote(w) for w in words)


def checkout_arg(root: Path) -> list[str]:
    """The checkout as a command's last argument: nothing where the command runs in it (the default `.`)."""
    try:
        here = Path.cwd().resolve() == root.resolve()
    except OSError:
        here = False
    return [] if here else [str(root)]
