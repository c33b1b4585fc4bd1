"""Probes on speculative decoding (EngineCore process): the drafts proposed, and what verification kept.

After a step's tokens are sampled, the drafter proposes up to k draft tokens per request (ngram: the
tokens that followed an earlier occurrence of the sequence's last n-gram); the EngineCore hands them to
`Scheduler.update_draft_token_ids`, and the next `schedule()` runs each request's last token plus its
drafts through the target model in one step. `Scheduler.update_from_output` then learns how many drafts
the target agreed with (the runner returns the accepted drafts and one token of the target's own) and
rolls `num_computed_tokens` back over the rest: their KV slots were written, and are overwritten later.
"""

from __future__ import annotations

from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.trace.writer import RECORDER as R
from vllm_tour.trace.writer import user_req_id

PINS = (*CPU_PINS, "v0.21.0")
SCHED = "vllm.v1.core.sched.scheduler.Scheduler"


def _proposer(scheduler) -> str:
    spec = scheduler.vllm_config.speculative_config
    return spec.method if spec is not None else "none"


# --- proposals ----------------------------------------------------------------------------------


def _propose_after(token, result, self, draft_token_ids, *a, **kw):
    proposed, ignored = {}, []
    for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
        uid = user_req_id(rid)
        proposed[uid] = [int(t) for t in drafts]
        request = self.requests.get(rid)
        if drafts and (request is None or not request.spec_token_ids):
            ignored.append(uid)  # finished, or a prefill chunk (upstream drops drafts made for those)
    R.write({"step": R.sched_step, "proc": R.proc_dict("engine_core"), "kind": "spec_proposal",
             "proposer": _proposer(self), "proposed": proposed, "ignored": ignored})


propose = Probe(
    name="spec.propose",
    target=f"{SCHED}.update_draft_token_ids",
    params=("self", "draft_token_ids"),
    records="per step: the draft tokens the proposer made for each request (for the next step), and which "
    "the scheduler dropped",
    pins=PINS,
    after=_propose_after,
    level="steps",
)


# --- verification -------------------------------------------------------------------------------


def _verify_before(self, scheduler_output, model_runner_output, *a, **kw):
    """Per request with drafts this step: (user id, drafts, computed tokens before the step, block ids, the
    runner's tokens), read before update_from_output frees a finished request's blocks and cuts the token
    list of a request that stops inside it (in place)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return None
    index, sampled = model_runner_output.req_id_to_index, model_runner_output.sampled_token_ids
    rows = []
    for rid, drafts in spec.items():
        request = self.requests.get(rid)
        if request is None:
            continue
        # schedule() already advanced num_computed_tokens over the scheduled tokens, drafts included
        before = request.num_computed_tokens - scheduler_output.num_scheduled_tokens[rid]
        blocks = list(self.kv_cache_manager.get_block_ids(rid)[0])
        got = [int(t) for t in sampled[index[rid]]] if rid in index and sampled else []
        rows.append((rid, [int(t) for t in drafts], before, blocks, got))
    return rows


def _verify_after(rows, result, self, scheduler_output, model_runner_output, *a, **kw):
    if rows is None:
        return
    bs = self.block_size
    verified = []
    for rid, drafts, before, blocks, got in rows:
        if not got:
            continue  # nothing sampled (the request was aborted or finished meanwhile): nothing verified
        accepted = len(got) - 1  # the target adds one token of its own after the drafts it accepts
        # draft i sits at position before + 1 + i; the rejected ones from before + 1 + accepted on
        rejected = range(before + 1 + accepted, before + 1 + len(drafts))
        last = before + accepted + 1  # the target's own token: the last position of the sequence now
        verified.append({
            "req_id": user_req_id(rid),
            "num_computed_tokens": before,
            "draft_token_ids": drafts,
            "num_accepted": accepted,
            "sampled_token_ids": got,
            "rejected_slots": [blocks[p // bs] * bs + p % bs for p in rejected],
            "rejected_only_blocks": blocks[last // bs + 1:],
        })
    R.write({"step": R.sched_step, "proc": R.proc_dict("engine_core"), "kind": "spec_verify",
             "num_speculative_tokens": getattr(self, "num_spec_tokens", 0),
             "num_lookahead_tokens": self.num_lookahead_tokens, "requests": verified})


verify = Probe(
    name="spec.verify",
    target=f"{SCHED}.update_from_output",
    params=("self", "scheduler_output", "model_runner_output"),
    records="per step with drafts: each request's drafts, how many the target accepted, the token it added, "
    "the KV slots and blocks written for rejected drafts, the KV manager's lookahead",
    pins=PINS,
    before=_verify_before,
    after=_verify_after,
    level="steps",
)

PROBES = [propose, verify]
