"""Lockstep data parallel (issue 16): a tiny Qwen2-MoE (shared expert, a dense layer between
MoE ones) with DP=2, TP=1 and expert parallelism (EP=2 over the DP ranks: each rank holds half
the experts, and every MoE layer gathers both ranks' tokens and combines the outputs; without
the data-parallel dispatch `FusedMoE` refuses EP over DP). Requests on one rank only and on both
give DP=1's greedy tokens, the idle rank runs dummy forwards (else its peer would hang in the
collectives), both ranks end the same waves, and a rank's death ends the engine cleanly.

One DPAsyncLLM for the module, on an event loop in a background thread; the death test is last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry

from fleetserve import LLM, SamplingParams
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.dp_async_llm import DPAsyncLLM
from fleetserve.engine.engine_client import EngineDeadError
from fleetserve.engine.request_output import RequestOutput
from tests.engine.tiny_models import make_tiny_moe_model

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 41], [100, 7, 3, 8, 9]]
PARAMS = SamplingParams(temperature=0, max_tokens=8)
T = TypeVar("T")


class _BackgroundLoop:
    """An event loop in its own thread, so one engine serves every test of the module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe"), "qwen2_moe")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[tuple[DPAsyncLLM, _BackgroundLoop]]:
    config = EngineConfig.create(
        str(model_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
        data_parallel_size=2, enable_expert_parallel=True,
    )  # fmt: skip
    assert config.parallel.needs_dp_lockstep
    background = _BackgroundLoop()

    async def start() -> DPAsyncLLM:
        llm = DPAsyncLLM(config, registry=CollectorRegistry(), model_name="tiny",
                         max_waiting_requests=64)  # fmt: skip
        try:
            await llm.start(300)
        except BaseException:
            await llm.shutdown()
            raise
        return llm

    llm = background.run(start(), timeout_s=300)
    try:
        yield llm, background
    finally:
        background.run(llm.shutdown(), timeout_s=60)
        background.close()


async def _tokens(stream: AsyncIterator[RequestOutput]) -> list[int]:
    tokens: list[int] = []
    async for output in stream:
        tokens += output.outputs[0].token_ids
    return tokens


async def _idle(llm: DPAsyncLLM, timeout_s: float = 10.0) -> None:
    """Wait until every rank reported the current wave finished."""
    deadline = time.monotonic() + timeout_s
    while llm.waves.running or len(set(llm.waves_completed)) != 1:
        assert time.monotonic() < deadline, (
            f"the ranks did not end their wave: {llm.waves_completed}"
        )
        await asyncio.sleep(0.02)


def test_requests_on_one_rank_and_on_both_equal_dp1(
    engine: tuple[DPAsyncLLM, _BackgroundLoop], reference: list[list[int]]
) -> None:
    llm, background = engine

    async def scenario() -> dict[str, Any]:
        assert llm.lockstep
        dummies_before = list(llm.dummy_steps)
        alone = await _tokens(llm.generate("alone", PROMPTS[0], PARAMS))
        await _idle(llm)
        dummies_alone = [a - b for a, b in zip(llm.dummy_steps, dummies_before, strict=True)]
        both = await asyncio.gather(
            *(_tokens(llm.generate(f"both-{i}", p, PARAMS)) for i, p in enumerate(PROMPTS))
        )
        await _idle(llm)
        # Straight to rank 1's client: no wave was started for it, so its core asks for one.
        dummies_before = list(llm.dummy_steps)
        direct = await _tokens(llm.ranks[1].generate("direct", PROMPTS[1], PARAMS))
        await _idle(llm)
        dummies_direct = [a - b for a, b in zip(llm.dummy_steps, dummies_before, strict=True)]
        return {"alone": alone, "dummies_alone": dummies_alone, "both": both,
                "direct": direct, "dummies_direct": dummies_direct}  # fmt: skip

    result = background.run(scenario())
    assert result["alone"] == reference[0]
    # One rank had the request; the other ran a dummy forward for each of its steps.
    assert sorted(result["dummies_alone"])[0] == 0 and max(result["dummies_alone"]) >= 8
    assert result["both"] == reference
    assert result["direct"] == reference[1]
    assert result["dummies_direct"][1] == 0 and result["dummies_direct"][0] >= 8


def test_both_ranks_end_every_wave_together_when_idle(
    engine: tuple[DPAsyncLLM, _BackgroundLoop],
) -> None:
    llm, background = engine

    async def scenario() -> tuple[list[int], list[int]]:
        # One wave of its own, so the test does not lean on the one before it in the module;
        # each rank's end-of-wave report may come a little after the request's last token.
        started = list(llm.waves_completed)
        await _tokens(llm.generate("one-wave", PROMPTS[0], PARAMS))
        deadline = time.monotonic() + 10.0
        while min(llm.waves_completed) <= max(started) or len(set(llm.waves_completed)) != 1:
            assert time.monotonic() < deadline, f"no common wave end: {llm.waves_completed}"
            await asyncio.sleep(0.02)
        await _idle(llm)
        before = list(llm.waves_completed)
        await asyncio.sleep(1.0)  # idle: no wave starts, nobody steps
        return before, list(llm.waves_completed)

    before, after = background.run(scenario())
    assert before == after and before[0] == before[1] >= 1
    assert not llm.waves.running and llm.is_healthy


def _exited(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def test_a_dead_rank_ends_the_lockstep_engine_cleanly(
    engine: tuple[DPAsyncLLM, _BackgroundLoop],
) -> None:
    llm, background = engine
    long_params = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)

    async def scenario() -> tuple[BaseException | None, float]:
        stream = llm.generate("long", PROMPTS[0], long_params)
        await anext(stream)  # under way on one rank; the other runs dummy forwards
        rank = llm.rank_of("long")
        assert rank is not None
        killed_at = time.monotonic()
        pid = llm.ranks[1 - rank].core_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        error: BaseException | None = None
        try:
            await asyncio.wait_for(_tokens(stream), 10)
        except EngineDeadError as exc:
            error = exc
        return error, time.monotonic() - killed_at

    error, after_s = background.run(scenario())
    assert isinstance(error, EngineDeadError) and "data-parallel rank" in str(error)
    assert after_s < 10
    assert not llm.is_healthy
    # The surviving core does not hang in a collective with its dead peer: it exits.
    pids = [r.core_pid for r in llm.ranks]
    deadline = time.monotonic() + 15
    while not all(pid is not None and _exited(pid) for pid in pids):
        assert time.monotonic() < deadline, "a lockstep core still runs 15 s after its peer died"
        time.sleep(0.1)
