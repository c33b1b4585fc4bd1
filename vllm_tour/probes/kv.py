"""Probes on the KV-cache manager and block pool (EngineCore process).

They collect, while `Scheduler.schedule` runs, what happened to blocks: which
request got which new blocks, which cached blocks a request reused (prefix
hits), which blocks went back to the free list, which cached blocks lost their
hash to be reused (evictions), and the last allocation that failed (the reason
behind a preemption). `scheduler.py` turns that into one `KVRecord` per step.
"""

from __future__ import annotations

from ..trace.writer import RECORDER as R
from ..trace.writer import user_req_id
from .base import Probe

PINS = ("v0.32.0", "v0.21.0")
KVM = "vllm.v1.core.kv_cache_manager.KVCacheManager"
POOL = "vllm.v1.core.block_pool.BlockPool"


def _block_ids(blocks) -> list[int]:
    """Block ids of the first KV-cache group of a KVCacheBlocks (None -> [])."""
    if blocks is None:
        return []
    groups = blocks.blocks
    return [b.block_id for b in groups[0]] if groups else []


def new_step_scratch() -> dict:
    return {"hits": []}


# --- allocate_slots: new blocks, prefix hits, failures ---------------------------------


def _alloc_after(token, result, self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, *a, **kw):
    # This runs for every scheduled request every step, so it does the least it
    # can: new blocks are found by kv_record() diffing block tables; here only
    # prefix-cache hits and failures (a failed allocation returns before it
    # touches the pool, so the free count read now is the one it failed against).
    if result is None:
        rid = user_req_id(request.request_id)
        R.last_alloc_failure = {"req_id": rid, "num_tokens": num_new_tokens, "free_blocks": self.block_pool.get_num_free_blocks()}
    elif num_new_computed_tokens and R.kv_step is not None:
        hit = {"req_id": user_req_id(request.request_id), "num_hit_tokens": num_new_computed_tokens, "block_ids": _block_ids(new_computed_blocks)}
        R.kv_step["hits"].append(hit)  # a schema.PrefixHit


allocate_slots = Probe(
    name="kv.allocate_slots",
    target=f"{KVM}.allocate_slots",
    params=("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks"),
    records="prefix-cache hits (tokens, reused block ids) and failed allocations (the reason behind a preemption)",
    pins=PINS,
    after=_alloc_after,
)


# --- free: blocks that really return to the free list ----------------------------------


def _free_before(self, request, *a, **kw):
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
)

PROBES = [allocate_slots, free, evict]


def kv_record(scheduler, step: int, scratch: dict) -> dict:
    """The KV state after this step's allocation, plus what changed."""
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    manager = kvm.coordinator.single_type_managers[0]
    # Full attention only appends to a request's block list (a preempted request's
    # list is dropped, and it is not rescheduled in the same step), so a list with
    # the previous record's length and last block is unchanged: its copy is reused.
    append_only = type(manager).__name__ == "FullAttentionManager"
    hit_ids = {h["req_id"]: h["block_ids"] for h in scratch["hits"]}
    prev = R.kv_prev_tables
    tables: dict[str, list[int]] = {}
    allocated = {}
    for rid, blocks in list(manager.req_to_blocks.items()):
        if not blocks:
            continue
        uid = user_req_id(rid)
        old = prev.get(uid)
        if old is not None and len(blocks) == len(old) and blocks[-1].block_id == old[-1]:
            # the common decode step: nothing changed
            tables[uid] = old if append_only else [b.block_id for b in blocks]
            continue
        ids = tables[uid] = [b.block_id for b in blocks]
        if old is None:  # new, or resumed after preemption: all but the reused blocks are new
            reused = hit_ids.get(uid, ())
            new = [b for b in ids if b not in reused]
        elif ids[: len(old)] == old:
            new = ids[len(old) :]
        else:  # blocks replaced in place (not seen with full attention)
            seen = set(old)
            new = [b for b in ids if b not in seen]
        if new:
            allocated[uid] = new
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
        "block_tables": tables,
        "allocated": allocated,
        "freed": freed,
        "evicted": evicted,
        "prefix_hits": scratch["hits"],
        "prefix_caching": bool(kvm.enable_caching),
    }
