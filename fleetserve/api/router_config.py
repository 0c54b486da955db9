"""`RouterConfig`: the router's settings, one definition for the operator and the router.

The operator renders a router Deployment's arguments with `to_args()`; `fleetserve router` parses
them with the flags `add_cli_args()` generates and rebuilds the config with `from_args()`. The
routing fields carry the names of the api's `RouterSpec`/`Disaggregation` (mode,
min_uncached_tokens, prefix_aware, load_aware); the rest say how to discover the engines.

Flags are `--` + the field name with dashes, except where a field's metadata names its flag
(`mode` is `--disaggregation`, ARCHITECTURE.md §3). Booleans are `--x` / `--no-x`.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

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
    discovery: Literal["kubernetes"] = field(
        default="kubernetes", metadata=_meta("how to find the engines: kubernetes (pod labels)")
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
            else:
                kwargs["type"] = int if kind is int else str
            help_text = f.metadata.get("help", "")
            kwargs["help"] = (
                f"{help_text} (default: {default})" if default is not None else help_text
            )
            parser.add_argument(_flag(f.name, f.metadata), **kwargs)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> RouterConfig:
        """The config from a namespace parsed with `add_cli_args`' flags.

        Raises:
            ValueError: a value out of range, or selectors that do not name a role layout.
        """
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})


def _flag(name: str, metadata: Any) -> str:
    return str(metadata.get("flag", "--" + name.replace("_", "-")))


def _is_literal(kind: Any) -> bool:
    return typing.get_origin(kind) is Literal
