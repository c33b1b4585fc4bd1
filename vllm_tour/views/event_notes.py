"""Which notes explain a trace event: `show` prints them beside preemptions, prefix hits, evictions,
chunked prefills, admissions and aborts, so a learner goes from what happened to the code that did it.

The link is the notes' own `concepts` tags (source/concepts.py), read on the run's pin: a note hidden there
(`not_on`) is not offered, one not checked there is offered with a mark.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from vllm_tour.trace.reader import Step

MAX_NOTES = 3  # per event: the first notes along the journey; `vllm-tour source` shows the rest beside the code


@lru_cache(maxsize=4)
def notes_by_concept(pin: str) -> dict[str, list[tuple[str, str, bool]]]:
    """concept -> [(note id, its symbol, checked on this pin)]: first the notes on code whose probe records the
    concept's trace field (a preemption is in the scheduler record: the scheduler's notes), then the rest, each
    group in journey order."""
    from vllm_tour.notes.annotations import load_all, on_pin
    from vllm_tour.notes.concepts import CONCEPTS

    found: dict[str, list] = {}
    for sub in on_pin(load_all(), pin):
        for n in sub.notes:
            for c in n.concepts:
                found.setdefault(c, []).append(n)
    out = {}
    for c, notes in found.items():
        kind = CONCEPTS[c][0].split(".")[0]
        ranked = sorted(notes, key=lambda n: kind not in n.probes)  # stable: journey order within each group
        out[c] = [(n.id, n.symbol, not n.caution) for n in ranked]
    return out


class Event(NamedTuple):
    text: str  # as `show` prints it
    zh: str  # the same in Chinese (the site's 中文 mode)
    concept: str  # notes/concepts.py
    req_id: str | None  # the request it happened to (None: the pool's, an eviction)


def step_events(step: Step) -> list[Event]:
    """The step's events, in the order `show` and the site list them. A resumed request is an admission too:
    upstream re-admits a preempted request from the waiting queue by the same code as a new one."""
    out = []
    s = step.scheduler
    if s:
        for r in s.scheduled:
            if r.kind == "new":
                out.append(Event(f"admit {r.req_id}", f"准入 {r.req_id}", "admission", r.req_id))
            elif r.kind == "resumed":
                out.append(Event(f"resume {r.req_id}", f"恢复 {r.req_id}", "admission", r.req_id))
            if r.is_prefill and r.num_computed_tokens + r.num_scheduled_tokens < r.num_prompt_tokens:
                part = f"{r.num_computed_tokens}+{r.num_scheduled_tokens}/{r.num_prompt_tokens}"
                out.append(Event(f"chunk {r.req_id} {part}", f"分块 {r.req_id} {part}", "chunked-prefill", r.req_id))
        for p in s.preempted:
            out.append(Event(f"PREEMPT {p.req_id}", f"抢占 {p.req_id}", "preemption", p.req_id))
    for a in step.aborts:  # a serve run's: the EngineCore dropped it during this step
        out.append(Event(f"ABORT {a.req_id}", f"中止 {a.req_id}", "abort", a.req_id))
    if step.kv:
        for h in step.kv.prefix_hits:
            out.append(Event(f"hit {h.req_id}: {h.num_hit_tokens} tokens, blocks {h.block_ids}",
                             f"前缀缓存命中 {h.req_id}：{h.num_hit_tokens} 个 token，块 {h.block_ids}", "prefix-hit", h.req_id))
        if step.kv.evicted:
            out.append(Event(f"evict {step.kv.evicted}", f"驱逐 {step.kv.evicted}", "eviction", None))
    for v in step.spec_verify.requests if step.spec_verify else []:
        n = f"{v.num_accepted}/{len(v.draft_token_ids)}"
        rejected = v.draft_token_ids[v.num_accepted:]
        en = f", {rejected} rejected, rolled back from slots {v.rejected_slots}" if rejected else ", all kept"
        zh = f"，{rejected} 被拒绝，从槽位 {v.rejected_slots} 回滚" if rejected else "，全部保留"
        out.append(Event(f"spec {v.req_id}: {n} drafts accepted{en}", f"投机解码 {v.req_id}：接受 {n} 个草稿 token{zh}",
                         "spec-decode", v.req_id))
    return out


def step_concepts(step: Step) -> list[str]:
    """The concepts of the step's events, each once, in event order."""
    return list(dict.fromkeys(e.concept for e in step_events(step)))


def notes_line(concept: str, pin: str) -> str | None:
    """"preemption → sched-preempt (Scheduler._preempt_request), ..." or None when no note explains it."""
    from vllm_tour.notes.concepts import CONCEPTS

    notes = notes_by_concept(pin).get(concept, [])
    if not notes:
        return None
    shown = [f"{nid} ({'.'.join(sym.split('.')[-2:])}){'' if checked else ' [not checked on ' + pin + ']'}"
             for nid, sym, checked in notes[:MAX_NOTES]]
    more = f" +{len(notes) - MAX_NOTES} more" if len(notes) > MAX_NOTES else ""
    return f"{CONCEPTS[concept][1]} → notes: {', '.join(shown)}{more}"
