"""Out-of-tree model architectures, registered by plugins (`register_model`).

A general plugin (`fleetserve.plugins.loader`) runs in every process, so the registration must
not import torch or the model in the API server: an architecture is registered by the
qualified name of its class (`"pkg.module:ClassName"`), imported only when the engine builds
the model (`fleetserve.engine.models.registry` merges these with the built-in ones).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["out_of_tree_architectures", "register_model"]

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


def out_of_tree_architectures() -> dict[str, Any]:
    """Architecture → class, importing each registered class.

    Raises:
        ValueError: a registered class that cannot be imported (named).
    """
    classes: dict[str, Any] = {}
    for architecture, qualname in _REGISTERED.items():
        module, _, attr = qualname.partition(":")
        try:
            classes[architecture] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"architecture {architecture!r} is registered to {qualname!r}, which does not "
                f"import: {exc}"
            ) from exc
    return classes
