"""The KV-cache manager: which blocks each request owns, prefix-cache lookups, allocation.

Upstream counterparts (v0.32.0), for one full-attention KV-cache group:
- `vllm.v1.core.kv_cache_manager.KVCacheManager.get_computed_blocks`,
  `.allocate_slots`, `.free`
- `vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager.find_longest_cache_hit`
- `vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager`
  `.get_num_blocks_to_allocate`, `.add_local_computed_blocks`,
  `.allocate_new_blocks`, `.cache_blocks`, `.free`
- `vllm.v1.core.kv_cache_utils.hash_block_tokens`, `.get_request_block_hasher`

The scheduler decides *how many* tokens a request runs; this file decides
*which physical blocks* hold them. It never chooses blocks itself: the block
pool hands out the front of its free queue.
"""

from __future__ import annotations

import hashlib
import pickle

from .block_pool import Block, BlockPool
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


NONE_HASH = b"\x00" * 32  # the parent of the first block


def hash_block_tokens(parent_hash: bytes | None, block_token_ids: list[int]) -> bytes:
    """Hash of one full block *and everything before it* (chained through the parent).

    Two blocks get the same hash only if their whole prefixes are equal, so a
    lookup can walk a request's hashes from the start and stop at the first
    miss. Upstream hashes (parent, tokens, extra_keys) with sha256 of a
    CBOR/pickle encoding; the bytes differ from ours, the hits do not.
    """
    payload = pickle.dumps((parent_hash or NONE_HASH, tuple(block_token_ids)), protocol=5)
    return hashlib.sha256(payload).digest()


def make_block_hasher(block_size: int):
    """Returns f(request) -> hashes of its full blocks not hashed yet (upstream get_request_block_hasher)."""

    def hasher(request: Request) -> list[bytes]:
        start = len(request.block_hashes) * block_size
        if start + block_size > request.num_tokens:
            return []  # called for every generated token: skip building all_token_ids until a block fills
        tokens = request.all_token_ids
        new: list[bytes] = []
        parent = request.block_hashes[-1] if request.block_hashes else None
        while start + block_size <= len(tokens):  # only full blocks get a hash
            parent = hash_block_tokens(parent, tokens[start : start + block_size])
            new.append(parent)
            start += block_size
        return new

    return hasher


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int,
                 free_policy: str = "uncached_to_front", block_pool_cls: type[BlockPool] = BlockPool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        # Upstream builds its BlockPool inside (through the KV-cache coordinator); the class is
        # a parameter here so that compare can run a learner's own pool (--impl block_pool=...).
        self.block_pool = block_pool_cls(num_blocks, enable_caching, free_policy)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.block_hasher = make_block_hasher(block_size) if enable_caching else None

    def register(self, request: Request) -> None:
        """Attach the hasher and hash the prompt (upstream does this in Request.__init__)."""
        request.block_hasher = self.block_hasher
        if self.block_hasher is not None:
            request.block_hashes = self.block_hasher(request)

    # --- prefix cache lookup -------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks from the start of the request.

        Returns (blocks, num_hit_tokens). At most num_tokens - 1 tokens can hit:
        the last token must run through the model to get logits to sample from
        (so a fully cached 64-token prompt with block 32 hits only 32 tokens).
        """
        if not self.enable_caching:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        hits: list[Block] = []
        for block_hash in request.block_hashes[: max_hit_tokens // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # chained hashes: every later block misses too
            hits.append(block)
        return hits, len(hits) * self.block_size

    # --- allocation ---------------------------------------------------------------------

    def _num_blocks_to_allocate(self, request: Request, num_tokens: int, new_computed_blocks: list[Block]) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request.req_id, ()))
        if request.req_id in self.num_cached_block:
            return max(num_required - num_held, 0)
        num_new = max(num_required - (len(new_computed_blocks) + num_held), 0)
        # A hit block that sits in the free queue (ref_cnt 0) leaves it when
        # touched, so it costs a free block just like a new one.
        num_evictable_hits = sum(b.ref_cnt == 0 and not b.is_null for b in new_computed_blocks)
        return num_new + num_evictable_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[Block] | None = None,
        full_sequence_must_fit: bool = False,
    ) -> list[Block] | None:
        """Make room for `num_new_tokens` more tokens; None if the pool cannot.

        None is the signal the scheduler acts on: for a running request it
        preempts someone; for a waiting one it stops admitting.
        """
        new_computed_blocks = new_computed_blocks or []
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed, self.max_model_len)

        if full_sequence_must_fit:
            # Admission gate (upstream scheduler_reserve_full_isl, on by default
            # in v0.32.0): a *waiting* request is admitted only if its whole
            # current sequence fits, not just this chunk.
            full = min(request.num_tokens, self.max_model_len)
            if self._num_blocks_to_allocate(request, full, new_computed_blocks) > self.block_pool.num_free_blocks():
                return None

        num_tokens_need_slot = min(total_computed + num_new_tokens, self.max_model_len)
        if self._num_blocks_to_allocate(request, num_tokens_need_slot, new_computed_blocks) > self.block_pool.num_free_blocks():
            return None

        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        if new_computed_blocks:
            # Take a reference on the hit blocks *before* allocating, so that
            # allocation cannot evict them.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.req_id] = len(req_blocks)

        num_new_blocks = cdiv(num_tokens_need_slot, self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)

        # Cache every block that will be full once this step's tokens are
        # computed -- already now, at scheduling time. A request admitted later
        # in the *same* step can therefore hit blocks computed in this step.
        if self.enable_caching:
            num_tokens_to_cache = min(total_computed + num_new_tokens, request.num_tokens)
            num_cached = self.num_cached_block.get(request.req_id, 0)
            num_full = num_tokens_to_cache // self.block_size
            if num_cached < num_full:
                self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_block[request.req_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Return a finished/preempted request's blocks, tail first.

        Reversed so that the tail of the prefix chain is evicted before its
        head: a later request can still hit the (more shareable) first blocks.
        """
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_block.pop(request.req_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))
        # for the trace: blocks that really went back to the free queue (a block
        # shared through the prefix cache may only have lost one reference)
        self.block_pool.events_freed += [b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null]

    def block_tables(self) -> dict[str, list[int]]:
        return {rid: [b.block_id for b in blocks] for rid, blocks in self.req_to_blocks.items() if blocks}

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]
