"""The labs on offer: which reference file each skeleton comes from and what the learner writes.

A method's `reads` are annotation note ids (annotations/*.toml; `vllm-tour source` shows them
in place) or, where no note covers it, the upstream qualified name it mirrors; `hints` are for
methods upstream has no counterpart of. A stub ends up with neither a docstring of its own nor
any of these only by mistake: skeleton.py refuses it, and a test resolves every id and name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_tour.compare.modules import REFERENCE


@dataclass(frozen=True)
class Lab:
    component: str  # the name `compare --impl COMPONENT=...` knows (compare/modules.py REFERENCE)
    module: str  # the compare module its checks run
    scenarios: tuple[str, ...]  # traces/scenarios/<name>.toml, chosen to exercise the component
    stub: tuple[str, ...]  # top-level classes/functions whose bodies the learner writes
    # top-level names taken from the reference module instead of copied (the engine owns them)
    from_reference: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()  # names (defined or imported) the lab file has no use for
    reads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    hints: dict[str, str] = field(default_factory=dict)

    @property
    def entry(self) -> str:
        """The class or function the lab file must define (the reference's name)."""
        return REFERENCE[self.component].split(":")[1]

    @property
    def reference(self) -> str:
        """The reference file, relative to the repository root."""
        return REFERENCE[self.component].split(":")[0].replace(".", "/") + ".py"


BLOCK_POOL = Lab(
    component="block_pool",
    module="reimpl.chunked_prefill",  # decisions are its whole effect: block tables, hits, evictions
    scenarios=("cmp_evict", "cmp_shared_prefix"),
    stub=("FreeBlockQueue", "BlockPool"),
    reads={
        "FreeBlockQueue": ("pool-free-queue",),
        "BlockPool": ("vllm.v1.core.block_pool.BlockPool",),
        "FreeBlockQueue.popleft_n": ("pool-get-new",),
        "FreeBlockQueue.remove": ("pool-touch",),
        "FreeBlockQueue.append_n": ("pool-free-order",),
        "FreeBlockQueue.prepend_n": ("pool-free-order",),
        "FreeBlockQueue.__len__": ("vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue",),
        "BlockPool.__init__": ("pool-null-block",),
        "BlockPool.get_cached_block": ("pool-cached-lookup",),
        "BlockPool.cache_full_blocks": ("pool-cache-full",),
        "BlockPool._maybe_evict": ("pool-evict-impl", "pool-evict-on-reuse"),
        "BlockPool.get_new_blocks": ("pool-get-new", "pool-evict-on-reuse"),
        "BlockPool.touch": ("pool-touch",),
        "BlockPool.free_blocks": ("pool-free-order",),
        "BlockPool.num_free_blocks": ("vllm.v1.core.block_pool.BlockPool.get_num_free_blocks",),
        "BlockPool.usage": ("pool-usage",),
    },
    hints={
        "FreeBlockQueue.__init__": "Hold `blocks` in the given order (ascending ids): the front is handed out first.",
        "FreeBlockQueue.block_ids": "The queued block ids, front first (the engine prints the head in --explain).",
        "BlockPool.take_events": "Return (freed, evicted) block ids since the last call and start both lists afresh "
                                 "(the engine writes them into the step's kv record; upstream emits KV events).",
    },
)

KV_CACHE_MANAGER = Lab(
    component="kv_cache_manager",
    module="reimpl.chunked_prefill",  # decisions are its whole effect: block tables, hits, evictions
    scenarios=("cmp_evict", "cmp_shared_prefix", "cmp_preempt"),
    stub=("KVCacheManager",),
    reads={
        "KVCacheManager": ("vllm.v1.core.kv_cache_manager.KVCacheManager",),
        "KVCacheManager.__init__": ("vllm.v1.core.kv_cache_manager.KVCacheManager.__init__",),
        "KVCacheManager.register": ("kvm-hash-chain", "kvm-hash-full-only", "kvm-request-hashes-grow"),
        "KVCacheManager.get_computed_blocks": ("kvm-hit-cap", "kvm-find-longest", "kvm-longest-hit"),
        "KVCacheManager._num_blocks_to_allocate": (
            "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate",),
        "KVCacheManager.allocate_slots": ("kvm-alloc-layout", "kvm-alloc-fail", "kvm-attach-hit", "kvm-new-blocks",
                                          "kvm-cache-blocks"),
        "KVCacheManager.free": ("kvm-free-reverse",),
        "KVCacheManager.block_ids": ("vllm.v1.core.kv_cache_manager.KVCacheManager.get_block_ids",),
    },
    hints={
        "KVCacheManager.block_tables": "Every request's block ids, for the trace (requests holding no block left out).",
    },
)

SCHEDULER = Lab(
    component="scheduler",
    module="reimpl.chunked_prefill",
    scenarios=("cmp_chunked", "cmp_preempt"),
    stub=("Scheduler",),
    reads={
        "Scheduler": ("vllm.v1.core.sched.scheduler.Scheduler",),
        "Scheduler.__init__": ("sched-queues", "sched-token-budget-config"),
        "Scheduler.add_request": ("sched-add-request",),
        "Scheduler.has_unfinished": ("vllm.v1.core.sched.scheduler.Scheduler.get_num_unfinished_requests",),
        "Scheduler.schedule": ("sched-no-phases", "sched-budget-init", "sched-running-loop", "sched-num-new-tokens",
                               "sched-zero-tokens-continue", "sched-allocate-running", "sched-preempt-self",
                               "sched-waiting-gate", "sched-max-active", "sched-prefix-lookup",
                               "sched-no-chunking-break", "sched-allocate-waiting", "sched-waiting-alloc-fail",
                               "sched-admit", "sched-scheduler-output"),
        "Scheduler._update_after_schedule": ("sched-update-after-schedule",),
        "Scheduler.pick_victim": ("sched-pick-victim",),
        "Scheduler.chunk": ("sched-running-clamp",),
        "Scheduler._preempt": ("sched-preempt-reset", "sched-preempt-prepend"),
        "Scheduler.update_from_output": ("sched-update-from-output", "sched-finish-free"),
        "Scheduler._update_request_with_output": ("sched-append-and-stop",),
        "Scheduler._check_stop": ("sched-check-stop",),
    },
    hints={
        "Scheduler._scheduled": "A `Scheduled` row for the step's output, taken before num_computed_tokens advances.",
    },
)

PAGED_ATTENTION = Lab(
    component="paged_attention",
    module="reimpl.paged_attn",
    scenarios=("cmp_single", "cmp_concurrent"),
    stub=("paged_attention",),
    from_reference=("slot_mapping", "BatchMeta", "PagedKVCache"),
    drop=("_gather_slots", "BlockPool", "KVCacheManager", "hash_block_tokens"),
    reads={
        "paged_attention": ("attn-metadata-build", "attn-kv-write", "attn-kv-layout", "attn-read-block-table",
                            "runner-slot-mapping"),
    },
    hints={
        "paged_attention": "The paging is the lab: scatter K/V into cache.k / cache.v viewed as [num_blocks * "
                           "block_size, kv_heads, head_dim] at meta.slot_mapping, and read each request's K/V back "
                           "through meta.block_tables yourself. (PagedKVCache.write / .gather do both for you; use "
                           "them only to compare.)",
    },
)

LABS: dict[str, Lab] = {lab.component: lab for lab in (BLOCK_POOL, KV_CACHE_MANAGER, SCHEDULER, PAGED_ATTENTION)}
