"""Diffs between an upstream run and a reimpl run: tokens and per-step decisions (tensors: tolerance.py).

Everything here works on plain dicts shaped like the trace schema
(`vllm_tour.trace.schema`), so it does not care who produced them. Each
difference is a `Divergence` naming the step and the field; the *first*
divergence is the earliest step, and within a step the scheduler's decision
comes before the KV state, which comes before the model runner's inputs.
"""

from __future__ import annotations

from typing import Any

from vllm_tour.compare.divergence import Divergence
from vllm_tour.compare.tokens import logprobs_close
from vllm_tour.trace.logprobs import TOP_K


def diff_tokens(upstream: dict[str, list[int]], reimpl: dict[str, list[int]], context: int = 4) -> list[Divergence]:
    out: list[Divergence] = []
    for rid in sorted(set(upstream) | set(reimpl)):
        up, re_ = upstream.get(rid), reimpl.get(rid)
        if up is None or re_ is None:
            out.append(Divergence("tokens", None, f"outputs[{rid}]", up, re_, rid, "request missing on one side"))
            continue
        if up == re_:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(up, re_)) if a != b), min(len(up), len(re_)))
        lo = max(0, pos - context)
        out.append(Divergence(
            "tokens", None, f"outputs[{rid}].token_ids[{pos}]",
            up[lo : pos + context + 1], re_[lo : pos + context + 1], rid,
            f"first differing output position {pos} (showing positions {lo}..{pos + context}); "
            f"lengths {len(up)} vs {len(re_)}",
        ))
    return out


def diff_tokens_topk(upstream: dict[str, list[int]], up_top: dict[str, list[list[int]]], reimpl: dict[str, list[int]],
                     re_top: dict[str, list[list[int]]], context: int = 4) -> tuple[list[Divergence], dict[str, dict]]:
    """bf16 tokens by vLLM's rule (tokens.logprobs_close): at the first differing greedy token each side's
    token must be in the other's top-k; nothing after it is compared. Returns (divergences, verdict per request)."""
    out: list[Divergence] = []
    verdicts: dict[str, dict] = {}
    for rid in sorted(set(upstream) | set(reimpl)):
        up, re_ = upstream.get(rid), reimpl.get(rid)
        if up is None or re_ is None:
            out.append(Divergence("tokens", None, f"outputs[{rid}]", up, re_, rid, "request missing on one side"))
            continue
        v = verdicts[rid] = logprobs_close(up, re_, up_top.get(rid, []), re_top.get(rid, []))
        if v["ok"]:
            continue
        pos = v["first_diff"]
        reasons = [v["why"]] if "why" in v else []  # lengths differ
        if "why" not in v and not v["reimpl_in_upstream_top"]:
            reasons.append(f"reimpl's {v['reimpl']} is not in upstream's top-{TOP_K} {v['upstream_top']}")
        if "why" not in v and not v["upstream_in_reimpl_top"]:
            reasons.append(f"upstream's {v['upstream']} is not in the reimpl's top-{TOP_K} {v['reimpl_top']}")
        lo = max(0, pos - context)
        out.append(Divergence(
            "tokens", None, f"outputs[{rid}].token_ids[{pos}]", up[lo : pos + context + 1], re_[lo : pos + context + 1], rid,
            f"bf16 top-{TOP_K} rule broken at output position {pos} (showing positions {lo}..{pos + context}): "
            + "; ".join(reasons),
        ))
    return out, verdicts


# --- decisions ---------------------------------------------------------------------------


def _int_list(v) -> list[int] | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("full")
    return list(v)


def scheduler_view(rec: dict | None) -> dict:
    if rec is None:
        return {}
    return {
        "scheduled": {s["req_id"]: {k: s[k] for k in ("kind", "num_scheduled_tokens", "num_computed_tokens",
                                                      "num_prompt_tokens", "num_output_tokens", "is_prefill")}
                      for s in rec["scheduled"]},
        "preempted": [{k: p.get(k) for k in ("req_id", "while_allocating_for", "num_tokens_requested",
                                             "free_blocks_at_failure", "freed_block_ids", "num_computed_tokens_lost")}
                      for p in rec["preempted"]],
        "finished": sorted(rec["finished"]),
        "tokens_scheduled": rec["tokens_scheduled"],
        "token_budget": rec["token_budget"],
        "waiting_before": rec["waiting_before"],
        "running_before": rec["running_before"],
        "waiting_after": rec["waiting_after"],
        "running_after": rec["running_after"],
    }


def kv_view(rec: dict | None) -> dict:
    if rec is None:
        return {}
    return {
        "block_tables": dict(sorted(rec["block_tables"].items())),
        "allocated": dict(sorted((k, v) for k, v in rec["allocated"].items() if v)),
        "prefix_hits": {h["req_id"]: {"num_hit_tokens": h["num_hit_tokens"], "block_ids": h["block_ids"]}
                        for h in rec["prefix_hits"]},
        "freed": list(rec["freed"]),
        "evicted": list(rec["evicted"]),
        "free_blocks": rec["free_blocks"],
        "num_blocks": rec["num_blocks"],
        "usage": round(rec["usage"], 6),
    }


def spec_view(verify: dict | None, proposal: dict | None) -> dict:
    """Speculative decoding in one step: per request the drafts verified and what the target kept, then the
    drafts proposed for the next step and which the scheduler dropped."""
    return {
        "verified": {v["req_id"]: {k: v[k] for k in ("num_computed_tokens", "draft_token_ids", "num_accepted",
                                                     "sampled_token_ids", "rejected_slots", "rejected_only_blocks")}
                     for v in (verify or {}).get("requests", [])},
        "num_lookahead_tokens": (verify or {}).get("num_lookahead_tokens"),
        "proposed": dict(sorted((proposal or {}).get("proposed", {}).items())),
        "ignored": sorted((proposal or {}).get("ignored", [])),
    }


def runner_view(rec: dict | None) -> dict:
    """Per request, then the batch as a whole: its row order (req_ids) and which rows give logits
    (logits_indices), compared as lists; None where the run did not record them (logits_not_recorded)."""
    if rec is None:
        return {}
    ids = rec["req_ids"]
    qsl = rec["query_start_loc"]
    lists = {k: _int_list(rec[k]) for k in ("input_ids", "positions", "slot_mapping")}
    per_req: dict[str, dict] = {}
    for i, rid in enumerate(ids):
        row: dict[str, Any] = {"num_scheduled_tokens": rec["num_scheduled_tokens"][i]}
        if i + 1 < len(qsl):
            a, b = qsl[i], qsl[i + 1]
            for k, v in lists.items():
                row[k] = v[a:b] if v is not None else None
        if i < len(rec["seq_lens"]):
            row["seq_len"] = rec["seq_lens"][i]
        per_req[rid] = row
    summarized = {k: {kk: rec[k].get(kk) for kk in ("length", "sha256")}
                  for k in ("input_ids", "positions", "slot_mapping")
                  if isinstance(rec[k], dict) and rec[k].get("full") is None}
    return {
        "num_tokens": rec["num_tokens"],
        "requests": per_req,
        # the rows' order: everything the runner lays out per row (input ids, positions, slot mapping,
        # logits, attention outputs) follows it; compared after the requests, so a missing request is named first
        "req_ids": list(ids),
        "logits_indices": None if logits_not_recorded(rec) else list(rec["logits_indices"]),
        "sampled_token_ids": {k: v for k, v in sorted(rec["sampled_token_ids"].items()) if v},
        "_summarized": summarized,
    }


def logits_not_recorded(rec: dict) -> bool:
    """The runner ran a batch but recorded no logits indices (the probe on _prepare_inputs did not fire)."""
    return bool(rec.get("req_ids")) and not rec.get("logits_indices")


def _diff_value(prefix: str, up: Any, re_: Any, step: int, out: list[Divergence], req_id: str | None = None) -> None:
    """Recursive diff; dict keys become path parts, lists compare whole (first differing index named)."""
    if isinstance(up, dict) and isinstance(re_, dict):
        for k in list(up) + [k for k in re_ if k not in up]:
            if k.startswith("_"):
                continue
            sub_req = req_id
            if prefix.endswith(("scheduled", "requests", "block_tables", "allocated", "prefix_hits", "sampled_token_ids",
                                "verified", "proposed")):
                sub_req = k
                path = f"{prefix}[{k}]"
            else:
                path = f"{prefix}.{k}"
            if k not in up or k not in re_:
                out.append(Divergence("decision", step, path, up.get(k), re_.get(k), sub_req,
                                      "only in reimpl" if k not in up else "only in upstream"))
                continue
            _diff_value(path, up[k], re_[k], step, out, sub_req)
        return
    if up != re_:
        msg = ""
        if isinstance(up, list) and isinstance(re_, list):
            i = next((i for i, (a, b) in enumerate(zip(up, re_)) if a != b), min(len(up), len(re_)))
            msg = f"first difference at index {i}" + (f" (lengths {len(up)} vs {len(re_)})" if len(up) != len(re_) else "")
        out.append(Divergence("decision", step, prefix, up, re_, req_id, msg))


def attention_view(rec: dict | None, runner: dict | None) -> dict:
    if rec is None or runner is None:
        return {}
    ids = runner["req_ids"]
    return {"requests": {rid: {"block_table": rec["block_table"][i], "seq_len": rec["seq_lens"][i],
                               "query_len": rec["query_lens"][i]}
                         for i, rid in enumerate(ids) if i < rec["num_reqs"]}}


def reimpl_attention(runner: dict | None, kv: dict | None) -> dict | None:
    """The reimpl has no separate attention metadata: derive it from runner + block tables."""
    if runner is None or kv is None:
        return None
    qsl = runner["query_start_loc"]
    return {"num_reqs": len(runner["req_ids"]),
            "seq_lens": runner["seq_lens"],
            "query_lens": [b - a for a, b in zip(qsl, qsl[1:])],
            "block_table": [kv["block_tables"].get(r, []) for r in runner["req_ids"]]}


def diff_step(step: int, up: dict[str, dict | None], re_: dict[str, dict | None], sections: tuple[str, ...]) -> list[Divergence]:
    """up/re_: {"scheduler": rec, "kv": rec, "runner": rec, "attention": rec, "moe": [recs]} for one step."""
    out: list[Divergence] = []
    if "scheduler" in sections:
        _diff_value("scheduler", scheduler_view(up.get("scheduler")), scheduler_view(re_.get("scheduler")), step, out)
    if "kv" in sections:
        _diff_value("kv", kv_view(up.get("kv")), kv_view(re_.get("kv")), step, out)
    if "runner" in sections:
        uv, rv = runner_view(up.get("runner")), runner_view(re_.get("runner"))
        summarized = uv.get("_summarized") or {}
        if summarized and rv:
            # upstream summarized long lists: compare length + digest in upstream's batch order
            from vllm_tour.trace.schema import int_digest
            order = up["runner"]["req_ids"]
            for k, s in summarized.items():
                vals = [v for rid in order for v in (rv["requests"].get(rid, {}).get(k) or [])]
                digest = int_digest(vals)
                if (len(vals), digest) != (s["length"], s["sha256"]):
                    out.append(Divergence("decision", step, f"runner.{k}", s, {"length": len(vals), "sha256": digest},
                                          None, "summarized list differs (length/sha256)"))
            for row in list(uv["requests"].values()) + list(rv["requests"].values()):
                for k in summarized:
                    row.pop(k, None)
        if uv and uv["logits_indices"] is None:  # not recorded upstream: not compared (the harness says so)
            rv.pop("logits_indices", None)
            uv.pop("logits_indices")
        before = len(out)
        _diff_value("runner", uv, rv, step, out)
        for d in out[before:]:
            if d.field == "runner.req_ids" and sorted(d.upstream or []) == sorted(d.reimpl or []):
                d.message = (f"batch row order differs, same requests ({d.message}): the runner's rows (input ids, "
                             "positions, slot mapping, logits indices, attention outputs) follow this order")
    if "attention" in sections and up.get("attention") is not None:
        _diff_value("attention", attention_view(up.get("attention"), up.get("runner")),
                    attention_view(re_.get("attention"), re_.get("runner")), step, out)
    if "spec_decode" in sections:
        _diff_value("spec_decode", spec_view(up.get("spec_verify"), up.get("spec_proposal")),
                    spec_view(re_.get("spec_verify"), re_.get("spec_proposal")), step, out)
    if "moe" in sections:
        from vllm_tour.compare.moe_diff import diff_moe

        out += diff_moe(step, up.get("moe") or [], re_.get("moe") or [], up.get("runner"), re_.get("runner"))
    return out


def diff_steps(up_steps: dict[int, dict], re_steps: dict[int, dict], sections: tuple[str, ...]) -> list[Divergence]:
    out: list[Divergence] = []
    for step in sorted(set(up_steps) | set(re_steps)):
        u, r = up_steps.get(step), re_steps.get(step)
        if u is None or r is None or (u.get("scheduler") is None) != (r.get("scheduler") is None):
            out.append(Divergence("missing", step, "step", u is not None, r is not None, None,
                                  "step present only in " + ("reimpl" if u is None else "upstream")))
            continue
        out.extend(diff_step(step, u, r, sections))
    return out
