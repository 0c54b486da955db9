"""`python -m fleetserve.operator.autoscale.trace_report`: the autoscaler on a trace, simulated.

Runs `FleetSim` (simulated engines, simulated clock, the real policy) on a trace, finds the
smallest static pool that reaches the attainment target on the same trace (the "sized for the
peak" baseline), prints both — SLO attainment, share within TTFT and within ITL, replica-seconds
per role — and writes a PNG of load, desired and ready groups per role over time
(matplotlib, a dev dependency: only this command needs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fleetserve.api.models import Autoscaling
from fleetserve.operator.autoscale.fleet_sim import FleetResult, FleetSim
from fleetserve.operator.autoscale.sim_engine import EngineModel
from fleetserve.operator.autoscale.trace import Trace

__all__ = ["main", "plot", "static_pool", "summary"]


def summary(result: FleetResult) -> dict[str, Any]:
    total = sum(result.replica_seconds.values())
    return {
        "requests": len(result.requests),
        "attainment": round(result.attainment, 4),
        "within_ttft": round(result.share_within("ttft"), 4),
        "within_itl": round(result.share_within("itl"), 4),
        "replica_seconds": {k: round(v) for k, v in result.replica_seconds.items()},
        "replica_seconds_total": round(total),
        "scale_decisions": result.decisions,
    }


def static_pool(sim: FleetSim, trace: Trace, duration_s: float, target: float) -> dict[str, int]:
    """The smallest static (prefill, decode) reaching `target` attainment: prefill first with a
    generous decode pool, then decode with that prefill pool.

    Raises:
        ValueError: no pool within the autoscaling max reaches the target.
    """
    a = sim.autoscaling
    assert a.prefill is not None and a.decode is not None
    big_d = a.decode.max

    def attained(p: int, d: int) -> float:
        s = FleetSim(**{**vars(sim), "static": {"prefill": p, "decode": d}})
        return s.run(trace, duration_s).attainment

    for p in range(1, a.prefill.max + 1):
        if attained(p, big_d) >= target:
            break
    else:
        raise ValueError(f"no static prefill pool up to {a.prefill.max} reaches {target:.0%}")
    for d in range(1, big_d + 1):
        if attained(p, d) >= target:
            return {"prefill": p, "decode": d}
    raise ValueError(f"no static decode pool up to {big_d} reaches {target:.0%}")


def plot(result: FleetResult, path: Path, title: str) -> None:
    """Load (req/s) and desired/ready groups per role over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in result.timeline]
    fig, (ax_load, ax_p, ax_d) = plt.subplots(3, 1, sharex=True, figsize=(10, 7))
    ax_load.plot(t, [s.rate for s in result.timeline], color="black")
    ax_load.set_ylabel("load (req/s)")
    for ax, role in ((ax_p, "prefill"), (ax_d, "decode")):
        ax.step(t, [s.desired[role] for s in result.timeline], where="post", label="desired")
        ax.step(t, [s.ready[role] for s in result.timeline], where="post", label="ready")
        ax.set_ylabel(f"{role} groups")
        ax.legend(loc="upper left")
    ax_d.set_xlabel("time (s)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _autoscaling(args: argparse.Namespace) -> Autoscaling:
    return Autoscaling.model_validate(
        {
            "enabled": True,
            "prefill": {
                "min": 1,
                "max": args.max_prefill,
                "targetTTFTSeconds": args.ttft,
                "tokensPerSecond": args.prefill_tps,
            },
            "decode": {
                "min": 1,
                "max": args.max_decode,
                "targetITLSeconds": args.itl,
                "maxKVUsage": 0.8,
            },
            "ratio": {"min": args.ratio_min, "max": args.ratio_max} if args.ratio_min else None,
            "intervalSeconds": args.interval,
            "scaleUpStabilizationSeconds": args.up,
            "scaleDownStabilizationSeconds": args.down,
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trace", default="bursty:low=1,high=24,low_s=420,high_s=180")
    parser.add_argument("--duration", type=float, default=1800.0)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--prefill-tps", type=float, default=16000.0, help="per replica")
    parser.add_argument("--cold-start", type=float, default=15.0, help="seconds to ready")
    parser.add_argument("--ttft", type=float, default=3.0)
    parser.add_argument("--itl", type=float, default=0.05)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--up", type=float, default=2.0)
    parser.add_argument("--down", type=float, default=60.0)
    parser.add_argument("--max-prefill", type=int, default=24)
    parser.add_argument("--max-decode", type=int, default=16)
    parser.add_argument("--ratio-min", type=float, default=0.0, help="0: no P:D band")
    parser.add_argument("--ratio-max", type=float, default=0.0)
    parser.add_argument(
        "--target", type=float, default=0.95, help="attainment the static pool needs"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initial-prefill", type=int, default=1, help="groups at t=0")
    parser.add_argument("--initial-decode", type=int, default=1)
    parser.add_argument("--plot", type=Path, default=None, help="PNG to write")
    args = parser.parse_args(argv)
    trace = Trace.parse(args.trace)
    sim = FleetSim(
        _autoscaling(args),
        model=EngineModel(prefill_tokens_per_s=args.prefill_tps),
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        cold_start_s=args.cold_start,
        seed=args.seed,
        initial={"prefill": args.initial_prefill, "decode": args.initial_decode},
    )
    scaled = sim.run(trace, args.duration)
    pool = static_pool(sim, trace, args.duration, args.target)
    static = FleetSim(**{**vars(sim), "static": pool}).run(trace, args.duration)
    report = {
        "trace": str(trace),
        "duration_s": args.duration,
        "cold_start_s": args.cold_start,
        "autoscaled": summary(scaled),
        "static_pool": pool,
        "static": summary(static),
    }
    report["replica_seconds_vs_static"] = round(
        report["autoscaled"]["replica_seconds_total"] / report["static"]["replica_seconds_total"], 4
    )
    json.dump(report, sys.stdout, indent=2)
    print()
    if args.plot is not None:
        a = report["autoscaled"]
        title = (
            f"{trace}  cold start {args.cold_start:g}s  {args.prompt_tokens} prompt tokens  "
            f"attainment {a['attainment']:.1%}  replica-s {report['replica_seconds_vs_static']:.0%}"
            f" of static {pool}"
        )
        plot(scaled, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
