"""The CPU thread count of a worker, from the process's CPU budget (`common.cpu_threads`)."""

from __future__ import annotations

import logging
import os

import torch

from fleetserve.common.cpu_threads import choose_threading, read_cpu_budget

logger = logging.getLogger(__name__)


def configure_cpu_threads(ranks_here: int) -> int:
    """Give torch this rank's share of the usable cores (OMP_NUM_THREADS, when set, wins) and
    log the threading choice; returns torch's thread count.

    Args:
        ranks_here: ranks of this engine sharing this process's cores.
    """
    # NOTE: the package root already set OMP_WAIT_POLICY (or kept the user's); the choice is
    # recomputed without it so the log says what the policy itself concludes.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    choice = choose_threading(read_cpu_budget(), env)
    if choice.num_threads is not None:
        torch.set_num_threads(max(1, choice.num_threads // max(1, ranks_here)))
    logger.info(
        "CPU threads: %d, OMP_WAIT_POLICY=%s (policy: %s, because %s; explicit OMP_* env wins)",
        torch.get_num_threads(),
        os.environ.get("OMP_WAIT_POLICY", "unset"),
        choice.wait_policy,
        choice.reason,
    )
    return torch.get_num_threads()
