"""layerstream: stream frozen transformer weights from pinned host RAM to the GPU, layer by layer.

The native core lives in ``layerstream._native`` (built by CMake through scikit-build-core). This package
adds the command line (``layerstream``), logging glue and the demo. See docs/architecture.md.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("layerstream")  # pyproject.toml is the one source
except PackageNotFoundError:  # pragma: no cover - imported from a source tree that was never installed
    __version__ = "0+unknown"

try:
    # torch first: on Windows, importing it puts its DLL folder on the search path that the extensions
    # (manager_modules links libtorch) need; there is no RPATH there.
    import torch
except ImportError:  # the torch-free core and its demo still work
    torch = None

from . import _torch_guard

# A torch other than the build's: importing manager_modules says so instead of failing at DLL load (Windows).
_torch_guard.install(getattr(torch, "__version__", None) if torch is not None else None)
del torch

try:
    from . import _native  # noqa: F401  (re-exported for users and tests)
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    if "Visual C++ Redistributable" in str(exc):  # built, but refused by its VC++ runtime check (Windows)
        raise
    raise ImportError(
        "layerstream's native extension (layerstream._native) is not built. Install the package with "
        "`pip install --no-build-isolation .` from the repository root (see README.md). "
        f"Original error: {exc}"
    ) from exc

from ._logging import install_log_bridge

install_log_bridge()

__all__ = ["__version__", "_native"]
