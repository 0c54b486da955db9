"""The CPU thread count of a worker, from the process's CPU budget (`common.cpu_threads`)."""

from __future__ import annotations

import logging
import os

import torch

from fleetserve.common.cpu_threads import AUTO_MARKER, choose_threading, read_cpu_budget

logger = logging.getLogger(__name__)


def configure_cpu_threads(ranks_here: int) -> int:
    """Give torch this rank's share of the usable cores (OMP_NUM_THREADS, when set, wins) and
    log the threading choice; returns torch's thread count.

    Args:
        ranks_here: ranks of this engine sharing this process's cores.
    """
    # NOTE: the package root already set OMP_WAIT_POLICY (or kept the user's); the choice is
    # recomputed without it so the log says what the policy itself concludes now.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", AUTO_MARKER)}
    choice = choose_threading(read_cpu_budget(), env)
    if choice.num_threads is not None:
        torch.set_num_threads(max(1, choice.num_threads // max(1, ranks_here)))
    logger.info(
        "CPU threads: %d, OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s (%s; policy now: %s, because "
        "%s; explicit OMP_* env wins)",
        torch.get_num_threads(),
        os.environ.get("OMP_WAIT_POLICY", "unset"),
        os.environ.get("GOMP_SPINCOUNT", "unset"),
        "chosen at start-up" if os.environ.get(AUTO_MARKER) == "1" else "set by the user",
        choice.wait_policy,
        choice.reason,
    )
    return torch.get_num_threads()
