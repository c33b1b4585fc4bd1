"""`vllm-tour explain --request R` on a speculative-decoding run: per step that verified the request's drafts, how
many were proposed (after the step before) and accepted, and why the first rejected one was rejected; a preemption
that dropped drafts. From the spec records only (`spec_proposal`, `spec_verify`), the sampling params in meta.

The rules, as upstream applies them at v0.32.0 (and v0.21.0): drafts proposed after step n are verified at step
n + 1 (spec-scheduled-drafts); greedy verification keeps a draft while it equals the target's argmax at its
position and puts the target's token in place of the first that does not (spec-greedy-accept); sampled
verification keeps draft i when u_i <= p(draft), and at the first failure draws a token from the target without
the draft (spec-random-accept); the rejected drafts are rolled back (spec-rejection-rollback). The records hold
the tokens the target kept, not its probabilities nor the draws: for a sampled request the line says where the
accept test failed and what was drawn there, never by how much.
"""

from __future__ import annotations

from vllm_tour.trace.reader import Run

FIELDS = ["spec_verify.requests[].draft_token_ids", "spec_verify.requests[].num_accepted",
          "spec_verify.requests[].sampled_token_ids"]


def spec_lines(run: Run, rid: str, step) -> list[dict]:
    """The spec lines of request `rid` at `step` (a reader Step): a verification, or drafts dropped by a preemption;
    each as the fields of explain's Line but its topic ("spec")."""
    out = []
    n = step.index
    prev = run.step(n - 1) if n > 1 else None
    proposed = prev.spec_proposal.proposed.get(rid, []) if prev is not None and prev.spec_proposal else []
    v = next((v for v in step.spec_verify.requests if v.req_id == rid), None) if step.spec_verify else None
    if v is not None:
        out.append(_verified(run, rid, n, v))
        out += _cut(run, rid, step, v)
    elif proposed and step.scheduler and any(p.req_id == rid for p in step.scheduler.preempted):
        out.append(_line("spec_dropped", {"k": len(proposed), "drafts": proposed, "prev": n - 1},
                         ["spec_proposal.proposed", "scheduler.preempted"], ["spec-preempt-drops-drafts"], n))
    return out


def _line(key: str, params: dict, fields: list[str], notes: list[str], n: int, cause: str | None = None,
          sub: list | None = None) -> dict:
    return {"key": key, "params": params, "fields": fields, "notes": notes, "cause": cause or key, "steps": (n, n),
            "sub": sub or []}


def _verified(run: Run, rid: str, n: int, v) -> dict:
    d, got, a = v.draft_token_ids, v.sampled_token_ids, v.num_accepted
    sampled = next(r for r in run.meta.requests if r.req_id == rid).temperature > 0
    rule = "spec-random-accept" if sampled else "spec-greedy-accept"
    notes = ["spec-scheduled-drafts", rule, "spec-rejection-rollback"]
    head = {"k": len(d), "drafts": d, "prev": n - 1, "a": a}
    if a == len(d):
        return _line("spec_all_accepted", {**head, "bonus": got[-1], "total": len(got)}, FIELDS, notes, n)
    why = ("spec_why_sampled" if sampled else "spec_why_greedy",
           {"i": a + 1, "draft": d[a], "target": got[a]})
    return _line("spec_rejected", {**head, "why": "", "rolled": len(d) - a, "kept": got},
                 FIELDS + ["meta.requests[].temperature"], notes, n,
                 "spec_rejected_sampled" if sampled else "spec_rejected_greedy", [("why", why)])


def _cut(run: Run, rid: str, step, v) -> list[dict]:
    """When the request stopped inside this step's tokens: how many were appended, how many dropped."""
    o = {x.req_id: x for x in run.outputs.requests}.get(rid) if run.outputs else None
    e = next((e for e in step.scheduler.scheduled if e.req_id == rid), None) if step.scheduler else None
    if o is None or e is None:
        return []
    got = v.sampled_token_ids
    kept = len(o.token_ids) - e.num_output_tokens
    if kept >= len(got):
        return []
    return [_line("spec_cut", {"total": len(got), "kept": kept, "dropped": got[kept:], "reason": o.finish_reason},
                  ["spec_verify.requests[].sampled_token_ids", "outputs.requests[].token_ids",
                   "scheduler.scheduled[].num_output_tokens"], ["sched-append-and-stop"], step.index)]
