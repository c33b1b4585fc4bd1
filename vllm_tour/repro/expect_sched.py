"""Scheduling expectations of `repro`, read from the scheduler and KV records of a run.

never_scheduled, stalled, max_scheduled_tokens and blocked_behind: each check
names the steps and the numbers (tokens, free blocks, budget) it judged by.
A request is in the engine from the step it arrives (scheduler step
arrival_step + 1) until the step that reports it finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_tour.scenario import ExpectSpec
from vllm_tour.trace.reader import Run, Step


@dataclass
class Check:
    key: str  # the [expect] key and its value, as written
    ok: bool
    evidence: list[str] = field(default_factory=list)


@dataclass
class Life:
    first: int  # the first scheduler step it could be scheduled in
    end: int | None  # the step whose record reports it finished (None: it never finished)
    prompt_len: int | None


def lives(run: Run) -> dict[str, Life]:
    finished = {}
    for s in run.steps:
        for rid in s.scheduler.finished if s.scheduler else []:
            finished.setdefault(rid, s.index)
    out = {}
    for r in run.meta.requests:
        first = r.arrival_step + 1
        # A request scheduled earlier than its arrival step arrived early (an idle engine takes it at once).
        seen = [s.index for s in run.steps if s.scheduler and any(x.req_id == r.req_id for x in s.scheduler.scheduled)]
        out[r.req_id] = Life(min([first, *seen]), finished.get(r.req_id),
                             len(r.prompt_token_ids) if r.prompt_token_ids is not None else None)
    return out


def _tokens(s: Step, rid: str) -> int:
    return sum(x.num_scheduled_tokens for x in s.scheduler.scheduled if x.req_id == rid) if s.scheduler else 0


def _alive(life: Life, s: Step) -> bool:
    return life.first <= s.index and (life.end is None or s.index < life.end)


def _end_note(run: Run, failure: str | None) -> list[str]:
    if failure:
        return [f"the engine failed first: {failure.splitlines()[0]}"]
    stopped = run.meta.engine_args.get("max_steps")
    if stopped and run.steps and run.steps[-1].index >= stopped:
        return [f"the scheduler harness stopped at its max_steps = {stopped}, requests unfinished"]
    return []


def scheduling_checks(ex: ExpectSpec, run: Run, failure: str | None):

    life = lives(run)
    steps = [s for s in run.steps if s.scheduler]
    checks = []
    for rid in ex.never_scheduled:
        got = [(s.index, _tokens(s, rid)) for s in steps if _tokens(s, rid)]
        key = f"never_scheduled: {rid}"
        if got:
            checks.append(Check(key, False, [f"step {i}: {rid} scheduled {n} tokens" for i, n in got[:3]]))
            continue
        alive = [s for s in steps if _alive(life[rid], s)]
        ev = [f"{rid} ({life[rid].prompt_len} prompt tokens) was in the engine for {len(alive)} steps "
              f"({alive[0].index}..{alive[-1].index}) and never got a token" if alive else "no step was traced after its arrival"]
        if alive and alive[-1].kv:
            kv = alive[-1].kv
            ev.append(f"step {alive[-1].index}: {kv.free_blocks} of {kv.num_blocks} blocks free, "
                      f"block size {kv.block_size}, {alive[-1].scheduler.waiting_after} waiting")
        checks.append(Check(key, bool(alive), ev + _end_note(run, failure)))

    for rid, want in ex.stalled.items():
        best, cur, where = 0, 0, None
        for s in steps:
            if _alive(life[rid], s) and not _tokens(s, rid) and s.scheduler.tokens_scheduled:
                cur += 1
                if cur > best:
                    best, where = cur, s.index
            else:
                cur = 0
        if best:
            ev = [f"{rid} got no token in {best} consecutive steps ({where - best + 1}..{where}) while the engine "
                  f"scheduled other requests"]
        else:
            ev = [f"{rid} was scheduled in every step it was in the engine with other work"]
        if best < want:
            ev.append(f"expected at least {want}")
        checks.append(Check(f"stalled.{rid} >= {want} steps", best >= want, ev + _end_note(run, failure)))

    for rid, cap in ex.max_scheduled_tokens.items():
        got = [(s.index, _tokens(s, rid)) for s in steps if _tokens(s, rid)]
        top = max((n for _, n in got), default=0)
        ev = [f"{rid} scheduled in {len(got)} steps: " + ", ".join(f"step {i}: {n}" for i, n in got[:8])
              + (" ..." if len(got) > 8 else "") + f" (at most {top})" if got else f"{rid}: never scheduled"]
        checks.append(Check(f"max_scheduled_tokens.{rid} <= {cap}", bool(got) and top <= cap, ev + _end_note(run, failure)))

    for rid, earlier in ex.blocked_behind.items():
        checks.append(_blocked_check(rid, earlier, life, steps, run, failure))
    if ex.kv_events or ex.kv_removed_while_cached is not None:
        checks.extend(_kv_event_checks(ex, run, failure))
    return checks


def _kv_event_checks(ex: ExpectSpec, run: Run, failure: str | None):
    """From kv_events.json, the events the scheduler published (scheduler mode with kv_events_config on)."""
    import json

    from vllm_tour.engine.sched_harness import KV_EVENTS_FILE

    path = run.path / KV_EVENTS_FILE
    if not path.is_file():
        why = [f"no {KV_EVENTS_FILE}: KV events are recorded in scheduler mode with "
               "engine.extra.kv_events_config = {enable_kv_cache_events = true}"] + _end_note(run, failure)
        return [Check(f"kv_events.{k} = {n}", False, why) for k, n in ex.kv_events.items()] + (
            [Check(f"kv_removed_while_cached = {str(ex.kv_removed_while_cached).lower()}", False, why)]
            if ex.kv_removed_while_cached is not None else [])
    events = json.loads(path.read_text(encoding="utf-8"))["events"]
    checks = []
    for kind, want in ex.kv_events.items():
        got = [(e["step"], len(e["block_hashes"])) for e in events if e["type"] == kind]
        n = sum(k for _, k in got)
        ev = [f"{n} block hashes in {len(got)} {kind} events" + (": " + ", ".join(f"step {s}: {k}" for s, k in got[:8])
                                                                 + (" ..." if len(got) > 8 else "") if got else "")]
        checks.append(Check(f"kv_events.{kind} = {want}", n == want, ev + _end_note(run, failure)))
    if ex.kv_removed_while_cached is not None:
        copies: dict[str, int] = {}  # hash -> stored copies still cached, after each step's events
        hits = []
        for step in sorted({e["step"] for e in events}):
            removed = []
            for e in (e for e in events if e["step"] == step):
                for h in e["block_hashes"]:
                    copies[h] = copies.get(h, 0) + (1 if e["type"] == "BlockStored" else -1 if e["type"] == "BlockRemoved" else 0)
                    if e["type"] == "BlockRemoved":
                        removed.append(h)
            hits += [f"step {step}: BlockRemoved {h[:16]}… while {copies[h]} stored copy of it stays cached"
                     for h in dict.fromkeys(removed) if copies[h] > 0]
        want = ex.kv_removed_while_cached
        ev = hits[:2] or [f"every BlockRemoved named a hash with no other stored copy ({len(events)} events)"]
        checks.append(Check(f"kv_removed_while_cached = {str(want).lower()}", bool(hits) == want, ev))
    return checks


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _blocked_check(rid: str, earlier: str, life: dict[str, Life], steps: list[Step], run: Run, failure: str | None):
    """`rid` waits and would fit, `earlier` (arrived first) waits and does not fit, neither is admitted."""

    key = f"blocked_behind.{rid} = {earlier}"
    a, b = life[rid], life[earlier]
    if a.prompt_len is None or b.prompt_len is None:
        return Check(key, False, ["the prompts' token counts are unknown (the run failed before tokenizing)"])
    if b.first > a.first:
        return Check(key, False, [f"{earlier} arrived at step {b.first}, after {rid} (step {a.first})"])
    started = {x: min([s.index for s in steps if _tokens(s, x)], default=None) for x in (rid, earlier)}
    hits = []
    for s in steps:
        if not (_alive(a, s) and _alive(b, s)) or s.kv is None:
            continue
        if any(started[x] is not None and started[x] <= s.index for x in (rid, earlier)):
            continue  # one of them has been admitted
        budget = s.scheduler.token_budget - s.scheduler.tokens_scheduled
        need_small = _blocks(min(a.prompt_len, budget), s.kv.block_size) if budget > 0 else None
        need_big = _blocks(b.prompt_len, s.kv.block_size)
        room = s.scheduler.running_after < s.scheduler.max_num_seqs
        if need_small is not None and room and need_small <= s.kv.free_blocks < need_big:
            hits.append(f"step {s.index}: {earlier} waits (needs {need_big} blocks, {s.kv.free_blocks} free); {rid} waits "
                        f"though it would fit ({need_small} blocks, {budget} tokens of budget left)")
    if hits:
        return Check(key, True, hits[:2] + ([f"... {len(hits)} such steps"] if len(hits) > 2 else []))
    ev = [f"no step where both waited and only {rid} fitted"
          + (f"; {rid} first scheduled at step {started[rid]}" if started[rid] else "")
          + (f", {earlier} at step {started[earlier]}" if started[earlier] else "")]
    return Check(key, False, ev + _end_note(run, failure))
