"""`fleetserve dev-cluster up|down|status|logs`: argparse wiring over `cluster` and friends.

The top-level CLI calls `register(subparsers)`; `python -m fleetserve.devcluster` works alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fleetserve.devcluster.binaries import Binaries, default_bin_dir
from fleetserve.devcluster.state import default_cluster_dir, load_state

# The handlers import `cluster` and `kube` (the kubernetes client, ~0.2 s) when they run, so that
# registering the command keeps `fleetserve --help` fast.

__all__ = ["register"]


def _cmd_up(args: argparse.Namespace) -> int:
    from fleetserve.devcluster.cluster import ClusterConfig, up
    from fleetserve.devcluster.nodes import NodeTopology

    cfg = ClusterConfig(
        dir=args.dir,
        topology=NodeTopology(gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node),
        local_node=args.local_node,
        local_node_cpus=args.local_node_cpus,
        local_node_memory_gib=args.local_node_memory_gib,
        local_node_gpus=args.local_node_gpus,
        kueue=args.kueue,
    )
    t0 = time.monotonic()
    try:
        state = up(cfg)
    except (FileExistsError, FileNotFoundError) as e:  # already running / binaries not built
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (TimeoutError, RuntimeError) as e:
        print(f"error: {e}\nlogs: {args.dir / 'logs'}; run `down` to clean up", file=sys.stderr)
        return 1
    print(f"dev cluster up in {time.monotonic() - t0:.1f}s; API {state.server}", file=sys.stderr)
    print(f"  export KUBECONFIG={state.kubeconfig}", file=sys.stderr)
    print(state.kubeconfig)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from fleetserve.devcluster.cluster import down

    if load_state(args.dir.resolve()) is None:
        print(f"no dev cluster in {args.dir}", file=sys.stderr)
        return 0
    stopped = down(args.dir)
    print(
        f"dev cluster down; stopped {', '.join(stopped) or 'nothing (already stopped)'}",
        file=sys.stderr,
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from fleetserve.devcluster import kube

    state = load_state(args.dir.resolve())
    if state is None:
        print(f"no dev cluster in {args.dir}")
        return 1
    print(f"dir:        {state.dir}\nAPI:        {state.server}\nkubeconfig: {state.kubeconfig}")
    kubectl = Binaries(default_bin_dir()).kubectl
    if kubectl.exists():
        print(f"kubectl:    {kubectl}")
    alive = True
    for p in state.processes:
        up_ = p.is_alive()
        alive &= up_
        print(f"  {p.name:24} pid {p.pid:<8} {'running' if up_ else 'STOPPED'}")
    try:
        with kube.api_client(state.kubeconfig) as api:
            readiness = kube.node_readiness(api)
    except Exception as e:  # status reports an unreachable API instead of crashing on it
        print(f"  API unreachable: {e}")
        return 1
    for name, ready in sorted(readiness.items()):
        print(f"  node {name:19} {'Ready' if ready else 'NotReady'}")
    return 0 if alive else 1


def _cmd_logs(args: argparse.Namespace) -> int:
    state = load_state(args.dir.resolve())
    if state is None:
        print(f"no dev cluster in {args.dir}", file=sys.stderr)
        return 1
    pods_dir = state.logs_dir / "pods"
    pattern = f"{args.namespace}_{args.pod}_{args.container or '*'}.log"
    files = sorted(pods_dir.glob(pattern))
    if not files:
        # Control-plane components are also reachable: `logs kube-apiserver`.
        component = state.logs_dir / f"{args.pod}.log"
        if component.exists():
            files = [component]
        else:
            print(
                f"no logs for {args.namespace}/{args.pod} (only local-node pods have logs here)",
                file=sys.stderr,
            )
            return 1
    for path in files:
        if len(files) > 1:
            print(f"==> {path.name} <==")
        sys.stdout.write(path.read_text(errors="replace"))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `dev-cluster` with its `up|down|status|logs` subcommands; each sets `func(args) -> int`."""
    parser = subparsers.add_parser(
        "dev-cluster", help="a local Kubernetes control plane with fake GPU nodes and a local node",
        description="A real kube-apiserver, controller-manager and scheduler with kwok fake GPU nodes and "
        "one local node that runs pods as local processes. Binaries: make dev-cluster-bin.",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="dev_cluster_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=Path,
        default=default_cluster_dir(),
        help="state folder (default: %(default)s)",
    )

    p = sub.add_parser("up", parents=[common], help="start the cluster; prints the kubeconfig path")
    p.add_argument("--gpu-nodes", type=int, default=4, help="fake GPU nodes (default: %(default)s)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="nvidia.com/gpu per node (default: %(default)s)",
    )
    p.add_argument(
        "--local-node", action=argparse.BooleanOptionalAction, default=True,
        help="run the local node agent (pods run as local processes; default: on)",
    )  # fmt: skip
    p.add_argument(
        "--local-node-cpus", type=int, default=None,
        help="CPU capacity the local node advertises (default: this machine's)",
    )  # fmt: skip
    p.add_argument(
        "--local-node-memory-gib", type=int, default=None,
        help="memory capacity the local node advertises (default: this machine's)",
    )  # fmt: skip
    p.add_argument(
        "--local-node-gpus", type=int, default=0,
        help="nvidia.com/gpu the local node advertises, to run GPU pods here on the CPU (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--kueue", action=argparse.BooleanOptionalAction, default=False,
        help="also run Kueue (gang admission; LocalQueue fleetserve in namespace default, quota"
        " = the nodes' cpu, memory and GPUs; default: off)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser(
        "down", parents=[common], help="stop every process and remove the state folder"
    )
    p.set_defaults(func=_cmd_down)

    p = sub.add_parser("status", parents=[common], help="processes and node readiness")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("logs", parents=[common], help="print a local-node pod's container log")
    p.add_argument("pod", help="pod name (or a component: kube-apiserver, kwok, local-node, …)")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("-c", "--container", default=None, help="container (default: all)")
    p.set_defaults(func=_cmd_logs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.devcluster")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dev-cluster", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))
