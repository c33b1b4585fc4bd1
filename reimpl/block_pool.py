"""The block pool: every physical KV block, which are free, and which hold a cached prefix.

Upstream counterparts (v0.32.0):
- `vllm.v1.core.block_pool.BlockPool` (get_new_blocks, free_blocks, touch,
  cache_full_blocks, get_cached_block, _maybe_evict_cached_block, get_usage)
- `vllm.v1.core.block_pool.BlockHashToBlockMap` (hash -> cached block(s))
- `vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue` (the free list, in eviction order)
- `vllm.v1.core.kv_cache_utils.KVCacheBlock`

Upstream keeps the free list as a hand-made doubly linked list so that a
block in the middle can be removed in O(1). An `OrderedDict` gives the same
operations (popleft, remove, append, prepend) with the same order, so we use it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    # How many requests hold this block in their block table. 0 = it sits in
    # the free queue (and, if it has a hash, can still be hit by prefix caching).
    ref_cnt: int = 0
    # Set once the block is full and cached; cleared when it is evicted.
    block_hash: bytes | None = None
    is_null: bool = False


class FreeBlockQueue:
    """Free blocks, front = next to be handed out (and evicted).

    Order policy (upstream FreeKVCacheBlockQueue + BlockPool.free_blocks):
    - at start: ascending block id;
    - a freed block *without* a hash goes to the FRONT (LIFO: reuse it soon);
    - a freed block *with* a hash goes to the BACK (LRU: keep it cached longest);
    - a cached block hit by a new request is pulled out of the middle (touch).
    (The FRONT rule is v0.32.0's; older pins append every freed block: see
    FREE_POLICIES below.)
    """

    def __init__(self, blocks: list[Block]):
        self._q: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def popleft_n(self, n: int) -> list[Block]:
        return [self._q.popitem(last=False)[1] for _ in range(n)]

    def remove(self, block: Block) -> None:
        del self._q[block.block_id]

    def append_n(self, blocks: list[Block]) -> None:
        for b in blocks:
            self._q[b.block_id] = b

    def prepend_n(self, blocks: list[Block]) -> None:
        # Keep the given order at the front: walk it backwards, moving each to the front.
        for b in reversed(blocks):
            self._q[b.block_id] = b
            self._q.move_to_end(b.block_id, last=False)

    def block_ids(self) -> list[int]:
        return list(self._q)


# Where BlockPool.free_blocks puts a block whose last reference was dropped.
# This changed upstream between the pins we compare against:
# - "uncached_to_front" (v0.32.0, vllm/v1/core/block_pool.py BlockPool.free_blocks):
#   blocks without a hash are *prepended* (LIFO reuse, "better GPU locality"),
#   blocks with a hash are appended (LRU for the prefix cache);
# - "append_all" (v0.21.0, same function): every freed block is appended, in the
#   order given (the tail of a request first), hash or not.
# The harness picks the policy from the upstream run's pin.
FREE_POLICIES = ("uncached_to_front", "append_all")


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, free_policy: str = "uncached_to_front"):
        if free_policy not in FREE_POLICIES:
            raise ValueError(f"unknown free_policy {free_policy!r} (known: {', '.join(FREE_POLICIES)})")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_policy = free_policy
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # hash -> {block_id: Block}, insertion ordered. Upstream does not
        # de-duplicate: two requests computing the same block at once both
        # cache theirs; a lookup returns the first one inserted.
        self.cached: dict[bytes, dict[int, Block]] = {}
        # Block 0 is the null block: a placeholder that is never handed out,
        # so real block ids start at 1 (this is why tables start at 1).
        self.null_block = self.free_queue.popleft_n(1)[0]
        self.null_block.is_null = True
        # What happened since the engine last asked (for the trace): drained by take_events().
        self.events_freed: list[int] = []  # filled by KVCacheManager.free (block-table order)
        self.events_evicted: list[int] = []

    # --- prefix cache ------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        blocks = self.cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(self, blocks: list[Block], block_hashes: list[bytes], num_cached: int, num_full: int) -> None:
        """Give blocks[num_cached:num_full] (now full of computed tokens) their hashes."""
        for i in range(num_cached, num_full):
            blk = blocks[i]
            if blk.is_null or blk.block_hash is not None:
                continue
            blk.block_hash = block_hashes[i]
            self.cached.setdefault(block_hashes[i], {})[blk.block_id] = blk

    def _maybe_evict(self, block: Block) -> None:
        # A free block still carrying a hash is being reused for something
        # else: its old contents stop being a prefix-cache hit.
        if block.block_hash is None:
            return
        entry = self.cached.get(block.block_hash, {})
        entry.pop(block.block_id, None)
        if not entry:
            self.cached.pop(block.block_hash, None)
        block.block_hash = None
        self.events_evicted.append(block.block_id)

    # --- allocation ----------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self.free_queue):
            raise ValueError(f"cannot get {n} free blocks from the pool")
        got = self.free_queue.popleft_n(n)  # always from the front
        for b in got:
            if self.enable_caching:
                self._maybe_evict(b)
            assert b.ref_cnt == 0
            b.ref_cnt = 1
        return got

    def touch(self, blocks: list[Block]) -> None:
        """A prefix-cache hit: take a reference; a free cached block leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[Block]) -> None:
        """Drop one reference from each block; `ordered_blocks` is in eviction priority (first = evict first)."""
        to_front, to_back = [], []
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                uncached = b.block_hash is None or not self.enable_caching
                (to_front if uncached and self.free_policy == "uncached_to_front" else to_back).append(b)
        self.free_queue.prepend_n(to_front)
        self.free_queue.append_n(to_back)

    # --- numbers -----------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        total = self.num_blocks - 1  # the null block does not count
        return 0.0 if not total else 1.0 - self.num_free_blocks() / total

    def take_events(self) -> tuple[list[int], list[int]]:
        freed, evicted = self.events_freed, self.events_evicted
        self.events_freed, self.events_evicted = [], []
        return freed, evicted
