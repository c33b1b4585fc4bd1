"""Proofs on the block pool: the free queue's order, reuse and eviction, replayed from the KV records."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_tour.notes.proofs._common import _block_size, _need, _sched_steps, _shown
from vllm_tour.trace.reader import Run


@dataclass
class Handout:
    step: int
    req_id: str
    blocks: list[int]
    states: list[str]  # per block: hashless | fresh | cached
    freed_at: list[int]  # per block: position in the run's sequence of frees (-1: fresh)


@dataclass
class PoolReplay:
    handouts: list[Handout] = field(default_factory=list)
    # block -> (step, position in the run's sequence of frees, hashed) of its latest free
    frees: dict[int, tuple[int, int, bool]] = field(default_factory=dict)
    cached_order: list[tuple[int, int]] = field(default_factory=list)  # (step, block) cached blocks as freed, in order
    evictions: list[tuple[int, int]] = field(default_factory=list)  # (step, block)
    owners: dict[int, tuple[str | None, int]] = field(default_factory=dict)  # block -> (request, position) at its free
    cached_free: dict[int, list[int]] = field(default_factory=dict)  # step -> cached blocks nobody holds, after it


def _replay_pool(run: Run) -> PoolReplay:
    bs = _block_size(run)
    rep = PoolReplay()
    computed: dict[str, int] = {}  # tokens whose KV each request has written (after its last scheduled step)
    tables: dict[str, list[int]] = {}
    used: set[int] = set()
    state: dict[int, str] = {}
    n_frees = 0
    for s in _sched_steps(run):
        sc, kv = s.scheduler, s.kv
        # Frees of this step: requests that finished after the previous step, then this step's preemptions.
        released = {r: (tables.get(r, []), computed.get(r, 0)) for r in sc.finished}
        for p in sc.preempted:
            released[p.req_id] = (p.freed_block_ids, p.num_computed_tokens_lost)
        order = list(released)

        def owner(b: int) -> str | None:
            holders = [r for r in order if b in released[r][0]]
            return holders[-1] if holders else None  # a shared block goes back with its last holder

        by_owner: dict[str | None, list[int]] = {}
        for b in kv.freed:
            by_owner.setdefault(owner(b), []).append(b)
        for r, blocks in by_owner.items():
            table, done = released.get(r, ([], 0))
            # Upstream frees a request's blocks tail first (SingleTypeKVCacheManager.free).
            for b in sorted(blocks, key=lambda b: -table.index(b) if b in table else 0):
                pos = table.index(b) if b in table else -1
                hashed = pos >= 0 and (pos + 1) * bs <= done
                state[b] = "cached" if hashed else "hashless"
                rep.frees[b] = (s.index, n_frees, hashed)
                rep.owners[b] = (r, pos)
                n_frees += 1
                if hashed:
                    rep.cached_order.append((s.index, b))
        for h in kv.prefix_hits:  # a hit takes its blocks out of the free pool (BlockPool.touch)
            for b in h.block_ids:
                state.pop(b, None)
        for r, blocks in kv.allocated.items():
            states = [state.pop(b, None) or ("fresh" if b not in used else "in use") for b in blocks]
            freed_at = [rep.frees[b][1] if st in ("hashless", "cached") else -1 for b, st in zip(blocks, states)]
            rep.handouts.append(Handout(s.index, r, list(blocks), states, freed_at))
            used.update(blocks)
        rep.evictions += [(s.index, b) for b in kv.evicted]
        rep.cached_free[s.index] = sorted(b for b, st in state.items() if st == "cached")
        for e in sc.scheduled:
            computed[e.req_id] = e.num_computed_tokens + e.num_scheduled_tokens
        tables = {r: list(t) for r, t in kv.block_tables.items()}
    return rep


_RANK = {"hashless": 0, "fresh": 1, "cached": 2}


def hashless_before_fresh_before_cached(run: Run) -> str:
    """Blocks are handed out hashless-freed first (latest freed first), then never-used, then cached."""
    found = []
    for h in _replay_pool(run).handouts:
        ranks = [_RANK.get(st, -1) for st in h.states]
        _need(ranks == sorted(ranks), h.step, f"{h.req_id} got {h.blocks} as {h.states}")
        hashless = [f for f, st in zip(h.freed_at, h.states) if st == "hashless"]
        _need(hashless == sorted(hashless, reverse=True), h.step,
              f"{h.req_id} got hashless blocks {[b for b, st in zip(h.blocks, h.states) if st == 'hashless']} "
              "not latest-freed first")
        if "hashless" in h.states and "fresh" in h.states:
            parts = {st: [b for b, x in zip(h.blocks, h.states) if x == st] for st in _RANK}
            found.append(f"step {h.step}: {h.req_id} got {h.blocks}: freed without a hash {parts['hashless']}, "
                         f"then never used {parts['fresh']}" + (f", then cached {parts['cached']}" if parts["cached"] else ""))
    return _shown(found, "an allocation that mixes hashless freed blocks with never-used ones")


def fresh_then_freed_in_free_order(run: Run) -> str:
    """Releases whose free_blocks appends every freed block (v0.21.0): never-used blocks are handed out first,
    then freed ones in the order they were freed, hashless or cached alike."""
    found = []
    for h in _replay_pool(run).handouts:
        freed = [st in ("hashless", "cached") for st in h.states]
        _need(freed == sorted(freed), h.step, f"{h.req_id} got {h.blocks} as {h.states}: a freed block before a never-used one")
        order = [f for f, is_freed in zip(h.freed_at, freed) if is_freed]
        _need(order == sorted(order), h.step, f"{h.req_id} got freed blocks "
              f"{[b for b, x in zip(h.blocks, freed) if x]} out of the order they were freed")
        if "hashless" in h.states and "fresh" in h.states:
            found.append(f"step {h.step}: {h.req_id} got {h.blocks} as {h.states}: never used first, then freed "
                         "blocks in the order they were freed, the hashless one given no preference")
    return _shown(found, "an allocation that takes never-used blocks and then a hashless freed block")


def cached_evicted_in_free_order(run: Run) -> str:
    """Cached blocks are evicted least recently freed first (a request's blocks tail first)."""
    rep = _replay_pool(run)
    hits = {(s.index, b) for s in _sched_steps(run) for h in s.kv.prefix_hits for b in h.block_ids}
    queue = []  # cached free blocks, least recently freed first
    # Within a step: frees, then hits, then the allocations that evict (each list keeps its own order).
    events = sorted([(st, 0, i, b) for i, (st, b) in enumerate(rep.cached_order)] + [(st, 1, 0, b) for st, b in hits]
                    + [(st, 2, i, b) for i, (st, b) in enumerate(rep.evictions)])
    found = []
    for step, kind, _, b in events:
        if kind == 0:
            queue.append(b)
        elif kind == 1:
            if b in queue:
                queue.remove(b)
        else:
            _need(bool(queue) and queue[0] == b, step, f"evicted {b} while the least recently freed cached block was "
                  f"{queue[0] if queue else None} (cached free queue {queue})")
            queue.pop(0)
            found.append(f"step {step}: evicted {b}")
    return _shown(found, "an eviction") + " — each the least recently freed cached block at the time"


def tail_evicted_before_head(run: Run) -> str:
    """A request's cached blocks go tail first: its later blocks are evicted before its earlier ones."""
    rep = _replay_pool(run)
    evicted = {b: st for st, b in rep.evictions}
    found = []
    by_req: dict[str, list[tuple[int, int]]] = {}
    for b, (r, pos) in rep.owners.items():
        if rep.frees[b][2]:
            by_req.setdefault(r, []).append((pos, b))
    for r, blocks in by_req.items():
        blocks.sort()
        for (p1, b1), (p2, b2) in zip(blocks, blocks[1:]):
            if b1 in evicted:
                _need(b2 in evicted and evicted[b2] <= evicted[b1], evicted[b1],
                      f"{r}'s block {b1} (position {p1}) was evicted before its later block {b2}")
        gone = [b for _, b in blocks if b in evicted]
        kept = [b for _, b in blocks if b not in evicted]
        if gone and kept:
            found.append(f"{r}'s cached blocks {[b for _, b in blocks]}: evicted {gone[::-1]} (steps "
                         f"{sorted({evicted[b] for b in gone})}) while its head {kept[0]} stayed cached")
    return _shown(found, "a request that lost its tail blocks but kept its head")


def evicted_when_handed_out(run: Run) -> str:
    """Every evicted block is a cached block handed out for new content in that same step."""
    rep = _replay_pool(run)
    given = {(h.step, b): st for h in rep.handouts for b, st in zip(h.blocks, h.states)}
    found = []
    for step, b in rep.evictions:
        _need(given.get((step, b)) == "cached", step, f"block {b} was evicted but not handed out as a cached block")
        found.append(f"step {step}: block {b}")
    return _shown(found, "an eviction") + " evicted as it was handed out again"


def only_hashed_blocks_evicted(run: Run) -> str:
    """Reusing a hashless or never-used block evicts nothing; reusing a cached one evicts it."""
    rep = _replay_pool(run)
    evicted = set(rep.evictions)
    found = []
    for h in rep.handouts:
        for b, st in zip(h.blocks, h.states):
            _need((st == "cached") == ((h.step, b) in evicted), h.step,
                  f"block {b} handed out as {st} to {h.req_id}, evicted: {(h.step, b) in evicted}")
        if "hashless" in h.states and "cached" in h.states:
            found.append(f"step {h.step}: {h.req_id} reused hashless "
                         f"{[b for b, st in zip(h.blocks, h.states) if st == 'hashless']} (no eviction) and cached "
                         f"{[b for b, st in zip(h.blocks, h.states) if st == 'cached']} (evicted)")
    return _shown(found, "one allocation reusing both a hashless and a cached block")


def _hit_free_balance(run: Run, want_free_hit: bool) -> list[str]:
    """free(step) = free(previous) + freed - newly allocated - hit blocks that were free (not held by anyone); the
    hits on free blocks (want_free_hit) or on held ones, as evidence lines."""
    steps = _sched_steps(run)
    found = []
    for prev, s in zip(steps, steps[1:]):
        kv = s.kv
        hitters = {h.req_id for h in kv.prefix_hits}
        held = {b for r, t in kv.block_tables.items() if r not in hitters for b in t} | \
               {b for r, t in prev.kv.block_tables.items() if r not in s.scheduler.finished for b in t
                if b not in kv.freed}
        free_hits = [b for h in kv.prefix_hits for b in h.block_ids if b not in held]
        new = sum(len(v) for v in kv.allocated.values())
        expect = prev.kv.free_blocks + len(kv.freed) - new - len(free_hits)
        _need(kv.free_blocks == expect, s.index, f"free blocks {kv.free_blocks}, expected {prev.kv.free_blocks} + "
              f"{len(kv.freed)} freed - {new} allocated - {len(free_hits)} free blocks hit = {expect}")
        for h in kv.prefix_hits:
            shared = [b for b in h.block_ids if b in held]
            if want_free_hit and set(h.block_ids) & set(free_hits):
                found.append(f"step {s.index}: {h.req_id} hit {h.block_ids} from the free pool: free blocks "
                             f"{prev.kv.free_blocks} + {len(kv.freed)} freed - {new} new - {len(free_hits)} hit = {kv.free_blocks}")
            if not want_free_hit and shared:
                found.append(f"step {s.index}: {h.req_id} hit {shared} held by a running request; free blocks "
                             f"{prev.kv.free_blocks} -> {kv.free_blocks} ({new} new, {len(kv.freed)} freed)")
    return found


def hit_takes_block_from_free_pool(run: Run) -> str:
    return _shown(_hit_free_balance(run, want_free_hit=True), "a prefix hit on a free cached block")


def hit_on_held_blocks_costs_nothing(run: Run) -> str:
    return _shown(_hit_free_balance(run, want_free_hit=False), "a prefix hit on held blocks")


def pool_is_the_override(run: Run) -> str:
    """num_gpu_blocks_override is the pool: every KV record counts override - 1 usable blocks (block 0 is the null
    block), and the small pool forces the preemptions and evictions the scenario is about."""
    override = run.meta.engine_args.get("num_gpu_blocks_override")
    _need(bool(override), None, "the run set no num_gpu_blocks_override")
    steps = _sched_steps(run)
    for s in steps:
        _need(s.kv.num_blocks == override - 1, s.index, f"{s.kv.num_blocks} usable blocks, override {override}")
    pressure = [s.index for s in steps if s.scheduler.preempted or s.kv.evicted]
    _need(bool(pressure), None, f"a pool of {override - 1} usable blocks forced no preemption or eviction")
    return (f"num_gpu_blocks_override = {override}: {override - 1} usable blocks at all {len(steps)} steps; "
            f"preemption or eviction at steps {pressure[:3]}{' …' if len(pressure) > 3 else ''}")
