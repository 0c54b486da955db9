"""The fleet as the router sees it: each engine's role, compatibility hash, scraped load,
in-flight count and circuit breaker, the (prefill, decode) pair breakers, and the approximate
prefix cache; plus the scraper that refreshes load and health from each engine's `/metrics`.

Discovery (static lists or Kubernetes pods, `fleetserve.router.discovery`) calls `update` with
the endpoints of one source; engines that leave are forgotten with their breakers and prefixes.
A static prefill or decode engine's compatibility hash is learned from its `GET /kv_transfer`
(the identity of its KV connector); until it is known the engine is not paired. An engine takes
requests only after one successful scrape, so an engine that joins is scraped at once rather than
at the next tick: during a roll the operator drains the old engine of a role as soon as the new
one is Ready, and until the router has scraped the new one it has no engine of that role it may
use. Until then the engine is *joining* (`joining`); a request that finds no usable engine while
one joins may wait for the fleet to change (`wait_for_change`, `fleetserve.router.forward`).
Everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import aiohttp

from fleetserve.api.router_config import RouterConfig
from fleetserve.router.breaker import CircuitBreaker
from fleetserve.router.metrics import RouterMetrics, parse_engine_load
from fleetserve.router.policy import EngineLoad, EngineSnapshot, Role
from fleetserve.router.prefix_cache import ApproxPrefixCache

__all__ = ["Endpoint", "EngineState", "Fleet"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine as discovery found it."""

    url: str
    role: Role
    compatibility_hash: str | None = None
    """From the pod's label; None for a static engine (learned from /kv_transfer)."""


@dataclass(slots=True)
class EngineState:
    """Mutable per-engine state (owned by `Fleet`)."""

    url: str
    role: Role
    compatibility_hash: str | None
    learn_identity: bool
    breaker: CircuitBreaker
    load: EngineLoad
    in_flight: int = 0
    scraped: bool = False
    model: str | None = None
    """The first model id its /v1/models lists (what the readiness generation asks for)."""
    adapters: frozenset[str] = frozenset()
    """The LoRA adapters its /v1/models lists (ids with a `parent`), refreshed every scrape:
    adapters are loaded and unloaded at run time."""
    problem: str | None = None
    """The last scrape failure, logged once as a warning until it changes or clears."""


class Fleet:
    """The engines, their breakers and the prefix cache (see the module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.engines: dict[str, EngineState] = {}
        self.prefixes = ApproxPrefixCache(config.prefix_cache_blocks)
        self._pairs: dict[tuple[str, str], CircuitBreaker] = {}
        self._sources: dict[str, set[str]] = {}
        self._joined: set[str] = set()
        """Engines that joined since the scraper last looked: it scrapes them at once."""
        self._wake = asyncio.Event()
        """Set when an engine joins, to wake the scraper before its next tick."""
        self._changed = asyncio.Event()
        """Set (and replaced by a fresh one) whenever which engines are usable may have changed."""

    # -- membership -------------------------------------------------------------------------

    def update(self, source: str, endpoints: Iterable[Endpoint]) -> None:
        """Replace the endpoints that `source` (a static list or a pod selector) provides."""
        new = {e.url: e for e in endpoints}
        for url in self._sources.get(source, set()) - set(new):
            self._remove(url)
        for url, endpoint in new.items():
            known = self.engines.get(url)
            if (
                known is not None
                and known.role == endpoint.role
                and (
                    known.learn_identity or known.compatibility_hash == endpoint.compatibility_hash
                )
            ):
                continue
            if known is not None:
                self._remove(url)
            learn = endpoint.role != "unified" and endpoint.compatibility_hash is None
            self.engines[url] = EngineState(
                url=url,
                role=endpoint.role,
                compatibility_hash=endpoint.compatibility_hash,
                learn_identity=learn,
                breaker=self._breaker(),
                load=EngineLoad(),
            )
            logger.info("engine %s (%s) joined", url, endpoint.role)
            self._joined.add(url)
            self._wake.set()
        self._sources[source] = set(new)
        self._export_engine_counts()
        self._notify()

    def _remove(self, url: str) -> None:
        if self.engines.pop(url, None) is not None:
            logger.info("engine %s left", url)
        self.prefixes.forget(url)
        for pair in [p for p in self._pairs if url in p]:
            del self._pairs[pair]

    def _breaker(self) -> CircuitBreaker:
        return CircuitBreaker(
            self.config.breaker_failures, self.config.breaker_cooldown_s, clock=self.clock
        )

    # -- what the policy sees ---------------------------------------------------------------

    def usable(self, engine: EngineState) -> bool:
        """Scraped once, identity known (unless unified) and its breaker lets a request by."""
        return (
            engine.scraped
            and (engine.role == "unified" or engine.compatibility_hash is not None)
            and engine.breaker.available()
        )

    def joining(self, roles: Collection[Role], exclude: Collection[str] = ()) -> bool:
        """Whether an engine of `roles` (and not in `exclude`) was discovered but has not answered
        its first scrape yet: it may become usable in a moment (a misconfigured one never does,
        which is why every wait for one is bounded by its caller)."""
        return any(
            e.role in roles and not e.scraped and e.url not in exclude
            for e in self.engines.values()
        )

    async def wait_for_change(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a change that may make an engine usable or unusable (one
        joined or left, answered its first scrape, or its breaker changed state). True if one
        happened, False if the time ran out. Wakes every waiter at once."""
        if timeout_s <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _notify(self) -> None:
        # NOTE: a fresh event per change (set, then replaced): every waiter of this change wakes,
        # and a later waiter waits for the next one instead of finding a stale set event.
        self._changed.set()
        self._changed = asyncio.Event()

    def snapshots(self) -> list[EngineSnapshot]:
        return [
            EngineSnapshot(
                url=e.url,
                role=e.role,
                compatibility_hash=e.compatibility_hash,
                load=e.load,
                available=self.usable(e),
                in_flight=e.in_flight,
                adapters=e.adapters,
            )
            for e in self.engines.values()
        ]

    def open_pairs(self) -> set[tuple[str, str]]:
        """(prefill, decode) pairs whose breaker does not let a request by now."""
        return {pair for pair, b in self._pairs.items() if not b.available()}

    def pair_breaker(self, prefill: str, decode: str) -> CircuitBreaker:
        breaker = self._pairs.get((prefill, decode))
        if breaker is None:
            breaker = self._pairs[(prefill, decode)] = self._breaker()
        return breaker

    # -- request accounting -----------------------------------------------------------------

    def begin(self, url: str) -> bool:
        """Take `url`'s breaker permission (the half-open trial slot, if that is the state)
        and count one request in flight; False if the engine is gone or its breaker is open."""
        engine = self.engines.get(url)
        if engine is None or not engine.breaker.acquire():
            return False
        engine.in_flight += 1
        return True

    def end(self, url: str, outcome: bool | None) -> None:
        """The request `begin` counted ended: True succeeded, False failed (5xx, timeout,
        connection error: the breaker counts it), None neither (client error, 429, the client
        went away)."""
        engine = self.engines.get(url)
        if engine is None:
            return
        engine.in_flight = max(0, engine.in_flight - 1)
        self._outcome(engine.breaker, outcome, engine.role)

    def end_pair(self, prefill: str, decode: str, outcome: bool | None) -> None:
        """The outcome of one disaggregated request for its pair's breaker."""
        if prefill in self.engines and decode in self.engines:
            self._outcome(self.pair_breaker(prefill, decode), outcome, "pair")

    def _outcome(self, breaker: CircuitBreaker, outcome: bool | None, target: str) -> None:
        before = breaker.state
        if outcome is True:
            breaker.record_success()
        elif outcome is False:
            if breaker.record_failure():
                self.metrics.ejections.labels(target).inc()
                logger.warning("circuit opened for a %s", target)
        else:
            breaker.release()
        # NOTE: only a breaker that changed state can change the usable-engine counts; exporting
        # them on every request cost more than the rest of the accounting (the scraper also
        # exports them each interval, which covers an open breaker's cooldown ending).
        if breaker.state != before:
            self._export_engine_counts()
            self._notify()

    def _export_engine_counts(self) -> None:
        counts: dict[tuple[str, str], int] = {
            (role, flag): 0 for role in ("prefill", "decode", "unified") for flag in ("1", "0")
        }
        for e in self.engines.values():
            counts[(e.role, "1" if self.usable(e) else "0")] += 1
        for (role, flag), n in counts.items():
            self.metrics.engines.labels(role, flag).set(n)

    # -- scraping ---------------------------------------------------------------------------

    async def run_scraper(self, session: aiohttp.ClientSession) -> None:
        """Scrape every engine each `scrape_interval_s` until cancelled, and an engine that joins
        at once (see the module docstring). Each engine's scrape runs on its own, so a stalled
        engine (its scrape waiting for the timeout) delays no other engine's; an engine is not
        scraped again while its last scrape runs."""
        loop = asyncio.get_running_loop()
        running: dict[str, asyncio.Task[None]] = {}
        next_tick = loop.time()
        self._wake = asyncio.Event()  # this loop's (an asyncio.Event binds to its first loop)
        try:
            while True:
                for url in [u for u, t in running.items() if t.done()]:
                    del running[url]
                tick = loop.time() >= next_tick
                for engine in list(self.engines.values()):
                    due = tick or engine.url in self._joined
                    if due and engine.url not in running:
                        running[engine.url] = asyncio.create_task(self._scrape(session, engine))
                self._joined.clear()
                if tick:
                    self._export_engine_counts()
                    next_tick = loop.time() + self.config.scrape_interval_s
                # NOTE: cleared here, with no await since the joined engines were taken above,
                # so a join can neither be missed nor wake the loop twice.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, next_tick - loop.time()))
        finally:
            for task in running.values():
                task.cancel()

    async def _scrape(self, session: aiohttp.ClientSession, engine: EngineState) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout_s)
        try:
            async with session.get(f"{engine.url}/metrics", timeout=timeout) as response:
                if response.status != 200:
                    raise ValueError(f"GET /metrics answered {response.status}")
                load = parse_engine_load(await response.text())
            if engine.learn_identity and engine.compatibility_hash is None:
                await self._learn_identity(session, engine, timeout)
            listed = await self._list_models(session, engine, timeout)
            if listed is not None:
                engine.model, engine.adapters = listed
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if self.engines.get(engine.url) is engine:
                # NOTE: a misconfigured engine (no connector, the wrong KV role) never becomes
                # usable; say so once, not at every scrape, and not silently.
                if str(exc) != engine.problem:
                    engine.problem = str(exc) or type(exc).__name__
                    logger.warning("engine %s is not usable yet: %s", engine.url, engine.problem)
                if engine.scraped or engine.breaker.state != "closed":
                    self._outcome(engine.breaker, False, engine.role)
            return
        engine.load = load
        first = not engine.scraped
        engine.scraped = True
        if first and self.engines.get(engine.url) is engine:
            logger.info("engine %s (%s) answered its first scrape", engine.url, engine.role)
            self._export_engine_counts()
            self._notify()
        if engine.problem is not None:
            logger.info("engine %s answers its scrapes again", engine.url)
            engine.problem = None

    async def _learn_identity(
        self, session: aiohttp.ClientSession, engine: EngineState, timeout: aiohttp.ClientTimeout
    ) -> None:
        async with session.get(f"{engine.url}/kv_transfer", timeout=timeout) as response:
            if response.status == 404:
                raise ValueError(f"{engine.url} has no KV connector but was given as {engine.role}")
            if response.status != 200:
                raise ValueError(f"GET /kv_transfer answered {response.status}")
            identity = await response.json()
        role = identity.get("role")
        expected = "producer" if engine.role == "prefill" else "consumer"
        if role not in (expected, "both"):
            raise ValueError(f"{engine.url} is a KV {role}, but was given as {engine.role}")
        compat = identity.get("compatibility_hash")
        if not isinstance(compat, str) or not compat:
            raise ValueError(f"{engine.url}'s /kv_transfer names no compatibility_hash")
        engine.compatibility_hash = compat

    def adapter_of(self, model: object) -> str | None:
        """`model` if some engine lists it as a LoRA adapter, else None (the base model)."""
        if not isinstance(model, str):
            return None
        return model if any(model in e.adapters for e in self.engines.values()) else None

    async def _list_models(
        self, session: aiohttp.ClientSession, engine: EngineState, timeout: aiohttp.ClientTimeout
    ) -> tuple[str, frozenset[str]] | None:
        """Its first model id and its adapters, or None when /v1/models did not answer."""
        with contextlib.suppress(
            aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError
        ):
            async with session.get(
                f"{engine.url}/v1/models", timeout=timeout, headers=self.engine_headers(None)
            ) as response:
                if response.status == 200:
                    cards = (await response.json())["data"]
                    adapters = frozenset(str(c["id"]) for c in cards if c.get("parent"))
                    return str(cards[0]["id"]), adapters
        return None

    def engine_headers(self, client_authorization: str | None) -> dict[str, str]:
        """Headers for a request to an engine: the configured key, else the client's own."""
        if self.config.engine_api_key:
            return {"Authorization": f"Bearer {self.config.engine_api_key}"}
        return {"Authorization": client_authorization} if client_authorization else {}
