"""Checks that prove the notes' claims on a live upstream trace (`vllm-tour annotations verify`).

Each check takes a loaded run (`trace.reader.Run`) and returns its evidence as one
line; when the claim does not hold it raises `ClaimFailed` with the step and what
was seen there. Checks read only the trace records (scheduler, kv, runner,
attention) and the run's meta (engine arguments, prompt token ids, outputs):
annotations/proofs/<pin>.toml says which note each one proves, on which scenario.

Block-pool checks replay the pool from the records: a block handed out is
"hashless" when it was freed while partly filled (no block hash: upstream caches
only full blocks), "fresh" when it was never used, "cached" when freed full (its
hash still in the lookup map).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..trace.reader import Run


class ClaimFailed(Exception):
    def __init__(self, step: int | None, evidence: str):
        super().__init__(evidence)
        self.step = step
        self.evidence = evidence


SHOWN = 2  # instances of a behaviour quoted as evidence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_size(run: Run) -> int:
    return run.meta.engine_args["block_size"]


def _sched_steps(run: Run):
    return [s for s in run.steps if s.scheduler is not None and s.kv is not None]


def _tokens(run: Run, req_id: str) -> list[int]:
    """Prompt + generated token ids of a request."""
    out = {o.req_id: o for o in run.outputs.requests} if run.outputs else {}
    o = out[req_id]
    return list(o.prompt_token_ids) + list(o.token_ids)


def _need(cond: bool, step: int | None, evidence: str) -> None:
    if not cond:
        raise ClaimFailed(step, evidence)


def _shown(found: list[str], what: str) -> str:
    """The evidence line, or a failure when the run never showed the behaviour at all."""
    _need(bool(found), None, f"the run never shows {what}")
    found = list(dict.fromkeys(found))
    more = f" (+{len(found) - SHOWN} more)" if len(found) > SHOWN else ""
    return "; ".join(found[:SHOWN]) + more


# --- the block pool, replayed ------------------------------------------------------------------


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


def _hit_free_balance(run: Run, want_free_hit: bool) -> str:
    """free(step) = free(previous) + freed - newly allocated - hit blocks that were free (not held by anyone)."""
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
    return _shown(found, "a prefix hit on a free cached block" if want_free_hit else "a prefix hit on held blocks")


def hit_takes_block_from_free_pool(run: Run) -> str:
    return _hit_free_balance(run, want_free_hit=True)


def hit_on_held_blocks_costs_nothing(run: Run) -> str:
    return _hit_free_balance(run, want_free_hit=False)


# --- prefix hits -------------------------------------------------------------------------------


def _earlier_tables(run: Run, upto: int) -> dict[str, list[int]]:
    """Each request's largest block table seen before step `upto`."""
    seen: dict[str, list[int]] = {}
    for s in _sched_steps(run):
        if s.index >= upto:
            break
        for r, t in s.kv.block_tables.items():
            if len(t) >= len(seen.get(r, [])):
                seen[r] = list(t)
    return seen


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _hits(run: Run):
    for s in _sched_steps(run):
        for h in s.kv.prefix_hits:
            yield s, h


def longest_hit_stops_at_first_miss(run: Run) -> str:
    """A hit is the run of cached blocks from the start; it ends at the first block no longer cached."""
    bs = _block_size(run)
    evicted = {b: st for st, b in _replay_pool(run).evictions}
    found = []
    for s, h in _hits(run):
        e = next(e for e in s.scheduler.scheduled if e.req_id == h.req_id)
        toks = _tokens(run, h.req_id)[:e.num_prompt_tokens + e.num_output_tokens]
        for other, table in _earlier_tables(run, s.index).items():
            if other == h.req_id:
                continue
            shared = min(_common(toks, _tokens(run, other)), len(toks) - 1) // bs
            n_hit = len(h.block_ids)
            if table[:n_hit] == h.block_ids and shared > n_hit:
                miss = table[n_hit]
                _need(miss in evicted and evicted[miss] < s.index, s.index,
                      f"{h.req_id} shares {shared} blocks of tokens with {other} but hit only {n_hit}, "
                      f"and {other}'s block {miss} was not evicted")
                found.append(f"step {s.index}: {h.req_id} shares {shared * bs} tokens with {other} but hits only "
                             f"{h.block_ids}: {other}'s next block {miss} was evicted at step {evicted[miss]}")
    return _shown(found, "a hit shorter than the shared prefix")


def block_hash_covers_prefix(run: Run) -> str:
    """Equal tokens in a block are not a hit unless every block before it is equal too."""
    bs = _block_size(run)
    found = []
    reqs = [r.req_id for r in run.meta.requests]
    hit = {(s.index, h.req_id): len(h.block_ids) for s, h in _hits(run)}
    first = _first_scheduled(run)
    for r in reqs:
        toks = _tokens(run, r)
        for other in reqs:
            if other == r or first.get(other, 1 << 30) >= first.get(r, 0):
                continue
            o = _tokens(run, other)
            same = [j for j in range(min(len(toks), len(o)) // bs) if toks[j * bs:(j + 1) * bs] == o[j * bs:(j + 1) * bs]]
            lead = _common(toks, o) // bs
            later = [j for j in same if j >= lead]
            n_hit = hit.get((first[r], r), 0)
            if later:
                _need(n_hit <= lead, first[r], f"{r} hit {n_hit} blocks but shares only {lead} leading blocks with {other}")
                found.append(f"{r}'s block {later[0]} holds the same {bs} tokens as {other}'s block {later[0]}, but "
                             f"their earlier blocks differ: {r} hit {n_hit} blocks at step {first[r]}")
    return _shown(found, "two requests with an equal block after a differing one")


def _first_scheduled(run: Run) -> dict[str, int]:
    first: dict[str, int] = {}
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            first.setdefault(e.req_id, s.index)
    return first


def hit_capped_below_prompt(run: Run) -> str:
    """A hit never covers the last prompt token: a fully cached block-aligned prompt recomputes its last block."""
    bs = _block_size(run)
    found = []
    for s, h in _hits(run):
        e = next(e for e in s.scheduler.scheduled if e.req_id == h.req_id)
        total = e.num_prompt_tokens + e.num_output_tokens
        _need(h.num_hit_tokens <= total - 1, s.index, f"{h.req_id} hit {h.num_hit_tokens} of its {total} tokens")
        cached = max((_common(_tokens(run, h.req_id)[:total], _tokens(run, o)) for o in _earlier_tables(run, s.index)
                      if o != h.req_id), default=0)
        if total % bs == 0 and cached >= total:
            found.append(f"step {s.index}: {h.req_id}'s {total} tokens are all cached, yet it hits "
                         f"{h.num_hit_tokens} and computes {e.num_scheduled_tokens}")
    return _shown(found, "a fully cached, block-aligned prompt")


def hit_becomes_computed(run: Run) -> str:
    """A hit found at admission becomes num_computed_tokens: only the rest of the prompt is scheduled."""
    found = []
    for s, h in _hits(run):
        e = next(e for e in s.scheduler.scheduled if e.req_id == h.req_id)
        _need(e.kind in ("new", "resumed") and e.num_computed_tokens == h.num_hit_tokens, s.index,
              f"{h.req_id} ({e.kind}) hit {h.num_hit_tokens} tokens, computed {e.num_computed_tokens}")
        found.append(f"step {s.index}: {h.req_id} hit {h.num_hit_tokens} of {e.num_prompt_tokens + e.num_output_tokens}"
                     f" tokens, scheduled {e.num_scheduled_tokens} from position {e.num_computed_tokens}")
    return _shown(found, "a prefix hit")


def hits_are_whole_blocks(run: Run) -> str:
    """Hits count whole blocks: num_hit_tokens = blocks x block_size, even where the shared prefix ends mid-block."""
    bs = _block_size(run)
    found = []
    for s, h in _hits(run):
        _need(h.num_hit_tokens == len(h.block_ids) * bs, s.index, f"{h.req_id} hit {h.num_hit_tokens} tokens in {h.block_ids}")
        shared = max((_common(_tokens(run, h.req_id), _tokens(run, o)) for o in _earlier_tables(run, s.index)
                      if o != h.req_id), default=0)
        if shared % bs:
            found.append(f"step {s.index}: {h.req_id} shares {shared} tokens with an earlier request, hits {h.num_hit_tokens}")
    return _shown(found, "a shared prefix that ends inside a block")


def hit_blocks_are_the_owners(run: Run) -> str:
    """The blocks a hit returns are the physical blocks an earlier request holds for the same prefix."""
    found = []
    for s, h in _hits(run):
        earlier = _earlier_tables(run, s.index)
        owners = [o for o, t in earlier.items() if t[:len(h.block_ids)] == h.block_ids]
        _need(bool(owners), s.index, f"{h.req_id} hit {h.block_ids}, which no earlier request held as its first blocks")
        whose = "its own earlier" if owners[0] == h.req_id else f"{owners[0]}'s"
        found.append(f"step {s.index}: {h.req_id} got {whose} blocks {h.block_ids}")
    return _shown(found, "a prefix hit")


def same_step_hit(run: Run) -> str:
    """A request admitted later in a schedule() call hits blocks allocated (not yet written) earlier in that call."""
    found = []
    for s, h in _hits(run):
        owners = [e.req_id for e in s.scheduler.scheduled if e.kind == "new" and e.req_id != h.req_id
                  and s.kv.allocated.get(e.req_id, [])[:len(h.block_ids)] == h.block_ids]
        if owners:
            found.append(f"step {s.index}: {h.req_id} hit {h.block_ids}, allocated to {owners[0]} in the same step "
                         f"(block tables {list(s.kv.block_tables.values())})")
    return _shown(found, "a hit on blocks allocated in the same step")


def hit_includes_generated_tokens(run: Run) -> str:
    """A request readmitted after preemption hits blocks filled by its own generated tokens."""
    found = []
    for s, h in _hits(run):
        e = next(e for e in s.scheduler.scheduled if e.req_id == h.req_id)
        if h.num_hit_tokens > e.num_prompt_tokens:
            found.append(f"step {s.index}: {h.req_id} ({e.kind}) hit {h.num_hit_tokens} tokens, past its "
                         f"{e.num_prompt_tokens}-token prompt")
    return _shown(found, "a hit longer than the prompt")


def finished_blocks_stay_cached(run: Run) -> str:
    """A finished request's full blocks keep their hashes in the free pool: a later request hits them."""
    found = []
    finished_at: dict[str, int] = {}
    rep = _replay_pool(run)
    for s, h in _hits(run):
        for b in h.block_ids:
            if b in rep.frees and rep.frees[b][0] <= s.index:
                owner = rep.owners[b][0]
                found.append(f"{owner}'s block {b}, freed at step {rep.frees[b][0]}, hit by {h.req_id} at step {s.index}")
    for s in _sched_steps(run):
        for r in s.scheduler.finished:
            finished_at[r] = s.index
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            _need(e.req_id not in finished_at or s.index < finished_at[e.req_id], s.index, f"{e.req_id} scheduled after it finished")
    return _shown(found, "a hit on a finished request's block")


def attention_sees_shared_blocks(run: Run) -> str:
    """Attention gets the same block-table rows the KV manager holds; a hit shows only as shared block ids."""
    found = []
    for s in _sched_steps(run):
        a, r = s.attention.get(0), s.runner.get(0)
        if a is None or r is None:
            continue
        for rid, row in zip(r.req_ids, a.block_table):
            table = s.kv.block_tables[rid]
            _need(row[:len(table)] == table, s.index, f"attention row of {rid} is {row}, the KV manager holds {table}")
        if s.kv.prefix_hits:
            found.append(f"step {s.index}: rows {a.block_table}")
    return _shown(found, "a step with a prefix hit")


def null_block_never_in_tables(run: Run) -> str:
    """Block 0 is the null block: no request's block table holds it, and the pool has num_blocks - 1 usable."""
    steps = _sched_steps(run)
    for s in steps:
        for r, t in s.kv.block_tables.items():
            _need(0 not in t, s.index, f"{r}'s block table {t} holds block 0")
    ids = {b for s in steps for t in s.kv.block_tables.values() for b in t}
    override = run.meta.engine_args.get("num_gpu_blocks_override")
    _need(override is None or steps[0].kv.num_blocks == override - 1, steps[0].index,
          f"pool of {override} blocks reports {steps[0].kv.num_blocks} usable")
    return f"{len(steps)} steps, block ids used {min(ids)}..{max(ids)}, usable blocks {steps[0].kv.num_blocks}"


def usage_counts_cached_as_free(run: Run) -> str:
    """kv.usage = 1 - free / usable blocks, where cached but unreferenced blocks count as free."""
    rep = _replay_pool(run)
    found = []
    for s in _sched_steps(run):
        kv = s.kv
        _need(abs(kv.usage - (1 - kv.free_blocks / kv.num_blocks)) < 1e-6, s.index,
              f"usage {kv.usage}, free {kv.free_blocks} of {kv.num_blocks}")
        if rep.cached_free[s.index]:
            found.append(f"step {s.index}: usage {kv.usage:.2f} = 1 - {kv.free_blocks}/{kv.num_blocks}, the free blocks "
                         f"including cached {rep.cached_free[s.index]}")
    return _shown(found, "a step with cached free blocks")


# --- the scheduler -------------------------------------------------------------------------------


def _admission_order(run: Run):
    """Per step: `running` as schedule() found it (admission order), replayed from the records."""
    running: list[str] = []
    for s in _sched_steps(run):
        sc = s.scheduler
        running = [r for r in running if r not in sc.finished]
        yield s, list(running)
        running = [r for r in running if r not in {p.req_id for p in sc.preempted}]
        running += [e.req_id for e in sc.scheduled if e.kind in ("new", "resumed")]


def running_in_admission_order(run: Run) -> str:
    """Running requests are served in admission order every step: nothing reorders `running`."""
    found = []
    for s, running in _admission_order(run):
        served = [e.req_id for e in s.scheduler.scheduled if e.kind == "running"]
        _need(served == [r for r in running if r in served], s.index, f"served {served}, running in admission order {running}")
        _need(served == running[:len(served)], s.index, f"served {served} but not from the head of running {running}")
        r = s.runner.get(0)
        if r and len(served) > 1 and [x for x in r.req_ids if x in served] != served:
            found.append(f"step {s.index}: scheduler serves {served} in admission order, the runner's batch rows are {r.req_ids}")
    steps = sum(1 for _ in _sched_steps(run))
    return f"{steps} steps each served `running` from its head in admission order" + (f"; {found[0]}" if found else "")


def victim_is_last_admitted(run: Run) -> str:
    """The preemption victim is the tail of `running`: the most recently admitted request."""
    found = []
    for s, running in _admission_order(run):
        for p in s.scheduler.preempted:
            _need(bool(running) and running[-1] == p.req_id, s.index, f"preempted {p.req_id}, running was {running}")
            found.append(f"step {s.index}: {p.req_id}, last of {running}, preempted while allocating for {p.while_allocating_for}")
            running.pop()
    return _shown(found, "a preemption")


def preempt_self_gets_nothing(run: Run) -> str:
    """A request that must preempt and is itself the tail preempts itself and gets no tokens this step."""
    found = []
    for s in _sched_steps(run):
        for p in s.scheduler.preempted:
            if p.while_allocating_for == p.req_id:
                _need(p.req_id not in {e.req_id for e in s.scheduler.scheduled}, s.index, f"{p.req_id} preempted itself but was scheduled")
                found.append(f"step {s.index}: {p.req_id} preempted itself (freed {p.freed_block_ids}); scheduled "
                             f"{[e.req_id for e in s.scheduler.scheduled]}")
    return _shown(found, "a request preempting itself")


def no_admission_in_preempting_step(run: Run) -> str:
    """A step that preempts admits nobody, even with free blocks and waiting requests."""
    found = []
    for s in _sched_steps(run):
        sc = s.scheduler
        if sc.preempted:
            admitted = [e.req_id for e in sc.scheduled if e.kind in ("new", "resumed")]
            _need(not admitted, s.index, f"preempted {[p.req_id for p in sc.preempted]} and admitted {admitted}")
            if sc.waiting_after:
                found.append(f"step {s.index}: preempted {[p.req_id for p in sc.preempted]}, {sc.waiting_after} waiting, "
                             f"{s.kv.free_blocks} blocks free, none admitted")
    return _shown(found, "a preempting step with requests waiting")


def resume_recomputes(run: Run) -> str:
    """A readmitted request starts over from its prefix hit (0 without one): prompt and outputs are prefilled again."""
    found = []
    for s in _sched_steps(run):
        hits = {h.req_id: h.num_hit_tokens for h in s.kv.prefix_hits}
        for e in s.scheduler.scheduled:
            if e.kind == "resumed":
                owed = e.num_prompt_tokens + e.num_output_tokens
                _need(e.num_computed_tokens == hits.get(e.req_id, 0), s.index,
                      f"{e.req_id} resumed at {e.num_computed_tokens}, prefix hit {hits.get(e.req_id, 0)}")
                found.append(f"step {s.index}: {e.req_id} resumed from {e.num_computed_tokens} (hit) and scheduled "
                             f"{e.num_scheduled_tokens} of its {owed} tokens")
    return _shown(found, "a resumed request")


def later_victim_resumes_first(run: Run) -> str:
    """A victim goes to the front of `waiting`: a request preempted later is readmitted before earlier ones."""
    preempted_at: dict[str, int] = {}
    found = []
    waiting: list[str] = []
    for s in _sched_steps(run):
        resumed = [e.req_id for e in s.scheduler.scheduled if e.kind == "resumed"]
        if resumed:
            _need(resumed == waiting[:len(resumed)], s.index, f"resumed {resumed}, front of waiting was {waiting}")
            if len(resumed) > 1 or len(waiting) > 1:
                found.append(f"step {s.index}: resumed {resumed} (preempted at steps {[preempted_at[r] for r in resumed]})")
            waiting = waiting[len(resumed):]
        for p in s.scheduler.preempted:
            preempted_at[p.req_id] = s.index
            waiting.insert(0, p.req_id)
    return _shown(found, "two preempted requests waiting together")


def allocation_all_or_nothing(run: Run) -> str:
    """A failed allocation changes nothing; after the preemption the retry gets all the blocks it asked for."""
    found = []
    for s in _sched_steps(run):
        for p in s.scheduler.preempted:
            who = p.while_allocating_for
            if who and who != p.req_id:
                got = s.kv.allocated.get(who, [])
                _need(len(got) > (p.free_blocks_at_failure or 0), s.index,
                      f"{who} got {got} with {p.free_blocks_at_failure} blocks free at the failure")
                found.append(f"step {s.index}: allocating {p.num_tokens_requested} token(s) for {who} failed with "
                             f"{p.free_blocks_at_failure} free blocks; {p.req_id} preempted (freed {p.freed_block_ids}); "
                             f"the retry gave {who} {got}")
    return _shown(found, "a preemption on behalf of another request")


def failed_running_allocation_preempts(run: Run) -> str:
    """Every preemption answers a failed allocate_slots() for a running request (named in the trace)."""
    found = []
    for s, running in _admission_order(run):
        for p in s.scheduler.preempted:
            _need(p.while_allocating_for in running, s.index, f"{p.req_id} preempted: {p.reason}")
            found.append(f"step {s.index}: {p.reason}")
    return _shown(found, "a preemption")


def decode_allocates_at_block_boundary(run: Run) -> str:
    """A running request gets a new block only when its tokens cross a block boundary."""
    bs = _block_size(run)
    prev: dict[str, list[int]] = {}
    grew, quiet = [], 0
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            if e.kind != "running":
                continue
            end = e.num_computed_tokens + e.num_scheduled_tokens
            got = s.kv.allocated.get(e.req_id, [])
            want = _cdiv(end, bs) - len(prev.get(e.req_id, []))
            _need(len(got) == max(want, 0), s.index, f"{e.req_id} reaches {end} tokens with {len(prev.get(e.req_id, []))} "
                  f"blocks and got {got}")
            if got:
                grew.append(f"step {s.index}: {e.req_id} reached token {end} -> +{got}")
            else:
                quiet += 1
        prev = {r: list(t) for r, t in s.kv.block_tables.items()}
    return _shown(grew, "a running request growing a block") + f"; {quiet} other running steps allocated nothing"


def table_covers_scheduled_tokens(run: Run) -> str:
    """After each step a request holds exactly ceil((computed + scheduled) / block_size) blocks, and only grows."""
    bs = _block_size(run)
    prev: dict[str, list[int]] = {}
    n = 0
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            t = s.kv.block_tables[e.req_id]
            end = e.num_computed_tokens + e.num_scheduled_tokens
            _need(len(t) == _cdiv(end, bs), s.index, f"{e.req_id} holds {t} for {end} tokens")
            if e.kind == "running":
                _need(t[:len(prev[e.req_id])] == prev[e.req_id], s.index, f"{e.req_id}'s table {prev[e.req_id]} -> {t}")
            n += 1
        prev = {r: list(t) for r, t in s.kv.block_tables.items()}
    return f"{n} scheduled entries, each holding ceil(tokens / {bs}) blocks"


def runner_drops_unscheduled(run: Run) -> str:
    """A preempted request leaves the runner's batch until it is readmitted as resumed."""
    found = []
    out: dict[str, int] = {}
    for s in _sched_steps(run):
        r = s.runner.get(0)
        for e in s.scheduler.scheduled:
            if e.req_id in out and e.kind == "resumed":
                found.append(f"{e.req_id}: out of the runner's batch from step {out.pop(e.req_id)} to {s.index - 1}, back at step {s.index}")
        if r:
            for rid in out:
                _need(rid not in r.req_ids, s.index, f"{rid} is preempted but in the runner's batch {r.req_ids}")
        for p in s.scheduler.preempted:
            out[p.req_id] = s.index
    return _shown(found, "a preempted request coming back")


def readmitted_as_resumed(run: Run) -> str:
    """A request's first admission is `new`; after a preemption it is admitted again as `resumed`, at the tail."""
    found = []
    out = set()
    for s, running in _admission_order(run):
        admitted = [e for e in s.scheduler.scheduled if e.kind in ("new", "resumed")]
        for e in admitted:
            want = "resumed" if e.req_id in out else "new"
            _need(e.kind == want and e.req_id not in running, s.index, f"{e.req_id} admitted as {e.kind}, expected {want}")
            if want == "resumed":
                found.append(f"step {s.index}: {e.req_id} back as resumed behind {running}")
            out.discard(e.req_id)
        out |= {p.req_id for p in s.scheduler.preempted}
    return _shown(found, "a resumed request")


def fcfs_admission(run: Run) -> str:
    """Waiting requests are admitted in arrival order."""
    first = _first_scheduled(run)
    reqs = sorted(run.meta.requests, key=lambda r: r.arrival_step)
    order = [r.req_id for r in reqs]
    got = sorted(order, key=lambda r: (first[r], order.index(r)))
    _need(got == order, first[got[0]], f"admitted {got}, arrival order {order}")
    return "admitted in arrival order: " + ", ".join(f"{r}@{first[r]}" for r in order)


def max_num_seqs_caps_running(run: Run) -> str:
    """Admission stops at max_num_seqs running requests, with budget and blocks to spare."""
    found = []
    for s in _sched_steps(run):
        sc = s.scheduler
        _need(sc.running_after <= sc.max_num_seqs, s.index, f"{sc.running_after} running, max_num_seqs {sc.max_num_seqs}")
        if sc.waiting_after and sc.running_after == sc.max_num_seqs and sc.tokens_scheduled < sc.token_budget:
            found.append(f"step {s.index}: {sc.waiting_after} waiting with {sc.token_budget - sc.tokens_scheduled} "
                         f"budget and {s.kv.free_blocks} blocks left, {sc.running_after} = max_num_seqs running")
    return _shown(found, "a request held back only by max_num_seqs")


# --- chunked prefill and the budget ---------------------------------------------------------------


def _owed(e) -> int:
    return e.num_prompt_tokens + e.num_output_tokens - e.num_computed_tokens


def budget_spent_running_first(run: Run) -> str:
    """Running requests take the budget first, in order; waiting ones get what is left."""
    found = []
    for s in _sched_steps(run):
        sc = s.scheduler
        left = sc.token_budget
        running = [e for e in sc.scheduled if e.kind == "running"]
        admitted = [e for e in sc.scheduled if e.kind != "running"]
        for e in running + admitted:
            _need(e.num_scheduled_tokens == min(_owed(e), left), s.index,
                  f"{e.req_id} got {e.num_scheduled_tokens} of {_owed(e)} owed with {left} budget left")
            left -= e.num_scheduled_tokens
        if admitted and running and admitted[-1].num_scheduled_tokens < _owed(admitted[-1]):
            found.append(f"step {s.index}: running {[(e.req_id, e.num_scheduled_tokens) for e in running]} first, "
                         f"then {admitted[-1].req_id} got the {admitted[-1].num_scheduled_tokens} left of {sc.token_budget}")
    return _shown(found, "a new request getting only the budget's remainder")


def running_prefill_clamped(run: Run) -> str:
    """A running prefill gets min(what it owes, the budget left): a long prompt runs as several chunks."""
    found = []
    for s in _sched_steps(run):
        left = s.scheduler.token_budget
        for e in s.scheduler.scheduled:
            if e.kind == "running" and e.is_prefill and e.num_scheduled_tokens < _owed(e):
                _need(e.num_scheduled_tokens == left, s.index, f"{e.req_id} got {e.num_scheduled_tokens} with {left} left")
                found.append(f"step {s.index}: {e.req_id} owes {_owed(e)}, gets {e.num_scheduled_tokens} (the budget left) "
                             f"from position {e.num_computed_tokens}")
            left -= e.num_scheduled_tokens if e.kind == "running" else 0
    return _shown(found, "a running prefill clamped by the budget")


def no_long_prefill_cap(run: Run) -> str:
    """With the default long_prefill_token_threshold (0), one chunk takes all the budget left, others present or not."""
    found = []
    for s in _sched_steps(run):
        sc = s.scheduler
        for e in sc.scheduled:
            if e.is_prefill and e.num_scheduled_tokens < _owed(e) and len(sc.scheduled) > 1:
                others = sum(x.num_scheduled_tokens for x in sc.scheduled if x is not e)
                _need(e.num_scheduled_tokens + others == sc.token_budget, s.index,
                      f"{e.req_id} got {e.num_scheduled_tokens}, others {others}, budget {sc.token_budget}")
                found.append(f"step {s.index}: {e.req_id} takes {e.num_scheduled_tokens} of {sc.token_budget} beside "
                             f"{len(sc.scheduled) - 1} other request(s)")
    return _shown(found, "a chunk beside other requests")


def waiting_prompt_chunked(run: Run) -> str:
    """Chunked prefill is on by default: a new prompt larger than the budget left is admitted with a chunk."""
    found = []
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            if e.kind == "new" and e.num_scheduled_tokens < _owed(e):
                found.append(f"step {s.index}: {e.req_id} admitted with {e.num_scheduled_tokens} of its {_owed(e)} prompt tokens")
    return _shown(found, "a new prompt admitted in part")


def owed_tokens(run: Run) -> str:
    """Tokens owed = all tokens - computed: 1 for a decode, the rest of the prompt (clamped) mid-prefill."""
    decodes = chunks = 0
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            _need(e.num_scheduled_tokens <= _owed(e), s.index, f"{e.req_id} got {e.num_scheduled_tokens}, owes {_owed(e)}")
            if not e.is_prefill:
                _need(e.num_scheduled_tokens == 1 == _owed(e), s.index, f"decode of {e.req_id} got {e.num_scheduled_tokens}")
                decodes += 1
            elif e.kind == "running":
                chunks += 1
    _need(chunks > 0, None, "the run never continues a prefill")
    return f"{decodes} decodes of exactly 1 token, {chunks} continued prefill chunks within what they owed"


def computed_advances_at_schedule(run: Run) -> str:
    """num_computed_tokens of a running request = previous computed + previous scheduled."""
    last: dict[str, int] = {}
    n = 0
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            if e.kind == "running":
                _need(e.num_computed_tokens == last[e.req_id], s.index,
                      f"{e.req_id} at {e.num_computed_tokens}, previous step ended at {last[e.req_id]}")
                n += 1
            last[e.req_id] = e.num_computed_tokens + e.num_scheduled_tokens
    return f"{n} running entries each start where the previous step's scheduled tokens end"


def budget_is_max_num_batched_tokens(run: Run) -> str:
    """The per-step budget is max_num_batched_tokens, and no step exceeds it."""
    want = run.meta.engine_args.get("max_num_batched_tokens")
    full = []
    for s in _sched_steps(run):
        sc = s.scheduler
        _need(sc.token_budget == want and sc.tokens_scheduled <= want, s.index,
              f"budget {sc.token_budget}, scheduled {sc.tokens_scheduled}, max_num_batched_tokens {want}")
        if sc.tokens_scheduled == want:
            full.append(s.index)
    return f"budget {want} every step; steps {full} used all of it"


def _partial_rows(s):
    return {e.req_id for e in s.scheduler.scheduled if e.is_prefill and e.num_scheduled_tokens < _owed(e)}


def partial_prefill_sample_dropped_by_runner(run: Run) -> str:
    """Every row gets a logits index (qsl[1:] - 1); the runner drops a partial prefill's sampled token."""
    found = []
    for s in _sched_steps(run):
        r = s.runner.get(0)
        if r is None:
            continue
        _need(r.logits_indices == [q - 1 for q in r.query_start_loc[1:]], s.index,
              f"logits_indices {r.logits_indices}, query_start_loc {r.query_start_loc}")
        for rid in _partial_rows(s):
            _need(r.sampled_token_ids.get(rid) == [], s.index, f"partial prefill {rid} came back with {r.sampled_token_ids.get(rid)}")
            i = r.req_ids.index(rid)
            found.append(f"step {s.index}: {rid} row {i}, logits index {r.logits_indices[i]}, runner output []")
    return _shown(found, "a partial prefill")


def partial_prefill_gets_no_token(run: Run) -> str:
    """A request mid chunked prefill gets no output token: its output count stays 0 until its last chunk."""
    found = []
    steps = _sched_steps(run)
    for s, nxt in zip(steps, steps[1:]):
        for rid in _partial_rows(s):
            e = next((e for e in nxt.scheduler.scheduled if e.req_id == rid), None)
            if e is not None:
                _need(e.num_output_tokens == 0, nxt.index, f"{rid} has {e.num_output_tokens} outputs after a partial chunk")
                found.append(f"step {s.index}: {rid} chunk -> 0 output tokens at step {nxt.index}")
    return _shown(found, "a partial prefill followed by its next chunk")


def _runner_rows(s):
    r = s.runner.get(0)
    by_id = {e.req_id: e for e in s.scheduler.scheduled}
    return r, [by_id[x] for x in r.req_ids]


def positions_start_at_computed(run: Run) -> str:
    """Token positions = the request's computed tokens + offset in this step's chunk."""
    found = []
    for s in _sched_steps(run):
        if s.runner.get(0) is None:
            continue
        r, rows = _runner_rows(s)
        want = [p for e in rows for p in range(e.num_computed_tokens, e.num_computed_tokens + e.num_scheduled_tokens)]
        if r.positions.full is None:
            continue
        _need(r.positions.full == want, s.index, "positions differ from computed + offset")
        found += [f"step {s.index}: {e.req_id}'s chunk starts at position {e.num_computed_tokens}"
                  for e in rows if e.is_prefill and e.num_computed_tokens > 0]
    return _shown(found, "a chunk that does not start at 0")


def seq_lens_computed_plus_scheduled(run: Run) -> str:
    """seq_lens = computed + scheduled per row; attention gets the same lengths."""
    found = []
    for s in _sched_steps(run):
        if s.runner.get(0) is None:
            continue
        r, rows = _runner_rows(s)
        want = [e.num_computed_tokens + e.num_scheduled_tokens for e in rows]
        _need(r.seq_lens == want, s.index, f"seq_lens {r.seq_lens}, computed + scheduled {want}")
        a = s.attention.get(0)
        _need(a is None or a.seq_lens == want, s.index, f"attention seq_lens {a.seq_lens if a else None}")
        found += [f"step {s.index}: {e.req_id} seq_len {e.num_computed_tokens + e.num_scheduled_tokens} "
                  f"= {e.num_computed_tokens} in cache + {e.num_scheduled_tokens} new" for e in rows
                  if e.num_computed_tokens and e.num_scheduled_tokens > 1]
    return _shown(found, "a chunk after cached context")


def slot_mapping_from_block_table(run: Run) -> str:
    """slot = block_table[p // block_size] * block_size + p % block_size for every new token."""
    bs = _block_size(run)
    n = 0
    for s in _sched_steps(run):
        if s.runner.get(0) is None or s.runner[0].slot_mapping.full is None:
            continue
        r, rows = _runner_rows(s)
        want = [s.kv.block_tables[e.req_id][p // bs] * bs + p % bs for e in rows
                for p in range(e.num_computed_tokens, e.num_computed_tokens + e.num_scheduled_tokens)]
        _need(r.slot_mapping.full == want, s.index, f"slot_mapping {r.slot_mapping.full[:8]}..., from block tables {want[:8]}...")
        n += 1
    _need(n > 0, None, "no step recorded its slot mapping in full")
    return f"{n} steps: every slot = block_table[p // {bs}] * {bs} + p % {bs}"


def flattened_batch(run: Run) -> str:
    """The batch is flat: num_tokens = sum of scheduled tokens, query_start_loc their running sum, no padding."""
    found = []
    for s in _sched_steps(run):
        if s.runner.get(0) is None:
            continue
        r, rows = _runner_rows(s)
        counts = [e.num_scheduled_tokens for e in rows]
        qsl = [0]
        for c in counts:
            qsl.append(qsl[-1] + c)
        _need(r.num_scheduled_tokens == counts and r.query_start_loc == qsl and r.num_tokens == qsl[-1]
              and r.input_ids.length == qsl[-1], s.index, f"counts {counts}, query_start_loc {r.query_start_loc}, "
              f"num_tokens {r.num_tokens}, input_ids {r.input_ids.length}")
        if len(set(counts)) > 1:
            found.append(f"step {s.index}: {counts} -> {r.num_tokens} tokens, query_start_loc {r.query_start_loc}")
    return _shown(found, "a step mixing chunk and decode sizes")


# --- admission ------------------------------------------------------------------------------------


def _waiting_steps(run: Run, rid: str):
    """Steps in which `rid` had arrived (scheduled from arrival_step + 1) but was not yet admitted."""
    arrival = next(r.arrival_step for r in run.meta.requests if r.req_id == rid)
    first = _first_scheduled(run).get(rid)
    return [s for s in _sched_steps(run) if arrival < s.index < (first or 1 << 30)], first


def whole_prompt_must_fit(run: Run) -> str:
    """A new request is admitted only when its whole prompt fits the free blocks, not just its first chunk."""
    bs = _block_size(run)
    found = []
    for req in run.meta.requests:
        waited, first = _waiting_steps(run, req.req_id)
        need = _cdiv(len(req.prompt_token_ids or []), bs)
        for s in waited:
            sc = s.scheduler
            left = sc.token_budget - sc.tokens_scheduled
            chunk_blocks = _cdiv(min(left, len(req.prompt_token_ids or [])), bs)
            if left > 0 and chunk_blocks <= s.kv.free_blocks < need and not sc.preempted:
                found.append(f"step {s.index}: {req.req_id} waits: its first {left}-token chunk needs {chunk_blocks} "
                             f"blocks of {s.kv.free_blocks} free, its {len(req.prompt_token_ids)}-token prompt {need}")
                break
    return _shown(found, "a request held back only by its full prompt")


def watermark_off(run: Run) -> str:
    """No watermark by default: a newcomer beside running requests is admitted with every free block it finds."""
    bs = _block_size(run)
    found = []
    for s in _sched_steps(run):
        sc = s.scheduler
        if not any(e.kind == "running" for e in sc.scheduled):
            continue
        allocated = list(s.kv.allocated.items())  # in allocation order: running requests first
        for e in sc.scheduled:
            if e.kind == "new" and e.req_id in s.kv.allocated:
                i = [r for r, _ in allocated].index(e.req_id)
                # Free blocks when this request was admitted: what is left now plus what it and later ones took.
                free_before = s.kv.free_blocks + sum(len(b) for _, b in allocated[i:])
                need = _cdiv(e.num_prompt_tokens, bs)
                if need == free_before:
                    found.append(f"step {s.index}: {e.req_id}'s prompt needs {need} blocks, {free_before} were free; "
                                 f"admitted beside running {[x.req_id for x in sc.scheduled if x.kind == 'running']} "
                                 f"(a 1% watermark would keep {int(0.01 * s.kv.num_blocks)} free)")
    return _shown(found, "an admission that leaves no free block for the whole prompt")


def failed_admission_stops_the_queue(run: Run) -> str:
    """A waiting request that cannot get blocks preempts nobody and stops admission: later ones wait behind it."""
    found = []
    reqs = sorted(run.meta.requests, key=lambda r: r.arrival_step)
    for i, head in enumerate(reqs):
        waited, first = _waiting_steps(run, head.req_id)
        for behind in reqs[i + 1:]:
            wb, fb = _waiting_steps(run, behind.req_id)
            both = [s for s in wb if s in waited]
            for s in both:
                _need(not s.scheduler.preempted, s.index, f"{head.req_id} waiting, yet {s.scheduler.preempted} preempted")
            blocked = [s for s in both if s.scheduler.running_after < s.scheduler.max_num_seqs
                       and s.scheduler.tokens_scheduled < s.scheduler.token_budget]
            if blocked:
                s = blocked[0]
                both = blocked
                found.append(f"steps {[x.index for x in both]}: {behind.req_id} ({len(behind.prompt_token_ids or [])} tokens) "
                             f"waits behind {head.req_id} with {s.kv.free_blocks} blocks free and nobody preempted")
    return _shown(found, "a request waiting behind one that does not fit")


def no_blocks_before_admission(run: Run) -> str:
    """A request added to the engine holds no blocks until the step that admits it."""
    found = []
    for req in run.meta.requests:
        waited, first = _waiting_steps(run, req.req_id)
        for s in waited:
            _need(req.req_id not in s.kv.block_tables, s.index, f"{req.req_id} holds blocks while waiting")
        if waited and first is not None:
            got = next(s for s in _sched_steps(run) if s.index == first).kv.block_tables[req.req_id]
            found.append(f"{req.req_id}: no blocks in steps {waited[0].index}..{waited[-1].index}, {len(got)} at step {first}")
    return _shown(found, "a request waiting before admission")


def batch_redecided_each_step(run: Run) -> str:
    """The batch is rebuilt every step: a finished request is gone and a waiting one joins in the same step."""
    found = []
    for s in _sched_steps(run):
        sc = s.scheduler
        joined = [e.req_id for e in sc.scheduled if e.kind == "new"]
        if sc.finished and joined:
            found.append(f"step {s.index}: {sc.finished} gone, {joined} joined")
    return _shown(found, "a step where requests leave and join")
