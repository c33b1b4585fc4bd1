"""Speculative decoding in `show`: per step and request, the drafts verified, how many the target accepted,
where the rejected ones were written, and the drafts proposed for the next step."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from vllm_tour.trace.reader import Run, Step


def has_spec(run: Run) -> bool:
    return any(s.spec_verify or s.spec_proposal for s in run.steps)


def events(step: Step) -> Text:
    """The step table's events: `spec REQ accepted/drafted` per request verified in this step."""
    t = Text()
    for v in step.spec_verify.requests if step.spec_verify else []:
        t.append(f"spec {v.req_id} {v.num_accepted}/{len(v.draft_token_ids)} ",
                 style="bold green" if v.num_accepted == len(v.draft_token_ids) else "yellow")
    return t


def counts(run: Run) -> dict:
    """The proposers the probes saw, and the verifications, draft tokens verified and drafts accepted."""
    verified = [v for s in run.steps if s.spec_verify for v in s.spec_verify.requests]
    return {"proposers": sorted({s.spec_proposal.proposer for s in run.steps if s.spec_proposal}),
            "verifications": len(verified), "drafted": sum(len(v.draft_token_ids) for v in verified),
            "accepted": sum(v.num_accepted for v in verified)}


def summary(run: Run) -> Text:
    c = counts(run)
    drafted, accepted = c["drafted"], c["accepted"]
    proposer = ", ".join(c["proposers"]) or "?"
    rate = f" ({accepted / drafted:.0%})" if drafted else ""
    return Text(f"speculative decoding ({proposer}): {c['verifications']} verifications, {drafted} draft tokens, "
                f"{accepted} accepted{rate}; each verification also adds one token of the target's own", style="bold")


def spec_table(run: Run, step: Step | None = None, request: str | None = None) -> Table:
    """One row per (step, request) where drafts were verified or proposed: in the whole run, one step, or
    for one request."""
    t = Table(title="speculative decoding: drafts verified in the step, and proposed after it",
              caption="target's tokens: the accepted drafts, then its own (a request at max_tokens keeps what fits) · "
                      "rejected drafts @ the KV slots they were written to (rolled back; overwritten by later tokens)",
              title_justify="left", caption_justify="left")
    for c, j in (("step", "right"), ("request", "left"), ("drafts verified", "left"), ("accepted", "right"),
                 ("target's tokens", "left"), ("rejected @ slots", "left"), ("proposed next", "left")):
        t.add_column(c, justify=j, overflow="fold")
    for s in [step] if step else run.steps:
        verified = {v.req_id: v for v in s.spec_verify.requests} if s.spec_verify else {}
        proposed = {rid: d for rid, d in s.spec_proposal.proposed.items() if d} if s.spec_proposal else {}
        ignored = set(s.spec_proposal.ignored) if s.spec_proposal else set()
        for rid in dict.fromkeys([*verified, *proposed]):
            if request and rid != request:
                continue
            v = verified.get(rid)
            cells = ["", "", "", ""]
            if v:
                rejected = v.draft_token_ids[v.num_accepted:]
                note = f"; blocks {v.rejected_only_blocks} hold only these" if v.rejected_only_blocks else ""
                cells = [str(v.draft_token_ids), f"{v.num_accepted}/{len(v.draft_token_ids)}", str(v.sampled_token_ids),
                         f"{rejected} @ {v.rejected_slots}{note}" if rejected else "-"]
            nxt = str(proposed[rid]) + (" (dropped)" if rid in ignored else "") if rid in proposed else ""
            t.add_row(str(s.index), rid, *cells, nxt)
    return t
