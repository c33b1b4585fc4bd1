"""Qwen3 forward pass in plain torch, fp32 or bf16, reading the same safetensors as upstream.

Upstream counterparts (v0.32.0):
- `vllm.model_executor.models.qwen3.Qwen3ForCausalLM`, `Qwen3Model`,
  `Qwen3DecoderLayer`, `Qwen3Attention` (q/k RMSNorm per head, then RoPE)
- `vllm.model_executor.models.qwen2.Qwen2MLP` (SiLU-gated MLP)
- `vllm.model_executor.layers.layernorm.RMSNorm`
- `vllm.model_executor.layers.rotary_embedding.RotaryEmbedding` (neox style)

The batch is *flattened*: tokens of all scheduled requests are concatenated
into one [num_tokens] sequence; `positions` says where each sits in its own
request; attention (paged_attn.py) keeps requests apart.

In bf16 it rounds where upstream rounds: weights, the residual stream, every
linear layer's output and the KV cache are bf16; RMSNorm's statistics,
RoPE's products and attention's softmax are computed in fp32 and rounded once.
The elementwise maths (RMSNorm, residual add, RoPE, SiLU * up) and its
roundings live in qwen3_numerics.py, shared with the fast engine's model
(fast_engine.py), so both compute the same bits. In fp32 every cast is a no-op.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .paged_attn import BatchMeta, PagedKVCache, paged_attention
from .qwen3_numerics import DTYPES, add_rms_norm, apply_rope, rms_norm, rope_cos_sin, silu_and_mul


class Qwen3:
    def __init__(self, model_dir: str | Path, attention=paged_attention, dtype: str | torch.dtype = torch.float32):
        model_dir = Path(model_dir)
        # Any callable with paged_attention's signature: reimpl/triton_attn.py's
        # engine_attention swaps the torch loop for a Triton kernel.
        self.attention = attention
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.cfg = json.loads((model_dir / "config.json").read_text())
        # Upstream loads the checkpoint's fp32 tensors into parameters of the model dtype.
        self.w = {k: v.to(self.dtype) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        c = self.cfg
        self.num_layers = c["num_hidden_layers"]
        self.num_heads = c["num_attention_heads"]
        self.num_kv_heads = c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.num_heads
        self.eps = c["rms_norm_eps"]
        # upstream's cos_sin_cache is in the model dtype
        self.cos, self.sin = rope_cos_sin(c["max_position_embeddings"], self.head_dim, c.get("rope_theta", 10000.0),
                                          self.dtype)
        lm_head = "lm_head.weight" if "lm_head.weight" in self.w else "model.embed_tokens.weight"
        self.lm_head = self.w[lm_head]
        # Per-layer attention outputs of the last forward (for tensor comparisons).
        self.last_attn_out: dict[int, torch.Tensor] = {}

    def new_kv_caches(self, num_blocks: int, block_size: int) -> list[PagedKVCache]:
        return [PagedKVCache(num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype) for _ in range(self.num_layers)]

    def forward(self, input_ids: list[int], positions: list[int], meta: BatchMeta, caches: list[PagedKVCache]) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        w, n, hd = self.w, len(input_ids), self.head_dim
        pos = torch.tensor(positions, dtype=torch.long)
        cos, sin = self.cos[pos], self.sin[pos]
        x = w["model.embed_tokens.weight"][torch.tensor(input_ids, dtype=torch.long)]  # the residual stream
        h = rms_norm(x, w["model.layers.0.input_layernorm.weight"], self.eps)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, self.num_heads, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, self.num_kv_heads, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, self.num_kv_heads, hd)
            # Qwen3's twist on Qwen2: RMSNorm each head's q and k before RoPE.
            q = apply_rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps), cos, sin)
            k = apply_rope(rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps), cos, sin)
            attn = self.attention(q, k, v, caches[i], meta)
            self.last_attn_out[i] = attn
            x, h = add_rms_norm(x, attn @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"], self.eps)
            mlp = self.mlp(i, h)
            # the next layer's input norm, or after the last layer the final norm
            norm = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < self.num_layers else "model.norm.weight"
            x, h = add_rms_norm(x, mlp, w[norm], self.eps)
        return h

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer i's SiLU-gated MLP (moe.py's Qwen3MoE puts a sparse MoE block here)."""
        p = f"model.layers.{i}.mlp."
        gate = h @ self.w[p + "gate_proj.weight"].T
        up = h @ self.w[p + "up_proj.weight"].T
        return silu_and_mul(gate, up) @ self.w[p + "down_proj.weight"].T

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.T
