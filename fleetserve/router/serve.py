"""Serving the router app until it is told to stop, and stopping without cutting a request.

A router pod that is replaced (an image roll, a scale-in) gets SIGTERM while clients still
stream through it. Stopping is therefore in three steps:

1. unready: `/health` answers 503 at once, but the listener stays open and every request is
   still served for `shutdown_delay_s`, so that the Service's endpoints drop the pod before it
   stops accepting (a client that resolved it a moment ago is not refused);
2. closed: the listener closes; requests in flight run on for up to `shutdown_grace_s`;
3. cut: whatever still runs after that is cancelled, and `serve` returns.

The pod's `terminationGracePeriodSeconds` must exceed the two (the operator renders it so).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from fleetserve.router.app import STATE_KEY

__all__ = ["serve", "serve_until_signalled"]

logger = logging.getLogger("fleetserve.router")


async def serve(app: web.Application, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve `app` on host:port until `stop` is set, then stop as the module docstring says.
    The app's config gives the two shutdown durations."""
    config = app[STATE_KEY].config
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=config.shutdown_grace_s
    )
    await runner.setup()
    in_flight = 0
    try:
        await web.TCPSite(runner, host, port).start()
        await stop.wait()
        app[STATE_KEY].terminating = True
        logger.info("stopping: unready now, still serving for %.1f s", config.shutdown_delay_s)
        await asyncio.sleep(config.shutdown_delay_s)
        in_flight = app[STATE_KEY].admission.in_flight
        logger.info("stopping: listener closed; up to %.1f s for the %d request(s) in flight",
                    config.shutdown_grace_s, in_flight)  # fmt: skip
    finally:
        started = time.monotonic()
        await runner.cleanup()
    if in_flight and time.monotonic() - started >= config.shutdown_grace_s:
        logger.warning("stopped: the grace of %.1f s ran out; what still ran was cut",
                       config.shutdown_grace_s)  # fmt: skip
    else:
        logger.info("stopped")


def serve_until_signalled(app: web.Application, host: str, port: int) -> None:
    """`serve` in a new event loop until SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(app, host, port, stop)

    asyncio.run(main())
