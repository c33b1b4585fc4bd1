"""The scheduler: continuous batching with chunked prefill, preemption and resume-by-recompute.

Upstream counterparts (v0.32.0):
- `vllm.v1.core.sched.scheduler.Scheduler.schedule` (FCFS policy; no
  connectors, spec decode, encoders, LoRA, mamba, async scheduling)
- `vllm.v1.core.sched.scheduler.Scheduler._preempt_request`
- `vllm.v1.core.sched.scheduler.Scheduler._update_after_schedule`
- `vllm.v1.core.sched.scheduler.Scheduler.update_from_output` (stop checks, frees)
- `vllm.v1.core.sched.utils.check_stop`

There is no "prefill phase" or "decode phase". Every request has
num_computed_tokens and num_tokens; each step hands out a token budget so
that the first catches up with the second. A 1-token catch-up is a decode,
a long one is a prefill, and a prefill longer than the budget is *chunked*.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import FINISHED_LENGTH, FINISHED_STOPPED, PREEMPTED, RUNNING, WAITING, Request


@dataclass
class Scheduled:
    req_id: str
    kind: str  # "new" | "resumed" | "running"
    num_tokens: int  # scheduled this step
    num_computed_tokens: int  # before this step
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class PreemptionInfo:
    req_id: str
    while_allocating_for: str
    num_tokens_requested: int
    free_blocks_at_failure: int
    freed_block_ids: list[int]
    num_computed_tokens_lost: int


@dataclass
class SchedulerOutput:
    """What the scheduler decided in one step (the model runner executes it)."""

    step: int
    scheduled: list[Scheduled]  # batch order: running ones first, then admitted waiting ones
    preempted: list[PreemptionInfo]
    prefix_hits: dict[str, tuple[int, list[int]]]  # req_id -> (hit tokens, hit block ids)
    new_block_ids: dict[str, list[int]]  # req_id -> blocks newly allocated this step
    finished: list[str]  # finished since the previous step
    token_budget: int
    waiting_before: int
    running_before: int
    budget_left: int = 0
    # Why the waiting loop stopped (for --explain): "budget", "max_num_seqs", "kv", "empty", "preempted".
    admission_stop: str = ""
    # req_id -> the draft tokens run after its last token this step (speculative decoding: spec_decode.py)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.req_id: s.num_tokens for s in self.scheduled}


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        reserve_full_sequence: bool = True,
        long_prefill_token_threshold: int = 0,
        long_prefill_token_threshold_adaptive: bool = False,
    ):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # upstream SchedulerConfig.scheduler_reserve_full_isl (default True at v0.32.0)
        self.reserve_full_sequence = reserve_full_sequence
        # upstream SchedulerConfig.long_prefill_token_threshold(_adaptive) (default 0 / False)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.long_prefill_token_threshold_adaptive = long_prefill_token_threshold_adaptive
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_since_last_step: list[str] = []
        self.step = 0

    def add_request(self, request: Request) -> None:
        self.kv.register(request)
        self.waiting.append(request)
        self.requests[request.req_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one scheduling step -------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        out = SchedulerOutput(
            step=self.step, scheduled=[], preempted=[], prefix_hits={}, new_block_ids={},
            finished=self.finished_since_last_step, token_budget=self.max_num_batched_tokens,
            waiting_before=len(self.waiting), running_before=len(self.running),
        )
        self.finished_since_last_step = []
        token_budget = self.max_num_batched_tokens
        cap = self.long_prefill_cap()

        # 1) RUNNING requests first, in order. Each wants num_tokens - num_computed
        #    (1 for a decode; the rest of the prompt for a chunked prefill).
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            if (request.num_output_placeholders
                    and request.num_computed_tokens + 2 - request.num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                i += 1  # async: the step in flight already samples its last token; do not run one more
                continue
            # tokens still in flight (async) count as known: the runner takes them from the GPU;
            # draft tokens (speculative decoding) are run too, to be verified
            num_wanted = request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
            if 0 < cap < num_wanted:
                num_wanted = cap  # a long prefill leaves budget to the others
            num_new = self.chunk(num_wanted, token_budget)
            # never run a position past max_model_len (1 slot kept for the sampled token)
            num_new = min(num_new, self.max_model_len - request.num_computed_tokens - 1)
            if num_new == 0:
                i += 1
                continue

            while True:
                new_blocks = self.kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                # Out of blocks: preempt someone -- possibly this very request.
                victim = self.pick_victim()
                out.preempted.append(self._preempt(victim, request, num_new))
                if victim is request:
                    break
            if new_blocks is None:
                break  # this request could not run; nor can anyone after it

            out.scheduled.append(self._scheduled(request, "running", num_new))
            out.new_block_ids[request.req_id] = [b.block_id for b in new_blocks]
            token_budget -= num_new
            i += 1

        # 2) WAITING requests, FCFS -- but only if nobody was preempted this
        #    step (admitting new work right after evicting some would thrash).
        if out.preempted:
            out.admission_stop = "preempted"
        while not out.preempted:
            if token_budget <= 0:
                out.admission_stop = "budget"
                break
            if not self.waiting:
                out.admission_stop = "empty"
                break
            if len(self.running) >= self.max_num_seqs:
                out.admission_stop = "max_num_seqs"
                break
            request = self.waiting[0]

            hit_blocks, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:  # new, or resumed after preemption
                hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_computed = request.num_computed_tokens + num_hit_tokens
            # num_tokens, not num_prompt_tokens: a resumed request recomputes its outputs too.
            num_new = request.num_tokens - num_computed
            if 0 < cap < num_new:
                num_new = cap  # before the no-chunking check, as upstream: a capped prompt is chunked anyway
            if not self.enable_chunked_prefill and num_new > token_budget:
                out.admission_stop = "budget"
                break
            num_new = self.chunk(num_new, token_budget)

            new_blocks = self.kv.allocate_slots(
                request, num_new, num_new_computed_tokens=num_hit_tokens,
                new_computed_blocks=hit_blocks, full_sequence_must_fit=self.reserve_full_sequence,
            )
            if new_blocks is None:
                out.admission_stop = "kv"
                break

            self.waiting.popleft()
            self.running.append(request)
            kind = "new" if request.status == WAITING else "resumed"
            request.status = RUNNING
            request.num_computed_tokens = num_computed
            if num_hit_tokens:
                out.prefix_hits[request.req_id] = (num_hit_tokens, [b.block_id for b in hit_blocks])
            out.scheduled.append(self._scheduled(request, kind, num_new))
            out.new_block_ids[request.req_id] = [b.block_id for b in new_blocks]  # hits not included
            token_budget -= num_new

        out.budget_left = token_budget
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Advance num_computed_tokens now, as if the step already ran: the
        next schedule() must not hand out the same tokens again."""
        for s in out.scheduled:
            self.requests[s.req_id].num_computed_tokens += s.num_tokens

    def long_prefill_cap(self) -> int:
        """This step's cap on one request's new tokens (0: none), fixed when the step starts.

        The threshold stops one long prefill from starving the others of the token budget, so it
        applies only when there is someone to starve: two or more requests running or waiting. The
        adaptive variant never cuts below a fair share, budget // number of those requests."""
        eligible = len(self.running) + len(self.waiting)
        cap = self.long_prefill_token_threshold if eligible > 1 else 0
        if cap > 0 and self.long_prefill_token_threshold_adaptive:
            cap = max(cap, self.max_num_batched_tokens // eligible)
        return cap

    def pick_victim(self) -> Request:
        """FCFS preemption: the *last* running request, i.e. the most recently admitted one."""
        return self.running.pop()

    def chunk(self, num_wanted: int, token_budget: int) -> int:
        """Chunked prefill in one line: run what the request wants, cut to what is left of the budget.

        The rest of a cut prompt simply stays "not computed yet"; the request
        is scheduled again next step (as a running request) for the next chunk.
        """
        return min(num_wanted, token_budget)

    def _scheduled(self, request: Request, kind: str, num_new: int) -> Scheduled:
        return Scheduled(request.req_id, kind, num_new, request.num_computed_tokens,
                         request.num_prompt_tokens, request.num_output_tokens)

    def _preempt(self, victim: Request, allocating_for: Request, num_new: int) -> PreemptionInfo:
        """Free all the victim's blocks and put it at the FRONT of the waiting queue.

        Resume is by recompute: num_computed_tokens goes back to 0, and when it
        is admitted again it re-runs prompt + outputs so far (prefix-cache hits
        on its own freed blocks may spare part of that).
        """
        free_before = self.kv.block_pool.num_free_blocks()
        freed = self.kv.block_ids(victim.req_id)
        lost = victim.num_computed_tokens
        self.kv.free(victim)
        victim.status = PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        return PreemptionInfo(victim.req_id, allocating_for.req_id, num_new, free_before, freed, lost)

    # --- after the model ran --------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append sampled tokens, stop finished requests and free their blocks (in batch order)."""
        stopped: list[Request] = []
        for s in out.scheduled:
            request = self.requests[s.req_id]
            if s.req_id not in sampled or request.is_finished:
                continue  # a prefill chunk short of the prompt's end; or (async) a step run after the stop
            was_preempted = request.status == PREEMPTED  # async: preempted while this step was in flight
            if self._update_request_with_output(request, sampled[s.req_id]):
                stopped.append(request)
                self.kv.free(request)
                self.finished_since_last_step.append(request.req_id)
                if was_preempted:
                    self.waiting.remove(request)
        self.running = [r for r in self.running if r not in stopped]
        return stopped

    def _update_request_with_output(self, request: Request, token_id: int) -> bool:
        """Append one sampled token; True if the request stops here."""
        request.append_output_token(token_id)
        return self._check_stop(request)

    def _check_stop(self, request: Request) -> bool:
        last = request.output_token_ids[-1]
        if request.eos_token_id is not None and last == request.eos_token_id:
            request.status = FINISHED_STOPPED
            return True
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            request.status = FINISHED_LENGTH
            return True
        return False
