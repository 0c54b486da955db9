"""The transport's pure parts: descriptors, planning and coalescing, admission, handle states."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

from fleetserve.engine.kv_transfer.transport import (
    BlockCopy,
    EndpointDescriptor,
    FailureStage,
    RegionInfo,
    TcpConfig,
    TransferFailure,
    TransferState,
    TransferStatus,
    make_transport,
)
from fleetserve.engine.kv_transfer.transport.handle import Admission, Task, TaskState, Transfer
from fleetserve.engine.kv_transfer.transport.plan import coalesce, make_region, plan_transfer


def _regions(num_blocks: int = 16):
    cache = torch.zeros(2, num_blocks, 4, 2, 8, dtype=torch.int16)
    return {
        "layer.0.k": make_region("layer.0.k", cache[0], layer=0, arena=None),
        "layer.0.v": make_region("layer.0.v", cache[1], layer=0, arena=None),
    }


def _peer(num_blocks: int = 20, block_bytes: int = 128) -> EndpointDescriptor:
    return EndpointDescriptor(
        transport="tcp",
        engine_id="p",
        host="127.0.0.1",
        port=1,
        namespace="00" * 16,
        host_identity="h",
        regions=tuple(
            RegionInfo(n, 0, num_blocks, block_bytes, block_bytes)
            for n in ("layer.0.k", "layer.0.v")
        ),
    )


def test_coalesce_merges_runs_consecutive_on_both_sides_only() -> None:
    expected = [(1, 10, 3), (5, 50, 1), (9, 13, 1)]
    assert coalesce([5, 1, 2, 3, 9], [50, 10, 11, 12, 13]) == expected
    assert coalesce([1, 2, 3], [7, 8, 10]) == [(1, 7, 2), (3, 10, 1)]
    assert coalesce([1, 2], [3, 4], allow=False) == [(1, 3, 1), (2, 4, 1)]
    assert coalesce([], []) == []
    # The vectorised path (long lists) agrees with the loop.
    src = [*range(100, 400), 7, *range(500, 600, 2)]
    dst = [*range(1000, 1150), *range(2000, 2150), 3, *range(50)]
    assert coalesce(src, dst) == [(7, 3, 1), (100, 1000, 150), (250, 2000, 150)] + [
        (500 + 2 * i, i, 1) for i in range(50)
    ]
    assert len(coalesce(range(300), range(300), allow=False)) == 300


def test_plan_orders_by_layer_and_counts_descriptors() -> None:
    runs = plan_transfer(
        "pull",
        _regions(),
        _peer(),
        [
            BlockCopy("layer.0.v", range(10), range(4, 14)),
            BlockCopy("layer.0.k", [3, 9, 4], [0, 1, 2]),
        ],
    )
    assert [(r.local.name, r.remote_start, r.local_start, r.num_blocks) for r in runs] == [
        ("layer.0.k", 3, 0, 1),
        ("layer.0.k", 4, 2, 1),
        ("layer.0.k", 9, 1, 1),
        ("layer.0.v", 0, 4, 10),
    ]
    push = plan_transfer("push", _regions(), _peer(), [BlockCopy("layer.0.k", [0, 1], [18, 19])])
    assert [(r.local_start, r.remote_start, r.nbytes) for r in push] == [(0, 18, 256)]


@pytest.mark.parametrize(
    ("copy", "message"),
    [
        (BlockCopy("layer.9.k", [0], [0]), "no local region 'layer.9.k'"),
        (BlockCopy("layer.0.k", [20], [0]), r"\(peer\): block id 20 out of range \[0, 20\)"),
        (BlockCopy("layer.0.k", [0], [16]), r"\(local\): block id 16 out of range \[0, 16\)"),
        (BlockCopy("layer.0.k", [0, 1], [2, 2]), "destination block 2 given twice"),
        (BlockCopy("layer.0.k", [0.5], [1]), "block ids must be ints"),
    ],
)
def test_plan_refuses_what_cannot_be_valid(copy: BlockCopy, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_transfer("pull", _regions(), _peer(), [copy])


def test_plan_refuses_mismatched_blocks_and_unknown_peer_regions() -> None:
    with pytest.raises(ValueError, match=r"local blocks are 128 B .* the peer's 256 B"):
        plan_transfer(
            "pull", _regions(), _peer(block_bytes=256), [BlockCopy("layer.0.k", [0], [0])]
        )
    peer = dataclasses.replace(_peer(), regions=_peer().regions[:1])
    with pytest.raises(ValueError, match=r"peer engine 'p' has no region 'layer\.0\.v'"):
        plan_transfer("pull", _regions(), peer, [BlockCopy("layer.0.v", [0], [0])])
    with pytest.raises(ValueError, match="2 source block ids but 1 destination"):
        BlockCopy("layer.0.k", [0, 1], [0])


def test_regions_must_be_cpu_blocks_that_do_not_overlap() -> None:
    with pytest.raises(ValueError, match="CPU tensors only, got device meta"):
        make_region("r", torch.empty(4, 8, device="meta"), layer=0, arena=None)
    with pytest.raises(ValueError, match=r"each block .* must be contiguous"):
        make_region("r", torch.zeros(4, 8, 2).transpose(1, 2), layer=0, arena=None)
    strided = torch.zeros(6, 2, 16)[:, 0]
    region = make_region("r", strided, layer=1, arena=None)
    assert (region.block_bytes, region.block_stride, region.contiguous) == (64, 128, False)
    assert len(region.view) == 5 * 128 + 64


def test_descriptor_round_trips_through_json_and_names_bad_fields() -> None:
    transport = make_transport("tcp", "e1")
    try:
        transport.register_kv_caches([torch.zeros(2, 3, 4, dtype=torch.float16)])
        descriptor = transport.descriptor()
        again = EndpointDescriptor.from_dict(json.loads(json.dumps(descriptor.to_dict())))
        assert again == descriptor
        assert [r.name for r in again.regions] == ["layer.0.k", "layer.0.v"]
        assert again.regions[0] == RegionInfo("layer.0.k", 0, 3, 8, 8)
        with pytest.raises(ValueError, match="already registered"):
            transport.register_region("layer.0.k", torch.zeros(3, 4), layer=0)
    finally:
        transport.close()
    data = descriptor.to_dict()
    data["port"] = "80"
    with pytest.raises(ValueError, match="descriptor field 'port' must be int, got '80'"):
        EndpointDescriptor.from_dict(data)
    data = descriptor.to_dict()
    data["regions"][0]["num_blocks"] = None
    with pytest.raises(ValueError, match="region field 'num_blocks' must be int"):
        EndpointDescriptor.from_dict(data)
    with pytest.raises(ValueError, match="unknown kv transport 'nixl'; expected one of tcp"):
        make_transport("nixl", "e")


def test_tcp_config_names_bad_fields() -> None:
    with pytest.raises(ValueError, match=r"TcpConfig.lanes_per_peer must be >= 1, got 0"):
        TcpConfig(lanes_per_peer=0)
    with pytest.raises(ValueError, match=r"TcpConfig\.progress_timeout must be > 0 seconds"):
        TcpConfig(progress_timeout=0)
    with pytest.raises(ValueError, match="must not exceed max_inflight_bytes"):
        TcpConfig(chunk_bytes=1 << 20, max_inflight_bytes=1 << 10)


def _transfer(admission: Admission, finished: list, deadline: float = 1e18) -> Transfer:
    return Transfer(
        1,
        "p",
        layers=[0, 1],
        total_bytes=0,
        num_descriptors=0,
        same_host=False,
        deadline=deadline,
        admission=admission,
        on_finish=lambda transfer, status: finished.append(transfer),
    )


def test_admission_bounds_tasks_and_bytes_in_fifo_order() -> None:
    admission = Admission(max_tasks=2, max_bytes=100)
    dispatched: list[Task] = []
    transfer = _transfer(admission, [])
    tasks = [Task(transfer, 0, n, None, dispatched.append) for n in (60, 30, 30, 200)]
    for task in tasks:
        transfer.add_task(task)
    admission.submit(transfer.start())
    assert dispatched == tasks[:2] and (admission.tasks, admission.bytes) == (2, 90)
    admission.release(tasks[0])  # 30 in flight: the next 30 fits, the 200 waits for an empty pipe
    assert dispatched == tasks[:3]
    admission.release(tasks[1])
    admission.release(tasks[2])
    assert dispatched == tasks  # alone, a task larger than the bound still goes
    assert (admission.peak_tasks, admission.peak_bytes) == (2, 200)


def test_a_failed_transfer_is_reported_only_once_its_running_tasks_retired() -> None:
    admission = Admission(10, 10**9)
    finished: list[Transfer] = []
    transfer = _transfer(admission, finished)
    a, b, c = (Task(transfer, layer, 10, None, lambda t: None) for layer in (0, 0, 1))
    for task in (a, b, c):
        transfer.add_task(task)
    admission.submit(transfer.start())
    assert transfer.claim(a, None) and transfer.claim(b, None)
    transfer.retire(a, TransferFailure(FailureStage.RECEIVE, "lost", quiesced=True))
    # b still runs (it may be writing): not FAILED yet; c never starts.
    assert transfer.poll().state is TransferState.PENDING and c.state is TaskState.RETIRED
    assert not transfer.claim(c, None)
    transfer.retire(b)
    status = transfer.poll()
    assert status.state is TransferState.FAILED and status.failure.stage is FailureStage.RECEIVE
    assert finished == [transfer] and admission.tasks == 0
    assert transfer.layer_state(1) is TransferState.FAILED


class _HeldAdmission(Admission):
    """Admission whose release of one task waits for an event (a runner descheduled there)."""

    def __init__(self) -> None:
        super().__init__(10, 10**9)
        self.hold: Task | None = None
        self.go = threading.Event()

    def release(self, task: Task) -> None:
        if task is self.hold:
            self.go.wait(10)
        super().release(task)


def test_the_outcome_is_published_only_after_every_release_and_the_report() -> None:
    """A caller that sees DONE must see it in the transport's stats too: the last task's runner
    settles the transfer while another runner has retired its task but not yet released its
    admission share, and the transport's report is slow. wait() returns after both."""
    admission = _HeldAdmission()
    reported = threading.Event()
    seen_by_report: list[TransferState] = []

    def on_finish(transfer: Transfer, status: TransferStatus) -> None:
        seen_by_report.append(status.state)
        assert transfer.poll().state is TransferState.PENDING  # not published yet
        reported.wait(10)

    transfer = Transfer(1, "p", layers=[0], total_bytes=20, num_descriptors=1, same_host=False,
                        deadline=1e18, admission=admission, on_finish=on_finish)  # fmt: skip
    a, b = (Task(transfer, 0, 10, None, lambda t: None) for _ in range(2))
    for task in (a, b):
        transfer.add_task(task)
    admission.submit(transfer.start())
    assert transfer.claim(a, None) and transfer.claim(b, None)
    admission.hold = a
    first = threading.Thread(target=transfer.retire, args=(a,))
    first.start()
    last = threading.Thread(target=transfer.retire, args=(b,))
    last.start()
    deadline = time.monotonic() + 10
    while not seen_by_report and time.monotonic() < deadline:
        time.sleep(0.001)
    assert seen_by_report == [TransferState.DONE] and transfer.settled
    reported.set()
    last.join(10)
    # Reported, but a's share is not released yet: still PENDING, and a's share is in flight.
    assert transfer.wait(0.05).state is TransferState.PENDING and admission.tasks == 1
    admission.go.set()
    assert transfer.wait(10).state is TransferState.DONE
    assert admission.tasks == 0 and admission.bytes == 0
    first.join(10)
    # A settled outcome stays: a late failure changes nothing.
    assert transfer.fail(TransferFailure(FailureStage.TIMEOUT, "late", quiesced=True)) == []
    assert transfer.poll().state is TransferState.DONE and seen_by_report == [TransferState.DONE]


def test_unstoppable_work_makes_a_timeout_unquiesced_at_once() -> None:
    admission = Admission(10, 10**9)
    transfer = _transfer(admission, [], deadline=time.monotonic() + 0.01)
    task = Task(transfer, 0, 1, None, lambda t: None, abortable=False, bounded=False)
    transfer.add_task(task)
    transfer.add_task(Task(transfer, 1, 1, None, lambda t: None))
    admission.submit(transfer.start())
    assert transfer.claim(task, None)
    time.sleep(0.02)
    assert transfer.expire(time.monotonic()) == [task]
    status = transfer.poll()
    assert status.state is TransferState.FAILED
    assert status.failure.stage is FailureStage.TIMEOUT and not status.failure.quiesced


def test_layers_finish_independently_and_seals_run_last() -> None:
    admission = Admission(10, 10**9)
    ran: list[Task] = []
    transfer = _transfer(admission, [])
    data0, data1 = Task(transfer, 0, 5, None, ran.append), Task(transfer, 1, 5, None, ran.append)
    seal0 = Task(transfer, 0, 0, "seal", ran.append)
    transfer.add_task(data0)
    transfer.add_task(data1)
    transfer.add_seal(seal0)
    admission.submit(transfer.start())
    assert ran == [data0, data1]
    for task in (data1, data0):
        assert transfer.claim(task, None)
        transfer.retire(task)
    assert transfer.layer_state(1) is TransferState.DONE
    assert transfer.layer_state(0) is TransferState.PENDING and ran[-1] is seal0
    assert transfer.claim(seal0, None)
    transfer.retire(seal0)
    assert transfer.wait(0).state is TransferState.DONE and transfer.poll().bytes_done == 10
