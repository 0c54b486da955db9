"""Reading Prometheus text for the fleet tests: the router's decision counter and an engine's
KV-loaded counter (what shows that a request went prefill → decode)."""

from __future__ import annotations

import re
import urllib.request

from fleetserve.common.metric_names import ROUTER_DECISIONS

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
    """The router's decision counter (`ROUTER_DECISIONS`) by its `kind` label."""
    name = ROUTER_DECISIONS.name
    decisions: dict[str, float] = {}
    for sample, labels, value in metrics:
        if sample in (name, f"{name}_total"):
            decisions[labels["kind"]] = decisions.get(labels["kind"], 0.0) + value
    return decisions


def went_prefill_then_decode(decisions: dict[str, float]) -> float:
    """How many decisions sent the prompt to a prefill engine first (kind `disaggregated`)."""
    return decisions.get("disaggregated", 0.0)
