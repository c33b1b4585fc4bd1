"""`vllm-tour export --format perfetto`: Chrome trace JSON that ui.perfetto.dev opens.

Process 1 "engine": a "steps" track with one span per step, and counters
(KV usage, running, waiting). Process 2 "requests": one track per request,
with spans for waiting, prefill chunks, decode and resumed (recompute)
steps, and an instant marker at each preemption and, with speculative decoding, at each verification
(drafts, how many the target accepted, its tokens, the slots of the rejected ones).

A TP run adds one process per worker rank ("rank 0", "rank 1", pid 100 + rank) with a "collectives"
track: the step's all-reduces and logits gather in call order (each a slice of the step; their own
durations are not recorded), joined across ranks by flow arrows.

Times come from the scheduler records (wall clock at the end of each
schedule()); a step lasts until the next one starts. Traces without times
(normalized golden traces) get 1 ms per step.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_tour.trace.reader import Run

ENGINE_PID, REQUESTS_PID = 1, 2
RANK_PID = 100  # + TP rank
STEPS_TID = 1


def _step_times(run: Run) -> list[tuple[float, float]]:
    """(start µs, duration µs) per step, relative to the first step."""
    starts = []
    for s in run.steps:
        t = s.scheduler.time - s.scheduler.duration_s if s.scheduler and s.scheduler.time > 0 else None
        starts.append(t)
    if any(t is None for t in starts) or any(b <= a for a, b in zip(starts, starts[1:])):
        return [(i * 1000.0, 1000.0) for i in range(len(run.steps))]
    t0 = starts[0]
    us = [(t - t0) * 1e6 for t in starts]
    last = us[-1] - us[-2] if len(us) > 1 else 1000.0
    return [(u, (us[i + 1] if i + 1 < len(us) else u + last) - u) for i, u in enumerate(us)]


def _meta(pid: int, tid: int | None, kind: str, name: str) -> dict:
    ev = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    ev["tid"] = tid if tid is not None else 0
    return ev


def to_chrome_trace(run: Run) -> dict:
    events: list[dict] = [
        _meta(ENGINE_PID, None, "process_name", "engine"),
        _meta(ENGINE_PID, STEPS_TID, "thread_name", "steps"),
        _meta(REQUESTS_PID, None, "process_name", "requests"),
    ]
    ids = run.request_ids()
    tid = {rid: 10 + i for i, rid in enumerate(ids)}
    for rid in ids:
        events.append(_meta(REQUESTS_PID, tid[rid], "thread_name", f"request {rid}"))
    lives = _lifetimes(run)
    reasons = {o.req_id: o.finish_reason for o in run.outputs.requests} if run.outputs else {}
    ends: dict[int, list[str]] = {}
    for rid, (_, last) in lives.items():
        if rid in reasons:
            ends.setdefault(last, []).append(rid)
    for s, (ts, dur) in zip(run.steps, _step_times(run)):
        sch, kv = s.scheduler, s.kv
        args = {"step": s.index}
        if sch:
            args.update(tokens=sch.tokens_scheduled, budget=sch.token_budget, batch={r.req_id: r.num_scheduled_tokens for r in sch.scheduled})
        events.append({"ph": "X", "pid": ENGINE_PID, "tid": STEPS_TID, "name": f"step {s.index}", "ts": ts, "dur": dur, "args": args})
        if kv:
            events.append({"ph": "C", "pid": ENGINE_PID, "tid": 0, "name": "KV usage", "ts": ts, "args": {"usage": kv.usage, "free_blocks": kv.free_blocks}})
        if sch is None:
            continue
        events.append({"ph": "C", "pid": ENGINE_PID, "tid": 0, "name": "requests", "ts": ts, "args": {"running": sch.running_after, "waiting": sch.waiting_after}})
        scheduled = {r.req_id for r in sch.scheduled}
        for r in sch.scheduled:
            if r.kind == "resumed":
                name = f"resumed: recompute {r.num_scheduled_tokens}"
            elif r.is_prefill:
                end = r.num_computed_tokens + r.num_scheduled_tokens
                name = f"prefill {r.num_computed_tokens}-{end}"
            else:
                name = "decode"
            events.append({"ph": "X", "pid": REQUESTS_PID, "tid": tid.get(r.req_id, 9), "name": name, "ts": ts, "dur": dur,
                           "args": {"tokens": r.num_scheduled_tokens, "computed_before": r.num_computed_tokens, "kind": r.kind}})
        for rid in ends.get(s.index, []):
            events.append({"ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": tid.get(rid, 9), "name": "finished", "ts": ts + dur, "args": {"finish_reason": reasons.get(rid)}})
        for p in sch.preempted:
            events.append({"ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": tid.get(p.req_id, 9), "name": "preempted", "ts": ts, "args": {"reason": p.reason, "freed_blocks": p.freed_block_ids}})
        for v in s.spec_verify.requests if s.spec_verify else []:  # at the step's end: the target's pass decided them
            events.append({"ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": tid.get(v.req_id, 9), "ts": ts + dur,
                           "name": f"drafts {v.num_accepted}/{len(v.draft_token_ids)} accepted",
                           "args": {"drafts": v.draft_token_ids, "accepted": v.num_accepted, "tokens": v.sampled_token_ids,
                                    "rejected_slots": v.rejected_slots}})
        # Requests in the queue this step: arrived, not finished, not scheduled.
        waiting_ids = [rid for rid, (a, z) in lives.items() if a <= s.index <= z and rid not in scheduled]
        for rid in waiting_ids:
            events.append({"ph": "X", "pid": REQUESTS_PID, "tid": tid.get(rid, 9), "name": "waiting", "ts": ts, "dur": dur, "args": {}})
    events += _collective_events(run)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"run": run.path.name, "pin": run.meta.pin, "model": run.meta.model}}


def _collective_events(run: Run) -> list[dict]:
    """Per rank a track of the step's collectives; a flow arrow from rank 0's slice to each other rank's."""
    ranks = sorted({r for s in run.steps for r in s.collectives})
    events = []
    for r in ranks:
        events += [_meta(RANK_PID + r, None, "process_name", f"rank {r}"), _meta(RANK_PID + r, 1, "thread_name", "collectives")]
    flow = 0
    for s, (ts, dur) in zip(run.steps, _step_times(run)):
        present = [r for r in ranks if s.collectives.get(r)]  # a rank that never flushed a step is left out there
        if not present:
            continue
        n = max(len(s.collectives[r]) for r in present)
        for i, calls in enumerate(zip(*(s.collectives[r] for r in present))):
            start, width = ts + i * dur / n, dur / n
            flow += 1
            for r, c in zip(present, calls):
                events.append({"ph": "X", "pid": RANK_PID + r, "tid": 1, "name": f"{c.op} {c.layer}", "ts": start, "dur": width,
                               "args": {"step": s.index, "in": c.sha256_in[:12], "out": (c.sha256_out or "")[:12],
                                        "shape_in": c.shape_in, "shape_out": c.shape_out}})
                events.append({"ph": "s" if r == present[0] else "f", "bp": "e", "id": flow, "cat": "collective",
                               "name": c.op, "pid": RANK_PID + r, "tid": 1, "ts": start + width / 2})
    return events


def _lifetimes(run: Run) -> dict[str, tuple[int, int]]:
    """(arrival step, last scheduled step) per request that was ever scheduled."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in run.steps:
        if s.scheduler:
            for r in s.scheduler.scheduled:
                first.setdefault(r.req_id, s.index)
                last[r.req_id] = s.index
    arrival = {r.req_id: r.arrival_step + 1 for r in run.meta.requests}
    return {rid: (min(first[rid], arrival.get(rid, first[rid])), last[rid]) for rid in first}


def default_export_path(run_dir: Path) -> Path:
    """Beside the run — except golden traces, which are checked in and stay untouched."""
    from vllm_tour.paths import GOLDEN_DIR, RUNS_DIR

    if run_dir.resolve().parent == GOLDEN_DIR.resolve():
        RUNS_DIR.mkdir(parents=True, exist_ok=True)
        return RUNS_DIR / f"golden-{run_dir.name}.perfetto.json"
    return run_dir / "trace.perfetto.json"


def export(run: Run, out: Path) -> Path:
    data = to_chrome_trace(run)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(out)
    return out
