"""Token rules: exact (fp32) and vLLM's top-k rule (bf16).

Pure Python, no torch: the GPU runner (vllm_tour/gpu/runner.py) imports these on a
machine without pydantic. In bf16 two correct implementations may pick different
greedy tokens where the top logits are within rounding of each other, so vLLM's
own tests (tests/models/utils.py `check_logprobs_close`) accept a difference
where each side's token is among the other side's top-k logprobs, and stop
comparing there (the two sides then continue from different contexts).
"""

from __future__ import annotations


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logprobs_close(up_tokens: list[int], re_tokens: list[int], up_top: list[list[int]], re_top: list[list[int]]) -> dict:
    """vLLM's `check_logprobs_close` rule for one request.

    Where the greedy tokens first differ, each side's token must be among the
    other side's top-k (k = 5 here) at that position; the comparison stops
    there (after one divergence the two continue from different contexts).
    """
    pos = first_difference(up_tokens, re_tokens)
    if pos is None:
        return {"ok": True, "identical": True, "first_diff": None}
    if pos >= min(len(up_tokens), len(re_tokens)):
        return {"ok": False, "identical": False, "first_diff": pos, "why": f"lengths {len(up_tokens)} vs {len(re_tokens)}"}
    u, r = up_tokens[pos], re_tokens[pos]
    u_in_re = pos < len(re_top) and u in re_top[pos]
    r_in_up = pos < len(up_top) and r in up_top[pos]
    return {"ok": bool(u_in_re and r_in_up), "identical": False, "first_diff": pos, "upstream": u, "reimpl": r,
            "upstream_in_reimpl_top": bool(u_in_re), "reimpl_in_upstream_top": bool(r_in_up),
            "upstream_top": up_top[pos] if pos < len(up_top) else None,
            "reimpl_top": re_top[pos] if pos < len(re_top) else None}
