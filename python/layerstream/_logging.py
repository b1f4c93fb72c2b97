"""Routes the native core's log messages into Python's ``logging`` (logger ``layerstream``), and makes them
visible in applications that configure no logging (AI-Toolkit): ``LAYERSTREAM_LOG=info`` (default) or
``warning`` prints them on stderr while no handler of the application would; ``off`` adds nothing.

``logging.disable`` does not silence them: AI-Toolkit's captioner extensions call ``logging.disable(logging.WARNING)``
when ``run.py`` imports them, which would hide "layerstream manager_modules active", the VRAM plan and the
summaries from every job's log. Their level is layerstream's own (``LAYERSTREAM_LOG``, or a level the application
set on the ``layerstream`` logger); every other logger of the process stays as the application left it."""

from __future__ import annotations

import logging
import os
import sys

LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "debug": logging.DEBUG, "off": None}


class OwnLevelLogger(logging.Logger):
    """The ``layerstream`` logger: enabled by its own level alone, whatever ``logging.disable`` says (see the
    module's note), so every route into it (the native core's sink, the torch glue's, Python code) is covered.
    With ``LAYERSTREAM_LOG=off`` it is an ordinary logger (``own_level``: decided once, at import)."""

    own_level = True

    def isEnabledFor(self, level: int) -> bool:
        if not self.own_level:
            return super().isEnabledFor(level)
        return not self.disabled and level >= self.getEffectiveLevel()


logger = logging.getLogger("layerstream")
logger.__class__ = OwnLevelLogger  # the instance other modules already hold, if any


def _sink(level: int, message: str) -> None:
    logger.log(level, message)


class FallbackHandler(logging.StreamHandler):
    """Writes to stderr only while no other handler above the ``layerstream`` logger would take the record,
    so an application that configures logging later (``logging.basicConfig``) sees each line once."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("layerstream %(levelname)s: %(message)s"))

    @property
    def stream(self):  # the current sys.stderr, which test runners and AI-Toolkit's UI may replace
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        node = logger.parent if logger.propagate else None
        while node is not None:
            if node.handlers:
                return
            node = node.parent if node.propagate else None
        super().emit(record)


def log_level_setting() -> int | None:
    value = os.environ.get("LAYERSTREAM_LOG", "").strip().lower() or "info"
    if value not in LEVELS:  # the setting's one line, as for every other (its origin: ./.env or the environment)
        from pathlib import Path

        from . import settings

        raise ValueError(settings.refusal("LAYERSTREAM_LOG", settings.run_settings(
            Path.cwd() / ".env", loaded=True)["LAYERSTREAM_LOG"]))
    return LEVELS[value]


def install_fallback_handler() -> None:
    level = log_level_setting()
    OwnLevelLogger.own_level = level is not None
    if level is None or any(isinstance(h, FallbackHandler) for h in logger.handlers):
        return
    if logger.level == logging.NOTSET:  # the application's own level for the logger wins
        logger.setLevel(level)
    handler = FallbackHandler()
    handler.setLevel(level)
    logger.addHandler(handler)


def install_log_bridge() -> None:
    """Core levels are the ``logging`` numbers (10 debug .. 40 error), so they pass through unchanged."""
    from . import _native

    _native.set_log_sink(_sink)
    install_fallback_handler()
