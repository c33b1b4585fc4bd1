"""Proofs on admission: the whole-prompt gate, no watermark, the waiting queue."""

from __future__ import annotations

from vllm_tour.notes.proofs._common import _block_size, _cdiv, _first_scheduled, _need, _sched_steps, _shown
from vllm_tour.trace.reader import Run


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
