"""The torch check of ``layerstream.manager_modules``, made before the extension is loaded.

The extension checks at import that the running torch is the one it was built against, but on Windows a
foreign torch stops it earlier: the loader cannot resolve the extension's torch DLL imports and Python reports
only "DLL load failed while importing manager_modules". The build records its torch version in ``_build.py``;
when the running torch differs, importing ``layerstream.manager_modules`` raises the extension's own message
instead, without loading it. (Copy mode loads the extension without this package: there the loader speaks.)
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

MODULE = "layerstream.manager_modules"


def mismatch(built: str, running: str | None) -> str | None:
    """The refusal for an extension built against torch `built` in a process running `running` (None: no
    torch), or None when they match."""
    if running == built:
        return None
    if not running:
        return (f"{MODULE} was built against torch {built} but this process cannot import torch; install torch "
                f"{built} (or the layerstream wheel built for the torch you install: docs/install.md)")
    return (f"{MODULE} was built against torch {built} but this process runs torch {running}; install the "
            f"layerstream wheel built for torch {running} (docs/install.md), or rebuild it in this environment: "
            "pip install --no-build-isolation --force-reinstall /path/to/layerstream")


class _Refuse(MetaPathFinder):
    def __init__(self, message: str):
        self.message = message

    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            raise ImportError(self.message, name=name)
        return None


def install(running: str | None) -> None:
    """Puts the refusal in front of the import system when the running torch is not the build's."""
    try:
        from ._build import TORCH_VERSION
    except ImportError:  # built without manager_modules
        return
    message = mismatch(TORCH_VERSION, running)
    if message is not None and not any(isinstance(f, _Refuse) for f in sys.meta_path):
        sys.meta_path.insert(0, _Refuse(message))
