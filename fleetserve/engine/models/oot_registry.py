"""Out-of-tree model architectures, registered by plugins (`register_model`).

A general plugin (`fleetserve.plugins.loader`) runs in every process, so the registration must
not import torch or the model in the API server: an architecture is registered by the
qualified name of its class (`"pkg.module:ClassName"`), imported only when the engine builds
the model (`fleetserve.engine.models.registry` looks here for an architecture it does not have,
so a broken registration fails only the model that names it).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["out_of_tree_class", "register_model", "registered_architectures"]

# NOTE: process state by design: plugins fill it at start-up in each process that builds models.
_REGISTERED: dict[str, str] = {}


def register_model(architecture: str, qualname: str) -> None:
    """Serve config.json `architectures[0] == architecture` with the class at `qualname`
    (`module:Class`, a `CausalLM`). Registering the same pair again is a no-op (plugins run in
    every process and may run twice).

    Raises:
        ValueError: a malformed qualname, or the architecture already registered to another.
    """
    module, sep, attr = qualname.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"qualname must be 'module:Class', got {qualname!r}")
    previous = _REGISTERED.get(architecture)
    if previous is not None and previous != qualname:
        raise ValueError(
            f"architecture {architecture!r} is already registered to {previous!r}, not {qualname!r}"
        )
    _REGISTERED[architecture] = qualname


def registered_architectures() -> list[str]:
    """The architectures plugins registered in this process."""
    return sorted(_REGISTERED)


def out_of_tree_class(architecture: str) -> Any:
    """The registered class of `architecture` (imported now), or None when none is registered.

    Raises:
        ValueError: the registered class does not import (named).
    """
    qualname = _REGISTERED.get(architecture)
    if qualname is None:
        return None
    module, _, attr = qualname.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"architecture {architecture!r} is registered to {qualname!r}, which does not "
            f"import: {exc}"
        ) from exc
