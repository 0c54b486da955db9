"""Simulated engines for the autoscaler's tests, traces and figures (torch-free, instant start).

A queueing model of one engine group, advanced in time steps:
  - prefill: one FCFS queue served at `prefill_tokens_per_s` (chunked prefill batches prompts,
    but its throughput in prompt tokens/s is what bounds a prefill engine); a request's TTFT is
    its wait plus its own prompt's time;
  - decode: up to `max_running` sequences, each holding its prompt and generated tokens in a
    KV cache of `kv_capacity_tokens`; one step emits a token for every running sequence and
    takes `itl_base_s + itl_per_seq_s × running` (a bigger batch is slower per token); requests
    beyond the slots or the KV wait.
It keeps the counters and gauges a real engine exports under the same names
(`EngineCounters`, and Prometheus text through `exposition`), so the autoscaler reads it as it
reads an engine; `fleetserve.operator.autoscale.sim_pod` serves one as a pod.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from fleetserve.common import metric_names as names
from fleetserve.operator.autoscale.load import EngineCounters

__all__ = ["EngineModel", "SimEngine", "SimRequest"]


@dataclass(frozen=True, slots=True)
class EngineModel:
    """What one simulated replica can do (scaled to the hardware it stands for)."""

    prefill_tokens_per_s: float = 16000.0
    max_running: int = 128
    kv_capacity_tokens: int = 1_000_000
    itl_base_s: float = 0.012
    itl_per_seq_s: float = 0.0003
    max_queue: int = 100_000
    """Requests one engine queues at most; beyond that it rejects (the caller counts them)."""

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "itl_base_s", "kv_capacity_tokens", "max_running"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineModel.{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class SimRequest:
    """One request's life across a prefill and a decode engine."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None
    done_s: float | None = None
    prefill_left: float = 0.0
    generated: float = 0.0
    itl_weighted_s: float = 0.0
    """Σ ITL × tokens while decoding: ÷ generated is the request's mean ITL."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def mean_itl_s(self) -> float | None:
        return self.itl_weighted_s / self.generated if self.generated else None


@dataclass
class SimEngine:
    """One simulated engine group of `role` ("prefill" or "decode")."""

    role: str
    model: EngineModel = field(default_factory=EngineModel)
    queue: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    prompt_tokens_total: float = 0.0
    ttft_count: float = 0.0
    ttft_sum: float = 0.0
    itl_count: float = 0.0
    itl_sum: float = 0.0
    rejected: int = 0
    backlog_tokens: float = 0.0
    """Prompt tokens queued and not yet computed (prefill; kept as requests move)."""
    eplb_balancedness: float | None = None
    """Exported as `fleetserve:eplb_balancedness` when set (an engine with EPLB; `sim_eplb`)."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"SimEngine.role must be 'prefill' or 'decode', got {self.role!r}")

    # -- load ---------------------------------------------------------------------------------

    def submit(self, request: SimRequest) -> bool:
        """Queue `request`; False (and counted as rejected) when the queue is full."""
        if len(self.queue) >= self.model.max_queue:
            self.rejected += 1
            return False
        if self.role == "prefill":
            request.prefill_left = float(request.prompt_tokens)
            self.backlog_tokens += request.prefill_left
        self.queue.append(request)
        return True

    @property
    def kv_tokens(self) -> float:
        return sum(r.prompt_tokens + r.generated for r in self.running)

    def itl_s(self, running: int | None = None) -> float:
        n = len(self.running) if running is None else running
        return self.model.itl_base_s + self.model.itl_per_seq_s * n

    # -- time ---------------------------------------------------------------------------------

    def advance(self, now: float, dt: float) -> list[SimRequest]:
        """Run from `now` for `dt` seconds; returns the requests that finished this role."""
        return self._prefill(now, dt) if self.role == "prefill" else self._decode(now, dt)

    def _prefill(self, now: float, dt: float) -> list[SimRequest]:
        budget = self.model.prefill_tokens_per_s * dt
        done: list[SimRequest] = []
        spent = 0.0
        while self.queue and budget > 0:
            head = self.queue[0]
            take = min(budget, head.prefill_left)
            head.prefill_left -= take
            budget -= take
            spent += take
            self.backlog_tokens = max(0.0, self.backlog_tokens - take)
            if head.prefill_left <= 1e-9:
                self.queue.popleft()
                head.first_token_s = now + spent / self.model.prefill_tokens_per_s
                self.prompt_tokens_total += head.prompt_tokens
                self.ttft_count += 1
                self.ttft_sum += head.first_token_s - head.arrival_s
                done.append(head)
        return done

    def _admit(self) -> None:
        cap = self.model.kv_capacity_tokens
        while self.queue and len(self.running) < self.model.max_running:
            head = self.queue[0]
            if self.kv_tokens + head.prompt_tokens + head.output_tokens > cap and self.running:
                break
            self.running.append(self.queue.popleft())

    def _decode(self, now: float, dt: float) -> list[SimRequest]:
        self._admit()
        if not self.running:
            return []
        itl = self.itl_s()
        steps = dt / itl
        done: list[SimRequest] = []
        for r in self.running:
            tokens = min(steps, r.output_tokens - r.generated)
            r.generated += tokens
            r.itl_weighted_s += tokens * itl
            self.itl_count += tokens
            self.itl_sum += tokens * itl
            if r.generated >= r.output_tokens - 1e-9:
                r.done_s = now + dt
                done.append(r)
        self.running = [r for r in self.running if r.done_s is None]
        self._admit()
        return done

    # -- what it reports ----------------------------------------------------------------------

    def counters(self, now: float) -> EngineCounters:
        """The engine's metrics now, as the autoscaler parses them from `/metrics`."""
        waiting = len(self.queue)
        return EngineCounters(
            time_s=now,
            prompt_tokens=self.prompt_tokens_total,
            ttft_count=self.ttft_count,
            ttft_sum=self.ttft_sum,
            itl_count=self.itl_count,
            itl_sum=self.itl_sum,
            prompt_tokens_waiting=self.backlog_tokens,
            requests_waiting=waiting,
            requests_running=len(self.running),
            kv_usage=min(1.0, self.kv_tokens / self.model.kv_capacity_tokens),
        )

    def exposition(self, now: float, model_name: str = "sim") -> bytes:
        """Prometheus text under the engines' metric names (the subset the autoscaler reads)."""
        c = self.counters(now)
        registry = CollectorRegistry()
        label = {names.MODEL_NAME_LABEL: model_name}

        def gauge(spec: names.MetricSpec, value: float) -> None:
            Gauge(
                spec.name, spec.documentation, [names.MODEL_NAME_LABEL], registry=registry
            ).labels(**label).set(value)

        def counter(spec: names.MetricSpec, value: float) -> None:
            Counter(
                spec.name, spec.documentation, [names.MODEL_NAME_LABEL], registry=registry
            ).labels(**label).inc(value)

        gauge(names.NUM_REQUESTS_RUNNING, c.requests_running)
        gauge(names.NUM_REQUESTS_WAITING, c.requests_waiting)
        gauge(names.PROMPT_TOKENS_WAITING, c.prompt_tokens_waiting)
        gauge(names.KV_CACHE_USAGE, c.kv_usage)
        counter(names.PROMPT_TOKENS, c.prompt_tokens)
        if self.eplb_balancedness is not None:
            gauge(names.EPLB_BALANCEDNESS, self.eplb_balancedness)
        text = generate_latest(registry).decode()
        # NOTE: prometheus_client cannot set a histogram's sum and count directly; the autoscaler
        # reads only those two, so they are written as the exposition format spells them.
        for spec, count, total in (
            (names.TIME_TO_FIRST_TOKEN, c.ttft_count, c.ttft_sum),
            (names.INTER_TOKEN_LATENCY, c.itl_count, c.itl_sum),
        ):
            text += (
                f"# HELP {spec.name} {spec.documentation}\n# TYPE {spec.name} histogram\n"
                f'{spec.name}_bucket{{le="+Inf",model_name="{model_name}"}} {count}\n'
                f'{spec.name}_count{{model_name="{model_name}"}} {count}\n'
                f'{spec.name}_sum{{model_name="{model_name}"}} {total}\n'
            )
        return text.encode()
