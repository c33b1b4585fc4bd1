"""Speculative decoding: guess the next tokens cheaply, let the model check them all in one step.

Upstream counterparts (v0.32.0):
- `vllm.v1.spec_decode.ngram_proposer.NgramProposer.propose` and
  `_find_longest_matched_ngram_and_propose_tokens` (prompt lookup)
- `vllm.v1.core.sched.scheduler.Scheduler.schedule` (a request's drafts are scheduled with its
  last token: `scheduled_spec_decode_tokens`), `Scheduler.update_from_output` (num_computed_tokens
  rolled back over the rejected drafts), `Scheduler.update_draft_token_ids`, `Scheduler._preempt_request`
- `vllm.v1.sample.rejection_sampler.RejectionSampler` (its greedy path)

A decode step computes one token per request. If we could guess the next k tokens, one step could
run the last token and the k guesses (drafts) together: the model's logits at each of those k + 1
positions say what it would have generated there. Greedy decoding keeps the drafts while they equal
the model's argmax, then adds the model's own token at the first mismatch (or after the last draft:
the "bonus" token). So a step yields 1 to k + 1 tokens, exactly the tokens plain decoding would give.

The n-gram proposer guesses without a model: find an earlier place where the sequence's last n
tokens occurred, and propose the tokens that followed there. Repetitive text (code, quotes, a
model stuck in a loop) gets long runs of accepted drafts; other text gets none, at the cost of the
extra positions computed.

The drafts' KV is written like any token's. For rejected drafts it belongs to tokens that are not
in the sequence: the scheduler rolls num_computed_tokens back over them, and the next steps write
the real tokens' KV into the same slots. The blocks stay with the request.

Here the drafts travel as upstream's do: proposed after a step (`propose`, on the runner's tokens,
before the scheduler's stop checks), kept on the request (`update_draft_token_ids`), cut to what
the step can run and recorded in the SchedulerOutput (`_update_after_schedule`).
"""

from __future__ import annotations

from .chunked_prefill import Scheduler, SchedulerOutput
from .request import Request


def ngram_propose(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram
    (min_n <= n <= max_n) of `tokens`; [] when no suffix of min_n tokens occurred before.

    Upstream finds the same match with a KMP pass over the reversed tokens; this is the direct search."""
    k = min(k, max_model_len - len(tokens))  # never draft past max_model_len
    if k <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # an occurrence must end before the last token: the suffix itself does not count
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def verify_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The tokens a step keeps: the drafts up to the first one the model disagrees with, then the model's own.

    target[i] is the model's token after the last token and the first i drafts (len(drafts) + 1 of them): its
    argmax when greedy. Sampled targets work too, for n-gram drafts: upstream's rejection sampler keeps such a
    draft (no draft probabilities: q = 1 on it) with the target's probability of it, else draws from the target
    without it; sampling the target and keeping the draft while they match has the same distribution."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, sequences: dict[str, list[int] | None]) -> dict[str, list[int]]:
        """req_id -> drafts, for every request the step ran; None: it sampled nothing (a prefill chunk) -> []."""
        return {rid: ngram_propose(tokens, self.min_n, self.max_n, self.k, self.max_model_len)
                if tokens and len(tokens) < self.max_model_len else []
                for rid, tokens in sequences.items()}


class SpecDecodeScheduler(Scheduler):
    """The scheduler with drafts: it runs them (Request.num_tokens_with_spec), records which, and takes back
    the computed tokens of the rejected ones. update_from_output takes a list of tokens per request."""

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            request = self.requests[s.req_id]
            # the step may run fewer drafts than proposed (token budget, max_model_len)
            num_drafts = s.num_computed_tokens + s.num_tokens - request.num_tokens
            if request.spec_token_ids and num_drafts > 0:
                out.scheduled_spec_decode_tokens[s.req_id] = request.spec_token_ids[:num_drafts]
            request.spec_token_ids = []  # the next proposal comes after this step
        super()._update_after_schedule(out)

    def _preempt(self, victim: Request, allocating_for: Request, num_new: int):
        victim.spec_token_ids = []  # drafts for a sequence it must recompute first
        return super()._preempt(victim, allocating_for, num_new)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            if sampled.get(rid):
                num_rejected = len(drafts) - (len(sampled[rid]) - 1)
                # their KV was written, but for tokens that are not in the sequence: not computed
                self.requests[rid].num_computed_tokens -= num_rejected
        return super().update_from_output(out, sampled)

    def _update_request_with_output(self, request: Request, token_ids: list[int]) -> bool:
        """Append the step's tokens one at a time; a stop (EOS, max_tokens) drops the rest."""
        for token_id in token_ids:
            if super()._update_request_with_output(request, token_id):
                return True
        return False

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> list[str]:
        """Keep each unfinished request's drafts for the next step; returns the requests whose drafts were
        dropped (finished in this step). Upstream also drops a prefill chunk's, but a chunk samples
        nothing, so the n-gram proposer gives it none."""
        dropped = []
        for rid, draft in drafts.items():
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                dropped += [rid] if draft else []
                continue
            request.spec_token_ids = list(draft)
        return dropped
