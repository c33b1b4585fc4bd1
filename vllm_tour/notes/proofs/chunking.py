"""Proofs on chunked prefill and the token budget, and on the runner inputs built from them."""

from __future__ import annotations

from vllm_tour.notes.proofs._common import _block_size, _need, _sched_steps, _shown
from vllm_tour.trace.reader import Run


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


def lone_prefill_not_capped(run: Run) -> str:
    """From v0.31.0 a request alone in the engine is not held to long_prefill_token_threshold: its prefill takes what
    the budget allows, above the threshold."""
    threshold = run.meta.engine_args.get("long_prefill_token_threshold") or 0
    _need(threshold > 0, None, "the run set no long_prefill_token_threshold")
    found = []
    for s in _sched_steps(run):
        sc = s.scheduler
        for e in sc.scheduled:
            if e.is_prefill and sc.running_before + sc.waiting_before == 1 and e.num_scheduled_tokens > threshold:
                found.append(f"step {s.index}: {e.req_id}, alone, prefills {e.num_scheduled_tokens} tokens in one step "
                             f"(long_prefill_token_threshold {threshold})")
    return _shown(found, "a lone request's prefill above long_prefill_token_threshold")


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
    """num_computed_tokens of a running request = previous computed + previous scheduled. Needs the case the
    note is about: a prefill continued in the next step (a chunk), and a decode following it."""
    last: dict[str, int] = {}
    was_prefill: dict[str, bool] = {}
    chunks, decodes = [], []
    for s in _sched_steps(run):
        for e in s.scheduler.scheduled:
            if e.kind == "running":
                _need(e.num_computed_tokens == last[e.req_id], s.index,
                      f"{e.req_id} at {e.num_computed_tokens}, previous step ended at {last[e.req_id]}")
                (chunks if was_prefill[e.req_id] and e.is_prefill else decodes).append(
                    f"step {s.index}: {e.req_id} starts at {e.num_computed_tokens}")
            last[e.req_id] = e.num_computed_tokens + e.num_scheduled_tokens
            was_prefill[e.req_id] = e.is_prefill
    return (_shown(chunks, "a prefill chunk continued in the next step") + "; "
            + _shown(decodes, "a running request decoding"))


def budget_is_max_num_batched_tokens(run: Run) -> str:
    """The per-step budget is max_num_batched_tokens, and no step exceeds it. Needs the budget set by the
    scenario and used up in some step: a budget nothing reaches proves no limit."""
    want = run.meta.engine_args.get("max_num_batched_tokens")
    _need(want is not None, None, "the run sets no max_num_batched_tokens: the claim is about that setting")
    full = []
    for s in _sched_steps(run):
        sc = s.scheduler
        _need(sc.token_budget == want and sc.tokens_scheduled <= want, s.index,
              f"budget {sc.token_budget}, scheduled {sc.tokens_scheduled}, max_num_batched_tokens {want}")
        if sc.tokens_scheduled == want:
            full.append(f"step {s.index}")
    return f"budget {want} every step; used up in " + _shown(full, f"a step that uses all {want} tokens")


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
