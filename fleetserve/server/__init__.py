"""OpenAI-compatible HTTP server for one engine (aiohttp; `create_app(config)` factory).

`create_app` and `ServerConfig` are imported lazily, so that importing a submodule (or
`fleetserve.server.cli` for `--help`) does not load the app and the engine client with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ServerConfig", "create_app"]

if TYPE_CHECKING:
    from fleetserve.server.app import ServerConfig, create_app


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fleetserve.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'fleetserve.server' has no attribute {name!r}")
