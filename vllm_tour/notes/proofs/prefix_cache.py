"""Proofs on prefix-cache hits: what is hit, how much, when, and who owns the blocks."""

from __future__ import annotations

from vllm_tour.notes.proofs._common import _block_size, _first_scheduled, _need, _sched_steps, _shown, _tokens
from vllm_tour.notes.proofs.block_pool import _replay_pool
from vllm_tour.trace.reader import Run


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


def _shared_with_earlier(run: Run, req_id: str, toks: list[int], upto: int) -> int:
    """How many leading tokens `toks` shares with any other request seen before step `upto`."""
    return max((_common(toks, _tokens(run, o)) for o in _earlier_tables(run, upto) if o != req_id), default=0)


def _entry(step, req_id: str):
    """The request's entry among the step's scheduled requests."""
    return next(e for e in step.scheduler.scheduled if e.req_id == req_id)


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
        e = _entry(s, h.req_id)
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


def hit_capped_below_prompt(run: Run) -> str:
    """A hit never covers the last prompt token: a fully cached block-aligned prompt recomputes its last block."""
    bs = _block_size(run)
    found = []
    for s, h in _hits(run):
        e = _entry(s, h.req_id)
        total = e.num_prompt_tokens + e.num_output_tokens
        _need(h.num_hit_tokens <= total - 1, s.index, f"{h.req_id} hit {h.num_hit_tokens} of its {total} tokens")
        cached = _shared_with_earlier(run, h.req_id, _tokens(run, h.req_id)[:total], s.index)
        if total % bs == 0 and cached >= total:
            found.append(f"step {s.index}: {h.req_id}'s {total} tokens are all cached, yet it hits "
                         f"{h.num_hit_tokens} and computes {e.num_scheduled_tokens}")
    return _shown(found, "a fully cached, block-aligned prompt")


def hit_becomes_computed(run: Run) -> str:
    """A hit found at admission becomes num_computed_tokens: only the rest of the prompt is scheduled."""
    found = []
    for s, h in _hits(run):
        e = _entry(s, h.req_id)
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
        shared = _shared_with_earlier(run, h.req_id, _tokens(run, h.req_id), s.index)
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
        e = _entry(s, h.req_id)
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
    _need(bool(ids), None, "no request ever held a block")
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


def no_hits_without_prefix_caching(run: Run) -> str:
    """With prefix caching off, requests sharing whole prompt blocks get no hit: nothing hashes their blocks."""
    bs = _block_size(run)
    _need(run.meta.engine_args.get("enable_prefix_caching") is False, None, "the run has prefix caching on")
    first = _first_scheduled(run)
    found = []
    for s in _sched_steps(run):
        _need(not s.kv.prefix_caching and not s.kv.prefix_hits, s.index,
              f"prefix caching {'on' if s.kv.prefix_caching else 'off'}, hits {[h.req_id for h in s.kv.prefix_hits]}")
    reqs = [r.req_id for r in run.meta.requests]
    for i, r in enumerate(reqs):
        for o in reqs[:i]:
            shared = _common(_tokens(run, r), _tokens(run, o)) // bs
            if shared and first.get(o, 0) < first.get(r, 0):
                found.append(f"{r} shares {shared} full block(s) with {o}, scheduled before it, and hit nothing")
    return _shown(found, "requests sharing whole blocks")
