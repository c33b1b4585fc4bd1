"""Trace concepts: what a learner sees in a trace, and where to read the code behind it.

Notes tag themselves with these ids; the site's index lists, per concept, the
trace field that shows it and the notes on the code that does it. Other tools
(`show`, `export`) can link to `concept_href(id)` inside a built site.
"""

from __future__ import annotations

# id -> (trace field that shows it, title en, title zh)
CONCEPTS: dict[str, tuple[str, str, str]] = {
    "admission": ("scheduler.scheduled[kind=new|resumed]", "Request admission (waiting → running)", "请求准入（waiting → running）"),
    "chunked-prefill": ("scheduler.scheduled[is_prefill, partial]", "Chunked prefill", "分块预填充（chunked prefill）"),
    "preemption": ("scheduler.preempted", "Preemption and recompute", "抢占与重算"),
    "prefix-hit": ("kv.prefix_hits", "Prefix-cache hit", "前缀缓存命中"),
    "eviction": ("kv.evicted", "Cached-block eviction", "缓存块驱逐"),
    "block-table": ("kv.block_tables / attention.block_table", "Block table", "块表（block table）"),
    "slot-mapping": ("runner.slot_mapping", "Slot mapping", "槽位映射（slot mapping）"),
    "sampling": ("runner.sampled_token_ids", "Sampling", "采样"),
    "tp-fanout": ("proc.rank", "Tensor-parallel worker fan-out", "张量并行的 worker 扇出"),
    "tp-collective": ("collective[rank]", "Tensor-parallel sharding and all-reduce", "张量并行的分片与 all-reduce"),
    "moe-routing": ("moe.topk_ids / moe.tokens_per_expert", "MoE routing (top-k experts per token)", "MoE 路由（每个 token 的 top-k 专家）"),
    "abort": ("abort", "Abort (a client gone, a stop string)", "中止（客户端离开、stop 字符串）"),
    "expert-parallel": ("moe.expert_map / moe.local_tokens_per_expert", "Expert parallelism (experts placed on ranks)", "专家并行（专家分布到各 rank）"),
    "spec-decode": ("spec_verify.requests / spec_proposal.proposed", "Speculative decoding (drafts proposed, verified, rolled back)",
                    "投机解码（草稿的提出、验证与回滚）"),
}


def concept_href(concept: str) -> str:
    """Where a concept lives in a site built by `vllm-tour site` (relative to its root)."""
    return f"index.html#concept-{concept}"
