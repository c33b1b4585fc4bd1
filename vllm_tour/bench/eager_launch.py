"""The mini engine's eager launch path against Triton's own, on one GPU (no upstream needed).

    python -m vllm_tour.bench.eager_launch        # writes $OUT/eager_launch.json when $OUT is set

`FastQwen3.forward` (fused) looks each Triton kernel up once per forward (reimpl/triton_launch.py) and
writes every layer's outputs into per-forward buffers (fused_ops.LayerKernels). `reference_forward`
below is the same forward through Triton's own `kernel[grid]` path and `F.linear`, one allocation per
output: what the fast path did before. Printed, side by side in one run:

1. whether both give bitwise-equal hidden states and KV caches (decode 256 x ctx900, decode 8 x ctx2000,
   a 4 x 64-token prefill), Qwen3-0.6B shapes, random weights, bf16;
2. the host's time to launch one decode forward at batch 1 (the GPU keeps up: wall time per forward is the
   host's), each path, and their ratio;
3. host time per call of one kernel through `kernel[grid]` and through the compiled kernel (Launch), and of
   `F.linear` against `torch.mm(out=)`, for Qwen3-0.6B's matrices at batch 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def reference_forward(model, input_ids, positions, slot_mapping, block_table, cu, seq_lens, max_q, caches):
    """The fused forward through Triton's own launch path and F.linear (reimpl/fused_ops.py's functions and
    triton_attn.paged_attention, once per layer: each builds a one-shot Launch, whose only call goes
    through `kernel[grid]`)."""
    import torch.nn.functional as F

    from reimpl import fused_ops as fo
    from reimpl.triton_attn import paged_attention

    n, nh, hd = input_ids.shape[0], model.num_heads, model.head_dim
    x, delta = model.embed[input_ids], None
    for L, (kc, vc) in zip(model.layers, caches):
        if delta is None:
            h = fo.rms_norm(x, L["ln1"], model.eps)
        else:
            h, x = fo.fused_add_rms_norm(delta, x, L["ln1"], model.eps)
        qkv = F.linear(h, L["qkv"])
        q = fo.qk_norm_rope_kv_write(qkv, L["q_norm"], L["k_norm"], model.cos, model.sin, positions, slot_mapping,
                                     kc, vc, nh, model.num_kv_heads, hd, model.eps)
        o = paged_attention(q, kc, vc, block_table, cu, seq_lens, max_seqlen_q=max_q)
        h, x = fo.fused_add_rms_norm(F.linear(o.reshape(n, nh * hd), L["o"]), x, L["ln2"], model.eps)
        delta = F.linear(fo.silu_and_mul(F.linear(h, L["gate_up"])), L["down"])
    return fo.fused_add_rms_norm(delta, x, model.norm, model.eps)[0]


def _inputs(batch: int, ctx: int, qlen: int = 1, block_size: int = 16):
    """(ids, positions, slots, block table, query offsets, sequence lengths) on the GPU, each sequence's
    blocks distinct and random, and the number of cache blocks they need."""
    import torch

    g = torch.Generator().manual_seed(0)
    width = -(-ctx // block_size)
    bt = (1 + torch.randperm(batch * width + 64, generator=g)[: batch * width]).int().view(batch, width)
    pos = torch.arange(ctx - qlen, ctx).repeat(batch)
    rows = torch.arange(batch).repeat_interleave(qlen)
    slots = bt[rows, pos // block_size].long() * block_size + pos % block_size
    ids = torch.randint(0, 10000, (batch * qlen,), generator=g)
    cu = torch.arange(0, batch * qlen + 1, qlen, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    return [t.cuda() for t in (ids, pos, slots, bt, cu, seq_lens)], batch * width + 65


def _host_ms(fn, reps: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    return round(host * 1e3, 3)


def _host_us(fn, reps: int = 2000) -> float:
    return round(_host_ms(fn, reps) * 1e3, 2)


def main() -> int:
    import torch
    import torch.nn.functional as F
    import triton

    from reimpl import fused_ops as fo
    from reimpl.fast_engine import FastQwen3, default_attn_fn
    from reimpl.triton_launch import Launch
    from vllm_tour.bench.race_recipe import model_config

    model = FastQwen3.random(model_config(), device="cuda", dtype=torch.bfloat16, seed=0)
    attn = default_attn_fn(torch.device("cuda"))
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for batch, ctx, qlen in ((256, 900, 1), (8, 2000, 1), (4, 300, 64)):
        (ids, pos, slots, bt, cu, sl), blocks = _inputs(batch, ctx, qlen)
        fast = model.new_kv_caches(blocks, 16)
        for kc, vc in fast:
            kc.normal_()
            vc.normal_()
        ref = [(k.clone(), v.clone()) for k, v in fast]
        h_fast = model.forward(ids, pos, slots, bt, cu, sl, qlen, fast, attn)
        h_ref = reference_forward(model, ids, pos, slots, bt, cu, sl, qlen, ref)
        torch.cuda.synchronize()
        same = torch.equal(h_fast, h_ref) and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(fast, ref))
        res[f"bitwise_equal_{batch}x{ctx}_q{qlen}"] = same
    (ids, pos, slots, bt, cu, sl), blocks = _inputs(1, 900)
    caches = model.new_kv_caches(blocks, 16)
    fast_ms = _host_ms(lambda: model.forward(ids, pos, slots, bt, cu, sl, 1, caches, attn))
    ref_ms = _host_ms(lambda: reference_forward(model, ids, pos, slots, bt, cu, sl, 1, caches))
    res["host_ms_per_decode_forward_batch1"] = {"triton_own_path": ref_ms, "launch_once_per_forward": fast_ms,
                                               "ratio": round(ref_ms / fast_ms, 2)}
    H = model.hidden
    x, r = torch.randn(1, H, device="cuda", dtype=torch.bfloat16), torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    block = triton.next_power_of_2(H)
    launch = Launch(fo._add_rms_norm_kernel, (1,), HAS_RES=True, BLOCK=block)
    launch(x, r, w, H, 1e-6)
    res["host_us_per_call_add_rms_norm"] = {
        "kernel[grid]": _host_us(lambda: fo._add_rms_norm_kernel[(1,)](x, r, w, H, 1e-6, HAS_RES=True, BLOCK=block)),
        "Launch (compiled kernel)": _host_us(lambda: launch(x, r, w, H, 1e-6))}
    matmuls = {}
    for name in ("qkv", "gate_up", "down"):
        W = model.layers[0][name]
        xi = torch.randn(1, W.shape[1], device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, W.shape[0], device="cuda", dtype=torch.bfloat16)
        Wt = W.t()
        matmuls[name] = {"F.linear": _host_us(lambda: F.linear(xi, W)), "torch.mm(out=)": _host_us(lambda: torch.mm(xi, Wt, out=out))}
    res["host_us_per_call_matmul_batch1"] = matmuls
    print("EAGER_LAUNCH " + json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "eager_launch.json").write_text(json.dumps(res, indent=1))
    return 0 if all(v for k, v in res.items() if k.startswith("bitwise_equal")) else 1


if __name__ == "__main__":
    sys.exit(main())
