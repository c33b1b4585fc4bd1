"""Proofs on the scheduler: running order, preemption, resumption, allocation."""

from __future__ import annotations

from vllm_tour.notes.proofs._common import _block_size, _cdiv, _first_scheduled, _need, _sched_steps, _shown
from vllm_tour.trace.reader import Run


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
    """Running requests are served in admission order every step: nothing reorders `running`. Needs a step
    serving two running requests or more: with one, any order is admission order."""
    several, found = [], []
    for s, running in _admission_order(run):
        served = [e.req_id for e in s.scheduler.scheduled if e.kind == "running"]
        _need(served == [r for r in running if r in served], s.index, f"served {served}, running in admission order {running}")
        _need(served == running[:len(served)], s.index, f"served {served} but not from the head of running {running}")
        if len(served) > 1:
            several.append(f"step {s.index}: served {served}")
        r = s.runner.get(0)
        if r and len(served) > 1 and [x for x in r.req_ids if x in served] != served:
            found.append(f"step {s.index}: scheduler serves {served} in admission order, the runner's batch rows are {r.req_ids}")
    return (_shown(several, "a step serving two running requests or more") + " from the head of `running` in admission order"
            + (f"; {found[0]}" if found else ""))


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
    """After each step a request holds exactly ceil((computed + scheduled) / block_size) blocks, and only grows.
    Needs a running request whose table grew (a block boundary crossed): else "only grows" went untested."""
    bs = _block_size(run)
    prev: dict[str, list[int]] = {}
    n, grew = 0, []
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            t = s.kv.block_tables[e.req_id]
            end = e.num_computed_tokens + e.num_scheduled_tokens
            _need(len(t) == _cdiv(end, bs), s.index, f"{e.req_id} holds {t} for {end} tokens")
            if e.kind == "running":
                _need(t[:len(prev[e.req_id])] == prev[e.req_id], s.index, f"{e.req_id}'s table {prev[e.req_id]} -> {t}")
                if len(t) > len(prev[e.req_id]):
                    grew.append(f"step {s.index}: {e.req_id} {prev[e.req_id]} -> {t}")
            n += 1
        prev = {r: list(t) for r, t in s.kv.block_tables.items()}
    return f"{n} scheduled entries, each holding ceil(tokens / {bs}) blocks; grown in place: " + _shown(grew, "a running request's table growing")


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
    """Waiting requests are admitted in arrival order. Needs a request that was already waiting when an
    earlier arrival was admitted and got in at a later step: admitted all at once, any order would pass."""
    first = _first_scheduled(run)
    arrival = {r.req_id: r.arrival_step + 1 for r in run.meta.requests}  # the first step it could run in
    order = sorted(arrival, key=lambda r: (arrival[r], list(arrival).index(r)))
    for s in _sched_steps(run):
        new = [e.req_id for e in s.scheduler.scheduled if e.kind == "new"]
        _need(new == sorted(new, key=order.index), s.index, f"admitted {new} in this order; arrival order {order}")
    got = sorted(order, key=lambda r: (first[r], order.index(r)))
    _need(got == order, first[got[0]], f"admitted {got}, arrival order {order}")
    held = [f"{b} waiting since step {arrival[b]} admitted at step {first[b]}, after {a} at step {first[a]}"
            for a, b in zip(order, order[1:]) if first[a] < first[b] and arrival[b] <= first[a]]
    return "admitted in arrival order; " + _shown(held, "a request waiting while an earlier one is admitted")


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
