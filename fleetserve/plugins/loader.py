"""Plugins discovered through Python entry points, loaded where their group says.

| Group                          | Loaded in                                                    |
|--------------------------------|--------------------------------------------------------------|
| `fleetserve.general_plugins`   | every process: the API server, the engine core, each worker |
|                                | (and the offline `LLM`'s one process)                        |
| `fleetserve.server_plugins`    | the API server only; each adds HTTP routes (default-deny)    |

A general plugin is a function taking no argument, called once per process (it must be
re-entrant: every process runs it), e.g. to register a model architecture
(`fleetserve.engine.models.registry.register_model`). A server plugin is a function
`register(app: aiohttp.web.Application) -> None` adding routes to the engine's app.

`FLEETSERVE_PLUGINS` is the allowlist: comma-separated entry-point names. Unset, every general
plugin loads and no server plugin does (those widen the network surface; a warning names the
ones found); set, only the named ones load; set to the empty string, none does (an empty
allowlist is not an unset one). A plugin whose import or call raises is logged with its name
("Failed to load plugin ...") and skipped: the others and the process go on. Each process loads
a group at most once, and the guard is set before loading, so a failure is not retried. What
loaded is logged and listed by `records()` (served at `GET /v1/plugins`).

This module imports no torch (the API server loads it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from fleetserve.envs import read_env

__all__ = [
    "GENERAL_GROUP",
    "SERVER_GROUP",
    "PluginLoader",
    "PluginRecord",
    "load_general_plugins",
    "process_plugins",
]

logger = logging.getLogger(__name__)

GENERAL_GROUP = "fleetserve.general_plugins"
SERVER_GROUP = "fleetserve.server_plugins"
GROUPS: tuple[str, ...] = (GENERAL_GROUP, SERVER_GROUP)


@dataclass(frozen=True, slots=True)
class PluginRecord:
    """One discovered plugin in this process."""

    group: str
    name: str
    value: str
    """The entry point's `module:attr`."""
    status: str
    """'loaded', 'failed' or 'denied' (not in the allowlist; server plugins: no allowlist)."""
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "name": self.name, "value": self.value,
                "status": self.status, "error": self.error}  # fmt: skip


@dataclass
class PluginLoader:
    """The plugins of one process: its allowlist, the groups loaded and what they gave.

    Args:
        environ: the environment the allowlist is read from (default: `os.environ`).
    """

    environ: Mapping[str, str] | None = None
    _loaded: dict[str, dict[str, Any]] = field(default_factory=dict)
    _records: list[PluginRecord] = field(default_factory=list)

    @property
    def allowlist(self) -> tuple[str, ...] | None:
        """None: unset; () from the empty string (matches nothing)."""
        raw = read_env(os.environ if self.environ is None else self.environ).plugins
        if raw is None:
            return None
        return tuple(name.strip() for name in raw.split(",") if name.strip())

    def records(self) -> list[PluginRecord]:
        return list(self._records)

    def load_group(self, group: str) -> dict[str, Any]:
        """Import the group's allowed entry points once per process; name → loaded object.

        Raises:
            ValueError: an unknown group.
        """
        if group not in GROUPS:
            raise ValueError(f"group must be one of {list(GROUPS)}, got {group!r}")
        if group in self._loaded:
            return self._loaded[group]
        # NOTE: the guard is set before loading: a failing plugin is not retried (seed §2.7).
        loaded: dict[str, Any] = {}
        self._loaded[group] = loaded
        found = list(entry_points(group=group))
        if not found:
            logger.debug("no plugins in group %s", group)
            return loaded
        level = logging.DEBUG if group == GENERAL_GROUP else logging.INFO
        logger.log(level, "plugins found in %s: %s", group, [ep.name for ep in found])
        allow = self.allowlist
        if group == SERVER_GROUP and allow is None:
            logger.warning(
                "server plugins %s add HTTP routes and are not loaded without an allowlist; "
                "name them in FLEETSERVE_PLUGINS to serve them",
                [ep.name for ep in found],
            )
        for ep in found:
            if (allow is None and group == SERVER_GROUP) or (
                allow is not None and ep.name not in allow
            ):
                self._records.append(PluginRecord(group, ep.name, ep.value, "denied"))
                continue
            self._load_one(group, ep, loaded)
        return loaded

    def _load_one(self, group: str, ep: EntryPoint, loaded: dict[str, Any]) -> None:
        try:
            loaded[ep.name] = ep.load()
        except Exception as exc:
            logger.exception("Failed to load plugin %s (%s = %s)", ep.name, group, ep.value)
            self._records.append(PluginRecord(group, ep.name, ep.value, "failed", repr(exc)))
            return
        self._records.append(PluginRecord(group, ep.name, ep.value, "loaded"))

    def run_general(self) -> None:
        """Load the general group (once) and call each plugin once in this process."""
        if GENERAL_GROUP in self._loaded:
            return
        for name, func in self.load_group(GENERAL_GROUP).items():
            self._call(GENERAL_GROUP, name, func)
        loaded = [r.name for r in self._records if r.status == "loaded"]
        if self._records:
            logger.info("plugins loaded in this process (pid %d): %s", os.getpid(), loaded)

    def apply_server(self, app: Any) -> None:
        """Let each allowed server plugin add its routes to `app`."""
        for name, register in self.load_group(SERVER_GROUP).items():
            self._call(SERVER_GROUP, name, register, app)

    def _call(self, group: str, name: str, func: Callable[..., Any], *args: Any) -> None:
        try:
            func(*args)
        except Exception as exc:
            logger.exception("Failed to load plugin %s (%s): it raised", name, group)
            self._records = [
                PluginRecord(r.group, r.name, r.value, "failed", repr(exc))
                if (r.group, r.name) == (group, name)
                else r
                for r in self._records
            ]


# NOTE: the one process-wide state of this package: plugins load once per *process*, so the
# guard lives as long as the process does (tests build their own `PluginLoader`s).
_PROCESS_LOADER = PluginLoader()


def process_plugins() -> PluginLoader:
    """This process's loader."""
    return _PROCESS_LOADER


def load_general_plugins() -> None:
    """Run the general plugins in this process (a second call does nothing)."""
    _PROCESS_LOADER.run_general()
