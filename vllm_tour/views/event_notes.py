"""Which notes explain a trace event: `show` prints them beside preemptions, prefix hits, evictions,
chunked prefills, admissions and aborts, so a learner goes from what happened to the code that did it.

The link is the notes' own `concepts` tags (source/concepts.py), read on the run's pin: a note hidden there
(`not_on`) is not offered, one not checked there is offered with a mark.
"""

from __future__ import annotations

from functools import lru_cache

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


def step_events(step: Step) -> list[tuple[str, str]]:
    """(text, concept) per event of the step, in the order `show` and the site list them. A resumed request is an
    admission too: upstream re-admits a preempted request from the waiting queue by the same code as a new one."""
    out = []
    s = step.scheduler
    if s:
        for r in s.scheduled:
            if r.kind in ("new", "resumed"):
                out.append((f"{'admit' if r.kind == 'new' else 'resume'} {r.req_id}", "admission"))
            if r.is_prefill and r.num_computed_tokens + r.num_scheduled_tokens < r.num_prompt_tokens:
                out.append((f"chunk {r.req_id} {r.num_computed_tokens}+{r.num_scheduled_tokens}/{r.num_prompt_tokens}",
                            "chunked-prefill"))
        for p in s.preempted:
            out.append((f"PREEMPT {p.req_id}", "preemption"))
    for a in step.aborts:  # a serve run's: the EngineCore dropped it during this step
        out.append((f"ABORT {a.req_id}", "abort"))
    if step.kv:
        for h in step.kv.prefix_hits:
            out.append((f"hit {h.req_id}: {h.num_hit_tokens} tokens, blocks {h.block_ids}", "prefix-hit"))
        if step.kv.evicted:
            out.append((f"evict {step.kv.evicted}", "eviction"))
    return out


def step_concepts(step: Step) -> list[str]:
    """The concepts of the step's events, each once, in event order."""
    return list(dict.fromkeys(concept for _, concept in step_events(step)))


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
