"""`vllm-tour explain`: why a request waited, missed the prefix cache, was chunked or preempted -- from records.

A view: it reads a run's records and re-runs nothing. Each sentence it prints is a `Line` that carries the
record fields it was derived from and the ids of the notes (annotations/*.toml) whose rule it applies, so a
reader can check both the evidence and the rule against the pinned source (`vllm-tour source`).

Right or silent: a cause is stated only when the records establish it. The records do not hold the waiting
queue itself, so it is rebuilt (`_Timeline`) from what they do hold -- arrivals (meta.requests, replayed the
way the driver adds them), admissions, preemptions and finishes -- and checked at every step against the
queue lengths the scheduler recorded (`waiting_before`, `running_before`). Where the rebuilt queue does not
match, or the numbers contradict the rule, the line says what is known and that the cause is not.

The rules, as Scheduler.schedule applies them at v0.32.0 (and v0.21.0):
- running requests are served first, in admission order, until the token budget is spent
  (sched-budget-init, sched-running-loop); a running prefill is cut to what is left (sched-running-clamp);
- when a running request's allocate_slots fails, the last running request is preempted (FCFS) and the
  allocation retried; the request itself is the last victim (sched-pick-victim, sched-preempt-self); a
  victim loses all computed tokens (sched-preempt-reset) and goes to the front of `waiting`
  (sched-preempt-prepend);
- no request is admitted in a step that preempted (sched-waiting-gate);
- admission walks `waiting` from its head while budget is left and fewer than max_num_seqs run
  (sched-max-active); the first request whose whole known sequence does not fit in the free blocks stops
  the walk, and everyone behind it waits too (kvm-reserve-full-isl, sched-waiting-alloc-fail);
- a prefix-cache hit is the longest run of cached full blocks from the start, capped at num_tokens - 1
  (kvm-longest-hit, kvm-hash-full-only, kvm-hit-cap); blocks are cached at allocation (kvm-cache-blocks) and
  lose their hash only when reused for other content (pool-evict-on-reuse);
- new blocks come from the head of the free queue (pool-get-new), whose order free_blocks builds: that rule differs
  between releases, so it is read from the pin profile (`free_queue_policy`) and never assumed; a pin that does not
  state it gets "not known" (free_queue.py rebuilds the queue and checks every allocation against it).
Read against the sources of v0.21.0, v0.31.0 and v0.32.0 (2026-12-02), the rules above hold on all three but for the
free-queue order; max_num_active_seqs exists from v0.31.0 on (an engine argument 0.21.0 does not take, so its runs
never record it).

Served runs (`vllm-tour serve`): requests come from clients, not from meta.requests' arrival steps. The front end's
records (server_requests) give each one's API id, arrival time and, for n > 1, its parent; an abort record gives the
step the engine dropped it at and the blocks it freed (served.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import ceil

from vllm_tour.errors import TourError
from vllm_tour.trace import levels
from vllm_tour.trace.reader import Run
from vllm_tour.upstream.pins import pin_profile
from vllm_tour.views import free_queue
from vllm_tour.views.explain_messages import KIND_WORDS, LANGS, MORE, msg
from vllm_tour.views.explain_queues import _Timeline
from vllm_tour.views.explain_spec import spec_lines
from vllm_tour.views.served import (
    abort_of,
    engine_request,
    served_after,
    server_record,
    siblings,
)


@dataclass
class Line:
    """One sentence of an explanation: what it says (key + params, rendered per language), the cause it names
    (machine-readable, for scripts and tests), the steps it covers, the record fields it read, the notes whose
    rule it applies."""

    topic: str  # arrival | wait | admit | chunk | spec | preempt | resume | cache | finish | level
    key: str
    params: dict
    fields: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cause: str | None = None
    steps: tuple[int, int] | None = None
    sub: list[tuple[str, tuple]] = field(default_factory=list)  # nested message pieces: (param name, (key, params))
    who: str | None = None  # the request a line of a step or cache view is about (None in a request's own story)

    def text(self, lang: str = "en") -> str:
        params = dict(self.params)
        for name, (key, p) in self.sub:
            params[name] = msg(key, lang, **p) if key else ""
        for k, v in list(params.items()):
            if isinstance(v, dict) and set(v) == set(LANGS):
                params[k] = v[lang]
        text = msg(self.key, lang, **params)
        # English plurals: the templates say "{n} tokens"; a count of one reads "1 token" (zh has no plural).
        return re.sub(r"(?<![\d.])1 (token|block)s\b", r"1 \1", text) if lang == "en" else text

    def to_json(self, lang: str) -> dict:
        return {"topic": self.topic, "cause": self.cause, **({"request": self.who} if self.who else {}), "steps": list(self.steps) if self.steps else None,
                "text": self.text(lang), "fields": self.fields, "notes": self.notes}


@dataclass
class Explanation:
    run: str
    pin: str
    level: str
    subject: str  # "request r2", "step 38", "cache"
    lines: list[Line]
    table: list[dict] = field(default_factory=list)  # --cache rows

    def turns(self) -> list[Line]:
        """The turns that matter (waits, preemptions, resumes, why the cache missed, the finish, whose choice a
        served request is), not every chunk; a miss line stands for the zero-hit line before it."""
        return [ln for ln in self.lines if (ln.topic in ("wait", "preempt", "resume", "cache", "finish", "level")
                or ln.cause == "n_child") and ln.cause not in ("no_hit", None)]

    def summary(self, lang: str = "en", limit: int = 8) -> list[str]:
        """A few lines: the turns, cut at `limit`."""
        out = [line_text(ln, lang) for ln in self.turns()]
        return out if len(out) <= limit else out[: limit - 1] + [MORE[lang].format(n=len(out) - limit + 1)]

    def to_json(self, lang: str = "en") -> dict:
        return {"run": self.run, "pin": self.pin, "level": self.level, "subject": self.subject, "lang": lang,
                "lines": [ln.to_json(lang) for ln in self.lines],
                **({"cache": [{k: v for k, v in row.items() if k != "lines"} | {"texts": [ln.text(lang) for ln in row["lines"]]}
                              for row in self.table]} if self.table else {})}


STEP = {"en": ("step {a}: ", "steps {a}-{b}: "), "zh": ("第 {a} 步：", "第 {a}-{b} 步：")}


def line_text(ln: Line, lang: str = "en") -> str:
    """A line as printed: its step or steps, then its sentence."""
    return _prefix(ln, lang) + ln.text(lang)


def _prefix(ln: Line, lang: str = "en") -> str:
    if not ln.steps:
        return ""
    a, b = ln.steps
    return STEP[lang][a != b].format(a=a, b=b)


class _Explainer:
    def __init__(self, run: Run):
        if not run.steps or not any(s.scheduler for s in run.steps):
            raise TourError(f"{run.path.name} has no scheduler records to explain")
        self.run = run
        self.tl = _Timeline(run)
        self.blocks = levels.has(run.meta.level, "blocks") and any(s.kv for s in run.steps)
        e = run.meta.engine_args
        self.bs = next((s.kv.block_size for s in run.steps if s.kv), None) or e.get("block_size") or 16
        self.policy = str(e.get("scheduling_policy", "fcfs"))
        self.chunked = e.get("enable_chunked_prefill", True) is not False
        self.max_active = e.get("max_num_active_seqs")
        self.threshold = e.get("long_prefill_token_threshold") or (e.get("extra") or {}).get("long_prefill_token_threshold")
        self.prompt_len = {r.req_id: len(r.prompt_token_ids or []) for r in run.meta.requests}
        outs = {o.req_id: o for o in run.outputs.requests} if run.outputs else {}
        self.outputs = outs
        self.seq = {r.req_id: list(r.prompt_token_ids or []) + list(outs[r.req_id].token_ids if r.req_id in outs else [])
                    for r in run.meta.requests}
        self.sched_rows: dict[str, list[tuple[int, object]]] = {}
        for s in run.steps:
            if s.scheduler:
                for r in s.scheduler.scheduled:
                    self.sched_rows.setdefault(r.req_id, []).append((s.index, r))
        self._cache = _CacheSim(self) if self.blocks else None
        self.free_policy, self.no_policy = _free_queue_policy(run.meta.pin)
        self.allocs = free_queue.rebuild(run, self.free_policy, self._cache.hashed) if self._cache and self.free_policy else {}

    # -- numbers the sentences use

    def tokens_at(self, rid: str, step: int) -> int:
        """The request's num_tokens (prompt + outputs so far) while it waits at `step`: the next scheduled row
        records it (outputs do not grow while waiting); before any row, the prompt."""
        rows = self.sched_rows.get(rid, [])
        nxt = next((r for i, r in rows if i >= step), None)
        if nxt is not None:
            return nxt.num_prompt_tokens + nxt.num_output_tokens
        last = rows[-1][1] if rows else None
        if last is None:
            return self.prompt_len.get(rid, 0)
        done = last.num_computed_tokens + last.num_scheduled_tokens
        own = last.num_prompt_tokens + last.num_output_tokens
        return own + (1 if done >= own else 0)  # a step that finished its prefill (or a decode) sampled one token

    def max_running(self, step) -> int:
        m = step.scheduler.max_num_seqs
        return min(m, self.max_active) if self.max_active else m

    @staticmethod
    def users(sch) -> str:
        return ", ".join(f"{r.req_id} {r.num_scheduled_tokens}" for r in sch.scheduled) or "nobody"

    # -- why a request got no tokens at a step

    def wait_line(self, rid: str, step) -> Line:
        sch, st = step.scheduler, self.tl.states.get(step.index)
        n = step.index
        budget_left = sch.token_budget - sch.tokens_scheduled
        waiting = st is not None and rid in st.left
        running = st is not None and rid in st.running and rid not in {p.req_id for p in sch.preempted}
        if st is None or not st.consistent or not (waiting or running):
            return Line("wait", "wait_unknown", {"queue": "", "why": {"en": "its place in the queues is not known here", "zh": "此处无法确定它在队列中的位置"}},
                        ["scheduler.waiting_before", "scheduler.running_before"], [], "unknown", (n, n),
                        sub=[("queue", ("queue_mismatch", {}))] if st is not None and not st.consistent else [])
        if running:
            if budget_left <= 0:
                return Line("wait", "wait_running_budget", {"used": sch.tokens_scheduled, "budget": sch.token_budget,
                                                              "users": self.users(sch)},
                            ["scheduler.token_budget", "scheduler.tokens_scheduled", "scheduler.scheduled"],
                            ["sched-budget-init", "sched-running-loop"], "token_budget", (n, n))
            return Line("wait", "wait_unknown", {"queue": {"en": " while running", "zh": "（运行中）"},
                                                 "why": {"en": f"{budget_left} tokens of the budget left", "zh": f"预算还剩 {budget_left} 个 token"}},
                        ["scheduler.token_budget", "scheduler.tokens_scheduled"], [], "unknown", (n, n))
        if sch.preempted:
            return Line("wait", "wait_preempt_gate", {"victims": ", ".join(p.req_id for p in sch.preempted)},
                        ["scheduler.preempted"], ["sched-waiting-gate"], "preempt_gate", (n, n))
        if budget_left <= 0:
            return Line("wait", "wait_budget", {"used": sch.tokens_scheduled, "budget": sch.token_budget, "users": self.users(sch)},
                        ["scheduler.token_budget", "scheduler.tokens_scheduled", "scheduler.scheduled"],
                        ["sched-budget-init", "sched-token-budget-config"], "token_budget", (n, n))
        if len(st.running_after) >= self.max_running(step):
            return Line("wait", "wait_max_running", {"running": len(st.running_after), "max": self.max_running(step)},
                        ["scheduler.running_after", "scheduler.max_num_seqs"], ["sched-max-active"], "max_running", (n, n))
        head = st.left[0]
        if rid == head:
            tokens = self.tokens_at(rid, n)
            if not self.chunked and tokens > budget_left:
                return Line("wait", "wait_no_chunking", {"owed": tokens, "left": budget_left},
                            ["scheduler.token_budget", "scheduler.tokens_scheduled", "meta.engine_args"],
                            ["sched-no-chunking-break"], "no_chunking", (n, n))
            if step.kv is None:
                return Line("wait", "wait_kv_nolevel", {"left": budget_left, "running": len(st.running_after),
                                                         "max": self.max_running(step), "level": self.run.meta.level},
                            ["scheduler.token_budget", "scheduler.tokens_scheduled", "scheduler.running_after"],
                            ["sched-waiting-alloc-fail", "kvm-reserve-full-isl"], "kv_blocks", (n, n))
            need, free = ceil(tokens / self.bs), step.kv.free_blocks
            if need <= free:  # the rule says it would have fit: do not claim a cause the numbers contradict
                return Line("wait", "wait_unknown", {"queue": {"en": " at the head of the waiting queue", "zh": "（位于等待队列队首）"},
                                                     "why": {"en": f"{tokens} tokens need at most {need} blocks and {free} were free",
                                                             "zh": f"{tokens} 个 token 最多只需 {need} 块，而空闲的有 {free} 块"}},
                            ["kv.free_blocks", "kv.block_size"], [], "unknown", (n, n))
            return Line("wait", "wait_kv", {"tokens": tokens, "bs": self.bs, "need": need, "free": free},
                        ["kv.free_blocks", "kv.block_size", "scheduler.scheduled[].num_prompt_tokens",
                         "scheduler.scheduled[].num_output_tokens"],
                        ["kvm-reserve-full-isl", "kvm-alloc-fail", "sched-waiting-alloc-fail"], "kv_blocks", (n, n))
        fits = []
        if step.kv is not None:
            tokens = self.tokens_at(rid, n)
            need, free = ceil(tokens / self.bs), step.kv.free_blocks
            if need <= free:
                fits = [("fits", ("hol_fits", {"rid": rid, "need": need, "tokens": tokens, "free": free}))]
        return Line("wait", "wait_hol", {"head": head, "fits": ""}, ["scheduler.scheduled", "meta.requests"] +
                    (["kv.free_blocks"] if fits else []), ["sched-waiting-alloc-fail", "sched-fcfs-queue"],
                    "head_of_line", (n, n), sub=fits)

    # -- the story of one request

    def request(self, rid: str) -> Explanation:
        run = self.run
        rid = engine_request(run, rid)
        spec = next(r for r in run.meta.requests if r.req_id == rid)
        arrived = self.tl.arrived.get(rid)
        lines = self.served_lines(rid, arrived) if run.server_requests else []
        if arrived is not None and not run.server_requests:
            early = arrived < spec.arrival_step + 1
            lines.append(Line("arrival", "arrival_early" if early else "arrival",
                              {"step": arrived, "arrival": spec.arrival_step, "tokens": self.prompt_len.get(rid, 0)},
                              ["meta.requests[].arrival_step", "meta.requests[].prompt_token_ids"], ["sched-add-request"]))
        rows = dict(self.sched_rows.get(rid, []))
        preempted_at = {s.index: p for s in run.steps if s.scheduler for p in s.scheduler.preempted if p.req_id == rid}
        end = self.tl.finish_step.get(rid, run.steps[-1].index)
        # without a known arrival (served, records that do not fit) the story starts where the records first show it
        start = arrived if arrived is not None else min(rows, default=None)
        last_preempt = None
        for s in run.steps:
            n = s.index
            if start is None or n < start or n > end or s.scheduler is None:
                continue
            if n in preempted_at:
                lines.append(self.preempt_line(rid, s, preempted_at[n]))
                lines += [Line("spec", **d) for d in spec_lines(run, rid, s)]
                last_preempt = n
                continue
            for p in s.scheduler.preempted:
                if p.while_allocating_for == rid and p.req_id != rid:
                    lines.append(Line("preempt", "preempted_other", {"step": n, "asked": p.num_tokens_requested,
                                                                      "free": p.free_blocks_at_failure, "victim": p.req_id,
                                                                      "lost": p.num_computed_tokens_lost},
                                      ["scheduler.preempted[].while_allocating_for", "scheduler.preempted[].num_tokens_requested",
                                       "scheduler.preempted[].free_blocks_at_failure"],
                                      ["sched-allocate-running", "sched-pick-victim"], "preempted_for", (n, n)))
            r = rows.get(n)
            if r is None:
                lines.append(self.wait_line(rid, s))
                continue
            if r.kind in ("new", "resumed"):
                tokens = r.num_prompt_tokens + r.num_output_tokens
                if r.kind == "resumed" and last_preempt is not None:
                    lines.append(Line("resume", "resume", {"step": n, "waited": n - last_preempt, "hit": r.num_computed_tokens,
                                                           "tokens": tokens, "recompute": tokens - r.num_computed_tokens},
                                      ["scheduler.scheduled[].kind", "scheduler.scheduled[].num_computed_tokens"],
                                      ["sched-admit", "sched-preempt-reset", "sched-prefix-lookup"], "resumed", (n, n)))
                else:
                    lines.append(Line("admit", "admit", {"step": n, "kind": KIND_WORDS[r.kind], "computed": r.num_computed_tokens,
                                                         "tokens": tokens, "scheduled": r.num_scheduled_tokens},
                                      ["scheduler.scheduled[].kind", "scheduler.scheduled[].num_computed_tokens",
                                       "scheduler.scheduled[].num_scheduled_tokens"], ["sched-admit", "sched-prefix-lookup"],
                                      r.kind, (n, n)))
                lines += self.cache_lines(rid, s, r)
                lines += self.alloc_lines(rid, s)
            chunk = self.chunk_line(rid, s, r)
            if chunk is not None:
                lines.append(chunk)
            lines += [Line("spec", **d) for d in spec_lines(run, rid, s)]
        lines += self.finish_lines(rid)
        if not rows:
            lines.append(Line("finish", "never_scheduled", {}, ["scheduler.scheduled"], []))
        if not self.blocks:
            lines.append(Line("level", "level", {"level": run.meta.level, "what": ""}, ["meta.level"], [],
                              sub=[("what", ("level_what", {}))]))
        return Explanation(run.path.name, run.meta.pin, run.meta.level, f"request {rid}", _merge(lines))

    def served_lines(self, rid: str, arrived: int | None) -> list[Line]:
        """A served request's arrival: the API id the client got, when the front end made it, the step it reached
        the engine by (rebuilt: see _Timeline._arrivals_served), and, for one of n > 1 choices, its parent."""
        rec = server_record(self.run, rid)
        if rec is None:
            return [Line("arrival", "served_unrecorded", {}, ["server_requests"], [])]
        fields = ["server_requests[].api_id", "server_requests[].arrival_time", "scheduler.waiting_before"]
        at = {"api": rec.api_id, "t": f"{rec.arrival_time - self.run.meta.started:.3f}",
              "tokens": len(rec.prompt_token_ids), "step": arrived}
        if arrived is None:
            out = [Line("arrival", "arrival_served_unknown", at, fields, ["sched-add-request"], "unknown")]
        else:
            out = [Line("arrival", "arrival_served", at, fields, ["sched-add-request", "core-busy-loop"], "api")]
        if rec.parent_id is not None:
            out.append(Line("arrival", "served_child", {"index": rec.index, "n": rec.n, "api": rec.api_id,
                                                        "parent": rec.parent_id,
                                                        "others": ", ".join(siblings(self.run, rec)) or "-"},
                            ["server_requests[].parent_id", "server_requests[].index", "server_requests[].n"], [],
                            "n_child"))
        return out

    def abort_lines(self, rid: str) -> list[Line]:
        """How an aborted request ended: who ended it (as far as the records say), the step the engine dropped it
        at, the blocks it held and those freed, and where the freed ones show."""
        step, a = abort_of(self.run, rid)
        rec = server_record(self.run, rid)
        later = served_after(self.run, a)
        fields = ["abort.step", "abort.status_before", "abort.num_computed_tokens", "abort.block_ids",
                  "abort.freed_block_ids"]
        notes = ["core-busy-loop", "sched-finish-free", "kvm-free-reverse"]
        out = self.outputs.get(rid)
        finish = rec.finish_reason if rec is not None else out.finish_reason if out is not None else None
        if finish == "stop":  # the engine does not look for stop strings: the front end finds them, then aborts
            stop = f" {rec.stop_reason!r}" if rec is not None and isinstance(rec.stop_reason, str) else ""
            who, cause = ("abort_stop_string", {"stop": stop}), "stop_string"
            fields, notes = fields + ["outputs.requests[].finish_reason"], ["out-detok-stop", "out-engine-abort", *notes]
        elif rec is not None and finish == "abort" and later:
            who, cause = ("abort_client", {"tokens": len(rec.token_ids), "later": later[0].api_id}), "client_closed"
            fields += ["server_requests[].finish_reason", "server_requests[].arrival_time"]
        elif rec is not None:
            who, cause = ("abort_client_or_shutdown", {}), "aborted"
        else:
            who, cause = ("abort_unknown", {"finish": finish}), "aborted"
        nxt = next((s for s in self.run.steps if s.index > step and s.kv is not None), None)
        if not a.freed_block_ids:
            freed = ("abort_none_freed", {})
        elif nxt is not None and set(a.freed_block_ids) <= set(nxt.kv.freed):
            freed, fields = ("abort_freed_at", {"blocks": a.freed_block_ids, "next": nxt.index}), fields + ["kv.freed"]
        else:
            freed = ("abort_freed_unseen", {"blocks": a.freed_block_ids})
        kept = [b for b in a.block_ids if b not in a.freed_block_ids]
        return [Line("finish", "abort", {"who": "", "status": a.status_before, "computed": a.num_computed_tokens,
                                         "outputs": a.num_output_tokens, "held": a.block_ids, "freed": "", "kept": ""},
                     fields, notes, cause, (step, step),
                     sub=[("who", who), ("freed", freed),
                          ("kept", ("abort_kept", {"kept": kept}) if kept else ("", {}))])]

    def policy_rule(self) -> tuple[str, dict]:
        return (f"rule_{self.free_policy}", {"pin": self.run.meta.pin})

    def policy_notes(self) -> list[str]:
        return ["pool-get-new", "kvm-free-reverse"] + (["pool-free-order"] if self.free_policy == "uncached_to_front" else [])

    def alloc_lines(self, rid: str, s) -> list[Line]:
        """Which blocks an admission got, and why those: the head of the free queue, whose order the release's
        free-queue policy (pin profile) builds -- checked against the queue rebuilt from the records."""
        got = s.kv.allocated.get(rid, []) if s.kv else []
        if not got:
            return []
        n = s.index
        fields = ["kv.allocated", "kv.freed", "kv.prefix_hits", "kv.num_blocks", f"pins/{self.run.meta.pin}.toml [profile] free_queue_policy"]
        if self.free_policy is None:
            return [Line("alloc", "alloc_policy_unknown", {"blocks": got, "why": self.no_policy}, fields[:4],
                         ["pool-get-new"], "policy_unknown", (n, n))]
        a = self.allocs.get((n, rid))
        if a is None or a.expected is None:
            return [Line("alloc", "alloc_lost", {"blocks": got}, fields, [], "unknown", (n, n))]
        if a.expected != got:
            return [Line("alloc", "alloc_mismatch", {"blocks": got, "expected": a.expected, "pin": self.run.meta.pin, "rule": ""},
                         fields, [], "unknown", (n, n), sub=[("rule", self.policy_rule())])]
        return [Line("alloc", "alloc_head", {"blocks": got, "pin": self.run.meta.pin, "rule": ""}, fields,
                     self.policy_notes(), f"free_queue_{self.free_policy}", (n, n), sub=[("rule", self.policy_rule())])]

    def preempt_line(self, rid: str, s, p) -> Line:
        n = s.index
        st = self.tl.states.get(n)
        if self.policy == "priority":
            rule, notes, cause = ("rule_priority", {}), ["sched-pick-victim"], "victim_priority"
        elif p.while_allocating_for == rid:
            rule, notes, cause = ("rule_self", {"rid": rid}), ["sched-preempt-self", "sched-pick-victim"], "victim_self"
        elif st is not None and st.consistent and st.victims_last:
            rule = ("rule_last", {"rid": rid, "running": "[" + ", ".join(st.running) + "]"})
            notes, cause = ["sched-pick-victim", "sched-queues"], "victim_last_running"
        else:
            rule, notes, cause = ("rule_unverified", {}), ["sched-pick-victim"], "victim_unverified"
        return Line("preempt", "preempt", {"step": n, "for_": p.while_allocating_for or "?", "asked": p.num_tokens_requested,
                                            "free": p.free_blocks_at_failure, "rule": "", "lost": p.num_computed_tokens_lost,
                                            "blocks": p.freed_block_ids},
                    ["scheduler.preempted[].while_allocating_for", "scheduler.preempted[].num_tokens_requested",
                     "scheduler.preempted[].free_blocks_at_failure", "scheduler.preempted[].num_computed_tokens_lost",
                     "scheduler.preempted[].freed_block_ids"],
                    ["sched-allocate-running", *notes, "sched-preempt-reset", "sched-preempt-prepend"], cause, (n, n),
                    sub=[("rule", rule)])

    def chunk_line(self, rid: str, s, r) -> Line | None:
        if not r.is_prefill:
            return None
        n, sch = s.index, s.scheduler
        owed = r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens
        chunk = r.num_scheduled_tokens
        fields = ["scheduler.scheduled[].num_scheduled_tokens", "scheduler.scheduled[].num_computed_tokens",
                  "scheduler.scheduled[].num_prompt_tokens"]
        if chunk >= owed:
            first = r.kind in ("new", "resumed")
            return None if first else Line("chunk", "chunk_last", {"step": n, "chunk": chunk}, fields,
                                            ["sched-running-clamp"], "last_chunk", (n, n))
        left = sch.token_budget - sch.tokens_scheduled
        if left <= 0:
            others = [x for x in sch.scheduled if x.req_id != rid]
            return Line("chunk", "chunk_budget", {"step": n, "chunk": chunk, "owed": owed, "budget": sch.token_budget,
                                                  "others": sum(x.num_scheduled_tokens for x in others),
                                                  "users": ", ".join(f"{x.req_id} {x.num_scheduled_tokens}" for x in others) or "nobody"},
                        fields + ["scheduler.token_budget", "scheduler.tokens_scheduled"],
                        ["sched-running-clamp", "sched-budget-init"], "chunk_budget", (n, n))
        if self.threshold and chunk == self.threshold:
            return Line("chunk", "chunk_threshold", {"step": n, "chunk": chunk, "owed": owed, "threshold": self.threshold},
                        fields + ["meta.engine_args"], ["sched-long-prefill-threshold"], "chunk_threshold", (n, n))
        return Line("chunk", "chunk_unknown", {"step": n, "chunk": chunk, "owed": owed, "left": left}, fields, [],
                    "unknown", (n, n))

    def cache_lines(self, rid: str, s, r) -> list[Line]:
        n = s.index
        tokens = r.num_prompt_tokens + r.num_output_tokens
        hit = r.num_computed_tokens
        if s.kv is not None and not s.kv.prefix_caching or self.run.meta.engine_args.get("enable_prefix_caching") is False:
            return [Line("cache", "cache_off", {"tokens": tokens}, ["kv.prefix_caching", "meta.engine_args"],
                         ["fe-block-hasher-origin"], "cache_off", (n, n))]
        cap = tokens - 1
        cacheable = (cap // self.bs) * self.bs
        blocks = next((h.block_ids for h in s.kv.prefix_hits if h.req_id == rid), []) if s.kv else []
        out = [Line("cache", "cache_hit", {"step": n, "hit": hit, "tokens": tokens, "blocks": blocks, "cacheable": cacheable},
                    ["scheduler.scheduled[].num_computed_tokens", "kv.prefix_hits"], ["sched-prefix-lookup", "kvm-longest-hit"],
                    "hit" if hit else "no_hit", (n, n))]
        if hit < cacheable:
            out += self._cache.miss(rid, n, hit, tokens) if self._cache else []
        if tokens - cacheable > 0:
            out.append(Line("cache", "cache_uncacheable" if cacheable else "cache_too_short",
                            {"rest": tokens - cacheable, "cap": cap, "bs": self.bs, "tokens": tokens},
                            ["scheduler.scheduled[].num_prompt_tokens", "kv.block_size"],
                            ["kvm-hit-cap", "kvm-hash-full-only"], "partial_block", (n, n)))
        return out

    def finish_lines(self, rid: str) -> list[Line]:
        if abort_of(self.run, rid) is not None:
            return self.abort_lines(rid)
        o = self.outputs.get(rid)
        last = self.tl.finish_step.get(rid)
        if o is None or last is None:
            return [Line("finish", "unfinished", {"status": self.run.meta.status}, ["meta.status", "outputs"], [])]
        spec = next(r for r in self.run.meta.requests if r.req_id == rid)
        if o.finish_reason == "length":
            at_len = len(o.token_ids) >= spec.max_tokens
            reason = ("finish_length", {"max": spec.max_tokens}) if at_len else ("finish_model_len", {})
        elif o.finish_reason == "stop":
            reason = ("finish_stop", {})
        else:
            reason = ("finish_other", {"reason": o.finish_reason})
        later = any(s.index == last + 1 for s in self.run.steps)
        freed = ("freed_at", {"step": last + 1}) if later else ("", {})
        return [Line("finish", "finish", {"step": last, "reason": "", "generated": len(o.token_ids), "freed": ""},
                     ["outputs.requests[].finish_reason", "outputs.requests[].token_ids", "scheduler.finished"],
                     ["sched-check-stop", "sched-finish-free"], o.finish_reason, (last, last),
                     sub=[("reason", reason), ("freed", freed)])]

    # -- one step

    def step(self, index: int) -> Explanation:
        s = self.run.step(index)
        sch = s.scheduler
        if sch is None:
            raise TourError(f"step {index} of {self.run.path.name} has no scheduler record")
        lines: list[Line] = []
        lines.append(Line("budget", "step_budget", {"step": index, "budget": sch.token_budget, "used": sch.tokens_scheduled,
                                                     "users": " + ".join(f"{r.req_id} {r.num_scheduled_tokens}" for r in sch.scheduled) or "0",
                                                     "left": sch.token_budget - sch.tokens_scheduled},
                          ["scheduler.token_budget", "scheduler.tokens_scheduled", "scheduler.scheduled"], ["sched-budget-init"]))
        for r in sch.scheduled:
            if r.kind in ("new", "resumed"):
                lines.append(Line("admit", "admit", {"step": index, "kind": KIND_WORDS[r.kind], "computed": r.num_computed_tokens,
                                                     "tokens": r.num_prompt_tokens + r.num_output_tokens,
                                                     "scheduled": r.num_scheduled_tokens},
                                  ["scheduler.scheduled[].kind", "scheduler.scheduled[].num_computed_tokens"],
                                  ["sched-admit", "sched-prefix-lookup"], r.kind, (index, index), who=r.req_id))
            chunk = self.chunk_line(r.req_id, s, r)
            if chunk is not None:
                chunk.who = r.req_id
                lines.append(chunk)
        for p in sch.preempted:
            ln = self.preempt_line(p.req_id, s, p)
            ln.who = p.req_id
            lines.append(ln)
        st = self.tl.states.get(index)
        scheduled = {r.req_id for r in sch.scheduled}
        if st is not None:
            victims = {p.req_id for p in sch.preempted}
            for rid in [r for r in st.running if r not in scheduled and r not in victims] + st.left:
                ln = self.wait_line(rid, s)
                ln.who = rid
                lines.append(ln)
        for a in s.aborts:  # dropped during this step (a client that hung up, a shutdown)
            for ln in self.abort_lines(a.req_id):
                ln.who = a.req_id
                lines.append(ln)
        if sch.finished:
            lines.append(Line("finish", "step_finished", {"who": ", ".join(sch.finished)}, ["scheduler.finished", "kv.freed"],
                              ["sched-finish-free"]))
        if not self.blocks:
            lines.append(Line("level", "level", {"level": self.run.meta.level, "what": ""}, ["meta.level"], [],
                              sub=[("what", ("level_what", {}))]))
        return Explanation(self.run.path.name, self.run.meta.pin, self.run.meta.level, f"step {index}", lines)

    # -- the prefix cache, per admission

    def cache(self) -> Explanation:
        rows, lines = [], []
        for s in self.run.steps:
            if not s.scheduler:
                continue
            for r in s.scheduler.scheduled:
                if r.kind not in ("new", "resumed"):
                    continue
                found = self.cache_lines(r.req_id, s, r)
                causes = [ln for ln in found if ln.key not in ("cache_hit",)]
                rows.append({"request": r.req_id, "step": s.index, "kind": r.kind,
                             "tokens": r.num_prompt_tokens + r.num_output_tokens, "prompt_tokens": r.num_prompt_tokens,
                             "hit_tokens": r.num_computed_tokens,
                             "causes": [ln.cause for ln in causes], "lines": causes})
                for ln in found:
                    ln.who = r.req_id
                lines += found
        if not self.blocks:
            lines.append(Line("level", "level", {"level": self.run.meta.level, "what": ""}, ["meta.level"], [],
                              sub=[("what", ("level_what", {}))]))
        return Explanation(self.run.path.name, self.run.meta.pin, self.run.meta.level, "cache", lines, rows)


# --- the prefix cache, rebuilt from block tables ----------------------------------------------------------------


class _CacheSim:
    """Which token prefixes the prefix cache held at each step, from block tables, allocations and evictions.

    A block's hash identifies its whole prefix (kvm-hash-chain), so the key of block i of a sequence is the
    sequence's first (i+1)*block_size tokens. A block is cached once the tokens computed through the step fill it
    (kvm-cache-blocks, only full blocks: kvm-hash-full-only) and stays cached, even when freed, until it is
    evicted (pool-evict-on-reuse). Cache salt, LoRA and multimodal extra keys are not recorded: scenarios set none.
    """

    def __init__(self, ex: _Explainer):
        self.ex = ex
        self.bs = ex.bs
        # key -> [(step cached, block, owner, step evicted or None)]
        self.history: dict[tuple, list[list]] = {}
        self.evicted_by: dict[tuple[int, int], str] = {}  # (step, block) -> request that got the block
        live: dict[int, tuple] = {}  # block -> key it holds now
        for s in ex.run.steps:
            if s.kv is None or s.scheduler is None:
                continue
            for rid, ids in s.kv.allocated.items():
                for b in ids:
                    self.evicted_by.setdefault((s.index, b), rid)
            for b in s.kv.evicted:
                key = live.pop(b, None)
                if key is not None:
                    for h in self.history[key]:
                        if h[1] == b and h[3] is None:
                            h[3] = s.index
            for r in s.scheduler.scheduled:
                seq, table = ex.seq.get(r.req_id, []), s.kv.block_tables.get(r.req_id, [])
                full = min(r.num_computed_tokens + r.num_scheduled_tokens, len(seq)) // self.bs
                for i in range(min(full, len(table))):
                    key = tuple(seq[: (i + 1) * self.bs])
                    b = table[i]
                    if live.get(b) == key:
                        continue
                    live[b] = key
                    self.history.setdefault(key, []).append([s.index, b, r.req_id, None])

    def hashed(self, block: int, step: int) -> bool:
        """Whether `block` held a cached prefix when it was freed during `step` (never, with prefix caching off)."""
        if self.ex.run.meta.engine_args.get("enable_prefix_caching") is False:
            return False
        return any(h[1] == block and h[0] < step and (h[3] is None or h[3] >= step)
                   for hist in self.history.values() for h in hist)

    def miss(self, rid: str, step: int, hit: int, tokens: int) -> list[Line]:
        seq = self.ex.seq.get(rid, [])
        i = hit // self.bs
        a, b = i * self.bs, (i + 1) * self.bs - 1
        fields = ["kv.block_tables", "kv.allocated", "kv.evicted", "scheduler.scheduled[].num_computed_tokens",
                  "meta.requests[].prompt_token_ids", "outputs.requests[].token_ids"]
        base = {"i": i, "a": a, "b": b}
        if len(seq) < b + 1:
            return [Line("cache", "miss_unknown", {**base, "why": {"en": "the request's tokens are not all recorded", "zh": "该请求的 token 没有全部记录"}}, fields, [],
                         "unknown", (step, step))]
        key = tuple(seq[: b + 1])
        hist = self.history.get(key, [])
        before = [h for h in hist if h[0] < step]
        chain = (tokens - 1) // self.bs > i + 1
        tail = [Line("cache", "miss_chain", {}, [], ["kvm-longest-hit", "kvm-hash-chain"], None, (step, step))] if chain else []
        if before:
            gone = [h for h in before if h[3] is not None and h[3] <= step]
            if len(gone) == len(before):
                h = max(gone, key=lambda h: h[3])
                by = self.evicted_by.get((h[3], h[1]), "?")
                return [Line("cache", "miss_evicted", {**base, "block": h[1], "owner": h[2], "step": h[3], "by": by},
                             fields, ["pool-evict-on-reuse", *self.ex.policy_notes()] if self.ex.free_policy else
                             ["pool-evict-on-reuse"], "evicted", (step, step))] + tail
            return [Line("cache", "miss_unknown", {**base, "why": {"en": "the rebuilt cache still held these tokens", "zh": "重建的缓存中这些 token 仍在"}}, fields, [],
                         "unknown", (step, step))]
        same = [h for h in hist if h[0] == step and h[2] != rid]
        if same:
            return [Line("cache", "miss_same_step", {**base, "other": same[0][2]}, fields,
                         ["kvm-cache-blocks", "sched-waiting-alloc-fail"], "same_step", (step, step))] + tail
        later = [h for h in hist if h[0] > step and h[2] != rid]
        if later:
            return [Line("cache", "miss_later", {**base, "other": later[0][2], "step": later[0][0]}, fields,
                         ["kvm-cache-blocks"], "not_yet_computed", (step, step))] + tail
        return [Line("cache", "miss_first", base, fields, ["kvm-hash-chain", "kvm-longest-hit"], "never_computed",
                     (step, step))] + tail


def _free_queue_policy(pin: str) -> tuple[str | None, dict | None]:
    """The release's free-queue policy as its pin profile states it, or None and why it is not known (never a
    default: the policy differs between releases)."""
    try:
        policy = pin_profile(pin).stated("free_queue_policy")
    except TourError:
        return None, {"en": f"there is no pin file pins/{pin}.toml", "zh": f"没有 pins/{pin}.toml 这个 pin 文件"}
    if policy is None:
        return None, {"en": f"pins/{pin}.toml [profile] gives no free_queue_policy",
                      "zh": f"pins/{pin}.toml 的 [profile] 没有给出 free_queue_policy"}
    if policy not in free_queue.POLICIES:
        return None, {"en": f"pins/{pin}.toml gives free_queue_policy {policy!r}, none explain knows",
                      "zh": f"pins/{pin}.toml 给出的 free_queue_policy {policy!r} 不是 explain 认识的"}
    return policy, None


def _merge(lines: list[Line]) -> list[Line]:
    """Consecutive steps with the same sentence (same cause, same numbers) become one line over a step range."""
    out: list[Line] = []
    for ln in lines:
        prev = out[-1] if out else None
        if (prev is not None and ln.topic == "wait" and prev.topic == "wait" and prev.key == ln.key
                and prev.sub == ln.sub and _same(prev.params, ln.params) and prev.steps and ln.steps
                and ln.steps[0] == prev.steps[1] + 1):
            prev.steps = (prev.steps[0], ln.steps[1])
            continue
        out.append(ln)
    return out


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "step"} == {k: v for k, v in b.items() if k != "step"}


# --- entry points ---------------------------------------------------------------------------------------------------


def explain(run: Run, request: str | None = None, step: int | None = None, cache: bool = False) -> Explanation:
    """The explanation of one request's life, one step, or the run's prefix-cache outcomes (exactly one)."""
    if sum(x is not None and x is not False for x in (request, step, cache)) != 1:
        raise TourError("give exactly one of --request R, --step N, --cache")
    ex = _Explainer(run)
    if request is not None:
        return ex.request(request)
    if step is not None:
        return ex.step(step)
    return ex.cache()


def explain_requests(run: Run) -> dict[str, Explanation]:
    """Every request's explanation, the records read once ({} for a run without scheduler records)."""
    if not any(s.scheduler for s in run.steps):
        return {}
    ex = _Explainer(run)
    return {rid: ex.request(rid) for rid in run.request_ids()}


def request_summary(run: Run, rid: str, lang: str = "en", limit: int = 8) -> list[str]:
    """The few lines `show --request R` prints under the request's steps ([] for a run without scheduler records:
    nothing to explain, and `show` still shows what the run has)."""
    if not any(s.scheduler for s in run.steps):
        return []
    return explain(run, request=rid).summary(lang, limit)


# --- the terminal --------------------------------------------------------------------------------------------------

HEAD = {
    "en": "explain {run} · {subject} · pin {pin} · level {level}",
    "zh": "解释 {run} · {subject} · 版本 {pin} · 记录级别 {level}",
}
EVIDENCE = {"en": "fields", "zh": "字段"}
RULES = {"en": "rules", "zh": "规则"}
SOURCE_HINT = {
    "en": "each rule is a note on the pinned source: vllm-tour source QUALNAME shows it beside the code (note ids as above)",
    "zh": "每条规则都是固定版本源码上的一条注解：vllm-tour source QUALNAME 会把它显示在代码旁（注解 id 如上）",
}


def note_marks(pin: str) -> dict[str, str]:
    """note id -> "" where the note holds on `pin`, else a mark saying it is not checked there or does not apply
    (a rule whose code differs between releases is shown as the notes state it per pin, never assumed)."""
    from vllm_tour.notes.annotations import all_notes, load_all

    marks = {}
    for n in all_notes(load_all()):
        status = n.status_on(pin)
        marks[n.id] = {"applies": "", "variant": "", "not_applicable": f" [not on {pin}]"}.get(status, f" [unchecked on {pin}]")
    return marks


def check_lang(lang: str) -> str:
    if lang not in LANGS:
        raise TourError(f"--lang {lang!r}: choose one of {', '.join(LANGS)}")
    return lang


def render(ex: Explanation, console, lang: str = "en") -> None:
    from rich.markup import escape
    from rich.table import Table

    console.print(HEAD[lang].format(run=ex.run, subject=ex.subject, pin=ex.pin, level=ex.level), style="bold")
    marks = note_marks(ex.pin)
    if ex.table:
        t = Table(title_justify="left")
        for c in ("request", "step", "kind", "tokens", "hit", "miss causes"):
            t.add_column(c, overflow="fold")
        for row in ex.table:
            t.add_row(row["request"], str(row["step"]), row["kind"], str(row["tokens"]), str(row["hit_tokens"]),
                      "; ".join(escape(ln.text(lang)) for ln in row["lines"]) or "-")
        console.print(t)
    for ln in ex.lines:
        if ex.table and ln.topic == "cache":
            continue  # already in the table
        who = f"{ln.who}: " if ln.who else ""
        console.print(escape(_prefix(ln, lang) + who + ln.text(lang)), highlight=False)
        if ln.fields or ln.notes:
            bits = ([f"{EVIDENCE[lang]} {', '.join(ln.fields)}"] if ln.fields else []) + \
                   ([f"{RULES[lang]} {', '.join(n + marks.get(n, ' [no such note]') for n in ln.notes)}"] if ln.notes else [])
            console.print("    " + escape(" · ".join(bits)), style="dim", highlight=False)
    console.print(SOURCE_HINT[lang], style="dim")
