"""The pure routing policy and the approximate prefix cache, without HTTP."""

from __future__ import annotations

import random

import pytest

from fleetserve.common.block_hash import hash_token_blocks
from fleetserve.router.breaker import CircuitBreaker
from fleetserve.router.policy import (
    EngineLoad,
    EngineSnapshot,
    NoEngineAvailable,
    RoutingPolicy,
    RoutingRequest,
)
from fleetserve.router.prefix_cache import ApproxPrefixCache

BLOCK = 16
H = "compat-a"


def _policy(**kwargs: object) -> RoutingPolicy:
    args: dict = {"mode": "always", "min_uncached_tokens": 64, "block_size": BLOCK, **kwargs}
    return RoutingPolicy(**args)


def _engine(url: str, role: str = "decode", **kwargs: object) -> EngineSnapshot:
    args: dict = {"compatibility_hash": H, **kwargs}
    return EngineSnapshot(url, role, **args)  # type: ignore[arg-type]


def _request(tokens: list[int], **kwargs: object) -> RoutingRequest:
    hashes = hash_token_blocks(tokens, BLOCK)
    return RoutingRequest(hashes, len(tokens), **kwargs)  # type: ignore[arg-type]


def _route(policy: RoutingPolicy, engines: list[EngineSnapshot], tokens: list[int],
           cache: ApproxPrefixCache, **kwargs: object) -> tuple[str, str | None, str, str]:  # fmt: skip
    """One decision, recorded in `cache` the way the router records it."""
    request = _request(tokens, **kwargs)
    d = policy.decide(engines, request, cache)
    cache.record(d.decode_url, request.block_hashes)
    if d.prefill_url:
        cache.record(d.prefill_url, request.block_hashes)
    return d.decode_url, d.prefill_url, d.kind, d.reason


def test_repeats_of_a_long_prefix_go_to_the_same_decode_engine() -> None:
    rng = random.Random(0)
    engines = [_engine(f"http://d{i}:1") for i in range(4)] + [_engine("http://p:1", "prefill")]
    policy, cache = _policy(), ApproxPrefixCache(1000)
    prefixes = [[rng.randrange(1000) for _ in range(200)] for _ in range(3)]
    first: dict[int, str] = {}
    for round_ in range(5):
        for k, prefix in enumerate(prefixes):
            tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            decode, _, _, _ = _route(policy, engines, prefix + tail, cache)
            if round_ == 0:
                first[k] = decode
            assert decode == first[k], f"prefix {k} moved in round {round_}"
    # Without prefix-awareness the same traffic spreads round-robin.
    spread = {_route(_policy(prefix_aware=False), engines, prefixes[0], cache)[0]}
    blind = _policy(prefix_aware=False)
    spread |= {_route(blind, engines, prefixes[0], cache)[0] for _ in range(4)}
    assert len(spread) > 1


def test_a_shared_system_prompt_does_not_keep_a_scaled_out_engine_idle() -> None:
    # Chats that share only their template's system prompt (half their blocks) must reach a
    # decode engine that just joined, as soon as the first one has more work; a long shared
    # prefix stays with its engine against a small load difference, not against a heavy one.
    system = list(range(100, 132))  # 2 blocks every chat starts with
    old, new = _engine("http://d0:1", in_flight=1), _engine("http://d1:1")
    policy, cache = _policy(mode="never"), ApproxPrefixCache(1000)
    cache.record(old.url, hash_token_blocks(system + list(range(500, 532)), BLOCK))
    chat = system + list(range(600, 632))  # 4 blocks, the first 2 known on d0
    assert policy.decide([old, new], _request(chat), cache).decode_url == new.url
    long_hit = system + list(range(500, 532)) + list(range(700, 716))  # 4 of 5 blocks on d0
    assert policy.decide([old, new], _request(long_hit), cache).decode_url == old.url
    heavy = _engine("http://d0:1", load=EngineLoad(waiting=6, running=8, kv_usage=0.6))
    assert policy.decide([heavy, new], _request(long_hit), cache).decode_url == new.url
    # Equally loaded, the half hit decides.
    assert policy.decide([_engine("http://d0:1"), new], _request(chat), cache).decode_url == old.url


def test_the_prefix_match_equals_the_engines_hashing_and_stops_at_the_first_miss() -> None:
    cache = ApproxPrefixCache(100)
    tokens = list(range(100))
    cache.record("d", hash_token_blocks(tokens[:64], BLOCK))  # 4 blocks
    assert cache.match("d", hash_token_blocks(tokens, BLOCK)) == 4
    other = [*tokens[:20], 7, *tokens[21:]]  # differs in block 1: only block 0 matches
    assert cache.match("d", hash_token_blocks(other, BLOCK)) == 1
    assert cache.match("d", hash_token_blocks(tokens, BLOCK, cache_salt="x")) == 0


def test_the_prefix_cache_is_bounded_per_engine() -> None:
    cache = ApproxPrefixCache(8)
    tokens = list(range(16 * 20))
    cache.record("d", hash_token_blocks(tokens, BLOCK))
    assert cache.size("d") == 8
    assert cache.match("d", hash_token_blocks(tokens, BLOCK)) == 0  # the oldest went first
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ApproxPrefixCache(0)


def test_a_burst_between_two_scrapes_is_not_saturation() -> None:
    # 64 requests just sent to an idle engine: none seen running yet, but the engine runs them;
    # only its own reported queue (or a full KV cache) saturates it.
    policy, cache = _policy(mode="never"), ApproxPrefixCache(100)
    burst = _engine("http://d:1", in_flight=64)
    assert _route(policy, [burst], [1, 2, 3], cache)[0] == burst.url
    queued = _engine("http://d:1", in_flight=64, load=EngineLoad(waiting=32, running=32))
    with pytest.raises(NoEngineAvailable, match="saturated"):
        policy.decide([queued], _request([1, 2, 3]), cache)


def test_load_awareness_avoids_a_busy_and_a_saturated_engine() -> None:
    policy, cache = _policy(mode="never"), ApproxPrefixCache(100)
    busy = _engine("http://busy:1", load=EngineLoad(waiting=10, running=8, kv_usage=0.7))
    idle = _engine("http://idle:1", load=EngineLoad(waiting=0, running=1, kv_usage=0.1))
    picks = {_route(policy, [busy, idle], [1, 2, 3], cache)[0] for _ in range(6)}
    assert picks == {"http://idle:1"}
    # A saturated engine is avoided even when it holds the whole prefix.
    tokens = list(range(160))
    cache.record("http://full:1", hash_token_blocks(tokens, BLOCK))
    full = _engine("http://full:1", load=EngineLoad(waiting=32, running=8))
    assert _route(policy, [full, busy], tokens, cache)[0] == "http://busy:1"
    kv_full = _engine("http://full:1", load=EngineLoad(kv_usage=0.99))
    assert _route(policy, [kv_full, busy], tokens, cache)[0] == "http://busy:1"
    # But a moderately loaded engine with the whole prefix beats an idle one without it.
    warm = _engine("http://full:1", load=EngineLoad(waiting=1, running=4, kv_usage=0.3))
    assert _route(policy, [warm, idle], tokens, cache)[0] == "http://full:1"
    # All saturated: the policy says so (the router answers 429).
    with pytest.raises(NoEngineAvailable) as info:
        policy.decide([full, kv_full], _request(tokens), cache)
    assert info.value.saturated


def test_without_load_awareness_load_is_ignored_but_saturation_is_not() -> None:
    policy, cache = _policy(mode="never", load_aware=False), ApproxPrefixCache(100)
    busy = _engine("http://busy:1", load=EngineLoad(waiting=10, running=8))
    idle = _engine("http://idle:1")
    assert {_route(policy, [busy, idle], [1], cache)[0] for _ in range(4)} == {
        "http://busy:1",
        "http://idle:1",
    }


def test_selective_skips_remote_prefill_for_short_and_cached_prompts() -> None:
    policy, cache = _policy(mode="selective", min_uncached_tokens=64), ApproxPrefixCache(1000)
    engines = [_engine("http://d:1"), _engine("http://p:1", "prefill")]
    short = list(range(40))
    assert _route(policy, engines, short, cache)[1:] == (None, "decode_only", "short_prompt")
    long = list(range(300))
    assert _route(policy, engines, long, cache)[1:] == ("http://p:1", "disaggregated", "selective")
    # The same long prompt again, or with a short new tail: cached on the decode engine.
    assert _route(policy, engines, long, cache)[1:] == (None, "decode_only", "prefix_cached")
    assert _route(policy, engines, long + list(range(30)), cache)[2:] == (
        "decode_only",
        "prefix_cached",
    )
    # A long new tail is worth a remote prefill again.
    assert _route(policy, engines, long + list(range(500, 600)), cache)[2] == "disaggregated"
    # The threshold is "uncached tokens", so min 0 always prefills remotely.
    zero = _policy(mode="selective", min_uncached_tokens=0)
    assert _route(zero, engines, long, cache)[2] == "disaggregated"


def test_always_and_never() -> None:
    cache = ApproxPrefixCache(100)
    engines = [_engine("http://d:1"), _engine("http://p:1", "prefill")]
    assert _route(_policy(mode="always"), engines, [1], cache)[1:3] == (
        "http://p:1",
        "disaggregated",
    )
    assert _route(_policy(mode="never"), engines, list(range(999)), cache)[1:] == (
        None, "decode_only", "mode_never",
    )  # fmt: skip
    batch = _request([1, 2], disaggregable=False)
    assert _policy().decide(engines, batch, cache).reason == "batch"
    unified = [_engine("http://u:1", "unified", compatibility_hash=None)]
    d = _policy().decide(unified, _request([1]), cache)
    assert (d.decode_url, d.prefill_url, d.kind) == ("http://u:1", None, "colocated")


def test_mismatched_hashes_are_never_paired() -> None:
    policy, cache = _policy(), ApproxPrefixCache(100)
    engines = [
        _engine("http://d1:1", compatibility_hash="A"),
        _engine("http://d2:1", compatibility_hash="B"),
        _engine("http://pa:1", "prefill", compatibility_hash="A"),
        _engine("http://pb:1", "prefill", compatibility_hash="B"),
        _engine("http://pn:1", "prefill", compatibility_hash=None),
    ]
    pairs = {_route(policy, engines, [i] * 50, cache)[:2] for i in range(20)}
    assert pairs == {("http://d1:1", "http://pa:1"), ("http://d2:1", "http://pb:1")}
    lonely = [engines[0], engines[3], engines[4]]
    assert _route(policy, lonely, [1] * 50, cache)[1:] == (
        None, "decode_only", "no_compatible_prefill",
    )  # fmt: skip
    unknown = [_engine("http://d:1", compatibility_hash=None), engines[4]]
    assert _route(policy, unknown, [1] * 50, cache)[1] is None


def test_breakers_and_exclusions_are_respected() -> None:
    policy, cache = _policy(), ApproxPrefixCache(100)
    clock = [0.0]
    breakers = {u: CircuitBreaker(2, 5.0, clock=lambda: clock[0]) for u in ("d1", "d2", "p1", "p2")}

    def fleet() -> list[EngineSnapshot]:
        return [
            _engine(u, "prefill" if u.startswith("p") else "decode", available=b.available())
            for u, b in breakers.items()
        ]

    for _ in range(2):
        breakers["d1"].record_failure()
        breakers["p1"].record_failure()
    assert breakers["d1"].state == "open"
    for i in range(6):
        assert _route(policy, fleet(), [i] * 20, cache)[:2] == ("d2", "p2")
    for _ in range(2):
        breakers["p2"].record_failure()
    assert _route(policy, fleet(), [9] * 20, cache)[1:] == (
        None, "decode_only", "prefill_unavailable",
    )  # fmt: skip
    # Per-request exclusions (what a retry passes): a failed pair, a failed engine.
    clock[0] = 10.0  # all half-open: available again for a trial
    d = policy.decide(fleet(), _request([1] * 20, exclude_decode={"d2"},
                                       exclude_pairs={("p1", "d1")}), cache)  # fmt: skip
    assert (d.decode_url, d.prefill_url) == ("d1", "p2")
    with pytest.raises(NoEngineAvailable) as info:
        policy.decide(fleet(), _request([1], exclude_decode={"d1", "d2"}), cache)
    assert not info.value.saturated


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        _policy(mode="sometimes")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        _policy(block_size=0)
    with pytest.raises(ValueError, match="min_uncached_tokens must be >= 0"):
        _policy(min_uncached_tokens=-1)


def test_noise_in_the_load_is_a_tie_but_one_request_is_not() -> None:
    # An idle engine that still holds two KV blocks (a transfer's, after a stall) must not read
    # as "most loaded" next to an idle one: that starved it of its half-open trial forever.
    # One request's worth of load still decides.
    policy, cache = _policy(prefix_aware=False), ApproxPrefixCache(100)
    holding = _engine("http://d0:1", load=EngineLoad(0, 0, 2 / 4097))
    idle = _engine("http://d1:1")
    chosen = {_route(policy, [holding, idle], list(range(40)), cache)[0] for _ in range(4)}
    assert chosen == {"http://d0:1", "http://d1:1"}
    busy = _engine("http://d0:1", load=EngineLoad(0, 1, 0.01))
    chosen = {_route(policy, [busy, idle], list(range(40)), cache)[0] for _ in range(4)}
    assert chosen == {"http://d1:1"}
