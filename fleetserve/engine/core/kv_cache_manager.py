"""Per-request KV cache API on top of the `BlockPool`.

The scheduler talks only to `KVCacheManager`: it looks up prefix hits (`get_computed_blocks`),
reserves slots for the tokens it schedules (`allocate_slots`, all-or-nothing: `None` means
"preempt someone or wait"), and frees a request's blocks when it finishes or is preempted. Block
tables are append-only: a request's blocks never move, so the runner only receives new block ids.

Blocks are indexed in the prefix cache when they are allocated for tokens that the step about to
run will compute. Within one forward pass every layer writes the whole batch's KV before attention
reads it, so a same-step hit on such a block reads KV written by that pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetserve.engine.core.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from fleetserve.engine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheBlocks:
    """Blocks returned to the scheduler (hides the pool's block objects behind ids)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(self.blocks + other.blocks)


class KVCacheManager:
    """Allocates, caches and frees the KV blocks of each request.

    Args:
        num_blocks: total blocks including the null block 0.
        block_size: tokens per block.
        enable_caching: reuse full blocks across requests (prefix caching).
        max_model_len: no request ever needs slots beyond this many tokens.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        """Per request: how many of its leading blocks are already in the prefix-cache index."""
        self._new_block_ids: list[int] = []
        self.prefix_cache_queries = 0
        """Cumulative prompt tokens looked up in the prefix cache."""
        self.prefix_cache_hits = 0
        """Cumulative tokens found in the prefix cache."""

    @property
    def usage(self) -> float:
        """Fraction of usable blocks owned by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-unowned blocks count as free)."""
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest chain of cached full blocks at the start of `request`.

        The hit stops at the first missing hash and never covers the last token: that token is
        always recomputed so the step produces logits to sample from. A request that wants
        prompt logprobs gets no hit: every prompt position must be computed for its logits.

        Nothing is counted here: the caller reports a lookup that led to an admission with
        `record_prefix_cache_lookup`, so a request that waits for room is counted once, not on
        every step it is looked up again.

        Returns:
            The hit blocks and the number of tokens they hold (a multiple of block_size).
        """
        if not self._looks_up(request):
            return KVCacheBlocks(), 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return KVCacheBlocks(hit), len(hit) * self.block_size

    def record_prefix_cache_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup: its tokens queried, `num_hit_tokens` found."""
        if self._looks_up(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _looks_up(self, request: Request) -> bool:
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        watermark_blocks: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Reserve KV slots for the tokens scheduled this step (all-or-nothing).

        Token layout of the request after this call:
        `| computed | new computed (prefix hit) | external computed | new | lookahead |`.

        Args:
            request: the request; `request.num_computed_tokens` excludes this step's hit.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: prefix-hit tokens held by `new_computed_blocks`.
            new_computed_blocks: the hit blocks (from `get_computed_blocks`) to share.
            num_lookahead_tokens: extra slots reserved beyond the new tokens (speculative).
            num_external_computed_tokens: tokens a KV connector will load into new blocks.
            full_sequence_must_fit: also require room for prompt + max_tokens (capped by
                max_model_len), so an admitted request is never preempted for lack of blocks.
            watermark_blocks: blocks that must stay free after this allocation.
            delay_cache_blocks: do not index the new full blocks yet (a KV connector loads them
                asynchronously; `cache_blocks` indexes them once the load is done).

        Returns:
            The newly allocated blocks (appended to the request's block table), or None when they
            do not fit; in that case the pool is unchanged.

        Raises:
            ValueError: if nothing at all is to be allocated for (no new or external tokens).
        """
        if num_new_tokens <= 0 and num_external_computed_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        computed_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else []
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_blocks_needed = _cdiv(num_slots, self.block_size)
        num_new_blocks = max(0, num_blocks_needed - len(req_blocks) - len(computed_blocks))

        num_blocks_checked = num_new_blocks
        if full_sequence_must_fit:
            max_tokens = (
                request.max_tokens if request.max_tokens is not None else self.max_model_len
            )
            num_full_slots = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
            num_blocks_checked = max(
                num_new_blocks,
                _cdiv(num_full_slots, self.block_size) - len(req_blocks) - len(computed_blocks),
            )
        # NOTE: hit blocks sitting in the free queue leave it when touched, so they use capacity.
        num_revived = (
            sum(1 for b in computed_blocks if b.ref_cnt == 0 and not b.is_null)
            if computed_blocks
            else 0
        )
        if num_blocks_checked + num_revived + watermark_blocks > self.num_free_blocks:
            return None

        if computed_blocks:
            assert not req_blocks, (
                f"prefix hit for request {request.request_id} that already owns blocks"
            )
            self.block_pool.touch(computed_blocks)
            req_blocks = list(computed_blocks)
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
        self.req_to_blocks[request.request_id] = req_blocks
        # NOTE: most decode steps of a request need no new block (one in block_size does).
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            self._new_block_ids.extend(block.block_id for block in new_blocks)

        if not delay_cache_blocks:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks among its first `num_tokens` tokens (their KV is, or
        within this step will be, computed or loaded)."""
        if not self.enable_caching:
            return
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_tokens_to_cache = min(num_tokens, request.num_tokens)
        num_full_blocks = min(num_tokens_to_cache // self.block_size, len(request.block_hashes))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return  # no block filled since the last call (most decode steps)
        self.block_pool.cache_full_blocks(
            request, req_blocks, num_cached, num_full_blocks, self.block_size
        )
        self._num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release all of `request`'s blocks, last block first (evicted before the prefix).

        Blocks indexed for tokens the request has not computed yet (allocated this step, then
        preempted before the step ran) are dropped from the index first: their KV is never
        written, so a later hit on them would read garbage.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        num_written_blocks = request.num_computed_tokens // self.block_size
        for block in blocks[num_written_blocks:]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.drop_hash(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's whole block table (empty if it holds no blocks)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def take_new_block_ids(self) -> list[int]:
        """Ids of blocks allocated since the last call (to zero before first use), deduplicated."""
        block_ids = list(dict.fromkeys(self._new_block_ids))
        self._new_block_ids.clear()
        return block_ids

    def begin_step(self) -> None:
        """A new step: what earlier steps indexed was computed (they succeeded)."""
        self.block_pool.forget_newly_cached()

    def take_newly_cached(self) -> list[KVCacheBlock]:
        """The blocks indexed since the last step began, which the caller now tracks (async
        scheduling keeps them per step in flight; `drop_cached` unindexes a failed step's)."""
        return self.block_pool.take_newly_cached()

    def drop_cached(self, blocks: list[KVCacheBlock]) -> None:
        """Unindex blocks a failed step's schedule indexed (their KV holds garbage)."""
        self.block_pool.drop_cached(blocks)

    def discard_step(self) -> None:
        """The current step failed: its newly indexed blocks hold no valid KV; unindex them."""
        self.block_pool.drop_newly_cached()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False (nothing done) while any block is owned."""
        return self.block_pool.reset_prefix_cache()
