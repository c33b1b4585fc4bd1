"""Teaching re-implementations of vLLM internals, diffed against the pinned upstream.

Read in this order: request.py → block_pool.py → kv_cache_manager.py →
chunked_prefill.py (the scheduler) → paged_attn.py → qwen3.py → sampler.py →
engine.py. Nothing here imports vllm: `vllm-tour compare` supplies upstream.
"""
