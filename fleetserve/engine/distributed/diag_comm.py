"""`fleetserve diag comm`: a layered communication self-test of one group's ranks.

The seed's layered NCCL sanity script (notes part 3 §2.9), over the layers the engine uses, each
only after the one below it passed, so that the first failing layer names the likely cause:

1. `rendezvous`: every rank reaches the TCP store at the init address, all with one world size
   (else: a rank never joined, the leader's address or port is unreachable, or the ranks were
   started with different world sizes);
2. `device`: a plain all-reduce on the device backend (NCCL on CUDA, gloo on the CPU) equals
   world size (else, on GPUs, a hardware or driver fault; on the CPU, gloo cannot connect the
   ranks over the network interface it picked);
3. `gloo`: an all-reduce on a separate gloo group of CPU tensors, the engine's control channel
   (else the network interfaces: set GLOO_SOCKET_IFNAME to the pods' interface);
4. `shm`: fleetserve's own shared-memory all-reduce (`ShmAllReduce`) among the ranks of one host
   (skipped when they span hosts: the engine then uses gloo there too; else /dev/shm is missing
   or too small, or the ranks do not share it);
5. `cuda_graph`: an all-reduce captured in a CUDA graph, correct after replay (skipped on the CPU;
   else stream or capture semantics of the NCCL build).

`run_rank` runs one rank (`python -m fleetserve.engine.distributed.diag_comm`, one JSON line per
layer on stdout as it finishes); `diagnose` starts this host's ranks, bounds each by
`timeout_s` per layer, and names a rank that hangs by the layer it did not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fleetserve.common.ports import free_port

if TYPE_CHECKING:
    from fleetserve.envs import Env

__all__ = [
    "CAUSES",
    "LAYERS",
    "LayerResult",
    "add_arguments",
    "diagnose",
    "first_failure",
    "group_ranks",
    "run_from_args",
    "run_rank",
]

LAYERS = ("rendezvous", "device", "gloo", "shm", "cuda_graph")
CAUSES = {
    "rendezvous": "a rank never joined, the leader's address or port is unreachable, or the "
    "ranks were started with different world sizes",
    "device": "a hardware or driver fault of the GPUs or their links (NCCL_DEBUG=INFO says more)",
    "device/gloo": "gloo cannot connect the ranks over the interface it picked (on the CPU the "
    "device backend is gloo; set GLOO_SOCKET_IFNAME to the interface the pods share)",
    "gloo": "the network interfaces: gloo cannot connect the ranks (set GLOO_SOCKET_IFNAME to "
    "the interface the pods share)",
    "shm": "fleetserve's shared-memory all-reduce: /dev/shm is missing, too small or not shared "
    "by the ranks of this host (pods need a memory-backed /dev/shm)",
    "cuda_graph": "stream or capture semantics: NCCL inside a CUDA graph (NCCL version, "
    "NCCL_GRAPH_MIXING_SUPPORT)",
}
"""The likely cause when a layer fails (seed notes part 3 §2.9); 'device/gloo' is the device
layer's on the CPU."""
_NUMEL = 1024
"""Elements per test all-reduce: a decode step's size, under the shared-memory threshold."""


@dataclass(frozen=True, slots=True)
class LayerResult:
    layer: str
    rank: int
    status: str
    """'ok', 'failed' or 'skipped'."""
    detail: str = ""
    cause: str = ""
    """The likely cause (`CAUSES`) when failed."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _failed(layer: str, rank: int, detail: str, backend: str = "nccl") -> LayerResult:
    cause = CAUSES["device/gloo" if layer == "device" and backend == "gloo" else layer]
    return LayerResult(layer, rank, "failed", detail, cause)


def _expect(tensor: Any, world_size: int) -> str:
    """'' if every element equals world_size, else what came instead."""
    got = sorted({float(v) for v in tensor.flatten().tolist()})
    return "" if got == [float(world_size)] else f"sum gave {got[:4]}, expected {world_size}"


def _rendezvous(rank: int, world_size: int, init_method: str, timeout_s: float) -> Any:
    """Join the TCP store; every rank checks its world size against rank 0's.

    Raises:
        RuntimeError: a rank did not join in time or the world sizes differ (on every rank,
            through the store's 'abort' key).
    """
    import torch.distributed as dist

    url = urlsplit(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://HOST:PORT, got {init_method!r}")
    store = dist.TCPStore(
        url.hostname, url.port, None, rank == 0, timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
    store.set(f"world_size/{rank}", str(world_size))
    theirs = int(store.get("world_size/0"))
    if theirs != world_size:
        reason = f"rank {rank} was started with world size {world_size}, rank 0 with {theirs}"
        store.set("abort", reason)
        raise RuntimeError(reason)
    store.add("joined", 1)
    deadline = time.monotonic() + timeout_s
    while (joined := store.add("joined", 0)) < world_size:
        if store.check(["abort"]):
            raise RuntimeError(store.get("abort").decode())
        if time.monotonic() > deadline:
            raise RuntimeError(f"{joined} of {world_size} ranks joined within {timeout_s:.0f} s")
        time.sleep(0.05)
    return store


def run_rank(
    rank: int, world_size: int, init_method: str, device: str, timeout_s: float
) -> list[LayerResult]:
    """Run every layer on this rank (printing each result as a JSON line as it finishes).

    Collective: every rank of the group calls it with the same world size and init method.
    """
    import torch
    import torch.distributed as dist

    from fleetserve.engine.distributed.parallel_state import device_backend
    from fleetserve.engine.distributed.shm_allreduce import ShmAllReduce
    from fleetserve.engine.kv_transfer.transport.shm import host_identity

    results: list[LayerResult] = []

    def report(result: LayerResult) -> None:
        results.append(result)
        print(result.to_json(), flush=True)

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    timeout = timedelta(seconds=timeout_s)
    store = None
    try:
        try:
            store = _rendezvous(rank, world_size, init_method, timeout_s)
            report(LayerResult("rendezvous", rank, "ok", f"{world_size} ranks at {init_method}"))
        except Exception as exc:
            report(_failed("rendezvous", rank, f"{type(exc).__name__}: {exc}"))
            return results
        backend = device_backend(dev)
        try:
            dist.init_process_group(
                backend, store=dist.PrefixStore("pg", store), rank=rank,
                world_size=world_size, timeout=timeout,
            )  # fmt: skip
            tensor = torch.ones(_NUMEL, device=dev)
            dist.all_reduce(tensor)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wrong = _expect(tensor.cpu(), world_size)
            report(
                _failed("device", rank, wrong, backend)
                if wrong
                else LayerResult("device", rank, "ok", f"{backend} all-reduce")
            )
            if wrong:
                return results
        except Exception as exc:
            report(_failed("device", rank, f"{backend}: {type(exc).__name__}: {exc}", backend))
            return results
        try:
            gloo = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
            tensor = torch.ones(_NUMEL)
            dist.all_reduce(tensor, group=gloo)
            wrong = _expect(tensor, world_size)
            report(_failed("gloo", rank, wrong) if wrong else LayerResult("gloo", rank, "ok"))
            if wrong:
                return results
        except Exception as exc:
            report(_failed("gloo", rank, f"{type(exc).__name__}: {exc}"))
            return results
        try:
            hosts: list[Any] = [None] * world_size
            dist.all_gather_object(hosts, host_identity(), group=gloo)
            if len(set(hosts)) > 1:
                report(LayerResult("shm", rank, "skipped", "the ranks span hosts (gloo there)"))
            else:
                shm = ShmAllReduce.create(gloo, rank, world_size, timeout_s=timeout_s)
                if shm is None:
                    report(_failed("shm", rank, "a rank could not map the shared buffer"))
                    return results
                tensor = torch.ones(_NUMEL)
                shm.all_reduce(tensor)
                wrong = _expect(tensor, world_size)
                report(_failed("shm", rank, wrong) if wrong else LayerResult("shm", rank, "ok"))
                if wrong:
                    return results
        except Exception as exc:
            report(_failed("shm", rank, f"{type(exc).__name__}: {exc}"))
            return results
        if dev.type != "cuda":
            report(LayerResult("cuda_graph", rank, "skipped", "no CUDA device (GPUs only)"))
        else:
            report(_cuda_graph_layer(rank, world_size, dev))
        dist.barrier(group=gloo)
        return results
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if store is not None:
            _leave(store, rank, world_size, timeout_s)
        del store


def _leave(store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Say this rank is done with the store; rank 0, which hosts it, keeps it up until every
    rank has (or `timeout_s` passed). Otherwise a fast failure on rank 0 closes the store under
    a slower rank, which then fails its next store call (still in the rendezvous's poll, or in
    the device layer's init) with a closed connection: a second, false cause."""
    # NOTE: a store that is gone or failing here changes no result: the layers said why.
    with contextlib.suppress(Exception):
        store.add("done", 1)
        deadline = time.monotonic() + timeout_s
        while rank == 0 and store.add("done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)


def _cuda_graph_layer(rank: int, world_size: int, dev: Any) -> LayerResult:
    import torch
    import torch.distributed as dist

    try:
        tensor = torch.zeros(_NUMEL, device=dev)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dist.all_reduce(tensor)  # NOTE: warm-up outside the graph (NCCL's lazy init)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_reduce(tensor)
        tensor.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        wrong = _expect(tensor.cpu(), world_size)
        return (
            _failed("cuda_graph", rank, wrong) if wrong else LayerResult("cuda_graph", rank, "ok")
        )
    except Exception as exc:
        return _failed("cuda_graph", rank, f"{type(exc).__name__}: {exc}")


def first_failure(results: list[LayerResult]) -> LayerResult | None:
    """The failure at the lowest layer (then the lowest rank), or None."""
    failed = [r for r in results if r.status == "failed"]
    return min(failed, key=lambda r: (LAYERS.index(r.layer), r.rank), default=None)


def diagnose(
    ranks: list[int], world_size: int, init_method: str, device: str, timeout_s: float
) -> list[LayerResult]:
    """Run `ranks` of the group as processes on this host; every rank's results.

    A rank that has not finished within `timeout_s` per layer (plus start-up) is killed and its
    first unfinished layer reported failed, so a hang is named, never waited out.
    """
    for rank in ranks:
        if not 0 <= rank < world_size:
            raise ValueError(f"ranks must be in [0, {world_size}), got {rank}")
    argv = [sys.executable, "-m", "fleetserve.engine.distributed.diag_comm"]
    procs = {}
    for rank in ranks:
        flags = {"--rank": rank, "--world-size": world_size, "--init-method": init_method,
                 "--device": device, "--timeout": timeout_s}  # fmt: skip
        rank_argv = argv + [str(part) for item in flags.items() for part in item]
        procs[rank] = subprocess.Popen(rank_argv, stdout=subprocess.PIPE)
    bound = 30.0 + timeout_s * (len(LAYERS) + 1)
    deadline = time.monotonic() + bound
    results: list[LayerResult] = []
    for rank, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        mine = [LayerResult(**json.loads(line)) for line in out.decode().splitlines() if line]
        results += mine
        if not any(r.status == "failed" for r in mine) and len(mine) < len(LAYERS):
            layer = LAYERS[len(mine)]
            results.append(
                _failed(
                    layer, rank, f"did not finish within {bound:.0f} s (exit {proc.returncode})"
                )
            )
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`fleetserve diag comm`'s flags; the group comes from the pod's env when it has one."""
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks of the group (default: FLEETSERVE_WORLD_SIZE, else 2)")  # fmt: skip
    parser.add_argument("--ranks", default=None,
                        help="comma-separated ranks to run here (default: this pod's ranks)")  # fmt: skip
    parser.add_argument("--init-method", default=None,
                        help="tcp://HOST:PORT (default: the leader's diag port in a multi-pod "
                        "group, else a free local port)")  # fmt: skip
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds each layer may take on a rank")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON line per rank and layer")


def group_ranks(env: Env, world_size: int) -> tuple[list[int], str]:
    """This pod's ranks and the self-test's rendezvous: the leader's `DIAG_PORT` in a multi-pod
    group (from the rendered env), else every rank here at a free local port.

    Raises:
        ValueError: an inconsistent group env (`pod_group`).
    """
    from fleetserve.engine.distributed.pod_group import DIAG_PORT, pod_group

    group = pod_group(env, world_size)
    if group is not None:
        return list(group.local_ranks), f"tcp://{group.leader_address}:{DIAG_PORT}"
    return list(range(world_size)), f"tcp://127.0.0.1:{free_port()}"


def run_from_args(args: argparse.Namespace) -> int:
    """Run the self-test; 0 when no layer failed, else 1 (the first failure is named)."""
    from fleetserve.envs import read_env

    env = read_env()
    world = args.world_size or env.world_size or 2
    ranks, init_method = group_ranks(env, world)
    if args.ranks is not None:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    init_method = args.init_method or init_method
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    results = diagnose(ranks, world, init_method, device, args.timeout)
    for r in results:
        if args.json:
            print(r.to_json())
        else:
            line = f"rank {r.rank} {r.layer:<10} {r.status:<7} {r.detail}"
            print(line.rstrip() + (f"\n    likely cause: {r.cause}" if r.cause else ""))
    failure = first_failure(results)
    if failure is None:
        print(f"comm self-test passed: ranks {ranks} of {world} at {init_method}")
        return 0
    print(
        f"comm self-test FAILED at layer {failure.layer!r} (rank {failure.rank}): "
        f"{failure.detail}; likely cause: {failure.cause}",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fleetserve-diag-comm-rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    results = run_rank(args.rank, args.world_size, args.init_method, args.device, args.timeout)
    sys.exit(1 if first_failure(results) else 0)


if __name__ == "__main__":
    main()
