"""What an engine is asked to run: one config and one request type for both mini engines.

Upstream counterparts (v0.32.0):
- `vllm.config.SchedulerConfig` (max_num_batched_tokens, max_num_seqs,
  enable_chunked_prefill, scheduler_reserve_full_isl, async_scheduling),
  `vllm.config.CacheConfig` (block_size, num_gpu_blocks, enable_prefix_caching),
  `vllm.config.ModelConfig` (max_model_len, dtype) and
  `vllm.config.CompilationConfig` (cudagraph_capture_sizes),
  `vllm.config.SpeculativeConfig` (method ngram: num_speculative_tokens, prompt_lookup_min/max)
- `vllm.v1.engine.EngineCoreRequest` (what the front end hands the engine core)

The teaching engine (engine.py) and the fast engine (fast_engine.py) build
the same KVCacheManager and Scheduler from an EngineConfig, so a per-pin
policy (compare's PIN_POLICIES, e.g. free_policy) set here reaches both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import Request


@dataclass
class EngineConfig:
    # The checkpoint the teaching engine loads when it is not handed a model
    # (the fast engine is always handed its FastQwen3).
    model_dir: str = ""
    block_size: int = 32
    num_blocks: int = 64  # including the null block 0, as upstream counts num_gpu_blocks
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    reserve_full_sequence: bool = True  # upstream scheduler_reserve_full_isl
    # Cap on the tokens one long prefill takes in a step when others are waiting or running (0: no cap);
    # adaptive: never below a fair share of the budget (chunked_prefill.Scheduler.long_prefill_cap)
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    # Free-queue order of freed blocks (block_pool.FREE_POLICIES): "uncached_to_front"
    # mirrors v0.32.0, "append_all" mirrors v0.21.0. Chosen per pin by the harness.
    free_policy: str = "uncached_to_front"
    # Upstream's SpeculativeConfig as given, e.g. {"method": "ngram", "num_speculative_tokens": 3,
    # "prompt_lookup_min": 1, "prompt_lookup_max": 3}; the teaching engine runs ngram (spec_decode.py). None: off
    speculative_config: dict | None = None
    dtype: str = "float32"  # or "bfloat16": of the model the teaching engine loads (see qwen3_numerics.py)
    # Round the softmax weights to bf16 before P·V, as upstream's AMX CPU kernel does
    # (paged_attn.paged_attention). Chosen by the harness from the ISA upstream recorded.
    bf16_attention_weights: bool = False
    # The fast engine's loop and model runner only:
    # schedule step t+1 before step t's tokens are back (async_scheduler.py; upstream's default at v0.21.0)
    async_scheduling: bool = False
    cuda_graphs: bool = True  # capture pure-decode steps for these padded batch sizes (on a GPU)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, *range(16, 257, 16))
    seed: int = 0  # its one sampling generator (the teaching engine seeds per request: RequestIn.seed)


@dataclass
class RequestIn:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    arrival_step: int = 0  # added before schedule() call number arrival_step + 1
    eos_token_id: int | None = None  # None: never stop on EOS (ignore_eos)


def admit_arrivals(pending: list[RequestIn], scheduler, step: int) -> None:
    """Hand the scheduler the requests that have arrived by engine step `step` (`pending` sorted by
    arrival_step; admitted ones are removed). Both engines' loops call this, so arrivals are one rule.
    A request arrives before engine step number arrival_step; an idle engine would not step at all,
    so then the next request arrives now."""
    while pending and (pending[0].arrival_step <= step or not scheduler.has_unfinished()):
        r = pending.pop(0)
        scheduler.add_request(Request(r.req_id, list(r.prompt_token_ids), r.max_tokens, r.temperature, r.seed,
                                      r.eos_token_id, r.arrival_step))
