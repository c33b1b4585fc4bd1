"""Probes on the KV-cache manager and block pool (EngineCore process).

They collect, while `Scheduler.schedule` runs, which blocks went back to the
free list and which cached blocks lost their hash to be reused (evictions).
`kv_record`, called once the step is scheduled, reads the rest from the state
the step left: which request got which new blocks, which cached blocks a newly
admitted request reused (prefix hits). `KVCacheManager.allocate_slots` is not
wrapped: it runs for every scheduled request every step, and what it decides
shows in that state (its failures, the reason behind a preemption, are read by
the preemption probe in `scheduler.py`).
"""

from __future__ import annotations

from itertools import compress
from operator import ne

from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.trace.writer import RECORDER as R
from vllm_tour.trace.writer import user_req_id

PINS = (*CPU_PINS, "v0.21.0")
KVM = "vllm.v1.core.kv_cache_manager.KVCacheManager"
POOL = "vllm.v1.core.block_pool.BlockPool"


def _block_ids(blocks) -> list[int]:
    """Block ids of the first KV-cache group of a KVCacheBlocks (None -> [])."""
    if blocks is None:
        return []
    groups = blocks.blocks
    return [b.block_id for b in groups[0]] if groups else []


# --- free: blocks that really return to the free list ----------------------------------


def _free_before(self, request, *a, **kw):
    R.kv_freed_since = True  # kv_record: the next record reads every table
    # Copy: upstream may clear these lists while freeing.
    return [list(g) for g in self.coordinator.get_blocks(request.request_id)]


def _free_after(blocks_by_group, result, self, request, *a, **kw):
    # A block shared with another request (prefix cache) only loses a reference.
    if blocks_by_group:
        R.kv_pending_freed.extend(b.block_id for b in blocks_by_group[0] if b.ref_cnt == 0 and not b.is_null)


free = Probe(
    name="kv.free",
    target=f"{KVM}.free",
    params=("self", "request"),
    records="block ids returned to the free list when a request finishes or is preempted",
    pins=PINS,
    before=_free_before,
    after=_free_after,
    level="blocks",
)


# --- eviction of cached blocks ------------------------------------------------------------


def _evict_after(token, evicted, self, block, *a, **kw):
    if evicted:
        R.kv_pending_evicted.append(block.block_id)


evict = Probe(
    name="kv.evict",
    target=f"{POOL}._maybe_evict_cached_block",
    params=("self", "block"),
    records="cached blocks whose hash is dropped so they can be reused (evictions)",
    pins=PINS,
    after=_evict_after,
    level="blocks",
)

PROBES = [free, evict]


def prefix_hits(scheduler, tables: dict[str, list[int]], admitted: dict[str, int]) -> list[dict]:
    """schema.PrefixHit dicts, in admission order, for the requests admitted this step (new or resumed)
    whose computed tokens at admission (`admitted`: user id -> tokens) came from the prefix cache: the
    first blocks of their tables, a whole block per block_size hit tokens."""
    bs = scheduler.block_size
    hits = []
    for req in scheduler.running:  # admission order: schedule() appends each request it admits
        uid = user_req_id(req.request_id)
        n = admitted.get(uid)
        if n:
            hits.append({"req_id": uid, "num_hit_tokens": n, "block_ids": tables[uid][: -(-n // bs)]})
    return hits


def kv_record(scheduler, step: int, admitted: dict[str, int]) -> dict:
    """The KV state after this step's allocation, plus what changed.

    Block tables are written as a delta against this process's previous KV record
    (see schema.KVRecord.block_tables_since): a decode step changes the tables of the
    few requests that crossed a block boundary."""
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    manager = kvm.coordinator.single_type_managers[0]
    # Full attention only appends to a request's block list (a preempted request's
    # list is dropped, and it is not rescheduled in the same step), so a list with
    # the previous record's length and last block is unchanged: its copy is reused.
    append_only = type(manager).__name__ == "FullAttentionManager"
    prev = R.kv_prev_tables
    by_request = manager.req_to_blocks
    keys, lists = list(by_request), list(by_request.values())
    sizes = list(map(len, lists))
    if append_only and not R.kv_freed_since and keys == R.kv_prev_keys:
        # The same requests as at the previous record, none freed since (a freed request's list is dropped, and
        # a new one goes to the end of the dict): every list is the one seen then, and only those that grew
        # changed. Found in C over the batch; the previous record's tables are updated in place.
        tables = prev
        grown = [(user_req_id(keys[i]), lists[i]) for i in compress(range(len(keys)), map(ne, sizes, R.kv_prev_sizes))]
        live = [(uid, blocks, prev.get(uid)) for uid, blocks in grown]
    else:
        tables = {}  # unchanged tables first, then the others (as in the loop below)
        live = []  # (user id, blocks, previous table or None) of the tables to read
        for uid, blocks in zip(map(user_req_id, keys), lists):
            if not blocks:
                continue
            old = prev.get(uid)
            if append_only and old is not None and len(blocks) == len(old) and blocks[-1].block_id == old[-1]:
                tables[uid] = old
            else:
                live.append((uid, blocks, old))
    R.kv_prev_keys, R.kv_prev_sizes, R.kv_freed_since = keys, sizes, False
    changed: dict[str, list[int]] = {}
    allocated = {}
    fresh = 0  # tables not in the previous record (counted once per request, even if user ids repeat)
    for uid, blocks, old in live:
        k = len(old) if old else 0
        if append_only and k and len(blocks) > k and blocks[k - 1].block_id == old[-1]:
            # grown (the common change): only the blocks past the old table are read
            new = [b.block_id for b in blocks[k:]]
            changed[uid] = tables[uid] = old + new
            allocated[uid] = new
            continue
        ids = tables[uid] = [b.block_id for b in blocks]
        if ids == old:
            continue
        changed[uid] = ids
        if old is None:  # new, or resumed after preemption: all but the reused blocks are new
            fresh += 1
            hit = admitted.get(uid, 0)
            reused = ids[: -(-hit // scheduler.block_size)] if hit else ()
            new = [b for b in ids if b not in reused]
        elif ids[: len(old)] == old:
            new = ids[len(old) :]
        else:  # blocks replaced in place (not seen with full attention)
            seen = set(old)
            new = [b for b in ids if b not in seen]
        if new:
            allocated[uid] = new
    # At least len(tables) - fresh of the previous record's tables are here again; when that is all of
    # them (no request finished or was preempted since), the set difference over the batch is skipped.
    if len(prev) > len(tables) - fresh:
        changed.update((uid, []) for uid in prev.keys() - tables.keys())  # released their blocks
    since, R.kv_prev_step = R.kv_prev_step, step
    R.kv_prev_tables = tables
    freed, R.kv_pending_freed = R.kv_pending_freed, []
    evicted, R.kv_pending_evicted = R.kv_pending_evicted, []
    return {  # a schema.KVRecord, as a dict (see Recorder.write)
        "step": step,
        "proc": R.proc_dict("engine_core"),
        "kind": "kv",
        "num_blocks": pool.num_gpu_blocks - 1,
        "block_size": scheduler.block_size,
        "free_blocks": pool.get_num_free_blocks(),
        "usage": round(pool.get_usage(), 6),
        "block_tables": changed if since is not None else tables,
        "block_tables_since": since,
        "allocated": allocated,
        "freed": freed,
        "evicted": evicted,
        "prefix_hits": prefix_hits(scheduler, tables, admitted) if admitted and kvm.enable_caching else [],
        "prefix_caching": bool(kvm.enable_caching),
    }
