"""`fleetserve serve` flags → ServerConfig (no engine is started), and the server's port: claimed
at start-up, before the engine loads."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import pytest
from aiohttp import ClientSession, web

from fleetserve.common.ports import free_port
from fleetserve.devcluster.processes import is_port_open
from fleetserve.server.cli import build_server_config, claim_port, register
from tests.server.server_process import REPO_ROOT


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_engine_and_server_flags_reach_the_config() -> None:
    from fleetserve.engine.models.bundled import bundled_model_path

    model = str(bundled_model_path())
    args = _parse(
        model, "--max-model-len", "256", "--block-size", "8", "--max-num-seqs", "3",
        "--no-enable-prefix-caching", "--scheduling-policy", "priority",
        "--long-prefill-token-threshold", "32", "--full-sequence-must-fit", "--served-model-name", "smol", "--api-key", "k", "--max-waiting-requests", "5",
        "--dtype", "float32", "--device", "cpu",
    )  # fmt: skip
    config = build_server_config(args)
    assert config.engine.model.max_model_len == 256
    assert config.engine.cache.block_size == 8
    assert not config.engine.cache.enable_prefix_caching
    assert config.engine.scheduler.max_num_seqs == 3
    assert config.engine.scheduler.policy == "priority"
    assert config.engine.scheduler.long_prefill_token_threshold == 32
    assert config.engine.scheduler.full_sequence_must_fit
    assert config.engine.kv_transfer is None
    assert (config.served_model_name, config.api_key, config.max_waiting_requests) == (
        "smol", "k", 5,
    )  # fmt: skip


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        _parse("m", "--kv-transfer-config", "[1, 2]")
    with pytest.raises(SystemExit):
        _parse("m", "--dtype", "int4")
    args = _parse("/nonexistent/model")
    with pytest.raises(ValueError, match="model must be a Hugging Face model folder"):
        build_server_config(args)


def test_unimplemented_flags_are_refused_by_name() -> None:
    from fleetserve.engine.models.bundled import bundled_model_path

    model = str(bundled_model_path())
    for flags, name in (
        (["--enable-expert-parallel"], "enable_expert_parallel"),
        (["--data-parallel-size", "2", "--pipeline-parallel-size", "2"], "data_parallel_size"),
    ):
        with pytest.raises(ValueError, match=rf"^{name}=.*not implement"):
            build_server_config(_parse(model, *flags))


def test_the_port_is_claimed_at_once_and_served_once_the_app_runs() -> None:
    sock = claim_port("127.0.0.1", free_port())
    port = sock.getsockname()[1]
    with socket.socket() as rival, pytest.raises(OSError):
        rival.bind(("127.0.0.1", port))  # claimed: nothing else binds it while the engine loads
    assert not is_port_open(port)  # not listening yet: a client is refused, not left in the backlog

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def serve_and_ask() -> str:
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, sock).start()  # what web.run_app(sock=...) does
        try:
            async with (
                ClientSession() as client,
                client.get(f"http://127.0.0.1:{port}/health") as response,
            ):
                return await response.text()
        finally:
            await runner.cleanup()

    assert asyncio.run(serve_and_ask()) == "ok"


def test_a_port_in_use_fails_before_the_engine_starts() -> None:
    from fleetserve.engine.models.bundled import bundled_model_path

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "fleetserve.server", str(bundled_model_path()), "--port",
             str(port), "--dtype", "float32"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"error: --host/--port 127.0.0.1:{port} cannot be bound (Address already in use)" in (
        done.stderr
    )
    assert "engine core" not in done.stderr, "the engine started before the port was claimed"
    assert time.monotonic() - started < 60


def test_a_host_that_does_not_resolve_is_named() -> None:
    with pytest.raises(ValueError, match=r"--host 'no-such-host\.invalid' does not resolve"):
        claim_port("no-such-host.invalid", 0)
