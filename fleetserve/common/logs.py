"""The log format of fleetserve's commands, defined once."""

from __future__ import annotations

import logging

__all__ = ["LOG_FORMAT", "LOG_LEVELS", "configure_logging"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_logging(level: str | int = logging.INFO) -> None:
    """Log to stderr in `LOG_FORMAT` at `level` (one of `LOG_LEVELS`, any case, or a number); a
    process that already configured logging keeps its handlers.

    Raises:
        ValueError: an unknown level name (the message names --log-level).
    """
    if isinstance(level, str):
        if level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
