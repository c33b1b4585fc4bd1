"""Fused elementwise kernels for the fast path (`reimpl/fast_engine.py`), in Triton.

Why: a Qwen3 layer is four matmuls and one attention call, but written with
plain torch ops its elementwise maths -- RMSNorm (cast, square, mean, add,
rsqrt, multiply, cast, multiply), q/k-norm, RoPE (slices, four multiplies,
two adds, cat, casts), SiLU * up, the residual adds, the K/V cache writes --
launch about 60 small kernels per layer, ~1,700 per decode step for 28 layers.
At decode batch sizes each of them moves a few hundred KB, so the step is
bound by launch and memory round trips, not by maths. Upstream fuses them:
custom CUDA ops in eager mode, torch.compile (Inductor) under CUDA graphs.

The three kernels here cut a layer to nine launches (2 norms, 4 matmuls,
q/k-norm+RoPE+cache write, attention, SiLU*mul):

| here                      | upstream (vLLM v0.32.0)                                          |
| ------------------------- | ---------------------------------------------------------------- |
| `fused_add_rms_norm`      | `torch.ops._C.fused_add_rms_norm` / `rms_norm`                    |
|                           | (`csrc/layernorm_kernels.cu`, called by                           |
|                           | `vllm.model_executor.layers.layernorm.RMSNorm.forward_cuda`)      |
| `qk_norm_rope_kv_write`   | `torch.ops._C.fused_qk_norm_rope` (compile pass                   |
|                           | `QKNormRoPEFusionPass`, `enable_qk_norm_rope_fusion`) and, with    |
|                           | the cache write, `fused_qk_norm_rope_and_unified_kv_cache_update` |
|                           | (`fuse_qk_norm_rope_kvcache`; vllm/compilation/passes/fusion/);   |
|                           | unfused: `rotary_embedding` + `reshape_and_cache_flash`           |
|                           | (Triton backend: `triton_reshape_and_cache_flash`)                |
| `silu_and_mul`            | `torch.ops._C.silu_and_mul` (`csrc/activation_kernels.cu`,        |
|                           | `vllm.model_executor.layers.activation.SiluAndMul`)               |

Numerics: bf16 in, bf16 out, statistics in fp32, and the *same roundings*
as `reimpl/qwen3_numerics.py`, which the teaching model (qwen3.py) and the
torch path of `FastQwen3` both call:
- `_add_rms_norm_kernel`: the residual sum is normalised in fp32 *unrounded*
  and stored rounded to the residual's dtype; the normalised value is rounded
  before the weight multiplies it, and the product is rounded
  (qwen3_numerics.add_rms_norm / rms_norm);
- `_qk_norm_rope_kv_kernel`: the same two roundings for the per-head q/k norm;
  the cos/sin tables come in the model dtype (qwen3_numerics.rope_cos_sin,
  already rounded), the rotation runs in fp32 and is rounded once
  (qwen3_numerics.apply_rope);
- `_silu_and_mul_kernel`: silu(gate) is rounded before it multiplies up
  (qwen3_numerics.silu_and_mul).
So fused and unfused paths differ only by the order of a sum and by rsqrt's
last bit.

Each function has a torch twin (`*_ref`), built from qwen3_numerics, that
states what it computes; tests/test_fused_ops.py runs both on CPU under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import qwen3_numerics
from .triton_launch import Launch


# --------------------------------------------------------------------------
# 1. residual add + RMSNorm
# --------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row. In place, as upstream's fused_add_rms_norm:
    s = x + res in fp32;  res <- s rounded;  x <- rms_norm(s) * w   (without a residual: x <- rms_norm(x) * w)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        x = x + r  # normalised as the fp32 sum; the residual stream keeps it rounded
        tl.store(res_ptr + row * N + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded, then times the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * N + cols, (y * w).to(x_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_launch(n: int, hidden: int, has_residual: bool = True) -> Launch:
    """The kernel's launch for n rows of `hidden`: one program per row."""
    return Launch(_add_rms_norm_kernel, (n,), HAS_RES=has_residual, BLOCK=triton.next_power_of_2(hidden))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """In place, as upstream's op: residual <- x + residual; x <- rms_norm(residual) * weight.
    x, residual: [n, H], contiguous. Returns (x, residual)."""
    assert x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
    n, H = x.shape
    add_rms_norm_launch(n, H)(x, residual, weight, H, eps)
    return x, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Out-of-place RMSNorm (the first layer's input norm: nothing to add yet)."""
    out = x.contiguous().clone()
    n, H = out.shape
    add_rms_norm_launch(n, H, has_residual=False)(out, out, weight, H, eps)
    return out


def rms_norm_ref(x, w, eps):
    return qwen3_numerics.rms_norm(x, w, eps)


def fused_add_rms_norm_ref(x, residual, w, eps):
    residual, out = qwen3_numerics.add_rms_norm(residual, x, w, eps)
    return out, residual


# --------------------------------------------------------------------------
# 2. q/k RMSNorm + RoPE (neox halves) + K/V cache write
# --------------------------------------------------------------------------
@triton.jit
def _qk_norm_rope_kv_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr,
                            kc_ptr, vc_ptr, stride_qkv, eps, NH: tl.constexpr, KVH: tl.constexpr,
                            HD: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token t, head h). h < NH: a query head -> q_out[t, h]. NH <= h < NH + KVH: a key head
    -> k_cache[slot[t]], and the value head beside it copied to v_cache[slot[t]]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK_H)
    m = i < HALF
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * HALF + i, mask=m, other=0.0).to(tl.float32)  # rounded to the model dtype
    sin = tl.load(sin_ptr + pos * HALF + i, mask=m, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    if h < NH:
        src = row + h * HD
        w_ptr = qw_ptr
    else:
        src = row + NH * HD + (h - NH) * HD
        w_ptr = kw_ptr
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD + eps)
    dt = qkv_ptr.dtype.element_ty
    w1 = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
    # RMSNorm with the torch path's roundings: normed -> dtype, times weight -> dtype
    n1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
    n2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    # RoPE, neox style: rotate the two halves (fp32, one rounding at the end)
    o1 = (n1 * cos - n2 * sin).to(dt)
    o2 = (n2 * cos + n1 * sin).to(dt)
    if h < NH:
        dst = q_out_ptr + (t * NH + h) * HD
        tl.store(dst + i, o1, mask=m)
        tl.store(dst + HALF + i, o2, mask=m)
    else:
        kh = h - NH
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = kc_ptr + (slot * KVH + kh) * HD
        tl.store(dst + i, o1.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF + i, o2.to(kc_ptr.dtype.element_ty), mask=m)
        vsrc = row + (NH + KVH) * HD + kh * HD
        vdst = vc_ptr + (slot * KVH + kh) * HD
        tl.store(vdst + i, tl.load(vsrc + i, mask=m, other=0.0).to(vc_ptr.dtype.element_ty), mask=m)
        tl.store(vdst + HALF + i, tl.load(vsrc + HALF + i, mask=m, other=0.0).to(vc_ptr.dtype.element_ty),
                 mask=m)


def qk_norm_rope_kv_launch(n: int, num_heads: int, num_kv_heads: int, head_dim: int) -> Launch:
    """The kernel's launch for n tokens: a program per (token, query or key head)."""
    half = head_dim // 2
    return Launch(_qk_norm_rope_kv_kernel, (n, num_heads + num_kv_heads), NH=num_heads, KVH=num_kv_heads,
                  HD=head_dim, HALF=half, BLOCK_H=triton.next_power_of_2(half))


def qk_norm_rope_kv_write(qkv, q_norm_w, k_norm_w, cos_table, sin_table, positions, slot_mapping,
                          k_cache, v_cache, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """qkv: [n, (NH + 2 KVH) * HD] (the fused projection's output); cos/sin tables: [max_pos, HD/2] in the
    model dtype (qwen3_numerics.rope_cos_sin);
    caches [num_blocks, block_size, KVH, HD], contiguous. Writes K and V of every token into its slot;
    returns q [n, NH, HD], normed and rotated."""
    n = qkv.shape[0]
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos_table.is_contiguous() and sin_table.is_contiguous() and head_dim % 2 == 0
    q = torch.empty(n, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    qk_norm_rope_kv_launch(n, num_heads, num_kv_heads, head_dim)(
        qkv, q_norm_w, k_norm_w, cos_table, sin_table, positions, slot_mapping, q, k_cache, v_cache,
        qkv.stride(0), eps)
    return q


def qk_norm_rope_kv_write_ref(qkv, q_norm_w, k_norm_w, cos_table, sin_table, positions, slot_mapping,
                              k_cache, v_cache, num_heads, num_kv_heads, head_dim, eps):
    n = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos_table[positions], sin_table[positions]
    q = qwen3_numerics.apply_rope(qwen3_numerics.rms_norm(q.reshape(n, num_heads, head_dim), q_norm_w, eps), cos, sin)
    k = qwen3_numerics.apply_rope(qwen3_numerics.rms_norm(k.reshape(n, num_kv_heads, head_dim), k_norm_w, eps), cos, sin)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                          v.reshape(n, num_kv_heads, head_dim).to(v_cache.dtype))
    return q


# --------------------------------------------------------------------------
# 3. SiLU(gate) * up
# --------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    """x: [n, 2I] = gate | up; out: [n, I]. Program (row, column block)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(x_ptr + row * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * I + I + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu, rounded (as F.silu)
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)


SILU_BLOCK = 1024  # columns per program


def silu_and_mul_launch(n: int, intermediate: int) -> Launch:
    return Launch(_silu_and_mul_kernel, (n, triton.cdiv(intermediate, SILU_BLOCK)), BLOCK=SILU_BLOCK)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    assert x.is_contiguous()
    n, two_i = x.shape
    I = two_i // 2
    out = torch.empty(n, I, device=x.device, dtype=x.dtype)
    silu_and_mul_launch(n, I)(x, out, I)
    return out


def silu_and_mul_ref(x):
    return qwen3_numerics.silu_and_mul(*x.chunk(2, dim=-1))


# --------------------------------------------------------------------------
# The three kernels for every layer of one forward
# --------------------------------------------------------------------------
class LayerKernels:
    """The kernels above for one forward of `n` tokens: the launches the functions above build, kept for
    every layer (reimpl/triton_launch.py: Triton's lookup on the first layer only), and the layer's matmuls
    (F.linear's x @ W.T). Every per-layer output lives in a buffer all layers reuse (the stream runs a
    layer's reads of a buffer before the next layer's writes), which spares each call an allocation."""

    def __init__(self, n: int, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, device, dtype):
        self.hidden, self.intermediate, self.eps = hidden, intermediate, eps
        self._add_norm = add_rms_norm_launch(n, hidden)
        self._qk = qk_norm_rope_kv_launch(n, num_heads, num_kv_heads, head_dim)
        self._silu = silu_and_mul_launch(n, intermediate)

        def buf(*shape):
            return torch.empty(*shape, device=device, dtype=dtype)

        self.q, self.act = buf(n, num_heads, head_dim), buf(n, intermediate)
        self.qkv, self.gate_up = buf(n, (num_heads + 2 * num_kv_heads) * head_dim), buf(n, 2 * intermediate)
        self.o, self.down = buf(n, hidden), buf(n, hidden)

    @staticmethod
    def linear(x, weight_t, out):
        """F.linear(x, W) into `out`, with W.T given (a view made once per model)."""
        return torch.mm(x, weight_t, out=out)

    def add_rms_norm(self, x, residual, weight):
        """fused_add_rms_norm: residual <- x + residual; x <- rms_norm(residual) * weight. Returns (x, residual)."""
        self._add_norm(x, residual, weight, self.hidden, self.eps)
        return x, residual

    def qk_norm_rope_kv_write(self, qkv, q_norm_w, k_norm_w, cos_table, sin_table, positions, slot_mapping,
                              k_cache, v_cache):
        self._qk(qkv, q_norm_w, k_norm_w, cos_table, sin_table, positions, slot_mapping, self.q, k_cache, v_cache,
                 qkv.stride(0), self.eps)
        return self.q

    def silu_and_mul(self, x):
        self._silu(x, self.act, self.intermediate)
        return self.act


# --------------------------------------------------------------------------
# 4. Sampling: temperature + Gumbel-max + argmax in one pass over the logits
# --------------------------------------------------------------------------
# argmax(p / E) with E ~ Exp(1) draws from p (sampler.py); with p = softmax(x / t) and E = -log(U),
# log(p / E) = x / t - logsumexp(x / t) - log(-log U): the normaliser is the same for every token, so
# the draw is argmax(x / t + G) with Gumbel noise G = -log(-log U) -- no softmax, no probabilities
# tensor, one read of the logits. A temperature <= 0 row takes the plain argmax. Ties go to the lowest
# token id, as torch.argmax. Upstream (v0.21.0, FlashInfer off) does this in torch: divide, softmax,
# exponential_, divide, argmax (vllm.v1.sample.ops.topk_topp_sampler.random_sample), ~5 passes over
# [rows, vocab] fp32; the noise here is Triton's Philox (tl.rand), keyed by (seed, row, token).
# `seed` changes every step: unspecialized, or Triton would compile a variant for seeds divisible by 16 (and
# for 1) the first time one comes, mid-run.
@triton.jit(do_not_specialize=["seed"])
def _sample_kernel(logits_ptr, stride, temps_ptr, out_ptr, V, seed, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temps_ptr + row)
    greedy = t <= 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    noise_on = tl.where(greedy, 0.0, 1.0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(base + offs, mask=m, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, row * V + offs)
        g = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        score = x * inv_t + g * noise_on
        take = score > best  # strict: a lane keeps its lowest token id among equals
        best = tl.where(take, score, best)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, V), axis=0))


def sample(logits: torch.Tensor, temps: torch.Tensor, seed: int) -> torch.Tensor:
    """One token id per row of `logits` [rows, vocab] (any float dtype); temps [rows] fp32, <= 0 = greedy.
    `seed` keys the noise: give each step its own."""
    rows, V = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    if rows:
        _sample_kernel[(rows,)](logits, logits.stride(0), temps, out, V, seed, BLOCK=2048, num_warps=8)
    return out
