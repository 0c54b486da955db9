"""`RouterConfig`: the router's settings, one definition for the operator and the router.

The operator renders a router Deployment's arguments with `to_args()`; `fleetserve router` parses
them with the flags `add_cli_args()` generates and rebuilds the config with `from_args()`. The
routing fields carry the names of the api's `RouterSpec`/`Disaggregation` (mode,
min_uncached_tokens, prefix_aware, load_aware); the rest say how to discover the engines (`discovery`: the static URL lists `prefill`, `decode`,
`engine`, or Kubernetes pod selectors), how to reach them (timeouts, the engines' API key) and the
router's own bounds (in-flight limit, admission queue, circuit breakers).

Flags are `--` + the field name with dashes, except where a field's metadata names its flag
(`mode` is `--disaggregation`, ARCHITECTURE.md §3). Booleans are `--x` / `--no-x`; a URL list is
its flag repeated once per URL (`--decode URL --decode URL`).
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = ["RouterConfig"]


def _meta(help: str, flag: str | None = None) -> dict[str, str]:
    return {"help": help, **({"flag": flag} if flag else {})}


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything `fleetserve router` runs with (validated on construction)."""

    mode: Literal["always", "selective", "never"] = field(
        default="always",
        metadata=_meta(
            "prefill/decode split: always, selective (see --min-uncached-tokens) or never",
            flag="--disaggregation",
        ),
    )
    min_uncached_tokens: int = field(
        default=256,
        metadata=_meta(
            "selective mode: use a prefill engine only when at least this many prompt tokens are"
            " not already cached on the chosen decode engine"
        ),
    )
    prefix_aware: bool = field(
        default=True, metadata=_meta("prefer engines that already cache the prompt's prefix")
    )
    load_aware: bool = field(
        default=True, metadata=_meta("weigh engines by their scheduler load (queue, KV usage)")
    )
    discovery: Literal["static", "kubernetes"] = field(
        default="kubernetes",
        metadata=_meta(
            "how to find the engines: static (--prefill/--decode/--engine URLs) or kubernetes"
            " (pods by label selector)"
        ),
    )
    prefill: tuple[str, ...] = field(
        default=(), metadata=_meta("static discovery: a prefill engine's URL (repeat the flag)")
    )
    decode: tuple[str, ...] = field(
        default=(), metadata=_meta("static discovery: a decode engine's URL (repeat the flag)")
    )
    engine: tuple[str, ...] = field(
        default=(),
        metadata=_meta("static discovery: a colocated (unified) engine's URL (repeat the flag)"),
    )
    namespace: str = field(default="default", metadata=_meta("namespace of the engine pods"))
    prefill_selector: str | None = field(
        default=None, metadata=_meta("label selector of the prefill pods")
    )
    decode_selector: str | None = field(
        default=None, metadata=_meta("label selector of the decode pods")
    )
    unified_selector: str | None = field(
        default=None, metadata=_meta("label selector of the unified (colocated) pods")
    )
    compatibility_hash: str | None = field(
        default=None, metadata=_meta("route only to pods labelled with this KV compatibility hash")
    )
    engine_port: int = field(default=8000, metadata=_meta("the engines' HTTP port"))
    host: str = field(default="0.0.0.0", metadata=_meta("address the router listens on"))
    port: int = field(default=8080, metadata=_meta("port the router listens on"))
    block_size: int = field(
        default=16, metadata=_meta("the engines' KV block size (prefix hashing must match it)")
    )
    engine_api_key: str | None = field(
        default=None,
        metadata=_meta(
            "bearer token the router sends to the engines (else the client's Authorization"
            " header is passed on)"
        ),
    )
    max_in_flight: int = field(
        default=256, metadata=_meta("requests the router forwards at once; more wait in a queue")
    )
    max_queued: int = field(
        default=256, metadata=_meta("requests waiting for an in-flight slot; more get 429")
    )
    queue_timeout_s: float = field(
        default=10.0, metadata=_meta("longest wait for an in-flight slot before a 429")
    )
    connect_timeout_s: float = field(default=3.0, metadata=_meta("timeout to connect to an engine"))
    prefill_timeout_s: float = field(
        default=120.0, metadata=_meta("timeout of a whole prefill leg")
    )
    first_byte_timeout_s: float = field(
        default=300.0, metadata=_meta("timeout until a decode engine answers with its headers")
    )
    read_timeout_s: float = field(
        default=120.0, metadata=_meta("longest silence between two chunks of a decode answer")
    )
    scrape_interval_s: float = field(
        default=1.0, metadata=_meta("period of the /metrics scrape and health probe of each engine")
    )
    join_wait_s: float = field(
        default=5.0,
        metadata=_meta(
            "a request that finds no usable decode engine while one is joining (discovered, its "
            "first /metrics scrape not answered yet, e.g. the new engine of a roll) waits this "
            "long at most for it, then gets a 503; 0: the 503 at once"
        ),
    )
    saturation_waiting: int = field(
        default=32,
        metadata=_meta("an engine with this many waiting requests (or a full KV) is saturated"),
    )
    breaker_failures: int = field(
        default=3, metadata=_meta("consecutive failures that open an engine's or pair's breaker")
    )
    breaker_cooldown_s: float = field(
        default=5.0, metadata=_meta("how long an open breaker waits before a probe")
    )
    shutdown_delay_s: float = field(
        default=0.0,
        metadata=_meta(
            "after SIGTERM: unready but still serving this long, so a Service's endpoints drop "
            "the pod first (the operator sets it; 0 outside Kubernetes)"
        ),
    )
    shutdown_grace_s: float = field(
        default=25.0,
        metadata=_meta("then, with the listener closed: longest wait for requests in flight"),
    )
    prefix_cache_blocks: int = field(
        default=65536,
        metadata=_meta("block hashes remembered per decode engine (LRU) for prefix affinity"),
    )

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(RouterConfig)
        for f in fields(self):
            choices = typing.get_args(hints[f.name]) if _is_literal(hints[f.name]) else ()
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}"
                )
        if self.min_uncached_tokens < 0:
            raise ValueError(f"min_uncached_tokens must be >= 0, got {self.min_uncached_tokens}")
        for name in ("engine_port", "port"):
            value = getattr(self, name)
            if not 1 <= value <= 65535:
                raise ValueError(f"{name} must be in 1..65535, got {value}")
        for name in ("block_size", "max_in_flight", "breaker_failures", "prefix_cache_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queued", "saturation_waiting"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in _TIMEOUTS:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        for name in ("shutdown_delay_s", "shutdown_grace_s", "join_wait_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        for name in ("prefill", "decode", "engine"):
            for url in getattr(self, name):
                _check_url(name, url)
        if self.discovery == "static":
            self._check_static()
        else:
            self._check_kubernetes()

    def _check_static(self) -> None:
        for name in ("prefill_selector", "decode_selector", "unified_selector"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is for discovery kubernetes, not static")
        if self.prefill and not self.decode:
            raise ValueError("prefill URLs need at least one decode URL to hand their KV to")
        if not self.decode and not self.engine:
            raise ValueError("discovery static needs at least one decode or engine URL")
        if self.mode != "never" and self.decode and not self.prefill:
            raise ValueError(
                f"decode URLs with disaggregation {self.mode} need at least one prefill URL"
                " (or use --disaggregation never)"
            )
        urls = [*self.prefill, *self.decode, *self.engine]
        dup = next((u for u in urls if urls.count(u) > 1), None)
        if dup is not None:
            raise ValueError(f"engine URL {dup} is listed twice")

    def _check_kubernetes(self) -> None:
        for name in ("prefill", "decode", "engine"):
            if getattr(self, name):
                raise ValueError(f"{name} URLs need discovery static (--discovery static)")
        split = self.prefill_selector is not None or self.decode_selector is not None
        if split == (self.unified_selector is not None) or (
            split and (self.prefill_selector is None or self.decode_selector is None)
        ):
            raise ValueError(
                "discovery kubernetes needs prefill_selector and decode_selector, or"
                " unified_selector alone"
            )

    def to_args(self) -> list[str]:
        """The command-line arguments that `from_args` turns back into this config."""
        args: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = _flag(f.name, f.metadata)
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag.removeprefix("--"))
            elif isinstance(value, tuple):
                for item in value:
                    args += [flag, item]
            elif value is not None:
                args += [flag, str(value)]
        return args

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field to `parser` (dest = the field name, default = the field's)."""
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            kwargs: dict[str, Any] = {"dest": f.name, "default": default}
            kind = hints[f.name]
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif _is_literal(kind):
                kwargs["choices"] = list(typing.get_args(kind))
            elif typing.get_origin(kind) is tuple:
                kwargs.update(action="append", default=None, metavar="URL")
            else:
                kwargs["type"] = {int: int, float: float}.get(kind, str)
            help_text = f.metadata.get("help", "")
            kwargs["help"] = (
                f"{help_text} (default: {default})" if default not in (None, ()) else help_text
            )
            parser.add_argument(_flag(f.name, f.metadata), **kwargs)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> RouterConfig:
        """The config from a namespace parsed with `add_cli_args`' flags.

        Raises:
            ValueError: a value out of range, a malformed URL, or engines (URLs or selectors)
                that do not name a role layout.
        """
        values = {f.name: getattr(namespace, f.name) for f in fields(cls)}
        for name in ("prefill", "decode", "engine"):
            values[name] = tuple(values[name] or ())
        return cls(**values)


_TIMEOUTS = (
    "queue_timeout_s", "connect_timeout_s", "prefill_timeout_s", "first_byte_timeout_s",
    "read_timeout_s", "scrape_interval_s", "breaker_cooldown_s",
)  # fmt: skip


def _check_url(name: str, url: str) -> None:
    """An engine's base URL: http(s)://host:port with no path, query or credentials."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(
            f"{name} URL must look like http://HOST:PORT (no path or credentials), got {url!r}"
        )


def _flag(name: str, metadata: Any) -> str:
    return str(metadata.get("flag", "--" + name.replace("_", "-")))


def _is_literal(kind: Any) -> bool:
    return typing.get_origin(kind) is Literal
