"""A worker process of the 'mp' executor: one rank's `Worker`, driven over two ZMQ sockets.

`python -m fleetserve.engine.worker.worker_proc --rank R --config PATH --requests ADDR
--results ADDR --init-method URL --parent-pid PID`, started by `MultiprocExecutor`.

Each request is one pickled `(call_id, method, args, kwargs)` (the executor serialises a step's
`SchedulerOutput` once and sends the same bytes to every rank); the reply is a pickled
`(rank, call_id, ok, result)`, where `result` is the error text when `ok` is False. Every rank
replies to every call except `execute_model`, where only the driver (the rank whose output the
engine uses) replies on success: the others reply only when they fail. Calls are taken one at
a time in arrival order, which is what lets pipeline stages overlap: a stage takes step N + 1
while the next stage still computes step N (see `distributed.pipeline`). The process exits on a
`None` method (shutdown), and within `PARENT_POLL_S` of its parent's death (it never outlives
the engine core).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import traceback
from typing import Any

import zmq

from fleetserve.engine.distributed.pod_group import pod_group
from fleetserve.engine.worker.cpu_malloc import tune_cpu_malloc
from fleetserve.engine.worker.cpu_threads import configure_cpu_threads
from fleetserve.engine.worker.worker import Worker
from fleetserve.envs import read_env
from fleetserve.plugins.loader import load_general_plugins

__all__ = ["PARENT_POLL_S", "main"]

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0
"""How often an idle worker checks that the executor's process still lives."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleetserve-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--driver-rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="pickled EngineConfig")
    parser.add_argument("--requests", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s worker {args.rank}: %(message)s"
    )
    load_general_plugins()  # a worker process is one of "every process" (and builds the model)
    with open(args.config, "rb") as f:
        config = pickle.load(f)
    if config.device.device == "cpu":
        # NOTE: every rank of this host would otherwise start one thread per core. In a
        # multi-pod group only this pod's ranks share its cores.
        group = pod_group(read_env(), config.parallel.world_size_across_dp)
        ranks_here = config.parallel.world_size if group is None else group.ranks_per_pod
        configure_cpu_threads(ranks_here)
        tune_cpu_malloc(read_env().cpu_malloc_tuning != 0)
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.connect(args.requests)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 1000)
    results.connect(args.results)
    worker = Worker(config, rank=args.rank, distributed_init_method=args.init_method)
    is_driver = args.rank == args.driver_rank
    try:
        while True:
            if not requests.poll(int(PARENT_POLL_S * 1000)):
                if os.getppid() != args.parent_pid:
                    logger.warning("the engine core is gone; worker exits")
                    return
                continue
            call_id, method, call_args, call_kwargs = pickle.loads(requests.recv())
            if method is None:
                return
            ok, result = _call(worker, method, call_args, call_kwargs)
            if method == "execute_model" and ok and not is_driver:
                continue
            results.send(pickle.dumps((args.rank, call_id, ok, result), protocol=5))
    finally:
        worker.shutdown()
        requests.close(linger=0)
        results.close()
        ctx.term()


def _call(worker: Worker, method: str, args: Any, kwargs: Any) -> tuple[bool, Any]:
    try:
        return True, getattr(worker, method)(*args, **kwargs)
    except Exception as exc:
        logger.error("%s failed:\n%s", method, traceback.format_exc())
        return False, f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    main()
