"""Reading Prometheus text for the fleet tests: the router's decision counter and an engine's
KV-loaded counter (what shows that a request went prefill → decode)."""

from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        out.append((match.group(1), labels, float(match.group(3))))
    return out


def scrape(base_url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        return samples(response.read().decode())


def total(metrics: list[tuple[str, dict[str, str], float]], name: str) -> float:
    """Sum of a counter's samples (`name` or `name_total`) over all labels."""
    return sum(v for n, _, v in metrics if n in (name, f"{name}_total"))


def router_decisions(metrics: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """The router's decision counter (`fleetserve:router_decisions*`) by its label values.

    NOTE: the exact name and label of the router's decision counter are the router's (issue 15);
    every `fleetserve:router_*decision*` counter sample is read, keyed by its joined label values.
    """
    decisions: dict[str, float] = {}
    for name, labels, value in metrics:
        if (
            name.startswith("fleetserve:router_")
            and "decision" in name
            and not name.endswith("_created")
        ):
            key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            decisions[key] = decisions.get(key, 0.0) + value
    return decisions


def went_prefill_then_decode(decisions: dict[str, float]) -> float:
    """How many decisions name a remote prefill (a label value mentioning prefill or P/D)."""
    words = ("prefill", "disagg", "remote", "pd")
    return sum(
        v for k, v in decisions.items() if any(w in k.lower() for w in words) and "never" not in k
    )
