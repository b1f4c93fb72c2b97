"""Routes the native core's log messages into Python's ``logging`` (logger ``layerstream``)."""

from __future__ import annotations

import logging

logger = logging.getLogger("layerstream")


def _sink(level: int, message: str) -> None:
    logger.log(level, message)


def install_log_bridge() -> None:
    """Core levels are the ``logging`` numbers (10 debug .. 40 error), so they pass through unchanged."""
    from . import _native

    _native.set_log_sink(_sink)
