"""The P2P connector's worker role: moves the bytes, keeps leases, never schedules.

One instance per rank, owned by the `Worker`; it runs the engine's control server (handshakes,
heartbeats, completions, push requests arrive there) and its transport (tcp or mooncake), and
each step it takes the scheduler role's `P2PMetadata` (`start_step`) and returns what finished
(`end_step`). Everything a step must not wait for (handshakes, the checks around a pull) runs in
background threads; `end_step` only polls.

Consumer, per request (`_Load`):
    watched    heartbeats to the producer start at once (a request queued for capacity keeps
               its lease), and so does the handshake with a new producer;
    handshake  once per producer engine, however many requests name it (`PeerRegistry`); the
               compatibility hash must match, or every request naming it fails (HANDSHAKE);
    pull       a heartbeat answered "known" first (the producer still holds the blocks), then
               one transfer of all layers; when it lands, `Done` tells the producer, and its
               answer says whether the lease held throughout (if not, the bytes are invalid);
    push       the consumer sends its block ids (`PushRequest`) and waits for `PushDone`;
    finished   reported in `finished_recving` (a failure too, with the stage, so nothing waits
               forever); a watchdog deadline turns silence into a failure.

Producer, per transfer key (`_Held`): the finished prompt's blocks are leased (`LeaseTable`);
`Done` or lease expiry releases them (`finished_sending`); in push mode the blocks are written
into the consumer's as soon as its `PushRequest` is known: layer by layer during the steps that
compute them (`save_kv_layer`), the rest when the prompt finishes, then `PushDone`.

A block is never reused while a transfer may still write into it: a failed transfer is reported
only once the transport says it is quiesced (else it is kept in flight until it is), and a
consumer request ended while blocks were offered to a push revokes the push first.

Tensor parallel (pull mode, `RankGroup`): every rank moves its own share of the KV heads. The
producer's driver rank (rank 0) answers the handshake with the engine's `KVLayout` and every
rank's transport descriptor, holds the leases and takes the heartbeats and `Done`s (block ids are
the same on every rank: one scheduler); the other producer ranks only serve their regions. Each
consumer rank maps its heads onto the producer's ranks (`plan_head_slices`): a rank whose heads
are exactly one producer rank's pulls straight into its cache (same TP: rank r from rank r);
otherwise it pulls those ranks' whole blocks into staging buffers and copies its head slices
into its blocks (our blocks are token-major, `[block_size, heads, head_size]`, so a head slice is
not contiguous in a block). A consumer rank's load that ended (landed or failed, nothing still
writing) is a vote; each step the ranks gather their votes, and the driver reports the load (and
sends `Done`) only once every rank voted: so no rank's blocks are used, or reused, early
(a gather per step only while a load is open).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from fleetserve.engine.config import KVTransferConfig
from fleetserve.engine.kv_transfer.connector_meta import (
    HoldSpec,
    KVConnectorOutput,
    LoadSpec,
    P2PMetadata,
    SaveSpec,
)
from fleetserve.engine.kv_transfer.head_map import HeadSlice, KVLayout, plan_head_slices
from fleetserve.engine.kv_transfer.lease import HeartbeatSchedule, LeaseTable
from fleetserve.engine.kv_transfer.ledger import FailureLedger, TransferStage
from fleetserve.engine.kv_transfer.params import ConsumerParams
from fleetserve.engine.kv_transfer.peers import PeerRegistry
from fleetserve.engine.kv_transfer.rank_group import RankGroup, SingleRank
from fleetserve.engine.kv_transfer.scheduler_role import EngineIdentity
from fleetserve.engine.kv_transfer.side_channel import (
    ControlClient,
    ControlMessage,
    ControlServer,
    Done,
    Handshake,
    HandshakeReply,
    Heartbeat,
    PushDone,
    PushRequest,
    _Reply,
)
from fleetserve.engine.kv_transfer.stats import KVTransferStats
from fleetserve.engine.kv_transfer.transport.base import (
    BlockCopy,
    EndpointDescriptor,
    FailureStage,
    KVTransport,
    TransferHandle,
    TransferState,
    kv_region_name,
)
from fleetserve.engine.kv_transfer.transport.shm import SharedKVArena
from fleetserve.engine.layers.attention.metadata import AttentionMetadata

__all__ = ["P2PConnectorWorker", "new_engine_id"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")

_STAGES = {
    FailureStage.CONNECT: TransferStage.HANDSHAKE,
    FailureStage.REJECTED: TransferStage.REGISTRATION,
    FailureStage.SEND: TransferStage.SEND,
    FailureStage.RECEIVE: TransferStage.RECEIVE,
    FailureStage.TIMEOUT: TransferStage.WATCHDOG,
    FailureStage.CLOSED: TransferStage.RECEIVE,
    FailureStage.TRANSPORT: TransferStage.RECEIVE,
}


def new_engine_id() -> str:
    """A fresh id per engine incarnation: a restarted producer is a different engine."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True, slots=True)
class _Peer:
    """What a handshake taught us about a producer."""

    engine_id: str
    host: str
    port: int
    lease_seconds: float
    descriptor: EndpointDescriptor
    layout: KVLayout | None = None
    """The producer's KV layout (None: a one-rank push target)."""
    rank_descriptors: tuple[EndpointDescriptor, ...] = ()
    """Every producer rank's transport, in rank order."""
    slices: tuple[HeadSlice, ...] = ()
    """What this rank reads from the producer's ranks (`plan_head_slices`)."""

    @property
    def direct(self) -> bool:
        """Whether this rank's heads are exactly one producer rank's (no staging)."""
        if len(self.slices) != 1 or self.layout is None:
            return False
        (only,) = self.slices
        held = len(self.layout.heads_of(only.producer_rank))
        return only.src_start == 0 and only.dst_start == 0 and only.count == held


@dataclass
class _Load:
    spec: LoadSpec
    state: str = "handshake"
    """handshake → checking → moving → verifying → done (or failed), or awaiting_push; with
    several ranks, moving → landed/failed_local (a vote) → verifying on the driver."""
    job: Future[Any] | None = None
    handles: list[TransferHandle] = field(default_factory=list)
    """One per producer rank this rank pulls from."""
    peer: _Peer | None = None
    failure: str | None = None
    """Set while "draining": why it failed, reported once nothing can write any more."""
    drain_deadline: float = 0.0


@dataclass
class _Held:
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class _PushTarget:
    """Where a producer writes a transfer's blocks (from the consumer's `PushRequest`)."""

    request: PushRequest
    peer: _Peer
    blocks_pushed: dict[int, int] = field(default_factory=dict)
    """Layer → the prompt block up to which that layer is written (exclusive)."""
    handles: list[TransferHandle] = field(default_factory=list)
    """The final pushes (after the prompt finished)."""
    final: bool = False


class P2PConnectorWorker:
    """The worker role (see the module docstring)."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        engine_id: str,
        compatibility_hash: str,
        compatibility_key: dict[str, Any],
        block_size: int,
        transport: KVTransport,
        layout: KVLayout,
        ranks: RankGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.layout = layout
        self.ranks: RankGroup = ranks if ranks is not None else SingleRank()
        if self.ranks.size != layout.tp_size:
            raise ValueError(
                f"the connector's rank group has {self.ranks.size} ranks but the layout "
                f"TP={layout.tp_size}"
            )
        if layout.tp_size > 1 and config.transfer_mode != "pull":
            raise ValueError(
                f"kv_transfer_config.transfer_mode {config.transfer_mode!r} with "
                f"tensor_parallel_size {layout.tp_size} is not implemented; use 'pull'"
            )
        self.engine_id = engine_id
        self.compatibility_hash = compatibility_hash
        self.compatibility_key = compatibility_key
        self.block_size = block_size
        self.transport = transport
        self.clock = clock
        self.stats = KVTransferStats()
        self._lock = threading.Lock()
        """Guards what the control thread touches: leases, held blocks, push targets."""
        self.leases = LeaseTable(config.lease_seconds)
        self._held: dict[str, _Held] = {}
        self._released: set[str] = set()
        self._gone: dict[str, str] = {}
        """Transfer keys released recently, with why (see `_remember_gone`)."""
        """Producer request ids whose blocks may be freed (reported at the next end_step)."""
        self._push_targets: dict[str, _PushTarget] = {}
        self._early_pushes: dict[str, tuple[PushRequest, float]] = {}
        """Push requests that arrived before their prompt finished or was known (bounded)."""
        self._loads: dict[str, _Load] = {}
        self._watched: dict[str, ConsumerParams] = {}
        self._pushed_done: dict[str, PushDone] = {}
        self.heartbeats = HeartbeatSchedule.for_lease(config.lease_seconds)
        self.ledger = FailureLedger()
        self.client = ControlClient(timeout_s=config.handshake_timeout_s)
        self._io = ThreadPoolExecutor(config.num_threads, thread_name_prefix="kv-io")
        self._progress = threading.Event()
        """Set when something a step would act on arrived (an io job ended, a control message
        came); `wait_for_progress` sleeps on it between steps that only poll."""
        self._addresses: dict[str, tuple[str, int]] = {}
        self.peers: PeerRegistry[_Peer] = PeerRegistry(self._handshake, clock=clock)
        self._step_saves: list[SaveSpec] = []
        self._step_pushes: list[tuple[str, TransferHandle]] = []
        self._num_layers = 0
        self._kv_caches: list[torch.Tensor] = []
        self._rank_descriptors: list[dict[str, Any]] = []
        self._stages: dict[tuple[int, int], list[torch.Tensor]] = {}
        """(producer rank, its heads) → per layer a staging `[2, num_blocks, ...]` (registered
        as local regions "stage.<rank>x<heads>.layer.<i>.<k|v>")."""
        self._local_votes: dict[str, str | None] = {}
        """Loads this rank ended since the last gather: request id → failure (None: landed)."""
        self._votes: dict[str, dict[int, str | None]] = {}
        """Every rank's vote on each load, until all ranks voted (the same on every rank)."""
        self._open: set[str] = set()
        """Loads started and not yet voted on by every rank (the same on every rank)."""
        self.control = ControlServer(config.host, config.side_channel_port, self._on_control)

    # -- setup ---------------------------------------------------------------------------------

    @property
    def wants_shared_memory(self) -> bool:
        """Whether the KV caches should live in shared memory (the tcp transport's same-host
        path maps them; `SharedKVArena`)."""
        return self.transport.kind == "tcp"

    def register_kv_caches(
        self,
        kv_caches: Sequence[torch.Tensor],
        *,
        layer_names: Sequence[str],
        shared: SharedKVArena | None = None,
    ) -> None:
        """Serve (and pull into, and push from) these caches: one `[2, num_blocks, ...]` per
        layer, in layer order; `layer_names` are the attention layers' names (the hooks')."""
        if len(layer_names) != len(kv_caches):
            raise ValueError(f"{len(kv_caches)} caches but {len(layer_names)} layer names")
        self.transport.register_kv_caches(kv_caches, shared=shared)
        self._num_layers = len(kv_caches)
        self._kv_caches = list(kv_caches)
        self._layer_of = {name: i for i, name in enumerate(layer_names)}
        if self.ranks.size > 1:
            # NOTE: a collective: every rank registers once, at the same point of start-up.
            self._rank_descriptors = self.ranks.all_gather(self.transport.descriptor().to_dict())

    def identity(self) -> EngineIdentity:
        return EngineIdentity(
            engine_id=self.engine_id,
            host=self.config.host,
            port=self.control.port,
            compatibility_hash=self.compatibility_hash,
        )

    def close(self) -> None:
        self.control.close()
        self.peers.close()
        self._io.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        self.transport.close()

    # -- control channel (its own thread) -----------------------------------------------------

    def _on_control(self, message: ControlMessage) -> ControlMessage | None:
        try:
            return self._answer(message)
        finally:
            self._progress.set()

    def _answer(self, message: ControlMessage) -> ControlMessage | None:
        now = self.clock()
        if isinstance(message, Handshake):
            self.stats.handshakes_served += 1
            return HandshakeReply(
                engine_id=self.engine_id,
                compatibility_hash=self.compatibility_hash,
                compatibility_key=self.compatibility_key,
                lease_seconds=self.config.lease_seconds,
                transport=self.transport.descriptor().to_dict(),
                layout=self.layout.to_dict(),
                rank_transports=self._rank_descriptors,
            )
        if isinstance(message, Heartbeat):
            with self._lock:
                known = self.leases.heartbeat(message.keys, now)
                gone = {k: self._gone[k] for k in message.keys if k in self._gone}
            return _Reply(known=known, gone=gone)
        if isinstance(message, Done):
            with self._lock:
                known = [key for key in message.keys if self._release(key, "released")]
                gone = {
                    k: self._gone[k] for k in message.keys if k not in known and k in self._gone
                }
            return _Reply(known=known, gone=gone)
        if isinstance(message, PushRequest):
            with self._lock:
                self._early_pushes[message.key] = (message, now)
                while len(self._early_pushes) > 4096:  # bounded: drop the oldest
                    self._early_pushes.pop(next(iter(self._early_pushes)))
            return _Reply(known=[message.key])
        if isinstance(message, PushDone):
            with self._lock:
                self._pushed_done[message.key] = message
            return None
        logger.warning("unexpected control message %r", message)
        return None

    def _release(self, key: str, why: str) -> bool:
        """(Under the lock.) Free a held transfer's blocks; False when it was not held."""
        held = self._held.pop(key, None)
        had_lease = self.leases.release(key)
        if held is not None:
            self._released.add(held.request_id)
            self._remember_gone(key, why)
        return held is not None and had_lease

    def _remember_gone(self, key: str, why: str) -> None:
        """(Under the lock.) Consumers asking about a released transfer learn why at once
        (instead of waiting for a lease that will never come); bounded, oldest dropped."""
        self._gone[key] = why
        while len(self._gone) > 100_000:
            self._gone.pop(next(iter(self._gone)))

    # -- step ----------------------------------------------------------------------------------

    def wait_for_progress(self, timeout_s: float) -> None:
        """Between steps that only poll transfers: return as soon as one may advance (a pull
        landed, an io job or a control message arrived), or after `timeout_s`."""
        moving = next(
            (
                handle
                for load in self._loads.values()
                if load.state == "moving"
                for handle in load.handles
                if handle.poll().state is TransferState.PENDING
            ),
            None,
        )
        if moving is not None:
            moving.wait(timeout_s)
        elif self._progress.wait(timeout_s):
            # NOTE: a set() between wait and clear is lost: it costs at most one timeout.
            self._progress.clear()

    def _wake(self, _: object = None) -> None:
        self._progress.set()

    def _submit(self, fn: Callable[..., _R], *args: Any) -> Future[_R]:
        future = self._io.submit(fn, *args)
        future.add_done_callback(self._wake)
        return future

    def start_step(self, meta: P2PMetadata | None) -> None:
        """Act on the scheduler role's metadata (before the forward pass)."""
        if meta is None:
            return
        now = self.clock()
        for watch in meta.watches:
            self._watch(watch.request_id, watch.params, now)
        for load in meta.loads:
            self._start_load(load, now)
        for hold in meta.holds:
            self._hold(hold, now)
        for request_id in meta.cancels:
            self._cancel(request_id)
        self._step_saves = meta.saves

    @property
    def saves_this_step(self) -> bool:
        """Whether this step's forward must run the per-layer save hook (push mode)."""
        return bool(self._step_saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (the request runs only once they finished): nothing to wait
        for inside the forward pass."""

    def save_kv_layer(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        """Push mode: write this layer's newly completed blocks of every request of the step
        whose consumer is known, as soon as the layer has them."""
        layer = self._layer_of[layer_name]
        for save in self._step_saves:
            with self._lock:
                target = self._push_target(save.key)
            if target is None:
                continue
            upto = save.num_computed_tokens // self.block_size
            handle = self._push_blocks(target, save.key, save.block_ids, layer, upto)
            if handle is not None:
                self._step_pushes.append((save.key, handle))
                self.stats.layer_pushes += 1

    def wait_for_save(self) -> None:
        """The step's pushes are done (the source blocks may change after the step)."""
        deadline = self.clock() + self.config.transfer_timeout_s
        for key, handle in self._step_pushes:
            status = handle.wait(max(0.0, deadline - self.clock()))
            if status.state is not TransferState.DONE:
                self._fail_push(key, status.failure.message if status.failure else "timed out")
        self._step_pushes = []
        self._step_saves = []

    def end_step(self) -> KVConnectorOutput:
        """Poll everything in flight; returns what finished since the last step."""
        now = self.clock()
        output = KVConnectorOutput()
        self._advance_loads(now, output)
        self._advance_pushes(now)
        for peer_id, keys in self.heartbeats.due(now).items():
            host, port = self._addresses[peer_id]
            if not self.client.notify(host, port, Heartbeat(keys=keys)):
                self.stats.control_messages_dropped += 1
        with self._lock:
            for key in self.leases.reap(now):
                held = self._held.pop(key, None)
                if held is not None:
                    logger.warning(
                        "releasing expired KV blocks of %s (lease of %.0f s, no consumer)",
                        held.request_id,
                        self.config.lease_seconds,
                    )
                    self.stats.lease_expirations += 1
                    self._released.add(held.request_id)
                    self._remember_gone(
                        key, f"its lease of {self.config.lease_seconds:g} s expired"
                    )
            output.finished_sending, self._released = self._released, set()
            self.stats.active_leases = len(self.leases)
        for failure in self.ledger.drain(now):
            load = self._loads.get(failure.key)
            if load is None:
                continue
            self.stats.count_failure(failure.stage.value)
            message = f"{failure.stage.value}: {failure.message}"
            if load.state == "moving":  # bytes may still be landing: fence until they stop
                self._drain(load, message)
                continue
            self._end(load, output, message)
        if self.ranks.size > 1:
            self._agree(output)
        return output

    # -- tensor-parallel agreement ---------------------------------------------------------------

    def _end(self, load: _Load, output: KVConnectorOutput, failure: str | None) -> None:
        """A load ended on this rank (nothing of it writes any more): report it (one rank), or
        vote (several: `_agree` reports it once every rank voted)."""
        if self.ranks.size == 1 or load.state == "verifying":
            self._finish_load(load, output, failure)
            return
        request_id = load.spec.request_id
        if failure is not None or request_id not in self._local_votes:
            self._local_votes[request_id] = failure
        if self.ranks.rank != 0:
            self._loads.pop(request_id, None)
            self.ledger.complete(request_id)
        elif load.state != "failed_local":
            # The driver keeps the load (inert) for the report; its watchdog still runs, so a
            # rank that never votes turns into a failure here.
            load.state = "landed" if failure is None else "failed_local"
            load.failure = failure

    def _agree(self, output: KVConnectorOutput) -> None:
        """(Every rank, a collective.) Gather the ranks' votes; the driver reports each load
        every rank voted on, or sends `Done` first when all landed.

        NOTE: only while some load is open: every rank opens a load at the same step (the
        step's metadata is the same on every rank) and closes it when the gathered votes (the
        same on every rank) are complete, so all ranks agree on whether to gather without
        asking; steps without loads in flight pay nothing.
        """
        if not self._open:
            return
        votes, self._local_votes = self._local_votes, {}
        gathered = self.ranks.all_gather(votes)
        for rank, rank_votes in enumerate(gathered):
            for request_id, failure in rank_votes.items():
                box = self._votes.setdefault(request_id, {})
                if failure is not None or rank not in box:
                    box[rank] = failure
        for request_id, box in list(self._votes.items()):
            if len(box) < self.ranks.size:
                continue
            del self._votes[request_id]
            self._open.discard(request_id)
            load = self._loads.get(request_id) if self.ranks.rank == 0 else None
            if load is None:
                continue
            failures = [f"rank {r}: {f}" for r, f in sorted(box.items()) if f is not None]
            if not failures and load.state == "landed" and load.peer is not None:
                key = load.spec.params.remote_request_id
                load.job = self._submit(self._lease_is_held, load.peer, key, Done)
                load.state = "verifying"
                continue
            self._finish_load(load, output, "; ".join(failures) or load.failure or "failed")

    # -- consumer ------------------------------------------------------------------------------

    def _watch(self, request_id: str, params: ConsumerParams, now: float) -> None:
        self._watched[request_id] = params
        self._addresses[params.remote_engine_id] = (params.remote_host, params.remote_port)
        if self.ranks.rank == 0:  # the driver keeps the lease (one per transfer, not per rank)
            self.heartbeats.add(params.remote_request_id, params.remote_engine_id, now)
        self.peers.connect(params.remote_engine_id)  # start the handshake early

    def _handshake(self, engine_id: str) -> _Peer:
        """(A handshake thread.) Ask the producer who it is; refuse an incompatible or
        restarted one with a message naming both sides."""
        host, port = self._addresses[engine_id]
        self.stats.handshakes += 1
        reply = self.client.request(host, port, Handshake(engine_id=self.engine_id))
        if not isinstance(reply, HandshakeReply):
            raise RuntimeError(f"{host}:{port} answered a handshake with {type(reply).__name__}")
        if reply.engine_id != engine_id:
            raise RuntimeError(
                f"the producer at {host}:{port} is engine {reply.engine_id!r}, not {engine_id!r}:"
                " it restarted, and the blocks the request names are gone"
            )
        if reply.compatibility_hash != self.compatibility_hash:
            differ = sorted(
                k
                for k in set(reply.compatibility_key) | set(self.compatibility_key)
                if reply.compatibility_key.get(k) != self.compatibility_key.get(k)
            )
            raise ValueError(
                f"KV compatibility hash mismatch: this engine has {self.compatibility_hash}, "
                f"producer {engine_id} has {reply.compatibility_hash} (they differ in "
                f"{', '.join(differ) or 'nothing visible'}); these engines cannot exchange KV"
            )
        descriptor = EndpointDescriptor.from_dict(reply.transport)
        mine = self.layout
        layout = (
            KVLayout.from_dict(reply.layout)
            if reply.layout is not None
            else KVLayout(1, 1, mine.num_kv_heads, mine.head_size, mine.block_size)
        )
        ranks = tuple(EndpointDescriptor.from_dict(d) for d in reply.rank_transports) or (
            descriptor,
        )
        if len(ranks) != layout.tp_size:
            raise ValueError(
                f"producer {engine_id} sent {len(ranks)} rank transports for TP={layout.tp_size}"
            )
        # Raises ValueError naming both layouts for a pair this connector cannot map.
        slices = plan_head_slices(layout, self.layout, self.ranks.rank)
        return _Peer(
            engine_id=engine_id,
            host=host,
            port=port,
            lease_seconds=reply.lease_seconds,
            descriptor=descriptor,
            layout=layout,
            rank_descriptors=ranks,
            slices=tuple(slices),
        )

    def _start_load(self, spec: LoadSpec, now: float) -> None:
        self._loads[spec.request_id] = _Load(spec)
        if self.ranks.size > 1:
            self._open.add(spec.request_id)
        self.ledger.watch(spec.request_id, spec.deadline_s)
        if spec.error is not None:
            self.ledger.report(spec.request_id, TransferStage.REGISTRATION, spec.error)

    def _advance_loads(self, now: float, output: KVConnectorOutput) -> None:
        for load in list(self._loads.values()):
            # NOTE: take every transition whose result is already there in this step (a cached
            # handshake, a finished transfer): each step a load waits costs the whole hand-off
            # a poll interval. A report to the ledger leaves the state as it is, ending the loop.
            while True:
                state = load.state
                try:
                    self._advance(load, output)
                except Exception as exc:  # a transport refusing the request at once, etc.
                    stage = TransferStage.HANDSHAKE if load.peer is None else TransferStage.RECEIVE
                    self.ledger.report(load.spec.request_id, stage, f"{type(exc).__name__}: {exc}")
                    break
                if load.state == state or load.spec.request_id not in self._loads:
                    break

    def _advance(self, load: _Load, output: KVConnectorOutput) -> None:
        spec, key = load.spec, load.spec.params.remote_request_id
        request_id = spec.request_id
        if load.state == "handshake":
            # NOTE: keep the first future: a failed handshake is dropped from the registry (so a
            # later request retries), and asking again would start a new one for this load.
            if load.job is None:
                load.job = self.peers.connect(spec.params.remote_engine_id)
                load.job.add_done_callback(self._wake)
            future = load.job
            if not future.done():
                return
            error = future.exception()
            if error is not None:
                self.ledger.report(request_id, TransferStage.HANDSHAKE, str(error))
                return
            load.peer = future.result()
            if self.config.transfer_mode == "push":
                self._request_push(load)
                load.state = "awaiting_push"
            else:
                load.job = self._submit(self._lease_is_held, load.peer, key, Heartbeat)
                load.state = "checking"
        elif load.state == "checking":
            if load.job is None or not load.job.done():
                return
            gone = load.job.exception()
            if gone is not None:
                self.ledger.report(request_id, TransferStage.REGISTRATION, str(gone))
                return
            if not load.job.result():
                self.ledger.report(
                    request_id,
                    TransferStage.REGISTRATION,
                    f"producer {spec.params.remote_engine_id} no longer holds transfer {key}",
                )
                return
            assert load.peer is not None
            self.peers.begin_transfer(load.peer.engine_id)
            load.state = "moving"
            for descriptor, copies in self._copies(load):
                # NOTE: a pull refused at once raises: the ones already started still count
                # (state moving), so the load drains them before it is reported.
                load.handles.append(self.transport.pull(descriptor, copies))
        elif load.state == "moving":
            assert load.peer is not None
            statuses = [handle.poll() for handle in load.handles]
            if any(status.state is TransferState.PENDING for status in statuses):
                return
            failures = [status.failure for status in statuses if status.failure is not None]
            if failures:
                failure = failures[0]
                if not all(f.quiesced for f in failures):
                    self._drain(load, f"{_STAGES[failure.stage].value}: {failure.message}")
                    return
                self.peers.end_transfer(load.peer.engine_id)
                self.ledger.report(request_id, _STAGES[failure.stage], failure.message)
                return
            self.peers.end_transfer(load.peer.engine_id)
            for status in statuses:
                self.stats.observe(status.elapsed_s, status.total_bytes, status.num_descriptors)
            if not load.peer.direct:
                self._unstage(load)
            if self.ranks.size == 1:
                load.job = self._submit(self._lease_is_held, load.peer, key, Done)
                load.state = "verifying"
            else:
                self._end(load, output, None)
        elif load.state == "verifying":
            if load.job is None or not load.job.done():
                return
            if load.job.exception() is not None or not load.job.result():
                self.ledger.report(
                    request_id,
                    TransferStage.RECEIVE,
                    f"the producer's lease on {key} ended during the transfer (the consumer "
                    "stalled past it); its blocks may have been reused",
                )
                return
            self._finish_load(load, output, None)
        elif load.state == "draining":
            # NOTE: the transport cannot say its writes stopped (Mooncake): wait for it, or for
            # its own transfer timeout, before the blocks may be reused.
            assert load.peer is not None
            statuses = [handle.poll() for handle in load.handles]
            quiesced = all(
                status.state is TransferState.DONE
                or (status.failure is not None and status.failure.quiesced)
                for status in statuses
            )
            if not (quiesced or self.clock() >= load.drain_deadline):
                return
            self.peers.end_transfer(load.peer.engine_id)
            self._end(load, output, load.failure)
        elif load.state == "awaiting_push":
            with self._lock:
                done = self._pushed_done.pop(key, None)
            if done is None:
                return
            if not done.ok:
                self.ledger.report(request_id, TransferStage.SEND, done.message)
                return
            self._finish_load(load, output, None)

    def _drain(self, load: _Load, failure: str) -> None:
        """Fail a load whose transfer may still be writing: only once it stopped (or after the
        transport's own timeout) is it reported, so the blocks stay fenced until then."""
        load.state, load.failure = "draining", failure
        load.drain_deadline = self.clock() + self.config.transfer_timeout_s

    def _lease_is_held(self, peer: _Peer, key: str, kind: type[Heartbeat] | type[Done]) -> bool:
        """(An io thread.) A heartbeat (before a pull) or `Done` (after it), answered with
        whether the producer held the transfer's lease at that moment.

        NOTE: a producer grants the lease in the step after the prompt finished, and its
        response may reach us first; so before a pull a key it has never heard of is asked
        again (after 1 ms, doubling to 20 ms, up to the transfer timeout). A key it released
        (lease expired) fails at once. After the pull a key must be known: the lease held throughout, or the
        bytes are suspect.

        Raises:
            LookupError: the producer released the transfer (the message says why).
        """
        deadline = time.monotonic() + self.config.transfer_timeout_s
        pause = 0.001
        while True:
            reply = self.client.request(peer.host, peer.port, kind(keys=[key]))
            if isinstance(reply, _Reply) and key in reply.known:
                return True
            if isinstance(reply, _Reply) and key in reply.gone:
                raise LookupError(f"producer {peer.engine_id} no longer holds {key}: "
                                  f"{reply.gone[key]}")  # fmt: skip
            if kind is Done or time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(0.02, pause * 2)

    def _copies(self, load: _Load) -> list[tuple[EndpointDescriptor, list[BlockCopy]]]:
        """The pulls of a load: per producer rank read, its descriptor and the copies (into
        the cache when `direct`, else into that rank's staging regions)."""
        spec, peer = load.spec, load.peer
        assert peer is not None and peer.layout is not None
        remote_ids = spec.params.remote_block_ids
        assert remote_ids is not None, "a pull needs the producer's block ids"
        src = list(remote_ids[spec.first_block : spec.first_block + len(spec.local_block_ids)])
        dst = list(spec.local_block_ids)
        pulls = []
        for rank in sorted({piece.producer_rank for piece in peer.slices}):
            stage = None if peer.direct else self._stage_prefix(rank, peer.layout)
            copies = [
                BlockCopy(
                    kv_region_name(layer, kind),
                    src,
                    dst,
                    local_region=None if stage is None else f"{stage}{kv_region_name(layer, kind)}",
                )
                for layer in range(self._num_layers)
                for kind in ("k", "v")
            ]
            pulls.append((peer.rank_descriptors[rank], copies))
        return pulls

    def _stage_prefix(self, rank: int, layout: KVLayout) -> str:
        """The staging regions for whole blocks of producer rank `rank` (allocated and
        registered on first use: as many blocks as the cache, since a load stages into its own
        block ids, which no other load in flight holds)."""
        heads = len(layout.heads_of(rank))
        prefix = f"stage.{rank}x{heads}."
        if (rank, heads) not in self._stages:
            tensors = []
            for layer, cache in enumerate(self._kv_caches):
                _, num_blocks, block_size, _, head_size = cache.shape
                shape = (2, num_blocks, block_size, heads, head_size)
                stage = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
                for index, kind in enumerate(("k", "v")):
                    name = f"{prefix}{kv_region_name(layer, kind)}"
                    self.transport.register_region(name, stage[index], layer=layer)
                tensors.append(stage)
            self._stages[(rank, heads)] = tensors
        return prefix

    def _unstage(self, load: _Load) -> None:
        """Copy this rank's head slices from the staged producer blocks into its own blocks
        (between steps, on the thread that runs the forward pass)."""
        peer = load.peer
        assert peer is not None and peer.layout is not None
        blocks = torch.tensor(load.spec.local_block_ids, dtype=torch.long)
        for piece in peer.slices:
            staged = self._stages[
                (piece.producer_rank, len(peer.layout.heads_of(piece.producer_rank)))
            ]
            src = slice(piece.src_start, piece.src_start + piece.count)
            dst = slice(piece.dst_start, piece.dst_start + piece.count)
            for cache, stage in zip(self._kv_caches, staged, strict=True):
                blocks_here = blocks.to(cache.device)
                cache[:, blocks_here, :, dst] = stage[:, blocks_here, :, src]

    def _request_push(self, load: _Load) -> None:
        assert load.peer is not None
        message = PushRequest(
            key=load.spec.params.remote_request_id,
            consumer_engine_id=self.engine_id,
            consumer_host=self.config.host,
            consumer_port=self.control.port,
            consumer_transport=self.transport.descriptor().to_dict(),
            block_ids=list(load.spec.local_block_ids),
            first_block=load.spec.first_block,
        )
        if not self.client.notify(load.peer.host, load.peer.port, message):
            self.ledger.report(
                load.spec.request_id, TransferStage.SEND, "the push request could not be sent"
            )

    def _finish_load(self, load: _Load, output: KVConnectorOutput, failure: str | None) -> None:
        spec = load.spec
        self._loads.pop(spec.request_id, None)
        self.ledger.complete(spec.request_id)
        self.heartbeats.remove(spec.params.remote_request_id)
        output.finished_recving.add(spec.request_id)
        if failure is None:
            self.stats.tokens_loaded += len(spec.local_block_ids) * self.block_size
            return
        output.failed_recving[spec.request_id] = failure
        output.invalid_block_ids |= set(spec.local_block_ids)
        if self.config.transfer_mode == "push" and not self.transport.revoke_pushes(
            spec.params.remote_request_id
        ):
            logger.error("a push into %s may still be writing", spec.request_id)
        if load.peer is not None:  # let the producer free its blocks now, not at lease end
            self.client.notify(
                load.peer.host, load.peer.port, Done(keys=[spec.params.remote_request_id])
            )

    def _cancel(self, request_id: str) -> None:
        """A request ended: stop renewing its lease; a load not yet moving bytes ends now."""
        params = self._watched.pop(request_id, None)
        if params is not None:
            self.heartbeats.remove(params.remote_request_id)
        load = self._loads.get(request_id)
        if load is not None and load.state in ("handshake", "checking", "awaiting_push"):
            self.ledger.report(request_id, TransferStage.RECEIVE, "the request ended")
        with self._lock:
            self._early_pushes.pop(request_id, None)

    # -- producer ------------------------------------------------------------------------------

    def _hold(self, spec: HoldSpec, now: float) -> None:
        if self.ranks.rank != 0:
            return  # the driver holds the lease for every rank (the blocks are the engine's)
        with self._lock:
            self._held[spec.key] = _Held(spec.request_id, spec.block_ids, spec.num_tokens)
            self.leases.grant(spec.key, now)
            target = self._push_target(spec.key)
        if target is not None:
            self._finish_push(target, spec)

    def _push_target(self, key: str) -> _PushTarget | None:
        """(Under the lock.) The push target of a transfer, created from its push request."""
        target = self._push_targets.get(key)
        if target is not None:
            return target
        early = self._early_pushes.pop(key, None)
        if early is None:
            return None
        request = early[0]
        peer = _Peer(
            engine_id=request.consumer_engine_id,
            host=request.consumer_host,
            port=request.consumer_port,
            lease_seconds=self.config.lease_seconds,
            descriptor=EndpointDescriptor.from_dict(request.consumer_transport),
        )
        target = _PushTarget(request, peer)
        self._push_targets[key] = target
        return target

    def _push_blocks(
        self, target: _PushTarget, key: str, block_ids: Sequence[int], layer: int, upto: int
    ) -> TransferHandle | None:
        """Write the layer's blocks `[pushed, upto)` of the consumer's range, if any."""
        first = target.request.first_block
        last = first + len(target.request.block_ids)
        start = max(target.blocks_pushed.get(layer, first), first)
        end = min(upto, last, len(block_ids))
        if end <= start:
            return None
        src = list(block_ids[start:end])
        dst = target.request.block_ids[start - first : end - first]
        copies = [BlockCopy(kv_region_name(layer, kind), src, dst) for kind in ("k", "v")]
        target.blocks_pushed[layer] = end
        return self.transport.push(target.peer.descriptor, copies, tag=key)

    def _finish_push(self, target: _PushTarget, spec: HoldSpec) -> None:
        """The prompt finished: write everything not written yet (every layer, the partial last
        block included); `_advance_pushes` reports and releases once it landed."""
        upto = -(-spec.num_tokens // self.block_size)
        for layer in range(self._num_layers):
            handle = self._push_blocks(target, spec.key, spec.block_ids, layer, upto)
            if handle is not None:
                target.handles.append(handle)
        target.final = True

    def _fail_push(self, key: str, message: str) -> None:
        with self._lock:
            target = self._push_targets.pop(key, None)
            self._release(key, "released")
        if target is not None:
            self.client.notify(target.peer.host, target.peer.port,
                               PushDone(key=key, ok=False, message=message))  # fmt: skip

    def _advance_pushes(self, now: float) -> None:
        with self._lock:
            late = [k for k in self._early_pushes if k in self._held]
            late_targets = [(self._push_target(k), self._held[k]) for k in late]
        for target, held in late_targets:  # the consumer asked after the prompt finished
            assert target is not None
            spec = HoldSpec(held.request_id, target.request.key, held.block_ids, held.num_tokens)
            self._finish_push(target, spec)
        with self._lock:
            finals = [(k, t) for k, t in self._push_targets.items() if t.final]
            for key, (_, arrived) in list(self._early_pushes.items()):
                if now - arrived > self.config.lease_seconds:
                    del self._early_pushes[key]  # its prompt never came (bounded by time too)
        for key, target in finals:
            states = [h.poll() for h in target.handles]
            if any(s.state is TransferState.PENDING for s in states):
                continue
            failed = [s for s in states if s.state is TransferState.FAILED]
            if failed:
                self._fail_push(key, failed[0].failure.message if failed[0].failure else "")
                continue
            for status in states:
                self.stats.observe(status.elapsed_s, status.total_bytes, status.num_descriptors)
            with self._lock:
                self._push_targets.pop(key, None)
                self._release(key, "released")
            self.client.notify(target.peer.host, target.peer.port, PushDone(key=key, ok=True))
