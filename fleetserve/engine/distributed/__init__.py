"""Process groups of one engine across ranks (torch.distributed) and the collectives layers use.

`parallel_state.ParallelState` builds every group from `fleetserve.api.topology.rank_layout`,
the same pure function the operator renders ranks with, so that every rank creates the same
groups in the same order; `group.GroupCoordinator` is one group: a device channel for tensors
and a CPU (gloo) channel for objects and barriers.
"""
