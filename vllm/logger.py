"""Logging set-up shared by the package: one ``vllm`` logger hierarchy, configured once."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger("vllm")
    from vllm import envs  # envs imports nothing of the package

    level = envs.VLLM_LOGGING_LEVEL
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
        root.addHandler(handler)
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """Returns the logger for a module of this package (``name`` is its ``__name__``)."""
    _configure_root()
    return logging.getLogger(name)
