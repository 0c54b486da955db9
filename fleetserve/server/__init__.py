"""OpenAI-compatible HTTP server for one engine (aiohttp; `create_app(config)` factory)."""

from __future__ import annotations

__all__ = ["ServerConfig", "create_app"]

from fleetserve.server.app import ServerConfig, create_app
