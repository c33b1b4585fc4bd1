"""A teaching Triton kernel for paged attention over a block table.

Upstream counterpart (vLLM v0.32.0):
    ``vllm.v1.attention.ops.triton_unified_attention.unified_attention``
    (launcher) and ``kernel_unified_attention`` (the ``@triton.jit`` kernel),
    with helpers in ``vllm.v1.attention.ops.triton_attention_helpers``
    (``find_seq_idx``, ``compute_tile_loop_bounds``, ``softmax_step``).

What it computes (see ``reimpl/attn_reference.py`` for the plain-torch
version and the exact tensor conventions):

- a *varlen* batch: prefill chunks (many query tokens) and decodes (one query
  token) packed back to back in ``q``, delimited by ``cu_seqlens_q``;
- keys/values live in a *paged* cache ``[num_blocks, block_size, num_kv_heads,
  head_size]``; a sequence's logical block ``j`` is physical block
  ``block_table[seq, j]``;
- causal mask *with a cached prefix*: the ``seq_len - query_len`` tokens already
  in the cache are visible to every query of the sequence; among the new
  tokens, query ``t`` sees new tokens ``0..t``;
- GQA: ``num_q_heads / num_kv_heads`` query heads share one KV head;
- fp32 / bf16 / fp16 inputs, fp32 accumulation, output in the input dtype;
- the softmax is computed *online* (FlashAttention style), one KV tile at a
  time, so the full score matrix never exists;
- small decode batches split each sequence's keys into segments merged by a
  second kernel (flash-decoding; upstream's "3D" path and ``reduce_segments``).

What upstream has and this file leaves out, on purpose: sliding windows,
ALiBi, softcap, attention sinks, FP8/INT8 KV quantization, multimodal
prefix ranges and Intel tensor descriptors. Each is a mask or a scale
bolted onto the same loop you see here.

Run it on a CPU with ``TRITON_INTERPRET=1`` (slow, numpy underneath, but
exact enough to test); on a GPU it compiles as usual. ``engine_attention`` at
the bottom plugs it into the mini engine in place of ``reimpl/paged_attn.py``'s
torch loop.

Nothing here is cleverer than upstream's kernel: its speed on an H200 (the
README's benchmark table; ``python -m vllm_tour.bench.triton_attn_gpu``)
comes from choosing the tiling per batch shape (``choose_config``) where
upstream uses one 16-row tiling for everything, and from a decode path
without the q-block search.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_launch import Launch

# exp(x) == exp2(x * log2(e)). The GPU has a fast native exp2 instruction, so
# we fold log2(e) into the softmax scale once and use exp2 everywhere. The
# softmax is unchanged because max/subtract/exp commute with a positive scale.
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------
# 1. Which sequence does this program serve?
# --------------------------------------------------------------------------
#
# The grid's first axis enumerates "query blocks": groups of up to BLOCK_Q
# consecutive query tokens of ONE sequence. We want to launch without first
# copying the query lengths to the host (that would stall the GPU stream), so
# -- exactly as upstream does -- we give sequence i the q-block ids
#
#     first_qblock(i) = cu_seqlens_q[i] // BLOCK_Q + i
#
# Sequence i needs ceil(len_i / BLOCK_Q) q-blocks; the gap between consecutive
# first_qblock values is floor(cu[i+1]/BQ) - floor(cu[i]/BQ) + 1, which is
# always >= ceil(len_i / BQ), so every sequence gets enough ids. Some ids are
# spare: those programs find they have no queries and exit at once. The grid
# size is the matching upper bound: num_tokens // BLOCK_Q + num_seqs.
@triton.jit
def _find_seq(cu_seqlens_q_ptr, qblock_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Binary search: the last sequence i with first_qblock(i) <= qblock_id."""
    lo: tl.int32 = 0
    hi = num_seqs  # answer is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first <= qblock_id:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. Interpreter only: Triton 3.9's
    interpreter casts fp32 to bf16 by truncation (cast_impl passes no rounding mode), which biases
    every rounded value toward zero; the GPU rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------
# 2. One KV tile of the online softmax
# --------------------------------------------------------------------------
#
# Online softmax (Milakov & Gimelshein 2018; FlashAttention): for each query
# row keep three running values over the keys seen so far,
#
#     m   = max score so far                      (for numerical safety)
#     l   = sum_k exp(s_k - m)                    (softmax denominator)
#     acc = sum_k exp(s_k - m) * v_k              (un-normalised output)
#
# When a new tile raises the max from m to m', everything accumulated so far
# was scaled by exp(-m) and must now be scaled by exp(-m'): multiply l and acc
# by alpha = exp(m - m'). At the end out = acc / l. One pass over K/V, O(tile)
# memory -- that is what lets the kernel stream a 4k-token context through a
# few KB of on-chip memory.
@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_PAD] this program's query rows, input dtype
    m_i,  # [BLOCK_M] fp32 running max (in log2 units, see LOG2E)
    l_i,  # [BLOCK_M] fp32 running denominator
    acc,  # [BLOCK_M, HEAD_PAD] fp32 running numerator
    tile_start,  # first key position of this tile (within the sequence)
    kv_end,  # keys at positions >= kv_end are never read
    q_abs_pos,  # [BLOCK_M] absolute position of each row's query token
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,  # block_table + seq * stride: this sequence's row
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    qk_scale,  # softmax scale * log2(e)
    offs_d,
    d_mask,
    TILE_N: tl.constexpr,
    PAGE: tl.constexpr,  # KV-cache block size (tokens per physical block)
    MASKED: tl.constexpr,  # does this tile touch the causal diagonal / the end?
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    kv_pos = tile_start + tl.arange(0, TILE_N)  # logical key positions

    # ---- gather the tile from the paged cache -------------------------------
    # Each key position maps to (physical block, slot inside it). A tile may
    # straddle several pages (TILE_N > PAGE), so the lookup is per key; the
    # loads of the same block-table entry coalesce into one transaction.
    if MASKED:
        kv_in = kv_pos < kv_end
        page = tl.load(block_table_row_ptr + kv_pos // PAGE, mask=kv_in, other=0)
    else:
        page = tl.load(block_table_row_ptr + kv_pos // PAGE)
    slot = kv_pos % PAGE
    # int64: num_blocks * stride_kb overflows int32 for caches > 2 G elements.
    k_rows = page.to(tl.int64) * stride_kb + slot * stride_ks + kv_head * stride_kh
    v_rows = page.to(tl.int64) * stride_vb + slot * stride_vs + kv_head * stride_vh
    # K is loaded already transposed, [HEAD_PAD, TILE_N], so Q @ K is a plain
    # dot; V as [TILE_N, HEAD_PAD]. Each key's head_size values are contiguous
    # in memory (last axis of the cache), which is what the hardware wants.
    k_ptrs = k_cache_ptr + k_rows[None, :] + offs_d[:, None]
    v_ptrs = v_cache_ptr + v_rows[:, None] + offs_d[None, :]
    if MASKED:
        # Masked-off lanes read 0 instead of memory: slots past the sequence's
        # end may hold garbage (even NaN), and 0 * NaN would still be NaN.
        k = tl.load(k_ptrs, mask=d_mask[:, None] & kv_in[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=kv_in[:, None] & d_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)

    # ---- scores, in log2 units ---------------------------------------------
    # Tensor cores multiply bf16/fp16 and accumulate in fp32. For fp32 inputs
    # we ask for true fp32 ("ieee") instead of TF32, trading speed for a
    # reference-grade result (fp32 is the teaching / testing dtype).
    if UPCAST_DOT:
        # Only under TRITON_INTERPRET=1 (CPU): Triton 3.9's interpreter stores
        # bf16 as raw uint16 and its tl.dot multiplies those integers. A bf16
        # tensor-core dot is exact products summed in fp32, which is what an
        # fp32 "ieee" dot of the upcast operands computes too.
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
    if MASKED:
        # Causal with a cached prefix: a query at absolute position p sees
        # keys 0..p. (kv_in also drops the tail of the last tile.)
        visible = (kv_pos[None, :] <= q_abs_pos[:, None]) & kv_in[None, :]
        s = tl.where(visible, s, float("-inf"))

    # ---- online softmax update ---------------------------------------------
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row can have every score masked (padding rows, or a tile wholly in a
    # query's future): m_new = -inf and exp2(-inf - -inf) = NaN. Subtract 0
    # instead; exp2(-inf - 0) = 0 then gives those entries weight 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)  # rescale for what we had; 0 on 1st tile
    p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N], unnormalised
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P is cast to V's dtype so the second product also runs on tensor cores
    # (what FlashAttention and upstream do); the sum stays fp32 in acc.
    if UPCAST_DOT:
        p = _round_to_bf16(p)  # the GPU's rounding, held in fp32 for the upcast dot
        v = v.to(tl.float32)
    else:
        p = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# --------------------------------------------------------------------------
# 3. The kernel: one program = (one q-block of one sequence) x (one KV head)
# --------------------------------------------------------------------------
#
# Tiling. A program owns a [BLOCK_M, HEAD_PAD] tile of queries and streams
# the sequence's keys/values through in [TILE_N, HEAD_PAD] tiles.
#
# GQA packing. The BLOCK_M query rows are BLOCK_Q tokens x GROUP query heads,
# all the heads that share this program's KV head. Row r is token r // GROUP,
# head r % GROUP. So every K/V tile fetched from memory is used by all GROUP
# heads: K/V traffic is divided by GROUP compared with one program per query
# head. For decode (1 token) this is the only thing that fills the rows of
# the matrix multiply at all; tl.dot needs >= 16 rows, so a decode program
# pads 2 real rows up to 16 (the padded rows are masked and cost only
# compute, which decode has to spare: it is bound by reading the KV cache).
#
# Two loop phases (as in the Triton fused-attention tutorial). Tiles that end
# before the earliest query of this q-block are visible to every row: no
# mask needed. Only the last few tiles (crossing the causal diagonal, or the
# sequence end) pay for the mask. For a long prefill that is most tiles.
# Triton compiles a variant per "int == 1 / divisible by 16" pattern of each int argument. num_seqs and
# the block table's row stride change from step to step in an engine, so a new pattern met mid-run would
# stall a step for a compile (seen in the race: ~3 s over its 9 prefill steps); these two are left generic.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    qk_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    part_acc_ptr,  # split keys only: [num_tokens, num_q_heads, MAX_SEGS, HEAD_PAD] fp32 partial numerators
    part_ml_ptr,  # split keys only: [num_tokens, num_q_heads, MAX_SEGS, 2] fp32 running max and denominator
    MAX_SEGS: tl.constexpr,  # segments per row in the partial buffers (a power of two)
    SEG_TILES: tl.constexpr,  # KV tiles per segment; 0 = one program reads all of its sequence's keys
    GROUP: tl.constexpr,  # query heads per KV head
    PAGE: tl.constexpr,  # tokens per KV-cache block
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE (tl.arange needs it)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    DECODE_ONLY: tl.constexpr,  # every sequence has exactly one query token (then BLOCK_Q == 1)
    HEADS_FIRST: tl.constexpr,  # grid axis 0 = KV head, axis 1 = q-block (else the other way round)
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program = pow2 >= max(16, BLOCK_Q * GROUP)
    TILE_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter-only workaround, see _attend_tile
):
    if HEADS_FIRST:  # consecutive programs: the KV heads of one sequence, which sit side by side in the cache
        kv_head = tl.program_id(0)
        qblock_id = tl.program_id(1)
    else:
        qblock_id = tl.program_id(0)
        kv_head = tl.program_id(1)

    # ---- which sequence, which of its query tokens --------------------------
    if DECODE_ONLY:  # one query token per sequence: program i serves sequence i, no search
        seq = qblock_id
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        qblock_local = 0
    else:
        seq = _find_seq(cu_seqlens_q_ptr, qblock_id, num_seqs, BLOCK_Q)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        qblock_local = qblock_id - (q_start // BLOCK_Q + seq)
    if qblock_local * BLOCK_Q >= q_len:
        return  # a spare id of the upper-bound grid (see _find_seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached prefix, visible to all queries

    rows = tl.arange(0, BLOCK_M)
    q_tok = qblock_local * BLOCK_Q + rows // GROUP  # token index within the sequence
    q_head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE

    q_offs = (q_start + q_tok).to(tl.int64)[:, None] * stride_qt + q_head[:, None] * stride_qh
    q = tl.load(
        q_ptr + q_offs + offs_d[None, :],
        mask=row_ok[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_abs_pos = context_len + q_tok

    # ---- which keys: [0, kv_end) split at the causal diagonal ---------------
    first_tok = qblock_local * BLOCK_Q
    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1  # the last row sees up to here
    # Keys < context_len + first_tok are visible to every row of the block.
    n_full_tiles = (context_len + first_tok + 1) // TILE_N
    full_end = n_full_tiles * TILE_N

    # ---- split keys: this program reads one segment of them ----------------
    # A segment is SEG_TILES tiles; segments past the sequence's end have
    # nothing to do (the reduce kernel knows how many a row has).
    if SEG_TILES > 0:
        seg_lo = tl.program_id(2) * (SEG_TILES * TILE_N)
        if seg_lo >= kv_end:
            return
        seg_hi = tl.minimum(seg_lo + SEG_TILES * TILE_N, kv_end)
    else:
        seg_lo = 0
        seg_hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    # Phase 1: tiles wholly in every row's past -- no masks.
    for tile_start in range(seg_lo, tl.minimum(full_end, seg_hi), TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile_start, kv_end, q_abs_pos,
            k_cache_ptr, v_cache_ptr, bt_row, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            qk_scale, offs_d, d_mask,
            TILE_N, PAGE, False, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    # Phase 2: the diagonal and the sequence end -- masked.
    for tile_start in range(tl.maximum(full_end, seg_lo), seg_hi, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile_start, kv_end, q_abs_pos,
            k_cache_ptr, v_cache_ptr, bt_row, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            qk_scale, offs_d, d_mask,
            TILE_N, PAGE, True, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip

    if SEG_TILES > 0:
        # Un-normalised partials; _reduce_segments_kernel merges a row's
        # segments exactly as the online softmax merges tiles.
        part = ((q_start + q_tok).to(tl.int64) * (GROUP * NUM_KV_HEADS) + q_head) * MAX_SEGS + tl.program_id(2)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        return

    # ---- normalise once at the end and store --------------------------------
    # Every real row sees at least key 0, so l_i > 0 there; padding rows have
    # l_i == 0 and are not stored, the guard only keeps them NaN-free.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    if UPCAST_DOT:
        out = _round_to_bf16(out)  # so the truncating store below is exact
    o_offs = (q_start + q_tok).to(tl.int64)[:, None] * stride_ot + q_head[:, None] * stride_oh
    tl.store(
        out_ptr + o_offs + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_mask[None, :],
    )


# --------------------------------------------------------------------------
# 4. Split keys (flash-decoding): merge a decode row's segments
# --------------------------------------------------------------------------
#
# A decode program streams its whole sequence alone. When the batch has few
# sequences, a handful of long programs runs while most SMs have nothing to
# do. (Sequences of very different lengths are better served by starting
# the long ones first -- the mini engine orders its rows so -- than by
# splitting: the partials' traffic costs more than the tail it saves.) Cutting
# every sequence's keys into segments of a fixed length gives many programs
# of about the same length; each writes its un-normalised (acc, m, l), and
# this kernel merges them: with M = max_s m_s and w_s = exp2(m_s - M),
#     out = sum_s w_s * acc_s / sum_s w_s * l_s.
# Upstream's counterpart is ``reduce_segments`` (its "3D" decode path).
@triton.jit
def _reduce_segments_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    MAX_SEGS: tl.constexpr,
    SEG_LEN: tl.constexpr,  # keys per segment
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    tok = tl.program_id(0)  # a decode row: token index == sequence index
    head = tl.program_id(1)
    n_seg = tl.cdiv(tl.load(seq_lens_ptr + tok), SEG_LEN)
    segs = tl.arange(0, MAX_SEGS)
    seg_ok = segs < n_seg
    part = (tok.to(tl.int64) * NUM_Q_HEADS + head) * MAX_SEGS + segs
    m = tl.load(part_ml_ptr + part * 2, mask=seg_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=seg_ok, other=0.0)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :],
                  mask=seg_ok[:, None] & d_mask[None, :], other=0.0)
    w = tl.math.exp2(m - tl.max(m, axis=0))  # segment 0 always has key 0: the max is finite
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    if UPCAST_DOT:
        out = _round_to_bf16(out)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


# --------------------------------------------------------------------------
# 5. The launcher: pick the tiling, size the grid
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    """Tiling and launch knobs. ``choose_config`` picks them; the GPU bench
    sweeps them (``vllm_tour/bench/triton_attn_gpu.py``)."""

    block_q: int  # query tokens per program
    tile_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    seg_tiles: int = 0  # decode only: split each sequence's keys into segments of this many tiles (0: no split)
    heads_first: bool = False  # decode only: launch a sequence's KV heads one after the other


# Fewer decode programs than this (sequences x KV heads) leave SMs idle: split the keys. Upstream's rule too
# (MIN_LAUNCH_GRID_SIZE_2D in vllm.v1.attention.backends.triton_attn, its 3D path).
MIN_DECODE_PROGRAMS = 128


def choose_config(max_seqlen_q: int, num_tokens: int, num_seqs: int, group: int, num_kv_heads: int) -> LaunchConfig:
    """Why these numbers (measured on an H200 with the bench's ``--sweep``,
    head 128, bf16, GROUP 2; see the closing table in the bench script):

    - KV tile of 64 keys: 64 x 128 dims x 2 B = 16 KB of K and 16 KB of V per
      step. Smaller tiles (16, 32) leave too few bytes in flight per SM to
      saturate HBM; 128 gave no further gain and doubles registers.
    - 2 pipeline stages (``num_stages``): Triton prefetches the next tile's
      K/V while the current one is in the dot products. On the decode shapes
      3-4 stages were slower (0.36 vs 0.26 ms on B64 x 4096): more shared
      memory per program means fewer programs resident per SM, and decode
      needs many of them to hide memory latency.
    - 4 warps: 8 warps halved decode throughput with TILE_N <= 64 (more
      threads, same bytes in flight, more synchronisation); 2 warps were the
      same as 4.
    - Decode (every sequence has 1 query): BLOCK_Q = 1, one program per
      (sequence, KV head); the GROUP heads are the only real rows. The
      programs of one sequence's KV heads run one after the other
      (``heads_first``): their keys share the cache's 2 KB rows. This reads
      the KV cache at the speed of a plain device-to-device copy.
    - Decode with at most MIN_DECODE_PROGRAMS programs (16 sequences x 8
      KV heads): keys split into segments of 4 tiles (section 4). 8
      sequences x 8 KV heads are 64 programs for 132 SMs; split, B8 x 4096
      ran 2.4x faster. From 64 sequences up, the split was 5-15% slower
      (the partials' extra traffic and the reduce launch): the programs
      already fill the GPU.
    - Long prefill: BLOCK_Q * GROUP = 64 rows per program. Each K/V tile is
      reused by 64 query rows instead of 16, so the kernel does 4x the math
      per byte loaded; it runs at ~185 TFLOP/s on 4 x 1024 (3.1x faster
      than upstream's fixed 16-row blocks). 128 rows was no faster and
      needs 8 warps for its registers.
    - Short chunks (mixed batches): 16 rows. A 17-token chunk in a 64-token
      q-block would leave most rows idle, and with few sequences small
      q-blocks are what gives the grid enough programs to fill 132 SMs.
    """
    if max_seqlen_q == 1:
        split = num_seqs * num_kv_heads <= MIN_DECODE_PROGRAMS
        return LaunchConfig(block_q=1, tile_n=64, num_warps=4, num_stages=2, seg_tiles=4 if split else 0,
                            heads_first=True)
    avg_q = num_tokens / max(num_seqs, 1)
    rows = 64 if avg_q >= 256 else 16
    return LaunchConfig(block_q=max(1, rows // group), tile_n=64, num_warps=4, num_stages=2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Causal paged attention; the arguments mean what they mean in
    ``reimpl/attn_reference.py`` (and in upstream's ``unified_attention``:
    ``cu_seqlens_q``, ``seqused_k`` = ``seq_lens``, ``block_table``).

    ``max_seqlen_q`` only picks the tiling; pass it when you know it, to avoid
    a device-to-host copy (upstream's caller always knows it).
    """
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    attend = PagedAttention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, scale=scale,
                            config=config)
    return attend(q, k_cache, v_cache, out)


class PagedAttention:
    """One batch's attention launch, ready for every layer of a forward: the tiling, the grid, the split
    buffers and the arguments layers share (block table, lengths, strides) are worked out once, and the
    kernels launch through reimpl/triton_launch.py (Triton's lookup once, not per layer). Each call takes
    a layer's queries and caches, of the shapes and dtypes of the first."""

    def __init__(self, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q: int, *,
                 scale: float | None = None, config: LaunchConfig | None = None):
        num_tokens, num_q_heads, head_size = q.shape
        num_blocks, page, num_kv_heads, k_head_size = k_cache.shape
        assert k_head_size == head_size and v_cache.shape == k_cache.shape
        assert num_q_heads % num_kv_heads == 0, "GQA needs num_q_heads % num_kv_heads == 0"
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        group = num_q_heads // num_kv_heads
        num_seqs = seq_lens.shape[0]
        if scale is None:
            scale = 1.0 / math.sqrt(head_size)
        if config is None:
            config = choose_config(max_seqlen_q, num_tokens, num_seqs, group, num_kv_heads)
        # See _attend_tile: the CPU interpreter cannot tl.dot bf16 operands.
        interpret_bf16 = os.environ.get("TRITON_INTERPRET") == "1" and q.dtype == torch.bfloat16
        head_pad = triton.next_power_of_2(head_size)
        # Split keys (section 4) only for decode rows, where a row's keys are its sequence's: the reduce
        # counts a row's segments from seq_lens. The grid covers the longest sequence the block table can
        # hold, so it is the same for every step of a CUDA graph; segments past a sequence's end exit at once.
        seg_tiles = config.seg_tiles if max_seqlen_q == 1 else 0
        block_q = 1 if seg_tiles else config.block_q
        block_m = max(16, triton.next_power_of_2(block_q * group))
        if seg_tiles:
            seg_len = seg_tiles * config.tile_n
            n_segs = -(-block_table.shape[1] * page // seg_len)
            max_segs = triton.next_power_of_2(n_segs)
            part_acc = torch.empty(num_tokens, num_q_heads, max_segs, head_pad, device=q.device, dtype=torch.float32)
            part_ml = torch.empty(num_tokens, num_q_heads, max_segs, 2, device=q.device, dtype=torch.float32)
        else:
            part_acc = part_ml = None  # not read; the output stands in for them
            max_segs = 1
        # A decode batch needs one program per sequence; otherwise the upper bound of _find_seq's numbering.
        decode_only = max_seqlen_q == 1 and block_q == 1
        heads_first = decode_only and config.heads_first
        n_qblocks = num_seqs if decode_only else num_tokens // block_q + num_seqs
        grid = ((num_kv_heads, n_qblocks) if heads_first else (n_qblocks, num_kv_heads)) + (n_segs if seg_tiles else 1,)
        self.q_shape, self.q_dtype = q.shape, q.dtype
        self.part_acc, self.part_ml = part_acc, part_ml
        # The arguments after (out, q, k_cache, v_cache); every layer's tensors have the first's strides.
        self.shared = (block_table, seq_lens, cu_seqlens_q, scale * LOG2E, num_seqs,
                       q.stride(0), q.stride(1), q.stride(0), q.stride(1), block_table.stride(0),
                       *k_cache.stride()[:3], *v_cache.stride()[:3])
        self.strides = (q.stride(), k_cache.stride(), v_cache.stride())
        self.attend = Launch(
            paged_attention_kernel, grid, {"num_warps": config.num_warps, "num_stages": config.num_stages},
            MAX_SEGS=max_segs,
            SEG_TILES=seg_tiles,
            GROUP=group,
            PAGE=page,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_Q=block_q,
            DECODE_ONLY=decode_only,
            HEADS_FIRST=heads_first,
            NUM_KV_HEADS=num_kv_heads,
            BLOCK_M=block_m,
            TILE_N=config.tile_n,
            DOT_PRECISION="ieee" if (q.dtype == torch.float32 or interpret_bf16) else "tf32",
            UPCAST_DOT=interpret_bf16,
        )  # fmt: skip
        self.reduce = None
        if seg_tiles:
            self.reduce = Launch(
                _reduce_segments_kernel, (num_tokens, num_q_heads),
                NUM_Q_HEADS=num_q_heads, MAX_SEGS=max_segs, SEG_LEN=seg_len,
                HEAD_SIZE=head_size, HEAD_PAD=head_pad, UPCAST_DOT=interpret_bf16,
            )  # fmt: skip

    def __call__(self, q, k_cache, v_cache, out: torch.Tensor | None = None) -> torch.Tensor:
        assert q.shape == self.q_shape and q.dtype == self.q_dtype
        assert (q.stride(), k_cache.stride(), v_cache.stride()) == self.strides
        if out is None:
            out = torch.empty_like(q)
        assert out.stride() == q.stride()
        part_acc = out if self.part_acc is None else self.part_acc
        part_ml = out if self.part_ml is None else self.part_ml
        self.attend(out, q, k_cache, v_cache, *self.shared, part_acc, part_ml)
        if self.reduce is not None:
            self.reduce(out, part_acc, part_ml, self.shared[1], out.stride(0), out.stride(1))
        return out


# --------------------------------------------------------------------------
# 6. Plugging the kernel into the mini engine
# --------------------------------------------------------------------------
def engine_attention(q, k_new, v_new, cache, meta, bf16_weights: bool = False) -> torch.Tensor:
    """Drop-in for ``reimpl.paged_attn.paged_attention`` (the mini engine's
    attention, called by ``reimpl/qwen3.py``): same arguments, same result
    ``[num_tokens, num_heads * head_dim]``, but the attention itself is this
    file's Triton kernel instead of a per-request torch loop.

    ``cache`` is a ``reimpl.paged_attn.PagedKVCache`` (K and V as
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, the layout the kernel
    reads); ``meta`` a ``BatchMeta``. Like upstream's backends, the new tokens'
    K/V are written into the cache first (through the slot mapping), then every
    query reads its whole sequence back through the block table.

    On a machine without a GPU, set ``TRITON_INTERPRET=1`` before this module is
    first imported (Triton reads it when the kernel is decorated).

    ``bf16_weights`` is paged_attention's switch for upstream's AMX CPU kernel; this
    kernel needs no switch: it always casts P to the cache dtype before the P·V dot,
    so in bf16 it rounds the weights as the AMX kernel (and upstream's Triton) does.
    """
    cache.write(k_new, v_new, meta.slot_mapping)
    width = max(len(t) for t in meta.block_tables)
    # Rows are padded with block 0; the kernel never reads past seq_len.
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in meta.block_tables], dtype=torch.int32)
    cu_seqlens_q = torch.tensor(meta.query_start_loc, dtype=torch.int32)
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    dev = q.device
    out = paged_attention(
        q.contiguous(), cache.k, cache.v, block_table.to(dev), cu_seqlens_q.to(dev), seq_lens.to(dev),
        max_seqlen_q=max(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])),
    )  # fmt: skip
    return out.reshape(q.shape[0], -1)
