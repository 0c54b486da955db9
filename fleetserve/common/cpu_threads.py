"""How many CPU threads the engine should run and whether its OpenMP workers may spin.

Spinning OpenMP workers (`OMP_WAIT_POLICY=ACTIVE`) are ~25% faster on cores the process has to
itself, and 10-100x slower where the cores are shared (a pod under a CFS quota, a box running
other work): a spinning worker burns the quota its siblings need. So the policy is chosen from
what the process actually has:

- usable cores: the affinity mask (`sched_getaffinity`), cut to the cgroup's CPU quota
  (`cpu.max` under cgroup v2, `cpu.cfs_quota_us / cpu.cfs_period_us` under v1) when one is set;
- dedicated: no quota below the affinity count, and the 1-minute load average of the machine
  below half the usable cores (other processes are not already using them).

ACTIVE when dedicated, else PASSIVE; the thread count is the usable cores. ACTIVE comes with a
bounded spin (`GOMP_SPINCOUNT`, about 0.1 ms) rather than libgomp's five minutes: long enough to
bridge the gaps between one step's parallel regions (as fast as unbounded spinning here: a tiny
model's 64-prompt run 0.50 s either way, 0.63 s passive), short enough that threads stop burning
a core once the work ends or another process needs the core (two such runs at once: 1.8 s each
bounded, 2.8 s unbounded, 0.75 s passive).

An explicit `OMP_WAIT_POLICY`, `GOMP_SPINCOUNT` or `OMP_NUM_THREADS` in the environment always
wins. Torch-free: the package root applies it before torch is imported (libgomp reads the
variables once, when it loads), and marks what it set (`FLEETSERVE_OMP_AUTO=1`), so that a child
process (an engine core spawned by a server) chooses again for itself instead of taking its
parent's choice for a user's setting.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    """What the process may use: its affinity, its cgroup quota (in cores) and the load."""

    affinity_cores: int
    quota_cores: float | None
    """None = no CPU quota."""
    load_1m: float


@dataclass(frozen=True)
class ThreadingChoice:
    wait_policy: str
    """'ACTIVE' or 'PASSIVE' (the value for OMP_WAIT_POLICY)."""
    num_threads: int | None
    """Threads for torch's pool; None = OMP_NUM_THREADS is set (leave torch's own)."""
    reason: str
    """Why, for the log line."""


def _cgroup_quota_cores(root: Path) -> float | None:
    v2 = root / "cpu.max"
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 else quota_us / period_us


def read_cpu_budget(cgroup_root: Path = Path("/sys/fs/cgroup")) -> CpuBudget:
    """This process's CPU budget, from the affinity mask, the cgroup and the load average."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return CpuBudget(affinity, _cgroup_quota_cores(cgroup_root), load)


AUTO_MARKER = "FLEETSERVE_OMP_AUTO"
"""Set to 1 beside the OpenMP variables fleetserve chose (`envs.Env.omp_auto`)."""
ACTIVE_SPIN_COUNT = 10_000
"""libgomp spins per wait under ACTIVE: about 0.1 ms (libgomp's estimate is 100,000 a ms)."""
_CHOSEN = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_threading_env(environ: MutableMapping[str, str], budget: CpuBudget) -> ThreadingChoice:
    """Put the wait policy for `budget` into `environ` (and the bounded spin with ACTIVE), unless
    the user set them; values an earlier fleetserve process chose (marked) are chosen anew."""
    if environ.get(AUTO_MARKER) == "1":
        for name in (*_CHOSEN, AUTO_MARKER):
            environ.pop(name, None)
    choice = choose_threading(budget, environ)
    if "OMP_WAIT_POLICY" not in environ:
        environ["OMP_WAIT_POLICY"] = choice.wait_policy
        if choice.wait_policy == "ACTIVE" and "GOMP_SPINCOUNT" not in environ:
            environ["GOMP_SPINCOUNT"] = str(ACTIVE_SPIN_COUNT)
        environ[AUTO_MARKER] = "1"
    return choice


def choose_threading(budget: CpuBudget, env: Mapping[str, str]) -> ThreadingChoice:
    """The wait policy and thread count for `budget`; explicit OMP_* settings in `env` win."""
    usable = budget.affinity_cores
    if budget.quota_cores is not None:
        usable = max(1, min(usable, math.floor(budget.quota_cores)))
    threads: int | None = usable
    if "OMP_NUM_THREADS" in env:
        threads = None
    if "OMP_WAIT_POLICY" in env:
        return ThreadingChoice(
            env["OMP_WAIT_POLICY"].upper(), threads, "OMP_WAIT_POLICY is set in the environment"
        )
    facts = f"{usable} usable core(s), load {budget.load_1m:.1f}"
    if budget.quota_cores is not None and budget.quota_cores < budget.affinity_cores:
        why = f"a CPU quota of {budget.quota_cores:g} core(s) below the {budget.affinity_cores}"
        return ThreadingChoice("PASSIVE", threads, f"{why} allowed ({facts})")
    if budget.load_1m >= usable / 2:
        return ThreadingChoice("PASSIVE", threads, f"the cores are shared ({facts})")
    return ThreadingChoice("ACTIVE", threads, f"the cores are dedicated ({facts})")
