"""layerstream: stream frozen transformer weights from pinned host RAM to the GPU, layer by layer.

The native core lives in ``layerstream._native`` (built by CMake through scikit-build-core). This package
adds the command line (``layerstream``), logging glue and the demo. See docs/architecture.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

try:
    from . import _native  # noqa: F401  (re-exported for users and tests)
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "layerstream's native extension (layerstream._native) is not built. Install the package with "
        "`pip install --no-build-isolation .` from the repository root (see README.md). "
        f"Original error: {exc}"
    ) from exc

from ._logging import install_log_bridge

install_log_bridge()

__all__ = ["__version__", "_native"]
