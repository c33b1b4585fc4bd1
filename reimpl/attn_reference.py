"""Plain-torch paged attention: the slow, obviously-correct reference.

This is what `reimpl/triton_attn.py` (and upstream's
`vllm.v1.attention.ops.triton_unified_attention.unified_attention`, vLLM v0.32.0)
must compute. No tiling, no online softmax: for each sequence we gather its
keys/values out of the paged cache through the block table, build the full
score matrix in fp32, mask it, softmax it, and multiply by V.

Conventions (the same ones upstream uses):

- ``q``: ``[num_tokens, num_q_heads, head_size]`` — the query tokens of every
  sequence in the batch, packed back to back (a "varlen" batch).
- ``cu_seqlens_q``: ``[num_seqs + 1]`` int32 — sequence ``i`` owns query rows
  ``cu_seqlens_q[i] : cu_seqlens_q[i+1]``. A decode has 1 row, a prefill chunk
  many.
- ``seq_lens``: ``[num_seqs]`` int32 — total tokens of sequence ``i`` in the KV
  cache *including* this step's queries. ``seq_lens[i] - query_len[i]`` is the
  cached prefix (context) the queries attend to in full.
- ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]``.
- ``block_table``: ``[num_seqs, max_blocks_per_seq]`` int32 — logical block
  ``j`` of sequence ``i`` lives in physical block ``block_table[i, j]``.
- Causal mask with a cached prefix: query ``t`` (0-based within its sequence)
  sits at absolute position ``context_len + t`` and sees keys ``0 ..
  context_len + t``.
- GQA: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import math

import torch


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, un-paged:
    ``[seq_len, num_kv_heads, head_size]``."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    pages = cache[block_table_row[:num_blocks].long()]  # [nb, block_size, H_kv, D]
    return pages.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal paged attention in fp32; returns ``q``'s shape and dtype."""
    num_q_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(q)
    for i, seq_len in enumerate(lens):
        qs = q[cu[i] : cu[i + 1]].float()  # [q_len, Hq, D]
        q_len = qs.shape[0]
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        k = gather_kv(k_cache, block_table[i], seq_len).float()
        v = gather_kv(v_cache, block_table[i], seq_len).float()
        # GQA: give every query head its own copy of the KV head it shares.
        k = k.repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = context_len + torch.arange(q_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def make_paged_inputs(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    extra_blocks: int = 3,
) -> dict:
    """Random inputs for a varlen paged-attention call.

    Physical blocks are handed out in a random order (``randperm``), so a
    kernel that ignored the block table and read the cache linearly would
    fail. Unused cache slots are filled with NaN: a kernel that reads past a
    sequence's end and does not mask it will poison its output.
    """
    assert len(query_lens) == len(seq_lens)
    assert all(0 < ql <= sl for ql, sl in zip(query_lens, seq_lens))
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, (nb, sl) in enumerate(zip(blocks_per_seq, seq_lens)):
        phys = perm[used : used + nb]
        used += nb
        block_table[i, :nb] = phys.to(torch.int32)
        # Fill exactly the seq_len written slots of this sequence's blocks.
        for j, b in enumerate(phys.tolist()):
            n = min(block_size, sl - j * block_size)
            k_cache[b, :n] = torch.randn(n, num_kv_heads, head_size, generator=g)
            v_cache[b, :n] = torch.randn(n, num_kv_heads, head_size, generator=g)
    q = torch.randn(sum(query_lens), num_q_heads, head_size, generator=g)
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    return dict(
        q=q.to(dtype=dtype, device=device),
        k_cache=k_cache.to(dtype=dtype, device=device),
        v_cache=v_cache.to(dtype=dtype, device=device),
        block_table=block_table.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
