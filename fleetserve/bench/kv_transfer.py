"""`fleetserve bench kv-transfer`: throughput and latency of the KV transports on loopback.

One run, two processes. A producer process allocates a KV cache (in a shared-memory arena, as an
engine that offers the same-host path does) and serves it over `tcp` and `mooncake`; this process
is the consumer and pulls blocks from it:

- throughput of `tcp` (the socket path), `tcp` same-host (shared memory), `mooncake` (its TCP
  transport), and a plain single-threaded memcpy of the same bytes inside this process, for each
  size (default 4 MiB and 64 MiB of blocks);
- a plain socket for reference: the same byte counts over one TCP stream between the two
  processes (`sendall` / `recv_into`, no protocol), what one socket moves here at the same time;
- the 4 KiB round trip (one block pulled, submit to completion) of `tcp`, `tcp` same-host,
  `mooncake` through our transport (which first checks the peer's namespace: two Mooncake round
  trips) and Mooncake's raw `batch_transfer_sync_read` for reference.

Layout: 4 layers x {k, v} regions of 32 KiB blocks (16 tokens x 8 KV heads x 128 x bf16),
contiguous block ids (one run per region; `--scattered` takes every other block instead, so
nothing coalesces). Each figure is the median of `--iterations` timed pulls, after warm-up
pulls whose bytes are checked against the producer's. The timed pulls are spread over
`--passes` passes over all cases (each case back to back within a pass, after untimed warm-up
pulls), so that load from elsewhere on the machine hits every case alike.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fleetserve.bench.plain_socket import SocketSink, SocketSource
from fleetserve.engine.kv_transfer.transport import (
    BlockCopy,
    EndpointDescriptor,
    KVTransport,
    SharedKVArena,
    TcpConfig,
    TcpTransport,
    TransferState,
    kv_region_name,
)

LAYERS = 4
BLOCK_SHAPE = (16, 8, 128)  # tokens per block, KV heads, head size
DTYPE = torch.bfloat16
BLOCK_BYTES = 16 * 8 * 128 * 2
RTT_BYTES = 4096
SOCKET_ROW = "plain socket (1 stream, no protocol)"
TARGETS = {"tcp_over_mooncake": 3.0, "same_host_over_memcpy": 0.25, "rtt_p50_us": 200.0}


def _caches(num_blocks: int, seed: int | None, arena: bool) -> tuple[list[torch.Tensor], Any]:
    """LAYERS [2, num_blocks, *BLOCK_SHAPE] tensors plus a [2, 4 KiB] region for round trips."""
    shapes = [(2, num_blocks, *BLOCK_SHAPE)] * LAYERS + [(2, RTT_BYTES // 2)]
    shared = SharedKVArena.create(shapes, DTYPE) if arena else None
    tensors = shared.tensors if shared else [torch.zeros(s, dtype=DTYPE) for s in shapes]
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for t in tensors:
            bits = torch.randint(-(2**15), 2**15, t.shape, generator=generator, dtype=torch.int16)
            t.view(torch.int16).copy_(bits)
    return tensors, shared


def _register(transport: KVTransport, tensors: list[torch.Tensor], shared: Any) -> None:
    transport.register_kv_caches(tensors[:LAYERS], shared=shared)
    transport.register_region("rtt", tensors[LAYERS], layer=LAYERS, shared=shared)


def _producer(conn: Any, num_blocks: int, with_mooncake: bool) -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    tensors, arena = _caches(num_blocks, seed=0, arena=True)
    transports: list[KVTransport] = [TcpTransport("bench-producer")]
    if with_mooncake:
        from fleetserve.engine.kv_transfer.transport.mooncake import MooncakeTransport

        transports.append(MooncakeTransport("bench-producer"))
    for transport in transports:
        _register(transport, tensors, arena)
    source = SocketSource(num_blocks * LAYERS * 2 * BLOCK_BYTES)
    conn.send(
        {
            "descriptors": {t.kind: t.descriptor().to_dict() for t in transports},
            "socket_port": source.port,
        }
    )
    conn.recv()
    source.close()
    for transport in transports:
        transport.close()
    arena.close()


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    gb_s: dict[str, float]
    """Size label -> GB/s (1e9 bytes per second) of the median pull."""


def _copies(blocks_per_region: int, scattered: bool) -> list[BlockCopy]:
    step = 2 if scattered else 1
    ids = list(range(0, blocks_per_region * step, step))
    return [BlockCopy(kv_region_name(layer, k), ids, ids) for layer in range(LAYERS) for k in "kv"]


def _timed_passes(
    cases: dict[tuple[str, str], Callable[[], None]], iterations: int, passes: int, warmup: int
) -> dict[tuple[str, str], list[float]]:
    """Time `iterations` calls of every case, spread over `passes` passes over all cases. In a
    pass each case runs `warmup` untimed calls, then its share of timed calls back to back
    (steady state); passes rotate the order, so a burst of load from elsewhere on the machine
    lands on all cases alike instead of on whichever ran during it."""
    keys = list(cases)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    per_pass = [iterations // passes + (p < iterations % passes) for p in range(passes)]
    for p, count in enumerate(per_pass):
        for key in keys[p % len(keys) :] + keys[: p % len(keys)]:
            for _ in range(warmup):
                cases[key]()
            for _ in range(count):
                start = time.perf_counter()
                cases[key]()
                times[key].append(time.perf_counter() - start)
    return times


def _pull_fn(
    transport: KVTransport, peer: EndpointDescriptor, copies: list[BlockCopy], same_host: bool
) -> Callable[[], None]:
    def pull() -> None:
        status = transport.pull(peer, copies, timeout=60).wait(90)
        if status.state is not TransferState.DONE:
            raise RuntimeError(f"{transport.kind} pull failed: {status.failure}")
        if status.same_host is not same_host:
            raise RuntimeError(
                f"{transport.kind}: same-host path {status.same_host}, expected {same_host}"
            )

    return pull


def _check(
    local: list[torch.Tensor], expected: list[torch.Tensor], copies: list[BlockCopy], what: str
) -> None:
    for copy in copies:
        layer, kind = int(copy.region.split(".")[1]), "kv".index(copy.region[-1])
        ids = list(copy.dst_block_ids)
        got, want = local[layer].view(torch.int16), expected[layer].view(torch.int16)
        if not torch.equal(got[kind, ids], want[kind, ids]):  # bits: random bf16 has NaNs
            raise RuntimeError(f"{what}: pulled bytes differ from the producer's")
        local[layer][kind, ids] = 0  # the next check sees fresh bytes only


def _percentiles(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1e6, p99 * 1e6


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    step = 2 if args.scattered else 1
    per_region = {s: s * (1 << 20) // (LAYERS * 2 * BLOCK_BYTES) for s in sizes}
    if any(n < 1 for n in per_region.values()):
        raise ValueError(f"--sizes-mib must be at least {LAYERS * 2 * BLOCK_BYTES >> 20} MiB")
    num_blocks = max(per_region.values()) * step
    with_mooncake = "mooncake" in args.transports
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    producer = ctx.Process(target=_producer, args=(child, num_blocks, with_mooncake), daemon=True)
    producer.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("the producer process did not start within 120 s")
        hello = conn.recv()
        peers = {k: EndpointDescriptor.from_dict(v) for k, v in hello["descriptors"].items()}
        sink = SocketSink(hello["socket_port"], num_blocks * LAYERS * 2 * BLOCK_BYTES)
        try:
            return _measure(args, sizes, per_region, num_blocks, peers, sink)
        finally:
            sink.close()
    finally:
        conn.send("exit")
        producer.join(30)


def _measure(
    args: argparse.Namespace,
    sizes: list[int],
    per_region: dict[int, int],
    num_blocks: int,
    peers: dict[str, EndpointDescriptor],
    sink: SocketSink,
) -> dict[str, Any]:
    expected, _ = _caches(num_blocks, seed=0, arena=False)
    local, _ = _caches(num_blocks, seed=None, arena=False)
    transports: dict[str, tuple[KVTransport, str, bool]] = {}
    if "tcp" in args.transports:
        transports["tcp"] = (
            TcpTransport("bench-consumer", config=TcpConfig(same_host=False)),
            "tcp",
            False,
        )
    if "tcp-shm" in args.transports:
        transports["tcp same-host (shm)"] = (TcpTransport("bench-consumer-shm"), "tcp", True)
    if "mooncake" in args.transports:
        from fleetserve.engine.kv_transfer.transport.mooncake import MooncakeTransport

        transports["mooncake (tcp)"] = (MooncakeTransport("bench-consumer"), "mooncake", False)
    for transport, _, _ in transports.values():
        _register(transport, local, None)
    one = [BlockCopy("rtt", [0], [0])]
    bulk: dict[tuple[str, str], Callable[[], None]] = {}
    small: dict[tuple[str, str], Callable[[], None]] = {}
    try:
        for name, (transport, kind, same_host) in transports.items():
            for size in sizes:
                copies = _copies(per_region[size], args.scattered)
                pull = _pull_fn(transport, peers[kind], copies, same_host)
                pull()
                _check(local, expected, copies, name)
                bulk[(name, f"{size} MiB")] = pull
            small[(name, "4 KiB")] = _pull_fn(transport, peers[kind], one, same_host)
        for size in sizes:
            bulk[("memcpy (1 thread)", f"{size} MiB")] = _memcpy(
                local, expected, per_region[size], args.scattered
            )
            bulk[(SOCKET_ROW, f"{size} MiB")] = sink.reader(size << 20)
        raw = None
        if "mooncake" in args.transports:
            raw = _MooncakeRaw(peers["mooncake"])
            small[("mooncake raw batch_transfer_sync_read", "4 KiB")] = raw.read
        bulk_times = _timed_passes(bulk, args.iterations, args.passes, warmup=2)
        small_times = _timed_passes(small, args.rtt_iterations, args.passes, warmup=20)
        if raw is not None:
            raw.close()
    finally:
        for transport, _, _ in transports.values():
            transport.close()
    rows: dict[str, dict[str, float]] = {}
    for (name, label), times in bulk_times.items():
        nbytes = int(label.split()[0]) * (1 << 20)
        rows.setdefault(name, {})[label] = nbytes / statistics.median(times) / 1e9
    rtt = {name: _percentiles(times) for (name, _), times in small_times.items()}
    return _summary(args, sizes, per_region, [Row(n, g) for n, g in rows.items()], rtt)


def _memcpy(
    local: list[torch.Tensor], source: list[torch.Tensor], blocks_per_region: int, scattered: bool
) -> Callable[[], None]:
    """The same bytes, region by region (one run each, or block by block when scattered)."""
    spans = []
    for copy in _copies(blocks_per_region, scattered):
        layer, kind = int(copy.region.split(".")[1]), "kv".index(copy.region[-1])
        dst, src = local[layer][kind], source[layer][kind]
        if scattered:
            spans += [
                (dst[b].data_ptr(), src[b].data_ptr(), BLOCK_BYTES) for b in copy.dst_block_ids
            ]
        else:
            spans.append((dst.data_ptr(), src.data_ptr(), len(copy.dst_block_ids) * BLOCK_BYTES))

    def copy_all() -> None:
        for dst_ptr, src_ptr, nbytes in spans:
            ctypes.memmove(dst_ptr, src_ptr, nbytes)

    return copy_all


class _MooncakeRaw:
    """Mooncake's own API, no transport around it: the reference 4 KiB read."""

    def __init__(self, peer: EndpointDescriptor) -> None:
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        if self._engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        self._buffer = torch.zeros(RTT_BYTES, dtype=torch.uint8)
        self._engine.register_memory(self._buffer.data_ptr(), RTT_BYTES)
        self._session = peer.extra["session"]
        self._remote = peer.extra["region_addrs"][peer.region_index("rtt")]

    def read(self) -> None:
        rc = self._engine.batch_transfer_sync_read(
            self._session, [self._buffer.data_ptr()], [self._remote], [RTT_BYTES]
        )
        if rc != 0:
            raise RuntimeError("mooncake raw read failed")

    def close(self) -> None:
        self._engine.unregister_memory(self._buffer.data_ptr())
        del self._engine


def _summary(
    args: argparse.Namespace,
    sizes: list[int],
    per_region: dict[int, int],
    rows: list[Row],
    rtt: dict[str, tuple[float, float]],
) -> dict[str, Any]:
    by_name = {r.name: r.gb_s for r in rows}
    ratios: dict[str, dict[str, float]] = {}
    for label in (f"{s} MiB" for s in sizes):
        pair = {}
        if "tcp" in by_name and "mooncake (tcp)" in by_name:
            pair["tcp_over_mooncake"] = by_name["tcp"][label] / by_name["mooncake (tcp)"][label]
        if "tcp" in by_name:
            pair["tcp_over_plain_socket"] = by_name["tcp"][label] / by_name[SOCKET_ROW][label]
        if "tcp same-host (shm)" in by_name:
            pair["same_host_over_memcpy"] = (
                by_name["tcp same-host (shm)"][label] / by_name["memcpy (1 thread)"][label]
            )
        ratios[label] = pair
    return {
        "layout": {
            "layers": LAYERS,
            "regions": LAYERS * 2,
            "block_bytes": BLOCK_BYTES,
            "blocks_per_size": {f"{s} MiB": per_region[s] * LAYERS * 2 for s in sizes},
            "scattered": args.scattered,
        },
        "iterations": args.iterations,
        "passes": args.passes,
        "rtt_iterations": args.rtt_iterations,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "rows": [asdict(r) for r in rows],
        "ratios": ratios,
        "rtt_us": {name: {"p50": p50, "p99": p99} for name, (p50, p99) in rtt.items()},
        "targets": TARGETS,
    }


def format_table(result: dict[str, Any]) -> str:
    layout = result["layout"]
    labels = list(layout["blocks_per_size"])
    head = [f"{label} ({layout['blocks_per_size'][label]} blocks)" for label in labels]
    lines = [
        f"kv-transfer on loopback: 2 processes, {result['cpus']} CPUs, load "
        f"{result['load_average'][0]:.2f}; {layout['layers']} layers x {{k,v}} regions, "
        f"{layout['block_bytes'] // 1024} KiB blocks, "
        f"{'scattered (every other block)' if layout['scattered'] else 'contiguous'} ids; "
        f"median of {result['iterations']} pulls in {result['passes']} passes",
        f"{'throughput GB/s':<40}" + "".join(f"{h:>26}" for h in head),
    ]
    for row in result["rows"]:
        lines.append(f"{row['name']:<40}" + "".join(f"{row['gb_s'][lb]:>26.2f}" for lb in labels))
    for label in labels:
        for key, value in result["ratios"][label].items():
            line = f"  {label}: {key.replace('_', ' ')} = {value:.2f}"
            if key in TARGETS:
                verdict = "meets" if value >= TARGETS[key] else "MISSES"
                line += f" ({verdict} the >= {TARGETS[key]:g} target)"
            lines.append(line)
    lines.append(
        f"{'4 KiB round trip':<40}{'p50 us':>12}{'p99 us':>12}   ({result['rtt_iterations']} pulls)"
    )
    for name, value in result["rtt_us"].items():
        verdict = (
            ""
            if "raw" in name
            else (
                "  meets <= 200 us"
                if value["p50"] <= TARGETS["rtt_p50_us"]
                else "  MISSES <= 200 us"
            )
        )
        lines.append(f"{name:<40}{value['p50']:>12.0f}{value['p99']:>12.0f}{verdict}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", default="4,64", help="comma-separated sizes in MiB")
    parser.add_argument("--iterations", type=int, default=25, help="timed pulls per size")
    parser.add_argument("--rtt-iterations", type=int, default=1000, help="timed 4 KiB pulls")
    parser.add_argument(
        "--passes", type=int, default=5, help="passes over all cases the iterations spread over"
    )
    parser.add_argument(
        "--transports",
        default="tcp,tcp-shm,mooncake",
        help="comma-separated subset of tcp,tcp-shm,mooncake",
    )
    parser.add_argument(
        "--scattered", action="store_true", help="pull every other block (no two blocks coalesce)"
    )
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")


def run_from_args(args: argparse.Namespace) -> int:
    chosen = [t for t in args.transports.split(",") if t]
    unknown = sorted(set(chosen) - {"tcp", "tcp-shm", "mooncake"})
    if unknown:
        raise ValueError(f"--transports: unknown {unknown}; choose from tcp, tcp-shm, mooncake")
    if args.passes < 1 or min(args.iterations, args.rtt_iterations) < args.passes:
        raise ValueError("--passes must be >= 1, and --iterations, --rtt-iterations >= --passes")
    args.transports = chosen
    result = run(args)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
