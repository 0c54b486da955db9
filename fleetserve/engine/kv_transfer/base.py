"""The scheduler role of a KV connector, and the no-op connector every engine has by default.

The scheduler calls, for each request (seed notes part 2 §2.7; part 1 §2.9-2.12):

1. `get_num_new_matched_tokens(request, num_local)` when it tries to admit a request with nothing
   computed: how many tokens beyond the local prefix hit a remote engine holds, and whether they
   load asynchronously. Only the longest prefix that is really available counts.
2. `update_state_after_alloc(request, block_ids, num_external)` once the blocks are allocated:
   whether to load is decided by `num_external`, never by whether blocks were given.
3. `build_connector_meta(scheduler_output)` once per step: what the workers must load or save.
4. `request_finished(request, block_ids)` when a request ends: True when the connector frees the
   blocks later (a producer keeps them under a lease until its consumer has read them).

The scheduler role never touches device memory; the worker role (a later issue) moves the bytes
and makes no scheduling decision.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.engine.core.outputs import SchedulerOutput
    from fleetserve.engine.request import Request

__all__ = ["KVConnectorMetadata", "KVConnectorRole", "KVConnectorScheduler", "NoKVConnector"]


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    """Decides (in the engine core's scheduler); never touches tensors."""
    WORKER = "worker"
    """Moves the bytes (in every rank's worker); makes no scheduling decision."""


@dataclass
class KVConnectorMetadata:
    """What the scheduler role tells the workers each step (plain data: it crosses processes)."""


class KVConnectorScheduler(ABC):
    """The scheduler role of a connector (see the module docstring for the call order)."""

    def bind_block_table(self, block_ids_of: Callable[[str], list[int]]) -> None:
        """The scheduler's read-only view of request block tables (ids, never memory)."""
        return None

    def on_new_request(self, request: Request) -> None:
        """A request was added (before any admission attempt).

        Raises:
            ValueError: its `kv_transfer_params` are malformed or not for this engine.
        """
        from fleetserve.engine.kv_transfer.params import parse_kv_transfer_params

        if parse_kv_transfer_params(request.kv_transfer_params) is not None:
            raise ValueError(
                "kv_transfer_params need an engine with a KV connector (--kv-transfer-config)"
            )

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` (the local hit) that a remote engine can provide.

        Returns:
            (number of external tokens, whether they load asynchronously: the request then
            waits in WAITING_FOR_REMOTE_KVS while other requests keep running).
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Record the request's blocks after allocation; load only if `num_external_tokens`."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions for the workers (called once per step, after scheduling)."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended (finished, stopped or aborted).

        Returns:
            (True when the connector frees the blocks later (the scheduler must not), the
            `kv_transfer_params` to return to the client, or None).
        """

    def load_finished(self, request_id: str) -> None:
        """The workers reported a request's remote load finished (successfully or not)."""
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose remote load failed since the last call (their tokens are recomputed)."""
        return set()


class NoKVConnector(KVConnectorScheduler):
    """The connector of a colocated engine: nothing is remote, nothing is held."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None
