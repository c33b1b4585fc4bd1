"""Probes on the V1 scheduler (EngineCore process): one SchedulerRecord + KVRecord per step.

`Scheduler.schedule` is the step: everything between its entry and return is
that step's decision. `_preempt_request` is wrapped to name each preempted
request and why (the allocation that failed just before it, read from the
`schedule()` frame that is preempting).
"""

from __future__ import annotations

import operator
import sys
import time

from vllm_tour.probes import kv
from vllm_tour.probes.base import CPU_PINS, Probe
from vllm_tour.trace import levels
from vllm_tour.trace.schema import Preemption
from vllm_tour.trace.writer import RECORDER as R
from vllm_tour.trace.writer import user_req_id

PINS = (*CPU_PINS, "v0.21.0")
KV_LEVEL = levels.rank("blocks")  # the KV record is kept from this level up
SCHED = "vllm.v1.core.sched.scheduler.Scheduler"


def _schedule_before(self, *a, **kw):
    R.sched_step += 1
    R.segment_boundary(R.sched_step)
    R.preempted = []
    running, waiting = self.get_request_counts()
    return time.perf_counter(), running, waiting


_prompt_len = operator.attrgetter("num_prompt_tokens")
# Request.num_tokens and num_output_tokens are properties, a Python call each per request per step:
# the lists they take the length of (len(_all_token_ids), len(_output_token_ids) on every pin) are read instead.
_outputs = operator.attrgetter("_output_token_ids")


def _scheduled(self, out) -> tuple[dict, dict[str, int]]:
    """The step's schema.ScheduledRequest rows as columns (new requests first; see
    schema.SchedulerRecord.scheduled), and user id -> computed tokens of the requests
    admitted this step (new or resumed: their prefix-cache hits).

    Written for speed (it runs for every request every step): column by column,
    with C-level map() where a column is one lookup per request; only the requests
    admitted this step get a closer look (their kind), and a step that runs the previous
    step's requests in the same order reuses that record's ids, kinds and prompt lengths.
    """
    cached = out.scheduled_cached_reqs
    new_reqs = out.scheduled_new_reqs
    rids = [nr.req_id for nr in new_reqs] + list(cached.req_ids)
    computed = [nr.num_computed_tokens for nr in new_reqs] + list(cached.num_computed_tokens)
    reqs = list(map(self.requests.__getitem__, rids))
    n_sched = out.num_scheduled_tokens
    prev = R.sched_prev
    admitted = {}
    if prev is not None and not new_reqs and not cached.resumed_req_ids and rids == prev[0]:
        # The same requests in the same order as at the previous step (a decode step), all running now: their
        # ids and prompt lengths are the previous record's; a request out of its prefill stays out of it.
        _, uids, prompts, kinds, was_prefill = prev
        prefill = _prefill(computed, prompts, reqs) if True in was_prefill else was_prefill
    else:
        prompts = list(map(_prompt_len, reqs))
        prefill = _prefill(computed, prompts, reqs)
        uids = list(map(user_req_id, rids))
        kinds = ["running"] * len(rids)
        # Every pin builds the cached requests from the ones it scheduled out of its running queue, then the
        # preempted ones it resumed (named in resumed_req_ids); a request from the waiting queue that is not
        # a resumed one is new, or resumed when it was preempted before (the v2 model runner sends those as new).
        resumed_ids = cached.resumed_req_ids
        n_new = len(new_reqs)
        for i in range(n_new):
            kinds[i] = "resumed" if reqs[i].num_preemptions > 0 else "new"
            admitted[uids[i]] = computed[i]
        if resumed_ids:
            for i in range(n_new, len(rids)):
                if rids[i] in resumed_ids:
                    kinds[i] = "resumed"
                    admitted[uids[i]] = computed[i]
    R.sched_prev = (rids, uids, prompts, ["running"] * len(rids) if admitted else kinds, prefill)
    columns = {
        "req_id": uids,
        "kind": kinds,
        "num_scheduled_tokens": list(map(n_sched.__getitem__, rids)),
        "num_computed_tokens": computed,
        "num_prompt_tokens": prompts,
        "num_output_tokens": list(map(len, map(_outputs, reqs))),
        "is_prefill": prefill,
    }
    return columns, admitted


def _prefill(computed: list[int], prompts: list[int], reqs: list) -> list[bool]:
    # Upstream's own prefill boundary, computed < max(prompt, num_tokens - 1): a resumed request
    # replays its outputs too. A comprehension without max() calls is the fastest form here.
    return [c < p or c < len(r._all_token_ids) - 1 for c, p, r in zip(computed, prompts, reqs)]


def _schedule_after(token, out, self, *a, **kw):
    t0, running_before, waiting_before = token
    step = R.sched_step
    running_after, waiting_after = self.get_request_counts()
    scheduled, admitted = _scheduled(self, out)
    R.write(  # a schema.SchedulerRecord, as a dict (see Recorder.write)
        {
            "step": step,
            "proc": R.proc_dict("engine_core"),
            "kind": "scheduler",
            "time": time.time(),
            "duration_s": time.perf_counter() - t0,
            "waiting_before": waiting_before,
            "running_before": running_before,
            "waiting_after": waiting_after,
            "running_after": running_after,
            "token_budget": self.max_num_scheduled_tokens,
            "tokens_scheduled": out.total_num_scheduled_tokens,
            "max_num_seqs": self.max_num_running_reqs,
            "scheduled": scheduled,
            "preempted": [p.model_dump(mode="json") for p in R.preempted],
            "finished": sorted(user_req_id(r) for r in out.finished_req_ids),
        },
        flush=R.level_rank < KV_LEVEL and R.worker_step == 0,  # else the KV record below completes the step: one write()
    )
    R.preempted = []
    # Flushed now, unless this process also runs the model (in-process engine, or a
    # uniproc executor): then the runner record that ends this step flushes all four.
    if R.level_rank >= KV_LEVEL:
        R.write(kv.kv_record(self, step, admitted), flush=R.worker_step == 0)


schedule = Probe(
    name="scheduler.schedule",
    target=f"{SCHED}.schedule",
    params=("self",),
    records="per step: queue sizes before/after, token budget and use, scheduled requests "
    "(new/resumed/running, tokens, computed tokens), preemptions, finished; then the KV record",
    pins=PINS,
    before=_schedule_before,
    after=_schedule_after,
    level="steps",
)


def _failed_allocation(scheduler) -> tuple[str, int] | None:
    """(user id, tokens asked) of the allocate_slots call that failed just before this preemption.

    Upstream preempts only from the loop over running requests in schedule(), right
    after `allocate_slots(request, num_new_tokens, ...)` returned None (same names on
    every pin: a missing one fails this probe, recorded as a probe error). None when
    no schedule() frame of this scheduler is preempting (e.g. a prefix-cache reset).
    """
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_name == "schedule" and frame.f_locals.get("self") is scheduler):
        frame = frame.f_back
    if frame is None:
        return None
    f_locals = frame.f_locals
    return user_req_id(f_locals["request"].request_id), f_locals["num_new_tokens"]


def _preempt_before(self, request, *a, **kw):
    rid = user_req_id(request.request_id)
    held = list(self.kv_cache_manager.get_block_ids(request.request_id)[0])
    fail = _failed_allocation(self)
    if fail is None:
        reason = "preempted outside a failed allocation (e.g. a prefix-cache reset)"
        return Preemption(req_id=rid, reason=reason, freed_block_ids=held, num_computed_tokens_lost=request.num_computed_tokens)
    who, num_tokens = fail
    # A failed allocation leaves the pool as it found it: the free count now is the one it failed against.
    free_blocks = self.kv_cache_manager.block_pool.get_num_free_blocks()
    reason = (
        f"no free KV blocks: allocate_slots for {who} ({num_tokens} tokens) "
        f"failed with {free_blocks} free blocks; "
        + (f"{rid} is the lowest-priority running request" if who != rid else f"{rid} itself has no one left to preempt")
    )
    return Preemption(
        req_id=rid,
        reason=reason,
        while_allocating_for=who,
        num_tokens_requested=num_tokens,
        free_blocks_at_failure=free_blocks,
        freed_block_ids=held,
        num_computed_tokens_lost=request.num_computed_tokens,
    )


def _preempt_after(preemption, result, *a, **kw):
    R.preempted.append(preemption)


preempt = Probe(
    name="scheduler.preempt",
    target=f"{SCHED}._preempt_request",
    params=("self", "request"),
    records="each preempted request, the blocks it loses, and why (the allocation that failed)",
    pins=PINS,
    before=_preempt_before,
    after=_preempt_after,
    level="steps",
)

PROBES = [schedule, preempt]
