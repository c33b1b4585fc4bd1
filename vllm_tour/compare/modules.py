"""The compare modules: which components each one runs in the reference engine, and what it is judged on.

This is the one place a module name is written. Standard library only: the GPU runner
(vllm_tour/gpu/runner.py) reads it on a machine without pydantic.

Every module is judged on tokens. `sections` are the per-step records compared besides
(scheduler decisions, KV state, runner inputs, attention metadata, MoE routing and expert
placement, speculative decoding's drafts and verifications), `captures` the tensors compared per layer (none: not judged on tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_tour.errors import TourError

# The reference engine's components (vllm_tour/compare/components.py has their interfaces).
REFERENCE = {
    "block_pool": "reimpl.block_pool:BlockPool",
    "kv_cache_manager": "reimpl.kv_cache_manager:KVCacheManager",
    "scheduler": "reimpl.chunked_prefill:Scheduler",
    "paged_attention": "reimpl.paged_attn:paged_attention",
}


@dataclass(frozen=True)
class CompareModule:
    name: str
    summary: str
    components: dict[str, str]  # component -> the reference object it runs ("module:name")
    sections: tuple[str, ...]  # per-step records judged: scheduler, kv, runner, attention
    # tensors judged, per layer: attn_out, kv_blocks, ...; "tp": every tensor a TP model records per rank (its
    # collectives and column outputs, and a MoE block's router logits and partial output)
    captures: tuple[str, ...] = ()
    triton: bool = False  # a Triton kernel: compiled on a GPU, the Triton interpreter without one
    needs_gpu: bool = False
    world_size: int = 1  # TP ranks: a module compares only scenarios run at this tensor_parallel_size
    # "module:function" building a model of world_size ranks (model_dir, world_size, dtype, attention); None: reimpl.qwen3
    model: str | None = None
    moe_only: bool = False  # judged on MoE models only (a dense scenario is skipped)
    # EP ranks its MoE block simulates: it also compares runs at tensor_parallel_size = this with
    # enable_expert_parallel (each rank's expert map and partial against upstream's own ranks)
    expert_parallel: int = 0
    # runs speculative decoding (a scenario with engine.extra.speculative_config needs such a module)
    speculative: bool = False


MODULES: dict[str, CompareModule] = {m.name: m for m in (
    CompareModule(
        "reimpl.paged_attn", "paged KV cache and attention: block pool, KV-cache manager, attention over block tables",
        components=dict(REFERENCE),
        sections=("scheduler", "kv", "runner", "attention"), captures=("attn_out", "kv_blocks")),
    CompareModule(
        "reimpl.chunked_prefill", "the scheduler: token budget, chunked prefill, preemption",
        components=dict(REFERENCE),
        sections=("scheduler", "kv", "runner")),
    CompareModule(
        "reimpl.triton_attn", "the mini engine with reimpl/triton_attn.py's Triton kernel as its attention",
        components={**REFERENCE, "paged_attention": "reimpl.triton_attn:engine_attention"},
        sections=("scheduler", "kv", "runner", "attention"), captures=("attn_out", "kv_blocks"), triton=True),
    CompareModule(
        "reimpl.tp", "tensor parallelism at TP=2 (ranks simulated in one process): weight shards, every all-reduce, "
        "the logits gather",
        components=dict(REFERENCE),
        sections=("scheduler", "kv", "runner"), captures=("tp",), world_size=2, model="reimpl.tp:simulated"),
    CompareModule(
        "reimpl.tp_moe", "Qwen3-MoE at TP=2 without expert parallelism (ranks simulated in one process): every "
        "expert's w13/w2 sharded by TP, the router replicated, each rank's MoE partial all-reduced; the rest as reimpl.tp",
        components=dict(REFERENCE),
        sections=("scheduler", "kv", "runner", "moe"), captures=("tp",), world_size=2, model="reimpl.tp_moe:simulated",
        moe_only=True),
    CompareModule(
        "reimpl.ep", "expert parallelism: the Qwen3-MoE block's routing, and its experts placed on 2 simulated "
        "ranks, run locally and all-reduced (reimpl/ep.py); against upstream at TP=1 or at EP=2",
        components={**REFERENCE, "moe": "reimpl.ep:expert_parallel_moe"},
        sections=("scheduler", "kv", "runner", "moe"), captures=("router_logits", "moe_out", "moe_partial"),
        moe_only=True, expert_parallel=2),
    CompareModule(
        "reimpl.spec_decode", "speculative decoding: ngram drafts proposed after each step, verified greedily in the "
        "next, rejected drafts rolled back (reimpl/spec_decode.py)",
        components={**REFERENCE, "scheduler": "reimpl.spec_decode:SpecDecodeScheduler"},
        sections=("scheduler", "kv", "runner", "spec_decode"), speculative=True),
)}

# What upstream is asked to capture: every module's tensors, so that one upstream run serves them all.
CAPTURES = tuple(dict.fromkeys(c for m in MODULES.values() for c in m.captures))


def get_module(name: str) -> CompareModule:
    if name not in MODULES:
        raise TourError(f"unknown module {name!r} (known: {', '.join(MODULES)})")
    return MODULES[name]
