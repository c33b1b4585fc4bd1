"""Runs reimpl/fused_ops.py's Triton kernels under the Triton interpreter on CPU, in a process of its
own (TRITON_INTERPRET must be set before triton.jit decorates; see tests/_triton_attn_worker.py);
prints one JSON object of verdicts for tests/test_fused_ops.py."""

from __future__ import annotations

import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from reimpl import fused_ops as fo  # noqa: E402
from reimpl.qwen3_numerics import rope_cos_sin  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# fp32: the two paths differ by sum order only. fp16: the interpreter rounds fp32 -> fp16 to nearest, as
# the GPU and torch do, so the kernels' roundings can be checked nearly bit for bit. bf16: the
# interpreter (triton 3.9) *truncates* fp32 -> bf16 (the GPU rounds to nearest even), so on CPU bf16
# results are a few bf16 ulps off the torch path, more after two layers: tolerance only.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
TOL_FORWARD = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (6e-2, 3e-2)}


def verdict(a, b, dtype, tol=None):
    atol, rtol = (tol or TOL)[dtype]
    a, b = a.float(), b.float()
    err = (a - b).abs()
    ok = bool(torch.allclose(a, b, atol=atol, rtol=rtol))
    return {"ok": ok, "max_abs": float(err.max()), "frac_equal": round(float((a == b).float().mean()), 4)}


def case_add_rms_norm(dt):
    g = torch.Generator().manual_seed(0)
    n, H, eps = 5, 96, 1e-6  # H not a power of two: masked lanes
    x = torch.randn(n, H, generator=g).to(dt)
    r = torch.randn(n, H, generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dt)
    ref_out, ref_res = fo.fused_add_rms_norm_ref(x, r, w, eps)
    out, res = fo.fused_add_rms_norm(x.clone(), r.clone(), w, eps)
    plain = fo.rms_norm(x, w, eps)
    return {"out": verdict(out, ref_out, dt), "residual": verdict(res, ref_res, dt),
            "residual_exact": bool(torch.equal(res, ref_res)),
            "rms_norm": verdict(plain, fo.rms_norm_ref(x, w, eps), dt)}


def case_qk_norm_rope_kv(dt):
    g = torch.Generator().manual_seed(1)
    n, nh, kvh, hd, bs, nb, eps = 6, 4, 2, 16, 4, 8, 1e-6
    qkv = torch.randn(n, (nh + 2 * kvh) * hd, generator=g).to(dt)
    qw = (1 + 0.1 * torch.randn(hd, generator=g)).to(dt)
    kw = (1 + 0.1 * torch.randn(hd, generator=g)).to(dt)
    cos, sin = rope_cos_sin(64, hd, 10000.0, dt)  # the tables FastQwen3 hands the kernel
    positions = torch.tensor([0, 1, 2, 17, 40, 63])
    slots = torch.tensor([5, 6, 7, 12, 30, 0])
    kc0 = torch.randn(nb, bs, kvh, hd, generator=g).to(dt)
    vc0 = torch.randn(nb, bs, kvh, hd, generator=g).to(dt)
    kr, vr = kc0.clone(), vc0.clone()
    q_ref = fo.qk_norm_rope_kv_write_ref(qkv, qw, kw, cos, sin, positions, slots, kr, vr, nh, kvh, hd, eps)
    kt, vt = kc0.clone(), vc0.clone()
    q = fo.qk_norm_rope_kv_write(qkv, qw, kw, cos, sin, positions, slots, kt, vt, nh, kvh, hd, eps)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    return {"q": verdict(q, q_ref, dt), "k_cache": verdict(kt, kr, dt), "v_cache_exact": bool(torch.equal(vt, vr)),
            "other_slots_untouched": bool(torch.equal(kt.view(nb * bs, -1)[untouched], kc0.view(nb * bs, -1)[untouched]))}


def case_silu_and_mul(dt):
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(3, 2 * 1100, generator=g)).to(dt)  # I = 1100: two column blocks, the second masked
    return {"out": verdict(fo.silu_and_mul(x), fo.silu_and_mul_ref(x), dt)}


def case_forward(dt):
    """FastQwen3.forward, fused vs torch ops, on a 2-layer random model: hidden states and KV caches."""
    from reimpl.attn_reference import paged_attention_reference
    from reimpl.fast_engine import FastQwen3

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "hidden_size": 32, "intermediate_size": 48, "vocab_size": 64, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 64, "tie_word_embeddings": True}
    attn = lambda q, kc, vc, bt, cu, sl, mq: paged_attention_reference(q, kc, vc, bt, cu, sl).to(q.dtype)  # noqa: E731
    res = {}
    models = {f: FastQwen3.random(cfg, device="cpu", dtype=dt, seed=0, fused=f) for f in (False, True)}
    # a prefill of 5 tokens (request 0) packed with a 3-token prefill (request 1): block size 4
    ids = torch.tensor([3, 9, 1, 4, 7, 11, 2, 8])
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    bt = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    slots = torch.tensor([4, 5, 6, 7, 8, 12, 13, 14])
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    sl = torch.tensor([5, 3], dtype=torch.int32)
    for f, m in models.items():
        caches = m.new_kv_caches(6, 4)
        hid = m.forward(ids, pos, slots, bt, cu, sl, 5, caches, attn)
        res[f] = (hid, caches)
    (h0, c0), (h1, c1) = res[False], res[True]
    return {"hidden": verdict(h1, h0, dt, TOL_FORWARD),
            "k_cache": verdict(torch.stack([k for k, _ in c1]), torch.stack([k for k, _ in c0]), dt, TOL_FORWARD),
            "v_cache": verdict(torch.stack([v for _, v in c1]), torch.stack([v for _, v in c0]), dt, TOL_FORWARD)}


def case_attention_plans(dt):
    """The fused forward with the Triton attention (fast_engine.default_attn_fn on a GPU; here under the
    interpreter): one attention launch worked out per forward, shared by its layers, and a second forward
    with the same batch tensors works out its own (a launch kept from an earlier forward would write the
    split buffers an earlier CUDA graph owns). Same hidden states as with the reference attention."""
    if dt != torch.float32:
        return {}
    from reimpl import triton_attn
    from reimpl.attn_reference import paged_attention_reference
    from reimpl.fast_engine import FastQwen3, default_attn_fn

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "hidden_size": 32, "intermediate_size": 48, "vocab_size": 64, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 64, "tie_word_embeddings": True}
    made = []

    class Counted(triton_attn.PagedAttention):
        def __init__(self, *a, **k):
            made.append(1)
            super().__init__(*a, **k)

    real, triton_attn.PagedAttention = triton_attn.PagedAttention, Counted
    try:
        attn = default_attn_fn(torch.device("cuda"))
    finally:
        triton_attn.PagedAttention = real
    ref = lambda q, kc, vc, bt, cu, sl, mq: paged_attention_reference(q, kc, vc, bt, cu, sl).to(q.dtype)  # noqa: E731
    m = FastQwen3.random(cfg, device="cpu", dtype=dt, seed=0, fused=True)
    ids, pos = torch.tensor([3, 9, 1, 4, 7]), torch.tensor([0, 1, 2, 3, 4])
    bt, slots = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([4, 5, 6, 7, 8])
    cu, sl = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    hidden = [m.forward(ids, pos, slots, bt, cu, sl, 5, m.new_kv_caches(4, 4), fn) for fn in (attn, attn, ref)]
    return {"one_launch_per_forward": {"ok": len(made) == 2, "made": len(made)},
            "same_as_reference": verdict(hidden[0], hidden[2], dt, TOL_FORWARD),
            "second_forward_same": {"ok": bool(torch.equal(hidden[0], hidden[1]))}}


def case_bench_reference(dt):
    """vllm_tour/bench/eager_launch.py's reference forward (Triton's own launch path, F.linear) and the fused
    forward with the Triton attention compute the same: the bench's bitwise comparison on the GPU is between
    two writings of one computation."""
    if dt != torch.float32:
        return {}
    from reimpl.fast_engine import FastQwen3, default_attn_fn
    from vllm_tour.bench.eager_launch import reference_forward

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "hidden_size": 32, "intermediate_size": 48, "vocab_size": 64, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 64, "tie_word_embeddings": True}
    m = FastQwen3.random(cfg, device="cpu", dtype=dt, seed=0, fused=True)
    ids, pos = torch.tensor([3, 9, 1, 4, 7]), torch.tensor([0, 1, 2, 3, 4])
    bt, slots = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([4, 5, 6, 7, 8])
    cu, sl = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    fast, ref = m.new_kv_caches(4, 4), m.new_kv_caches(4, 4)
    h_fast = m.forward(ids, pos, slots, bt, cu, sl, 5, fast, default_attn_fn(torch.device("cuda")))
    h_ref = reference_forward(m, ids, pos, slots, bt, cu, sl, 5, ref)
    same = torch.equal(h_fast, h_ref) and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(fast, ref))
    return {"bitwise_equal": {"ok": bool(same)}}


def case_sample(dt):
    """Greedy rows (temperature 0): torch.argmax, ties to the lowest id. Temperature rows (fp32 only: the
    noise does not depend on the dtype, and 192 rows are slow in the interpreter): 192 draws from one row
    of logits land as softmax(x / t) says (tolerance ~3.5 standard deviations; with t ignored or without
    noise the frequencies are >= 0.18 off)."""
    g = torch.Generator().manual_seed(0)
    greedy = torch.randn(3, 3000, generator=g).to(dt)
    greedy[0, 7] = greedy[0, 2500] = 50.0  # a tie across the kernel's 2048-wide chunks
    picked = fo.sample(greedy, torch.zeros(3), seed=1)
    res = {"greedy": {"ok": picked.tolist() == greedy.float().argmax(-1).tolist()}}
    if dt != torch.float32:
        return res
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    rows, t = 192, 2.0
    drawn = fo.sample(x.to(dt).repeat(rows, 1), torch.full((rows,), t), seed=7)
    freq = torch.bincount(drawn, minlength=4).float() / rows
    err = float((freq - torch.softmax(x / t, -1)).abs().max())
    return {**res, "draw": {"ok": err < 0.12, "max_abs": err}}


CASES = {"add_rms_norm": case_add_rms_norm, "qk_norm_rope_kv": case_qk_norm_rope_kv,
         "silu_and_mul": case_silu_and_mul, "forward": case_forward, "sample": case_sample,
         "attention_plans": case_attention_plans, "bench_reference": case_bench_reference}


def main():
    out = {}
    for name, fn in CASES.items():
        for dname, dt in DTYPES.items():
            try:
                out[f"{name}-{dname}"] = fn(dt)
            except Exception:  # noqa: BLE001
                out[f"{name}-{dname}"] = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
