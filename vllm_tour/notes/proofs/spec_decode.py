"""Proofs on speculative decoding (ngram): the proposer's match, greedy verification, the drafts' way through the
scheduler, the rollback over rejected drafts, the lookahead, and a step's tokens cut at a stop.

They read the spec records (`spec_proposal`: the drafts proposed after a step; `spec_verify`: the drafts a step
verified, how many the target kept, the KV slots of the rejected ones), the scheduler, KV and runner records, and the
run's prompts and outputs. The proposer's rule is replayed here on its own (`_prompt_lookup`), not borrowed from
the reimpl: a proof must not lean on the code it is meant to judge.
"""

from __future__ import annotations

from vllm_tour.notes.proofs._common import _block_size, _cdiv, _need, _sched_steps, _shown
from vllm_tour.trace.reader import Run


def _spec_config(run: Run, method: str = "ngram") -> dict:
    spec = (run.meta.engine_args or {}).get("speculative_config") or {}
    _need(spec.get("method") == method, None, "the run enables no ngram speculative decoding")
    return spec


def _verified(run: Run):
    """(step, verification) for every request whose drafts a step verified."""
    return [(s, v) for s in _sched_steps(run) if s.spec_verify for v in s.spec_verify.requests]


def _entry(step, req_id: str):
    return next((e for e in step.scheduler.scheduled if e.req_id == req_id), None)


def _next_entry(steps, i: int, req_id: str):
    """The request's scheduled entry at the first step after steps[i] that schedules it, and that step."""
    for s in steps[i + 1:]:
        if (e := _entry(s, req_id)) is not None:
            return s, e
    return None, None


def _outputs(run: Run) -> dict:
    return {o.req_id: o for o in run.outputs.requests} if run.outputs else {}


def _prompt_lookup(tokens: list[int], lo: int, hi: int, k: int, max_model_len: int, earliest: bool = True) -> list[int]:
    """Up to k tokens after an earlier occurrence of the longest suffix n-gram (lo <= n <= hi) of `tokens`: the
    earliest occurrence (upstream's rule) or, earliest=False, the latest one (what the rule rules out)."""
    k = min(k, max_model_len - len(tokens))
    if k <= 0 or len(tokens) >= max_model_len:
        return []
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]  # not the suffix itself
        if starts:
            start = starts[0] if earliest else starts[-1]
            return tokens[start + n:start + n + k]
    return []


def ngram_drafts_from_longest_earliest_match(run: Run) -> str:
    """Every proposal is prompt lookup on the request's tokens after the step (prompt + outputs): the tokens that
    followed the earliest earlier occurrence of the longest suffix n-gram, at most k; none without a match, none for
    a request that sampled nothing. Needs a proposal where a shorter match, and one where a later occurrence, would
    have drafted other tokens: else "longest" and "earliest" went untested."""
    spec = _spec_config(run)
    lo, hi, k = spec["prompt_lookup_min"], spec["prompt_lookup_max"], spec["num_speculative_tokens"]
    mml = run.meta.engine_args["max_model_len"]
    outs = _outputs(run)
    steps = _sched_steps(run)
    drafted, none, longer, earlier = [], [], [], []
    for i, s in enumerate(steps):
        if not s.spec_proposal:
            continue
        for rid, drafts in s.spec_proposal.proposed.items():
            e, (_, nxt) = _entry(s, rid), _next_entry(steps, i, rid)
            if e is None or nxt is None:
                continue  # finished in this step: its context is not in the records
            tokens = list(outs[rid].prompt_token_ids) + list(outs[rid].token_ids[:nxt.num_output_tokens])
            sampled = e.num_computed_tokens + e.num_scheduled_tokens >= e.num_prompt_tokens + e.num_output_tokens
            want = _prompt_lookup(tokens, lo, hi, k, mml) if sampled else []
            _need(drafts == want, s.index, f"{rid} proposed {drafts} after {len(tokens)} tokens ending {tokens[-hi:]}; "
                  f"prompt lookup drafts {want}")
            where = f"step {s.index}: {rid} ending {tokens[-hi:]} drafted {drafts}"
            if not drafts:
                if sampled:
                    none.append(f"step {s.index}: {rid}, last token {tokens[-1]} never seen before it")
                continue
            drafted.append(where)
            if (short := _prompt_lookup(tokens, lo, lo, k, mml)) != drafts:
                longer.append(f"{where} (a {lo}-token match would draft {short})")
            if (late := _prompt_lookup(tokens, lo, hi, k, mml, earliest=False)) != drafts:
                earlier.append(f"{where} (the latest occurrence would draft {late})")
    return "; ".join([_shown(drafted, "a proposal with drafts"),
                      _shown(none, "a request that sampled a token with no earlier match (no drafts)"),
                      "longest: " + _shown(longer, "a proposal where a shorter match would draft other tokens"),
                      "earliest: " + _shown(earlier, "a proposal where a later occurrence would draft other tokens")])


def greedy_keeps_drafts_to_first_mismatch(run: Run) -> str:
    """Greedy verification keeps the drafts up to the first the target disagrees with, then one token of the
    target's own, which differs from that draft; all accepted, the bonus token follows."""
    _spec_config(run)
    sampled = [r.req_id for r in run.meta.requests if r.temperature > 0]
    _need(not sampled, None, "the run has sampled requests: greedy verification needs greedy ones only")
    mid, full, first = [], [], []
    for s, v in _verified(run):
        d, got, a = v.draft_token_ids, v.sampled_token_ids, v.num_accepted
        where = f"step {s.index}: {v.req_id} drafts {d}, target kept {got}"
        _need(got[:a] == d[:a] and len(got) == a + 1, s.index, f"{where}: not the accepted drafts plus one token")
        if a == len(d):
            full.append(f"{where} ({a}/{len(d)} + bonus {got[-1]})")
            continue
        _need(got[a] != d[a], s.index, f"{where}: the target's token at the rejected draft {d[a]} is that draft")
        (first if a == 0 else mid).append(f"{where} (draft {d[a]} vs target {got[a]} at draft {a + 1})")
    return "; ".join(["rejected mid-draft: " + _shown(mid, "a draft rejected after an accepted one"),
                      "all accepted: " + _shown(full, "every draft of a step accepted (a bonus token added)"),
                      "first rejected: " + _shown(first, "a step whose first draft was rejected")])


def drafts_verified_next_step(run: Run) -> str:
    """Drafts proposed after step s are scheduled with the request's last token at step s + 1 (1 + k tokens, cut by
    the budget) and verified there, once: a step's verified drafts are exactly the previous step's proposal."""
    _spec_config(run)
    steps = _sched_steps(run)
    pairs, plain = [], []
    for prev, s in zip(steps, steps[1:]):
        proposed = {r: d for r, d in (prev.spec_proposal.proposed.items() if prev.spec_proposal else ()) if d}
        verified = {v.req_id: v.draft_token_ids for v in (s.spec_verify.requests if s.spec_verify else ())}
        for e in s.scheduler.scheduled:
            if e.kind != "running" or e.num_computed_tokens < e.num_prompt_tokens + e.num_output_tokens - 1:
                continue  # a new or resumed request, or a prefill chunk: no drafts
            d = proposed.get(e.req_id, [])
            _need(e.num_scheduled_tokens <= 1 + len(d) and verified.get(e.req_id, []) == d[:e.num_scheduled_tokens - 1],
                  s.index, f"{e.req_id} scheduled {e.num_scheduled_tokens} tokens, verified {verified.get(e.req_id)}; "
                  f"step {prev.index} proposed {d}")
            if d:
                pairs.append(f"step {prev.index} proposed {d} for {e.req_id}; step {s.index} scheduled "
                             f"{e.num_scheduled_tokens} tokens and verified {verified[e.req_id]}")
            else:
                plain.append(f"step {s.index}: {e.req_id} with no drafts scheduled 1 token")
        extra = set(verified) - {e.req_id for e in s.scheduler.scheduled}
        _need(not extra, s.index, f"verified {sorted(extra)}, which the step did not schedule")
    return _shown(pairs, "drafts proposed after a step and verified in the next") + "; " + \
        _shown(plain, "a decode without drafts")


def rejected_drafts_rolled_back(run: Run) -> str:
    """After a verification the request's num_computed_tokens is its last token's position + 1 + the accepted
    drafts (schedule() added 1 + k, update_from_output took the rejected back); no block is freed, not even one
    allocated only for the drafts; each rejected draft's KV slot is written again by a later step of the request."""
    _spec_config(run)
    bs = _block_size(run)
    steps = _sched_steps(run)
    index = {s.index: i for i, s in enumerate(steps)}
    rolled, kept, rewritten = [], [], []
    for s, v in _verified(run):
        later, e = _next_entry(steps, index[s.index], v.req_id)
        if e is None or e.kind != "running":
            continue  # finished, or preempted before its next step: recomputed from scratch
        want = v.num_computed_tokens + 1 + v.num_accepted
        _need(e.num_computed_tokens == want, later.index, f"{v.req_id} at {e.num_computed_tokens} computed after "
              f"step {s.index} kept {v.num_accepted} of {len(v.draft_token_ids)} drafts from {v.num_computed_tokens}; "
              f"want {want}")
        table, after = s.kv.block_tables.get(v.req_id, []), later.kv.block_tables.get(v.req_id, [])
        _need(after[:len(table)] == table, later.index, f"{v.req_id}'s blocks {table} at step {s.index}, {after} at {later.index}")
        rejected = len(v.draft_token_ids) - v.num_accepted
        if rejected:
            rolled.append(f"step {s.index}: {v.req_id} kept {v.num_accepted} of {len(v.draft_token_ids)}, "
                          f"next at {e.num_computed_tokens} computed (step {later.index})")
        new = s.kv.allocated.get(v.req_id, [])
        without_drafts = _cdiv(v.num_computed_tokens + 1, bs)
        if rejected and new and len(table) - len(new) >= without_drafts:
            kept.append(f"step {s.index}: {v.req_id} got block {new} for its drafts' positions, still holds it at "
                        f"step {later.index}: {after}")
        for slot in v.rejected_slots:
            if w := _written_again(steps[index[s.index] + 1:], v.req_id, slot):
                rewritten.append(f"slot {slot} of {v.req_id}, rejected at step {s.index}, rewritten at step {w}")
    return "; ".join(["rolled back: " + _shown(rolled, "a rejected draft"),
                      "blocks kept: " + _shown(kept, "a block allocated for drafts that were rejected"),
                      "slots reused: " + _shown(rewritten, "a rejected draft's KV slot written again by a later step")])


def _written_again(steps, req_id: str, slot: int) -> int | None:
    """The first of `steps` whose runner writes `slot` for `req_id`, or None (the request ended first)."""
    for s in steps:
        r = s.runner.get(0)
        if r is None or req_id not in r.req_ids or r.slot_mapping.full is None:
            continue
        i = r.req_ids.index(req_id)
        start = sum(r.num_scheduled_tokens[:i])
        if slot in r.slot_mapping.full[start:start + r.num_scheduled_tokens[i]]:
            return s.index
    return None


def ngram_lookahead_is_zero(run: Run) -> str:
    """ngram drafts are token ids with no KV of their own: the lookahead is 0 and every scheduled request holds
    exactly the blocks its computed and scheduled tokens (drafts included) need; drafts that reach past a block
    boundary get that block."""
    _spec_config(run)
    bs = _block_size(run)
    crossing, verifying = [], 0
    for s in _sched_steps(run):
        if s.spec_verify:
            verifying += 1
            _need(s.spec_verify.num_lookahead_tokens == 0, s.index,
                  f"lookahead {s.spec_verify.num_lookahead_tokens} slots with ngram drafts")
        verified = {v.req_id: v for v in (s.spec_verify.requests if s.spec_verify else ())}
        for e in s.scheduler.scheduled:
            end = e.num_computed_tokens + e.num_scheduled_tokens
            held = s.kv.block_tables.get(e.req_id, [])
            _need(len(held) == _cdiv(end, bs), s.index, f"{e.req_id} holds {held} for {end} tokens (block size {bs})")
            if e.req_id in verified and _cdiv(e.num_computed_tokens + 1, bs) < _cdiv(end, bs):
                crossing.append(f"step {s.index}: {e.req_id} at {e.num_computed_tokens} with "
                                f"{len(verified[e.req_id].draft_token_ids)} drafts holds {held} (got {s.kv.allocated.get(e.req_id, [])})")
    return f"lookahead 0 in {verifying} verifying steps, every table exact; " + \
        _shown(crossing, "drafts that reach into a block the last token alone would not need")


def step_tokens_cut_at_stop(run: Run) -> str:
    """A step's tokens are appended one at a time with a stop check after each: all of them when none stops the
    request, else those up to the stop, the rest dropped, and the request finishes (at max_tokens: exactly there)."""
    _spec_config(run)
    outs = _outputs(run)
    limit = {r.req_id: r.max_tokens for r in run.meta.requests}
    whole, cut = [], []
    for s, v in _verified(run):
        before, got = _entry(s, v.req_id).num_output_tokens, v.sampled_token_ids
        o = outs[v.req_id]
        kept = min(len(got), len(o.token_ids) - before)
        appended = list(o.token_ids[before:before + kept])
        _need(appended == got[:kept], s.index, f"{v.req_id} got {got} at output {before}; its output there is {appended}")
        _need(before + kept <= limit[v.req_id], s.index,
              f"{v.req_id} appended {appended} at output {before}, past max_tokens {limit[v.req_id]}")
        if kept == len(got):
            whole.append(f"step {s.index}: {v.req_id} appended {got}")
            continue
        left = limit[v.req_id] - before
        _need(o.finish_reason == "stop" or (o.finish_reason == "length" and kept == left), s.index,
              f"{v.req_id} got {got} with {left} left before max_tokens, kept {appended}, finished ({o.finish_reason})")
        cut.append(f"step {s.index}: {v.req_id} got {got} with {left} left before max_tokens: kept {appended}, "
                   f"dropped {got[kept:]}, finished ({o.finish_reason}) with {len(o.token_ids)} tokens")
    return _shown(whole, "a step's tokens all appended") + "; " + \
        _shown(cut, "a step that yielded more tokens than the request had left")


def preempted_drafts_dropped(run: Run) -> str:
    """A request preempted while holding drafts loses them: they are not verified, it resumes as a prefill of its
    prompt and outputs with no drafts, and its next drafts are proposed after that prefill."""
    _spec_config(run)
    steps = _sched_steps(run)
    held, back = [], []
    for prev, s in zip(steps, steps[1:]):
        proposed = prev.spec_proposal.proposed if prev.spec_proposal else {}
        verified = {v.req_id for v in (s.spec_verify.requests if s.spec_verify else ())}
        for p in s.scheduler.preempted:
            if proposed.get(p.req_id):
                _need(p.req_id not in verified, s.index, f"{p.req_id} preempted, yet its drafts were verified")
                held.append(f"step {s.index}: {p.req_id} preempted holding drafts {proposed[p.req_id]} (proposed at "
                            f"step {prev.index}), none verified")
        for e in s.scheduler.scheduled:
            if e.kind == "resumed":
                owed = e.num_prompt_tokens + e.num_output_tokens - e.num_computed_tokens
                _need(e.req_id not in verified and e.num_scheduled_tokens <= owed, s.index,
                      f"{e.req_id} resumed with {e.num_scheduled_tokens} tokens scheduled for {owed} owed")
                back.append(f"step {s.index}: {e.req_id} resumed with {e.num_scheduled_tokens} of its "
                            f"{e.num_prompt_tokens + e.num_output_tokens} tokens, no drafts")
    return _shown(held, "a request preempted while holding drafts") + "; " + _shown(back, "a preempted request resumed")
