"""Transfers as sets of tasks: the handle every transport returns, admission and the watchdog.

A transfer is cut into tasks (a chunk of a run, a same-host copy, a per-layer notification).
Each task moves QUEUED -> RUNNING -> RETIRED exactly once. The handle is DONE when every task
retired successfully; it is FAILED, with a quiesced failure, only when every task retired: a
failed task's runner has returned (its lane was torn down if need be), and tasks that had not
started are retired without running. That is how rule 2 of the interface (no late write into a
block the caller may reuse) is kept.

Settling and publishing are two steps. The transfer *settles* under the handle's lock when its
outcome is fixed; the transport is told (`on_finish`) and the retired tasks' admission shares are
released outside that lock; only then is the outcome *published* to `poll()` and `wait()`. So a
caller that sees DONE or FAILED also sees it in the transport's `stats()`, with the transfer's
tasks no longer in flight.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from fleetserve.engine.kv_transfer.transport.base import (
    FailureStage,
    TransferFailure,
    TransferHandle,
    TransferState,
    TransferStatus,
    TransportStats,
)

__all__ = ["Admission", "Runner", "Tally", "Task", "TaskState", "Transfer", "Watchdog"]


class TaskState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    RETIRED = "retired"


class Runner(Protocol):
    """What runs a task (a lane)."""

    def abort(self, task: Task) -> None:
        """If `task` is still running here, tear down what it waits on so that it returns."""


class Task:
    """One unit of work of a transfer, run by a lane or a worker thread."""

    __slots__ = (
        "abortable",
        "admitted",
        "bounded",
        "dispatch",
        "layer",
        "nbytes",
        "runner",
        "state",
        "transfer",
        "work",
    )

    def __init__(
        self,
        transfer: Transfer,
        layer: int,
        nbytes: int,
        work: Any,
        dispatch: Callable[[Task], None],
        *,
        abortable: bool = True,
        bounded: bool = True,
    ) -> None:
        self.transfer = transfer
        self.layer = layer
        self.nbytes = nbytes
        self.work = work
        self.dispatch = dispatch
        """Hands the admitted task to whatever runs it (a lane's queue)."""
        self.abortable = abortable
        """Whether the watchdog may tear its runner down to make it return."""
        self.bounded = bounded
        """Whether it returns soon on its own even if not aborted (a memcpy does; a Mooncake
        call may keep its buffers for the engine's own timeout). A transfer failing while an
        unabortable, unbounded task runs reports an unquiesced failure at once."""
        self.state = TaskState.QUEUED
        self.runner: Runner | None = None
        self.admitted = False


class Admission:
    """Bounds the tasks and bytes in flight (admitted and not retired) across a transport.

    Tasks wait in FIFO order; one task is always admitted when nothing is in flight, so a task
    larger than `max_bytes` cannot stall (transports chunk work below `max_bytes` anyway).
    """

    def __init__(self, max_tasks: int, max_bytes: int) -> None:
        if max_tasks < 1 or max_bytes < 1:
            raise ValueError(
                f"admission bounds must be >= 1, got max_tasks={max_tasks}, max_bytes={max_bytes}"
            )
        self.max_tasks = max_tasks
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pending: deque[Task] = deque()
        self.tasks = 0
        self.bytes = 0
        self.peak_tasks = 0
        self.peak_bytes = 0

    def submit(self, tasks: Iterable[Task]) -> None:
        with self._lock:
            self._pending.extend(tasks)
            ready = self._take()
        for task in ready:
            task.dispatch(task)

    def release(self, task: Task) -> None:
        """A task retired: free its share and admit what now fits."""
        with self._lock:
            if task.admitted:
                task.admitted = False
                self.tasks -= 1
                self.bytes -= task.nbytes
            ready = self._take()
        for ready_task in ready:
            ready_task.dispatch(ready_task)

    def _take(self) -> list[Task]:
        ready = []
        while self._pending:
            task = self._pending[0]
            if task.state is TaskState.RETIRED:
                self._pending.popleft()
                continue
            fits = self.tasks < self.max_tasks and self.bytes + task.nbytes <= self.max_bytes
            if not fits and self.tasks > 0:
                break
            self._pending.popleft()
            task.admitted = True
            self.tasks += 1
            self.bytes += task.nbytes
            self.peak_tasks = max(self.peak_tasks, self.tasks)
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            ready.append(task)
        return ready


class Tally:
    """What a transport's finished transfers add up to, for its `stats()` (the transport's own
    lock guards it)."""

    __slots__ = ("bytes_moved", "done", "failed")

    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.bytes_moved = 0

    def record(self, status: TransferStatus) -> None:
        """Count a finished transfer."""
        if status.failure is None:
            self.done += 1
        else:
            self.failed += 1
        self.bytes_moved += status.bytes_done

    def stats(self, admission: Admission, *, served: int, rejected: int) -> TransportStats:
        return TransportStats(
            inflight_tasks=admission.tasks,
            inflight_bytes=admission.bytes,
            peak_inflight_tasks=admission.peak_tasks,
            peak_inflight_bytes=admission.peak_bytes,
            transfers_done=self.done,
            transfers_failed=self.failed,
            bytes_moved=self.bytes_moved,
            served_requests=served,
            rejected_requests=rejected,
        )


class Transfer(TransferHandle):
    """The handle of one pull or push (see the module docstring for the state rules)."""

    def __init__(
        self,
        transfer_id: int,
        peer_engine_id: str,
        *,
        layers: Iterable[int],
        total_bytes: int,
        num_descriptors: int,
        same_host: bool,
        deadline: float,
        admission: Admission,
        on_finish: Callable[[Transfer, TransferStatus], None],
    ) -> None:
        """`on_finish` is called once, outside the handle's lock, with the settled status; the
        outcome is published only after it returned."""
        self.transfer_id = transfer_id
        self.peer_engine_id = peer_engine_id
        self.deadline = deadline
        self._admission = admission
        self._on_finish = on_finish
        self._cond = threading.Condition()
        self._layers = frozenset(layers)
        self._data_left: dict[int, int] = dict.fromkeys(self._layers, 0)
        self._seals: dict[int, Task] = {}
        self._layers_done: set[int] = set()
        self._tasks: list[Task] = []
        self._outstanding = 0
        self._failure: TransferFailure | None = None
        self._settled = False
        self._reported = False
        """`on_finish` returned: the transport counted the settled outcome."""
        self._unreleased = 0
        """Retired tasks whose admission share a runner has yet to release."""
        self._finished = False
        """Published: settled, reported and every retired task released."""
        self._bytes_done = 0
        self._total_bytes = total_bytes
        self._num_descriptors = num_descriptors
        self._same_host = same_host
        self._started = time.monotonic()
        self._elapsed: float | None = None

    # -- building (before the tasks are submitted) -------------------------------------------

    def add_task(self, task: Task) -> None:
        self._tasks.append(task)
        self._data_left[task.layer] += 1
        self._outstanding += 1

    def add_seal(self, task: Task) -> None:
        """A task that runs once the layer's other tasks all succeeded (a push's notification);
        the layer is done only when it is."""
        self._seals[task.layer] = task
        self._outstanding += 1

    def start(self) -> list[Task]:
        """The tasks to submit now; settles an empty transfer at once."""
        with self._cond:
            for layer, left in self._data_left.items():
                if left == 0 and layer not in self._seals:
                    self._layers_done.add(layer)
            settled = self._settle()
        self._after([], settled)
        return list(self._tasks)

    # -- runners -------------------------------------------------------------------------------

    def claim(self, task: Task, runner: Runner | None) -> bool:
        """A runner is about to run `task`: False (and the task retired) if it must not."""
        retired: list[Task] = []
        with self._cond:
            if task.state is not TaskState.QUEUED:
                return False
            if self._failure is None and time.monotonic() > self.deadline:
                self._record(_timeout(self), retired)  # retires `task` with the other queued
            if self._failure is None:
                task.state = TaskState.RUNNING
                task.runner = runner
                return True
            if task.state is TaskState.QUEUED:
                task.state = TaskState.RETIRED
                self._outstanding -= 1
                retired.append(task)
            self._unreleased += len(retired)
            settled = self._settle()
        self._after(retired, settled)
        return False

    def retire(
        self, task: Task, failure: TransferFailure | None = None, *, nbytes: int | None = None
    ) -> None:
        """`task` returned: succeeded when `failure` is None. Dispatches the layer's seal when
        it was the last of the layer's tasks."""
        ready: Task | None = None
        retired = [task]
        with self._cond:
            if task.state is not TaskState.RUNNING:
                return
            task.state = TaskState.RETIRED
            task.runner = None
            self._outstanding -= 1
            if failure is not None:
                self._record(failure, retired)
            elif self._failure is None:
                self._bytes_done += task.nbytes if nbytes is None else nbytes
                seal = self._seals.get(task.layer)
                if seal is task:
                    self._layers_done.add(task.layer)
                else:
                    self._data_left[task.layer] -= 1
                    if self._data_left[task.layer] == 0:
                        if seal is None:
                            self._layers_done.add(task.layer)
                        else:
                            ready = seal
            self._unreleased += len(retired)
            settled = self._settle()
        self._after(retired, settled)
        if ready is not None:
            # Seals bypass admission: they are tiny and must not queue behind new data.
            ready.dispatch(ready)

    def fail(self, failure: TransferFailure) -> list[Task]:
        """Fail the transfer (first failure wins); returns the tasks still running, for the
        caller to abort. Tasks not started are retired. A settled transfer's outcome stays."""
        retired: list[Task] = []
        with self._cond:
            running = [t for t in self._tasks if t.state is TaskState.RUNNING]
            running += [t for t in self._seals.values() if t.state is TaskState.RUNNING]
            if self._settled:
                return running
            if any(not t.abortable and not t.bounded for t in running):
                failure = TransferFailure(failure.stage, failure.message, quiesced=False)
            self._record(failure, retired)
            self._unreleased += len(retired)
            settled = self._settle()
        self._after(retired, settled)
        return running

    def expire(self, now: float) -> list[Task]:
        """The watchdog's check: past the deadline, fail with TIMEOUT; returns tasks to abort."""
        if self._settled or now <= self.deadline:
            return []
        with self._cond:
            if self._failure is not None or self._settled:
                return []
        return self.fail(_timeout(self))

    @property
    def settled(self) -> bool:
        """The outcome is fixed (it may not be published yet)."""
        return self._settled

    # -- TransferHandle ------------------------------------------------------------------------

    def poll(self) -> TransferStatus:
        with self._cond:
            return self._status()

    def wait(self, timeout: float | None = None) -> TransferStatus:
        with self._cond:
            self._cond.wait_for(lambda: self._finished, timeout)
            return self._status()

    def layer_state(self, layer: int) -> TransferState:
        with self._cond:
            return self._layer_state(layer)

    def wait_layer(self, layer: int, timeout: float | None = None) -> TransferState:
        with self._cond:
            if layer not in self._layers:
                raise ValueError(
                    f"layer {layer} is not part of this transfer (layers {sorted(self._layers)})"
                )
            self._cond.wait_for(
                lambda: self._layer_state(layer) is not TransferState.PENDING, timeout
            )
            return self._layer_state(layer)

    # -- internals (hold self._cond) -----------------------------------------------------------

    def _layer_state(self, layer: int) -> TransferState:
        if layer in self._layers_done:
            return TransferState.DONE
        if self._finished and self._failure is not None:
            return TransferState.FAILED
        return TransferState.PENDING

    def _status(self, *, settled: bool = False) -> TransferStatus:
        """What callers see: the published outcome, or the settled one for `on_finish`."""
        final = self._finished or settled
        if not final:
            state = TransferState.PENDING
        else:
            state = TransferState.FAILED if self._failure is not None else TransferState.DONE
        elapsed = self._elapsed if self._elapsed is not None else time.monotonic() - self._started
        return TransferStatus(
            state=state,
            failure=self._failure if final else None,
            layers_done=frozenset(self._layers_done),
            layers=self._layers,
            bytes_done=self._bytes_done,
            total_bytes=self._total_bytes,
            num_descriptors=self._num_descriptors,
            same_host=self._same_host,
            elapsed_s=elapsed,
        )

    def _record(self, failure: TransferFailure, retired: list[Task]) -> None:
        if self._failure is None:
            self._failure = failure
        elif not failure.quiesced and self._failure.quiesced:
            # A later failure that cannot be stopped overrides: the caller must quarantine.
            self._failure = TransferFailure(self._failure.stage, self._failure.message, False)
        for task in [*self._tasks, *self._seals.values()]:
            if task.state is TaskState.QUEUED:
                task.state = TaskState.RETIRED
                self._outstanding -= 1
                retired.append(task)

    def _settle(self) -> TransferStatus | None:
        """Fix the outcome when the state allows: the settled status if it just settled."""
        if self._settled:
            return None
        if self._failure is not None:
            done = self._outstanding == 0 or not self._failure.quiesced
        else:
            done = self._outstanding == 0
        if not done:
            if self._layers_done:
                self._cond.notify_all()
            return None
        self._settled = True
        self._elapsed = time.monotonic() - self._started
        return self._status(settled=True)

    def _publish(self) -> None:
        if self._settled and self._reported and self._unreleased == 0 and not self._finished:
            self._finished = True
        self._cond.notify_all()

    def _after(self, retired: list[Task], settled: TransferStatus | None) -> None:
        """Outside the lock: release `retired`'s admission shares, report a just-settled
        outcome, then publish it if nothing else is pending."""
        for task in retired:
            self._admission.release(task)
        if settled is not None:
            self._on_finish(self, settled)
        if not retired and settled is None:
            return
        with self._cond:
            self._unreleased -= len(retired)
            self._reported = self._reported or settled is not None
            self._publish()


def _timeout(transfer: Transfer) -> TransferFailure:
    return TransferFailure(
        FailureStage.TIMEOUT,
        f"transfer {transfer.transfer_id} with {transfer.peer_engine_id!r} passed its deadline",
        quiesced=True,
    )


class Watchdog:
    """Enforces deadlines: every `interval` s, fails overdue transfers and aborts the runners of
    their tasks in flight (tearing a lane down makes a blocked socket call return)."""

    def __init__(self, name: str, interval: float = 0.02) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._live: dict[int, Transfer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-watchdog", daemon=True)
        self._thread.start()

    def add(self, transfer: Transfer) -> None:
        with self._lock:
            if not transfer.settled:
                self._live[transfer.transfer_id] = transfer

    def discard(self, transfer: Transfer) -> None:
        with self._lock:
            self._live.pop(transfer.transfer_id, None)

    def live(self) -> list[Transfer]:
        with self._lock:
            return list(self._live.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            for transfer in self.live():
                for task in transfer.expire(now):
                    abort_task(task)


def abort_task(task: Task) -> None:
    runner = task.runner
    if runner is not None and task.abortable:
        runner.abort(task)
