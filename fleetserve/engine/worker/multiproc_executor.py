"""`MultiprocExecutor` ('mp'): one worker process per rank, driven from the engine core.

Control path (seed notes part 1 §2.14): each call is pickled once and the same bytes are pushed
to every rank over its own local ZMQ socket (ipc); the results come back on one shared socket,
and for `execute_model` only the driver's does (the rank whose `ModelRunnerOutput` the engine
uses: TP rank 0 of the last pipeline stage). With more than one pipeline stage, steps may be
submitted without waiting (`execute_model_async`, up to `pipeline_parallel_size` in flight):
each rank takes its calls in order, so while the last stage computes step N the first stage
computes step N + 1, and the driver's replies come back in submission order. Tensors never
travel here: the ranks exchange them among themselves over torch.distributed
(`fleetserve.engine.distributed`).

Multi-pod groups (`fleetserve.engine.distributed.pod_group`): on the leader pod the executor
starts only the leader's ranks; the others' calls and replies travel over TCP sockets the leader
binds at its pod IP, whose ZMQ heartbeats and disconnect events make a lost pod a dead worker
(`remote_ranks`) within seconds, as a local worker's exit is.

Failure: every wait is a poll of at most `POLL_S` followed by a liveness check of every worker
process, plus an overall bound per call (a pending step's `StepFuture.result()` is such a wait);
a worker that exits, a call that outlives its bound or a non-driver rank that fails a step (the
ranks' states have diverged; under pipeline parallelism a stage before the last that fails also
leaves the later stages waiting for its tensors) raise `ExecutorDeadError`, after which the
executor kills the remaining workers and refuses every call. A driver's error in a step is
raised as `WorkerError`, so the engine's step isolation can retry its requests (every rank
samples the same logits, so they fail alike).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from typing import Any

import zmq

from fleetserve.common.ports import free_port
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.distributed.parallel_state import layout_of
from fleetserve.engine.distributed.pod_group import CONTROL_PORT, pod_group
from fleetserve.engine.distributed.remote_ranks import RemoteRanks, heartbeats
from fleetserve.engine.worker.executor import (
    Executor,
    ExecutorDeadError,
    StepFuture,
    check_worker_method,
)
from fleetserve.envs import Env, read_env

__all__ = ["MultiprocExecutor", "WorkerError", "worker_argv"]

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""Longest wait on a socket before the workers' liveness is checked again."""
START_TIMEOUT_S = 600.0
"""Bound on the set-up calls (model loading, KV allocation)."""
STEP_TIMEOUT_S = 300.0
"""Bound on one step (a worker alive but stuck, e.g. in a collective with a hung peer)."""
SHUTDOWN_GRACE_S = 5.0
"""How long workers get to exit after the shutdown message before they are killed."""
SEND_HWM = 16
"""Calls queued towards one worker before a send waits (it never waits past a death)."""


class WorkerError(RuntimeError):
    """A worker's call raised; the message is the worker's error text."""


def worker_argv(
    *, rank: int, driver_rank: int, config_path: str, requests: str, results: str, init_method: str
) -> list[str]:
    """The command line of one rank's worker process (`worker_proc`), child of this process."""
    flags = {
        "--rank": str(rank),
        "--driver-rank": str(driver_rank),
        "--config": config_path,
        "--requests": requests,
        "--results": results,
        "--init-method": init_method,
        "--parent-pid": str(os.getpid()),
    }
    argv = [sys.executable, "-m", "fleetserve.engine.worker.worker_proc"]
    return argv + [part for flag, value in flags.items() for part in (flag, value)]


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class MultiprocExecutor(Executor):
    """Spawns `world_size` worker processes (`worker_proc`) on this host and drives them."""

    def __init__(self, config: EngineConfig, env: Env | None = None) -> None:
        super().__init__(config)
        layout = layout_of(config.parallel)
        self.world_size = layout.world_size
        self.driver_rank = layout.pipeline[0][-1]
        """TP rank 0 of the last stage: it samples with every stage's work done."""
        self._last_stage_ranks = {group[-1] for group in layout.pipeline}
        """Ranks whose failure in a step leaves no other rank waiting for their tensors."""
        self._pending_steps: deque[int] = deque()
        """Call ids of the submitted steps whose result was not taken yet, oldest first."""
        self._early_replies: dict[int, tuple[bool, Any]] = {}
        """The driver's replies to pending steps that arrived while another call was awaited."""
        group = pod_group(read_env() if env is None else env, self.world_size)
        if group is not None and not group.is_leader:
            raise ValueError(
                f"pod {group.pod_index} of a multi-pod group runs workers only; only pod 0 "
                "runs the executor (fleetserve.engine.distributed.follower)"
            )
        self.group = group
        """The multi-pod group this leader drives (None: every rank runs on this host)."""
        local = list(range(self.world_size) if group is None else group.local_ranks)
        self._dead_reason: str | None = None
        self._call_id = 0
        self._failed_step_calls: set[int] = set()
        self._dir = tempfile.mkdtemp(prefix="fleetserve-workers-")
        self._ctx = zmq.Context()
        self._results = self._ctx.socket(zmq.PULL)
        self._results.bind(f"ipc://{self._dir}/results")
        self._requests: list[zmq.Socket[bytes]] = []
        self._remote: RemoteRanks | None = None
        if group is not None:
            heartbeats(self._results)
            self._results.bind(group.bind_endpoint(CONTROL_PORT))
        for rank in range(self.world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            if rank in local:
                sock.bind(f"ipc://{self._dir}/rank{rank}")
            else:
                assert group is not None
                heartbeats(sock)
                sock.bind(group.bind_endpoint(CONTROL_PORT + 1 + rank))
            self._requests.append(sock)
        if group is not None:
            self._remote = RemoteRanks(
                {r: self._requests[r] for r in range(self.world_size) if r not in local},
                group,
            )
        config_path = f"{self._dir}/config.pkl"
        with open(config_path, "wb") as f:
            pickle.dump(config, f, protocol=5)
        init_method = f"tcp://127.0.0.1:{free_port()}" if group is None else group.init_method
        self._procs = {
            rank: subprocess.Popen(self._worker_argv(rank, config_path, init_method))
            for rank in local
        }
        """This host's worker processes by rank (a multi-pod group's others run elsewhere)."""
        # NOTE: an engine dropped without shutdown() (the offline LLM) must not leave its
        # workers waiting out their parent poll.
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs.values()))
        logger.info(
            "started %d worker processes %s (driver rank %d%s)",
            len(self._procs),
            [p.pid for p in self._procs.values()],
            self.driver_rank,
            ""
            if group is None
            else f"; ranks {sorted(set(range(self.world_size)) - set(local))}"
            f" join from the group's other {group.num_pods - 1} pod(s) at {group.init_method}",
        )

    def _worker_argv(self, rank: int, config_path: str, init_method: str) -> list[str]:
        return worker_argv(
            rank=rank,
            driver_rank=self.driver_rank,
            config_path=config_path,
            requests=f"ipc://{self._dir}/rank{rank}",
            results=f"ipc://{self._dir}/results",
            init_method=init_method,
        )

    @property
    def worker_pids(self) -> list[int]:
        """This host's worker processes' ids, in rank order."""
        return [p.pid for _, p in sorted(self._procs.items())]

    # -- calls ---------------------------------------------------------------------------------

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        if len(self._pending_steps) >= self.max_concurrent_batches:
            raise RuntimeError(
                f"{len(self._pending_steps)} steps already in flight "
                f"(max_concurrent_batches={self.max_concurrent_batches})"
            )
        call_id = self._broadcast("execute_model", (scheduler_output,), {})
        self._pending_steps.append(call_id)
        return StepFuture(lambda: self._step_result(call_id))

    def _step_result(self, call_id: int) -> ModelRunnerOutput:
        """Wait for the driver's output of step `call_id` (the oldest pending one)."""
        assert self._pending_steps[0] == call_id, "step results must be taken oldest first"
        try:
            reply = self._early_replies.pop(call_id, None)
            if reply is None:
                reply = self._wait(call_id, {self.driver_rank}, STEP_TIMEOUT_S)[self.driver_rank]
        finally:
            self._pending_steps.popleft()
        ok, result = reply
        if not ok:
            self._failed_step_calls.add(call_id)
            # NOTE: a peer's death surfaces first as the driver's failed collective; report the
            # death (the engine ends), not a step error (which would be retried).
            time.sleep(POLL_S)
            self.check_health()
            raise WorkerError(result)
        assert isinstance(result, ModelRunnerOutput)
        return result

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        check_worker_method(method)
        call_id = self._broadcast(method, args, kwargs)
        replies = self._wait(call_id, set(range(self.world_size)), START_TIMEOUT_S)
        errors = [f"rank {r}: {res}" for r, (ok, res) in sorted(replies.items()) if not ok]
        if errors:
            raise WorkerError(f"{method} failed on " + "; ".join(errors))
        return [replies[r][1] for r in range(self.world_size)]

    def check_health(self) -> None:
        if self._dead_reason is None:
            exited = [(r, p.returncode) for r, p in self._procs.items() if p.poll() is not None]
            if exited:
                rank, code = exited[0]
                self._die(f"worker rank {rank} (pid {self._procs[rank].pid}) exited with {code}")
        if self._dead_reason is None and self._remote is not None:
            lost = self._remote.lost()
            if lost is not None:
                self._die(lost)
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)

    # -- plumbing ------------------------------------------------------------------------------

    def _broadcast(self, method: str | None, args: Any, kwargs: Any) -> int:
        self.check_health()
        self._call_id += 1
        data = pickle.dumps((self._call_id, method, args, kwargs), protocol=5)
        deadline = time.monotonic() + STEP_TIMEOUT_S
        for rank, sock in enumerate(self._requests):
            while True:
                try:
                    sock.send(data, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    pass
                self.check_health()
                if time.monotonic() > deadline:
                    self._die(f"worker rank {rank} did not take a call within {STEP_TIMEOUT_S} s")
                    self.check_health()
                sock.poll(int(POLL_S * 1000), zmq.POLLOUT)
        return self._call_id

    def _wait(self, call_id: int, ranks: set[int], timeout_s: float) -> dict[int, tuple[bool, Any]]:
        """The replies of `ranks` to call `call_id` (rank → (ok, result)).

        Raises:
            ExecutorDeadError: a worker died, the bound passed, or a rank failed a step alone.
        """
        replies: dict[int, tuple[bool, Any]] = {}
        others: dict[int, str] = {}
        """Failures of this call by ranks that reply only on failure (fine if the driver
        failed too: every rank ran the same step into the same error)."""
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(ranks):
            if not self._results.poll(int(POLL_S * 1000)):
                self.check_health()
                if time.monotonic() > deadline:
                    self._die(f"no reply from ranks {sorted(ranks - set(replies))} to call "
                              f"{call_id} within {timeout_s:.0f} s")  # fmt: skip
                    self.check_health()
                continue
            rank, reply_id, ok, result = pickle.loads(self._results.recv())
            if reply_id == call_id:
                if rank in ranks:
                    replies[rank] = (ok, result)
                elif not ok and rank not in self._last_stage_ranks:
                    # NOTE: the later stages wait for this stage's tensors of the step forever.
                    self._diverged(rank, result)
                elif not ok:
                    others[rank] = result
            elif rank == self.driver_rank and reply_id in self._pending_steps:
                self._early_replies[reply_id] = (ok, result)
            elif not ok and reply_id not in self._failed_step_calls:
                self._diverged(rank, result)
        if others and all(ok for ok, _ in replies.values()):
            rank = min(others)
            self._diverged(rank, others[rank])
        return replies

    def _diverged(self, rank: int, error: str) -> None:
        # NOTE: a non-driver rank failed a step its driver passed: the ranks' states
        # (persistent batch, KV) no longer agree, and no retry can mend that. A peer's death
        # surfaces first as this rank's failed send or collective: report the death then.
        time.sleep(POLL_S)
        self.check_health()
        self._die(f"worker rank {rank} failed a step alone: {error}")
        self.check_health()

    def _die(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        logger.error("executor failed: %s; stopping the workers", reason)
        self._dead_reason = reason
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        if self._remote is not None:
            # NOTE: the other pods' ranks cannot be killed from here; a stop ends them (their
            # pods then exit), best effort: a lost pod takes none.
            stop = pickle.dumps((0, None, (), {}), protocol=5)
            for rank, sock in enumerate(self._requests):
                if rank not in self._procs:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send(stop, zmq.NOBLOCK)

    def shutdown(self) -> None:
        """Ask every worker to exit, kill those that do not within the grace, release sockets.

        Idempotent.
        """
        if self._ctx.closed:
            return
        stop = pickle.dumps((0, None, (), {}), protocol=5)
        for rank, sock in enumerate(self._requests):
            proc = self._procs.get(rank)
            if proc is None or proc.poll() is None:
                try:
                    sock.send(stop, zmq.NOBLOCK)
                except zmq.Again:
                    if proc is not None:
                        proc.kill()
        if self._remote is not None:
            # NOTE: give the stop messages to remote ranks a moment on the wire before the
            # sockets close (their pods then exit instead of waiting out the leader's loss).
            self._remote.flush(SHUTDOWN_GRACE_S / 5)
            self._remote.close()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._dead_reason = self._dead_reason or "the executor is shut down"
        self._finalizer.detach()
        for rank, sock in enumerate(self._requests):
            # NOTE: a remote rank's socket keeps the linger `RemoteRanks.flush` gave it.
            sock.close(linger=0 if rank in self._procs else None)
        self._results.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
