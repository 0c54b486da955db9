"""The physical KV block pool: free queue, reference counts, the hash index and the null block.

Lifecycle of a block:

    free (unhashed) ──get_new_blocks──► owned (ref_cnt ≥ 1) ──cache_full_blocks──► owned + hashed
         ▲                                  │  ▲                                        │
         └───── free_blocks (ref_cnt → 0) ──┘  └──── touch (prefix hit) ◄── free + hashed ◄┘
                                                                            (evictable)

The free queue's order *is* the eviction policy: `get_new_blocks` pops from the head. Freed blocks
without a hash go to the head (reused first: nothing to lose), freed hashed blocks go to the tail
(evicted least-recently-freed first, i.e. LRU). A hashed block stays findable through the index while
it sits in the free queue; `touch` takes it back out when a request hits it, and popping it for a new
owner evicts its hash.

Block 0 is the null block: popped at init, never handed out, never freed or evicted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetserve.common.block_hash import BlockHash

if TYPE_CHECKING:
    from fleetserve.engine.request import Request


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """Metadata of one physical KV block (the KV itself lives in the runner's tensors)."""

    block_id: int
    ref_cnt: int = 0
    """Number of requests whose block table holds this block."""
    block_hash: BlockHash | None = None
    """Set once the block is full and indexed in the prefix cache."""
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    is_null: bool = False


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = next to hand out).

    Sentinel head and tail nodes keep every operation branch-free and O(1), including `remove`
    from the middle (which `touch` needs when a prefix hit revives a free cached block).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            ValueError: if the queue is empty.
        """
        block = self._head.next_free_block
        assert block is not None, "free queue sentinel broken"
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` (which must be in the queue) in O(1)."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None, (
            f"block {block.block_id} is not in the free queue"
        )
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        self._insert_between(self._tail.prev_free_block, self._tail, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head (handed out next)."""
        self._insert_between(self._head, self._head.next_free_block, block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks head to tail (O(n); for tests and integrity checks)."""
        blocks: list[KVCacheBlock] = []
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            blocks.append(node)
            node = node.next_free_block
        return blocks

    def _insert_between(
        self, prev_block: KVCacheBlock | None, next_block: KVCacheBlock | None, block: KVCacheBlock
    ) -> None:
        assert prev_block is not None and next_block is not None, "free queue sentinel broken"
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"block {block.block_id} is already in the free queue"
        )
        block.prev_free_block, block.next_free_block = prev_block, next_block
        prev_block.next_free_block = block
        next_block.prev_free_block = block
        self.num_free_blocks += 1


class BlockHashToBlockMap:
    """Prefix-cache index: block hash → the cached block(s) with that hash.

    Two blocks can hold the same content (e.g. two requests computed the same prefix before
    either was indexed). The common case, one block per hash, is stored directly; a hash is
    upgraded to a `{block_id: block}` dict only when a duplicate appears.
    """

    def __init__(self) -> None:
        self._map: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        entry = self._map.get(block_hash)
        if isinstance(entry, dict):
            return next(iter(entry.values()))
        return entry

    def get_all_blocks(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        entry = self._map.get(block_hash)
        if entry is None:
            return []
        return list(entry.values()) if isinstance(entry, dict) else [entry]

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        entry = self._map.get(block_hash)
        if entry is None:
            self._map[block_hash] = block
        elif isinstance(entry, dict):
            entry[block.block_id] = block
        elif entry is not block:
            self._map[block_hash] = {entry.block_id: entry, block.block_id: block}

    def pop(self, block_hash: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove the entry of `block_id` under `block_hash`, keeping any duplicates."""
        entry = self._map.get(block_hash)
        if entry is None:
            return None
        if isinstance(entry, dict):
            block = entry.pop(block_id, None)
            if len(entry) == 1:
                self._map[block_hash] = next(iter(entry.values()))
            return block
        if entry.block_id != block_id:
            return None
        del self._map[block_hash]
        return entry

    def num_blocks(self) -> int:
        """Number of indexed blocks (duplicates counted separately)."""
        return sum(len(e) if isinstance(e, dict) else 1 for e in self._map.values())

    def items(self) -> Iterable[tuple[BlockHash, KVCacheBlock]]:
        for block_hash, entry in self._map.items():
            for block in entry.values() if isinstance(entry, dict) else (entry,):
                yield block_hash, block

    def __len__(self) -> int:
        """Number of distinct hashes."""
        return len(self._map)

    def clear(self) -> None:
        self._map.clear()


class BlockPool:
    """All KV blocks of one engine, with the free queue and the prefix-cache index.

    Args:
        num_blocks: total blocks including the null block 0 (so `num_blocks - 1` are usable).
        enable_caching: index full blocks by hash so later requests can reuse them.

    Raises:
        ValueError: if num_blocks < 2.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (null block + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        assert self.null_block.block_id == 0, "the null block must be block 0"
        self._newly_cached: list[KVCacheBlock] = []
        """Blocks indexed since the current step began (see `drop_newly_cached`)."""

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding `block_hash`'s content (free or owned), or None on a miss."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the free-queue head, evicting their hashes; ref_cnt = 1.

        Raises:
            ValueError: if fewer than `num_blocks` blocks are free (the pool is left unchanged).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            self._evict_hash(block)
            block.ref_cnt = 1
        return blocks

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Index `blocks[num_cached_blocks:num_full_blocks]` under `request.block_hashes`.

        A block that already carries a different hash (e.g. promoted from partial to full) loses
        its old index entry first, so the index never points at content a block no longer holds.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
            f"{num_full_blocks} full blocks of {block_size} tokens to cache"
        )
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                continue
            block_hash = request.block_hashes[index]
            if block.block_hash == block_hash:
                continue
            self._evict_hash(block)
            block.block_hash = block_hash
            self.cached_block_hash_to_block.insert(block_hash, block)
            self._newly_cached.append(block)

    def forget_newly_cached(self) -> None:
        """Start a step: the blocks indexed so far hold KV that was computed."""
        self._newly_cached.clear()

    def take_newly_cached(self) -> list[KVCacheBlock]:
        """The blocks indexed since the last call (or `forget_newly_cached`), forgotten here:
        under async scheduling the caller keeps them with the step that indexed them."""
        blocks, self._newly_cached = self._newly_cached, []
        return blocks

    def drop_cached(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Unindex `blocks` (a failed step's, from `take_newly_cached`)."""
        for block in blocks:
            self._evict_hash(block)

    def drop_newly_cached(self) -> None:
        """The step failed: unindex the blocks it indexed (their KV was never, or only partly,
        written, so a later prefix hit on them would read garbage)."""
        self.drop_cached(self.take_newly_cached())

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take shared ownership of `blocks` (prefix hits): revive free ones, bump ref counts."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 go back to the free queue.

        Unhashed blocks go to the head (reused first), hashed ones to the tail (LRU). Callers pass a
        request's blocks last-first, so its tail blocks are evicted before its shared prefix.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than owned"
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self.free_block_queue.appendleft(block)
            else:
                self.free_block_queue.append(block)

    def drop_hash(self, block: KVCacheBlock) -> None:
        """Remove `block` from the prefix-cache index (its content will not be written)."""
        self._evict_hash(block)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the `num_blocks - 1` usable blocks currently owned by requests."""
        num_usable = self.num_blocks - 1
        return (num_usable - self.get_num_free_blocks()) / num_usable

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (returns False) while any block is owned."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def check_integrity(self) -> None:
        """Assert that the free queue, ref counts and hash index agree (tests and debug runs)."""
        free_blocks = self.free_block_queue.get_all_free_blocks()
        assert len(free_blocks) == self.get_num_free_blocks(), "free-queue count drifted"
        free_ids = {block.block_id for block in free_blocks}
        assert len(free_ids) == len(free_blocks), "a block is in the free queue twice"
        assert 0 not in free_ids and self.null_block.ref_cnt == 0, "null block was handed out"
        for block in self.blocks[1:]:
            in_queue = block.block_id in free_ids
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue: {in_queue}"
            )
        indexed = 0
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"stale index entry for block {block.block_id}"
            indexed += 1
        num_hashed = sum(1 for block in self.blocks if block.block_hash is not None)
        assert indexed == num_hashed, f"{num_hashed} hashed blocks but {indexed} index entries"

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
        block.block_hash = None
