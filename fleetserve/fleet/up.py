"""`fleetserve up`: the local fleet on one machine, a prefill engine, a decode engine and the router.

Two `fleetserve serve` processes (the first a KV producer, the second its consumer, over the
`tcp` or `mooncake` connector) on loopback ports derived from the router's (`--port` + 101 and
+ 102 unless given), then `fleetserve router --discovery static` in front of them on
`--host:--port` (127.0.0.1:8000 by default). The engines start together; the router starts once
both answer 200 on /health, and the fleet is up when the router's /health answers 200 (the router
says so only after one real generation went through). Every line of each process is printed
prefixed by its name (`[prefill]`, `[decode]`, `[router]`); Ctrl-C or SIGTERM stops all three,
and when any one dies the others are stopped and the command exits 1 (`Supervisor`).

`--ask QUESTION` sends one chat completion through the router once it is up and prints the
answer and a `curl` line to try more (`make run`); `--once` exits after the answer.

Only the standard library, `fleetserve.fleet.supervisor` and `fleetserve.common.ports` are
imported: the supervising process never loads torch (the bundled model's folder is resolved by a
short child process).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.common.ports import bind_port, free_ports
from fleetserve.fleet.supervisor import Child, Supervisor, describe_exit

__all__ = [
    "DECODE_PORT_OFFSET",
    "PREFILL_PORT_OFFSET",
    "FleetPlan",
    "add_arguments",
    "ask",
    "curl_line",
    "plan_fleet",
    "register",
    "run_from_args",
]

PREFILL_PORT_OFFSET = 101
DECODE_PORT_OFFSET = 102
_ASK_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """What `fleetserve up` runs: the engines (stage 1), then the router (stage 2)."""

    engines: tuple[Child, Child]
    router: Child
    base_url: str
    model_name: str

    @property
    def stages(self) -> list[list[Child]]:
        return [list(self.engines), [self.router]]


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a port must be an integer, got {text!r}") from exc
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be in 0..65535, got {value}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder (default: the bundled SmolLM2-135M-Instruct)")  # fmt: skip
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients use (default: the model folder's name)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument("--port", type=_port, default=8000, help="the router's port (0: any free)")
    parser.add_argument("--prefill-port", type=_port, default=None,
                        help=f"prefill engine port (default: --port + {PREFILL_PORT_OFFSET}, any free one with --port 0; 0: any free)")  # fmt: skip
    parser.add_argument("--decode-port", type=_port, default=None,
                        help=f"decode engine port (default: --port + {DECODE_PORT_OFFSET}, any free one with --port 0; 0: any free)")  # fmt: skip
    parser.add_argument("--connector", choices=["tcp", "mooncake"], default="tcp",
                        help="the KV connector between the engines")  # fmt: skip
    parser.add_argument("--transfer-mode", choices=["pull", "push"], default="pull")
    parser.add_argument("--disaggregation", choices=["always", "selective", "never"],
                        default="always", help="the router's prefill/decode split")  # fmt: skip
    parser.add_argument("--min-uncached-tokens", type=int, default=None,
                        help="selective mode's threshold (default: the router's)")  # fmt: skip
    parser.add_argument("--prefix-aware", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--load-aware", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--dtype", default="auto", help="the engines' --dtype")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="the engines' --max-model-len"
    )
    parser.add_argument("--engine-args", default="",
                        help="more `fleetserve serve` flags for both engines, one shell-quoted string")  # fmt: skip
    parser.add_argument("--startup-timeout", type=_positive, default=600.0,
                        help="seconds each stage (engines, router) may take to come up")  # fmt: skip
    parser.add_argument("--grace-period", type=_positive, default=15.0,
                        help="seconds between SIGTERM and SIGKILL at shutdown")  # fmt: skip
    parser.add_argument("--ask", default=None, metavar="QUESTION",
                        help="once up, send this chat completion through the router and print the answer")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64, help="--ask: the answer's max tokens")
    parser.add_argument("--once", action="store_true",
                        help="exit after the --ask answer (default: serve until interrupted)")  # fmt: skip


def register(subparsers: Any) -> None:
    """Add the `up` subcommand to the top-level CLI's subparsers."""
    parser = subparsers.add_parser(
        "up", help="the local fleet: prefill + decode engines and the router on this machine"
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)


def _what(role: str) -> str:
    """How an error names `role`'s port: the role and the flag that sets it."""
    return f"the {role} port ({'--port' if role == 'router' else f'--{role}-port'})"


def _ports(args: argparse.Namespace) -> tuple[int, int, int]:
    """(router, prefill, decode) ports, each checked free now. Those left 0 are chosen together
    on loopback (where the engines listen) while the others are held, so all three differ."""
    ports = {"router": args.port}
    for role, given, offset in (
        ("prefill", args.prefill_port, PREFILL_PORT_OFFSET),
        ("decode", args.decode_port, DECODE_PORT_OFFSET),
    ):
        if given is None:
            # NOTE: with --port 0 the router's port is any free one, and so are the engines':
            # a port derived from a random one may be another connection's ephemeral port.
            given = args.port + offset if args.port else 0
        if given > 65535:
            raise ValueError(
                f"--port {args.port} + {offset} is no port for the {role} engine; pass --{role}-port"
            )
        ports[role] = given
    chosen = [port for port in ports.values() if port]
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"the router, prefill and decode ports must differ, got {ports}")
    unset = [role for role, port in ports.items() if port == 0]
    with ExitStack() as held:
        for role, port in ports.items():
            if port:
                # The engines listen on loopback whatever --host the router binds.
                host = args.host if role == "router" else "127.0.0.1"
                held.enter_context(bind_port(host, port, what=_what(role)))
        if unset:
            ports.update(zip(unset, free_ports(len(unset), "127.0.0.1"), strict=True))
        if "router" in unset:
            held.enter_context(bind_port(args.host, ports["router"], what=_what("router")))
    return ports["router"], ports["prefill"], ports["decode"]


def resolve_model(model: str | None) -> str:
    """The model folder: `model` checked, or the bundled one (converted on first use).

    The bundled model's folder comes from a child process so that this one never imports the
    engine (the conversion, once per machine, prints its progress there).

    Raises:
        ValueError: `model` is not a folder, or the bundled model cannot be prepared.
    """
    if model is not None:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"--model must be a Hugging Face model folder, got {model!r}")
        return str(path.resolve())
    code = "from fleetserve.engine.models.bundled import bundled_model_path as p; print(p())"
    out = subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=False
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise ValueError(
            f"the bundled model could not be prepared (`fleetserve models prepare`"
            f" {describe_exit(out.returncode)}); pass --model PATH"
        )
    return lines[-1]


def plan_fleet(args: argparse.Namespace, model: str, ports: tuple[int, int, int]) -> FleetPlan:
    """The three commands for `args` (pure: nothing is started or checked here).

    Raises:
        ValueError: an `--engine-args` string that does not split, or a negative threshold.
    """
    router_port, prefill_port, decode_port = ports
    name = args.served_model_name or Path(model).name
    try:
        extra = shlex.split(args.engine_args)
    except ValueError as exc:
        raise ValueError(f"--engine-args does not split as shell words: {exc}") from exc
    if args.min_uncached_tokens is not None and args.min_uncached_tokens < 0:
        raise ValueError(f"--min-uncached-tokens must be >= 0, got {args.min_uncached_tokens}")
    fleetserve = [sys.executable, "-m", "fleetserve"]
    loopback = "127.0.0.1"

    def engine(role: str, kv_role: str, port: int) -> Child:
        kv = {
            "connector": args.connector,
            "role": kv_role,
            "transfer_mode": args.transfer_mode,
            "host": loopback,
        }
        argv = [*fleetserve, "serve", model, "--served-model-name", name,
                "--host", loopback, "--port", str(port), "--dtype", args.dtype,
                "--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]  # fmt: skip
        if args.max_model_len is not None:
            argv += ["--max-model-len", str(args.max_model_len)]
        return Child(role, [*argv, *extra], health_url=f"http://{loopback}:{port}/health")

    prefill = engine("prefill", "producer", prefill_port)
    decode = engine("decode", "consumer", decode_port)
    router_argv = [
        *fleetserve, "router", "--discovery", "static",
        "--prefill", f"http://{loopback}:{prefill_port}",
        "--decode", f"http://{loopback}:{decode_port}",
        "--host", args.host, "--port", str(router_port),
        "--disaggregation", args.disaggregation,
    ]  # fmt: skip
    if args.min_uncached_tokens is not None:
        router_argv += ["--min-uncached-tokens", str(args.min_uncached_tokens)]
    if not args.prefix_aware:
        router_argv.append("--no-prefix-aware")
    if not args.load_aware:
        router_argv.append("--no-load-aware")
    client_host = loopback if args.host in ("0.0.0.0", "::", "") else args.host
    base_url = f"http://{client_host}:{router_port}"
    router = Child("router", router_argv, health_url=f"{base_url}/health")
    return FleetPlan((prefill, decode), router, base_url, name)


def curl_line(base_url: str, model: str) -> str:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}
    )
    return (
        f"curl -s {base_url}/v1/chat/completions -H 'Content-Type: application/json'"
        f" -d {shlex.quote(body)}"
    )


def ask(base_url: str, model: str, question: str, max_tokens: int) -> str:
    """One greedy chat completion through `base_url`; the answer's text.

    Raises:
        RuntimeError: the request failed (the message has the status and the error body).
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=_ASK_TIMEOUT_S) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"the chat completion failed: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"the chat completion failed: {exc}") from exc
    try:
        return str(answer["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"the chat completion answered no message: {answer!r}") from exc


def run_from_args(args: argparse.Namespace) -> int:
    if args.once and args.ask is None:
        raise ValueError("--once needs --ask QUESTION (it exits after the answer)")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    ports = _ports(args)
    model = resolve_model(args.model)
    plan = plan_fleet(args, model, ports)
    supervisor = Supervisor(
        plan.stages, startup_timeout_s=args.startup_timeout, grace_s=args.grace_period
    )
    supervisor.say(
        f"starting {model} as {plan.model_name!r}: prefill :{ports[1]}, decode :{ports[2]}"
        f" ({args.connector}, {args.transfer_mode}), router {plan.base_url}"
        f" (disaggregation {args.disaggregation})"
    )

    def on_ready(sup: Supervisor) -> None:
        sup.say(f"ready: the OpenAI API is at {plan.base_url}/v1")
        if args.ask is not None:
            try:
                answer = ask(plan.base_url, plan.model_name, args.ask, args.max_tokens)
            except RuntimeError as exc:
                sup.say(str(exc))
                sup.request_stop(1)
                return
            sup.say(f"user> {args.ask}")
            sup.say(f"assistant> {answer.strip()}")
        sup.say(f"try: {curl_line(plan.base_url, plan.model_name)}")
        if args.once:
            sup.request_stop(0)
        else:
            sup.say("serving until Ctrl-C")

    return supervisor.run(on_ready)
