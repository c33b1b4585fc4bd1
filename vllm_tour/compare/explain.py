"""--explain: both sides' scheduler queues, budget and block tables at the first divergent step,
and where a bf16 run's tokens stopped being compared."""

from __future__ import annotations

from vllm_tour.compare.result import CompareResult
from vllm_tour.trace.logprobs import TOP_K


def explain(result: CompareResult, up_steps, re_steps, re_state) -> dict | None:
    first = result.first
    if first is None:
        return None
    step = first.step
    if step is None:
        return {"step": None, "divergence": first.to_json()}

    def side(steps, s):
        st = steps.get(s) or {}
        sched, kv = st.get("scheduler") or {}, st.get("kv") or {}
        return {
            "queues": {k: sched.get(k) for k in ("waiting_before", "running_before", "waiting_after", "running_after")},
            "token_budget": sched.get("token_budget"),
            "tokens_scheduled": sched.get("tokens_scheduled"),
            "scheduled": {r["req_id"]: r["num_scheduled_tokens"] for r in sched.get("scheduled", [])},
            "preempted": [p["req_id"] for p in sched.get("preempted", [])],
            "finished": sched.get("finished"),
            "free_blocks": kv.get("free_blocks"),
            "block_tables": kv.get("block_tables"),
            "prefix_hits": kv.get("prefix_hits"),
            "freed": kv.get("freed"),
            "evicted": kv.get("evicted"),
        }

    return {
        "step": step,
        "divergence": first.to_json(),
        "previous_step": {"upstream": side(up_steps, step - 1), "reimpl": side(re_steps, step - 1)} if step > 1 else None,
        "upstream": side(up_steps, step),
        "reimpl": side(re_steps, step),
        "reimpl_internal_state": re_state.get(step),
    }


def topk_notes(verdicts: dict[str, dict], up_steps: dict[int, dict], dtype: str) -> list[str]:
    """Say where each request's tokens stopped being compared, and that the reimpl ran on upstream's tokens."""
    notes = [f"{dtype}: the reimpl runs every request on upstream's tokens (teacher forcing) and records its own "
             f"greedy token and top-{TOP_K} at each position; tokens follow vLLM's check_logprobs_close rule"]
    for rid, v in sorted(verdicts.items()):
        pos = v["first_diff"]
        if v["ok"] and not v["identical"]:
            notes.append(f"{rid}: greedy tokens first differ at output position {pos} (sampled at step "
                         f"{_sampling_step(up_steps, rid, pos)}): upstream {v['upstream']}, reimpl {v['reimpl']}, each in "
                         f"the other's top-{TOP_K}; tokens not compared after it, the reimpl continued with upstream's "
                         "tokens, so later decisions and tensors are compared on the same context")
    return notes


def _sampling_step(up_steps: dict[int, dict], rid: str, pos: int) -> int | None:
    """The upstream step whose runner sampled output position `pos` of request `rid`."""
    n = 0
    for step, s in sorted(up_steps.items()):
        n += len(((s.get("runner") or {}).get("sampled_token_ids") or {}).get(rid) or [])
        if n > pos:
            return step
    return None
