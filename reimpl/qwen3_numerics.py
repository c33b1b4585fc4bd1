"""Qwen3's elementwise maths and where it rounds: one truth for both model runners.

Upstream counterparts (v0.32.0):
- `vllm.ir.ops.layernorm.rms_norm` and `vllm.ir.ops.layernorm.fused_add_rms_norm`
  (the reference implementations behind `vllm.model_executor.layers.layernorm.RMSNorm`)
- `vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding._compute_cos_sin_cache`
  and `_match_cos_sin_cache_dtype` (the table, cast to the model dtype), with
  `vllm.model_executor.layers.rotary_embedding.common.ApplyRotaryEmb.forward_static` (neox halves)
- `vllm.model_executor.layers.activation.SiluAndMul.forward_native`

The teaching model (qwen3.py) and the fast model's torch path (fast_engine.py)
both call these functions, so in fp32 and in bf16 they compute the same bits
from the same inputs. The fast model's Triton kernels (fused_ops.py) round at
the same places; their `*_ref` twins are these functions.

Where a bf16 model rounds (in fp32 every cast below is a no-op):
1. RMSNorm: statistics in fp32; the normalised value is rounded to the model
   dtype, then multiplied by the weight (one more rounding).
2. Residual add + RMSNorm: the sum is formed in fp32 and *normalised
   unrounded*; the residual stream stores it rounded.
3. RoPE: the cos/sin table is built in fp32 and rounded to the model dtype
   (upstream keeps it in the query's dtype); the rotation runs in fp32 on
   those rounded values and is rounded once.
4. SiLU * up: silu(gate) is rounded, then the product is rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in fp32; the normalized x is rounded to the weight's dtype, then scaled (upstream's order)."""
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype) * weight


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next RMSNorm (upstream fused_add_rms_norm): the sum is
    normalized in fp32, before the residual stream stores it rounded to its dtype.
    Returns (new residual stream, normalized)."""
    s = x.float() + delta.float()
    return s.to(x.dtype), rms_norm(s, weight, eps)


def rope_cos_sin(max_pos: int, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_pos, head_dim / 2], computed in fp32 and rounded to the model dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [tokens, heads, head_dim] with cos/sin [tokens, head_dim / 2]: the first
    and second halves of each head form the pairs. Products and sums in fp32, rounded once to x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # broadcast over heads
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP activation: silu(gate) rounded to the dtype, times up, rounded again."""
    return F.silu(gate) * up
