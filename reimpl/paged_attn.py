"""Paged attention: a KV cache cut into fixed-size blocks, read through per-request block tables.

Upstream counterparts (v0.32.0):
- slot mapping: `vllm.v1.worker.block_table.BlockTable.compute_slot_mapping`
  (slot = block_table[pos // block_size] * block_size + pos % block_size)
- cache write: `vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update`
- attention over the cache: `vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`
  (a C++ kernel upstream, one per ISA that `cpu_attn._get_attn_isa` picks; plain torch here)
- the block bookkeeping behind the tables: see block_pool.py and kv_cache_manager.py
  (`vllm.v1.core.block_pool.BlockPool`, `vllm.v1.core.kv_cache_manager.KVCacheManager`)

`vllm-tour compare reimpl.paged_attn` diffs this module's outputs (slot
mappings, block tables, cache hits, per-layer attention outputs, KV blocks)
against upstream. Its allocation policy lives in block_pool.py /
kv_cache_manager.py, which this module re-exports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .block_pool import BlockPool  # noqa: F401  (re-exported: part of "paged attention")
from .kv_cache_manager import KVCacheManager, hash_block_tokens  # noqa: F401


def _gather_slots(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    # the same formula, used for reads (kept separate so a broken write path shows up as a diff)
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Where each token's K/V goes: a flat index into the cache viewed as [num_blocks * block_size].

    Position p lives in logical block p // block_size, which the table maps to
    a physical block; within it at offset p % block_size.
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


@dataclass
class BatchMeta:
    """What the attention needs to know about one step's flattened batch."""

    query_start_loc: list[int]  # request i's tokens are [qsl[i], qsl[i+1]) of the batch
    seq_lens: list[int]  # tokens in the cache for request i after this step (context + new)
    block_tables: list[list[int]]
    slot_mapping: list[int]  # one slot per batch token


class PagedKVCache:
    """One layer's cache: K and V, each [num_blocks, block_size, num_kv_heads, head_dim].

    (Upstream's CPU backend allocates [num_blocks, num_kv_heads, block_size,
    2 * head_size], and inside each (block, head) stores K then V in the order
    its C++ kernel reads fastest: K transposed for the "vec" kernel, K and V cut
    into 16-row AMX tiles for the "amx" one. The tracer decodes that into this
    module's shape when it captures the blocks.)
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=torch.float32):
        self.block_size = block_size
        self.k = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> None:
        """Scatter this step's new K/V ([num_tokens, kv_heads, head_dim]) into their slots."""
        idx = torch.tensor(slots, dtype=torch.long)
        self.k.view(-1, *self.k.shape[2:])[idx] = k
        self.v.view(-1, *self.v.shape[2:])[idx] = v

    def gather(self, block_table: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions 0..seq_len-1 of one request, read through its block table."""
        slots = torch.tensor(_gather_slots(block_table, list(range(seq_len)), self.block_size), dtype=torch.long)
        return self.k.view(-1, *self.k.shape[2:])[slots], self.v.view(-1, *self.v.shape[2:])[slots]

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The given blocks as [block, K|V, kv_head, slot, head_dim] (the layout `compare` diffs in)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        return torch.stack([self.k[idx], self.v[idx]], dim=1).permute(0, 1, 3, 2, 4).contiguous()


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: PagedKVCache, meta: BatchMeta,
                    bf16_weights: bool = False) -> torch.Tensor:
    """Causal attention for a flattened batch of requests, each at its own position.

    q: [num_tokens, num_heads, head_dim]; k_new/v_new: [num_tokens, kv_heads, head_dim].
    Returns [num_tokens, num_heads * head_dim].

    1. write the new tokens' K/V into the cache (through slot_mapping);
    2. for each request, read *all* its K/V back through its block table --
       earlier steps' tokens and this step's alike -- and attend causally.
    A request's query tokens are the last `query_len` positions of its sequence.
    Scores, softmax and the weighted sum run in fp32 whatever the cache dtype
    (as upstream's kernels accumulate); the output is rounded to q's dtype.

    bf16_weights mirrors upstream's AMX kernel (bf16 on CPUs with AMX tiles): its
    P·V product is a bf16 tile gemm, so the unnormalised weights exp(s - max) enter
    it rounded to bf16, and the fp32 sum of the unrounded weights divides after.
    Against that kernel, rounding here brings the layer-0 attention difference from
    7.8e-3 to 9.8e-4 (cmp_single_bf16, tiny-qwen3); against the "vec" kernel, which
    keeps the weights in fp32, it would add error instead.
    """
    cache.write(k_new, v_new, meta.slot_mapping)
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    scale = 1.0 / math.sqrt(head_dim)
    for i, (table, seq_len) in enumerate(zip(meta.block_tables, meta.seq_lens)):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        query_len = end - start
        k, v = (t.float() for t in cache.gather(table, seq_len))  # [seq_len, kv_heads, d]
        group = num_heads // k.shape[1]  # GQA: each KV head serves `group` query heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].float().transpose(0, 1)  # [heads, query_len, d]
        scores = torch.matmul(qi, k.permute(1, 2, 0)) * scale  # [heads, query_len, seq_len]
        # query j sits at position seq_len - query_len + j and sees keys 0..that position
        q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        if bf16_weights:
            weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            mixed = torch.matmul(weights.bfloat16().float(), v.transpose(0, 1)) / weights.sum(dim=-1, keepdim=True)
        else:
            mixed = torch.matmul(torch.softmax(scores, dim=-1), v.transpose(0, 1))
        out[start:end] = mixed.transpose(0, 1).reshape(query_len, -1)
    return out
