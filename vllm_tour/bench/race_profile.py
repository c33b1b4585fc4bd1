"""Where the mini engine's race time goes, on one GPU (no upstream needed).

    python -m vllm_tour.bench.race_profile [--mode graphs|eager] [--num-seqs 256] [--vllm-src .gpu/vllm_src.tar.xz]

1. The race of `race_gpu.py` (same recipe, same engine), every step split
   into phases: schedule (+ arrivals), prepare (numpy inputs), launch (the
   forward's kernels queued or the graph replayed), gpu (waiting for the
   forward to finish after launching), sample (logits, sampling, tokens to
   the host), update (scheduler bookkeeping). A synchronize after the forward
   makes `gpu` measurable; the engine syncs once per step anyway (tokens to
   the host), so the total moves little. Reported per batch-size bucket.
2. GPU time of one decode forward (graph replay) at batch x context shapes
   the race passes through, and of the attention kernel alone at those shapes,
   with upstream's Triton kernel beside it when `--vllm-src` is given.
3. The CUDA kernels of one eager decode forward, by total time (torch.profiler).
4. (`--gaps`) The race as it really runs (async scheduling, no extra sync):
   a CUDA event before and after each step's device work gives the time the
   GPU waited for the host between steps, per bucket; the whole-run GPU idle
   share is what overlapping host and device still leaves on the table.
5. (`--host`) The host's cost of launching one eager decode forward: wall
   time per forward when the GPU keeps up, and cProfile's top functions.

Prints `PROFILE {json}`; writes $OUT/race_profile.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time
from pathlib import Path

from vllm_tour.bench.race_gpu import build_reimpl

# (batch, context) points on the race's path: the batch shrinks from 256 as outputs finish, contexts grow.
SHAPES = ((256, 700), (192, 900), (128, 1100), (64, 1300), (32, 1450), (16, 1500), (4, 1550))
BUCKETS = ((1, 16), (17, 64), (65, 128), (129, 256), (257, 1 << 30))


def _bucket(n: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= n <= hi:
            return f"{lo}-{hi}" if hi < 1 << 30 else f">{lo - 1}"
    return "?"


def phase_profile(eng, reqs) -> dict:
    """Run the race with every phase of every step timed (perf_counter, one extra sync after the forward)."""
    import torch

    times: dict[str, float] = {}
    rows: list[dict] = []

    def add(name: str, seconds: float) -> None:
        times[name] = times.get(name, 0.0) + seconds

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            add(name, time.perf_counter() - t)
            return r
        return wrapper

    def launched_then_waited(fn):
        """`launch`: queueing the forward's kernels; `gpu`: waiting for them to finish."""
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            add("launch", time.perf_counter() - t)
            t = time.perf_counter()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            add("gpu", time.perf_counter() - t)
            return r
        return wrapper

    sched = eng.scheduler
    sched.schedule = timed("schedule", sched.schedule)
    sched.update_from_output = timed("update", sched.update_from_output)
    eng.prepare = timed("prepare", eng.prepare)
    eng.model.forward = launched_then_waited(eng.model.forward)
    eng._replay = launched_then_waited(eng._replay)
    orig_launch, orig_collect = eng.launch, eng.collect

    def launch(out):  # what launch spends beyond prepare/forward is sampling (+ the uploads)
        before = dict(times)
        t = time.perf_counter()
        r = orig_launch(out)
        total = time.perf_counter() - t
        inner = sum(times.get(k, 0.0) - before.get(k, 0.0) for k in ("prepare", "launch", "gpu"))
        add("sample", total - inner)
        return r

    eng.launch = launch
    eng.collect = timed("sample", orig_collect)
    step_start = [time.perf_counter()]

    def on_step(out, sampled):
        now = time.perf_counter()
        rows.append({"n": len(out.scheduled), "decode": all(s.num_tokens == 1 for s in out.scheduled),
                     "step": (now - step_start[0]) * 1e3, **{k: v * 1e3 for k, v in times.items()}})
        times.clear()
        step_start[0] = time.perf_counter()

    t0 = time.perf_counter()
    outs = eng.generate(reqs, on_step=on_step)
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in outs.values())
    agg: dict[str, dict] = {}
    for r in rows:
        key = ("decode " + _bucket(r["n"])) if r["decode"] else "prefill/mixed"
        a = agg.setdefault(key, collections.defaultdict(float))
        a["steps"] += 1
        for k, v in r.items():
            if k not in ("n", "decode"):
                a[k] += v
    table = {k: {"steps": int(v["steps"]), "total_s": round(v["step"] / 1e3, 3),
                 **{f"{p}_ms": round(v[p] / v["steps"], 3) for p in
                    ("step", "schedule", "prepare", "launch", "gpu", "sample", "update") if p in v}}
             for k, v in sorted(agg.items())}
    return {"wall_s": round(wall, 3), "tokens": tokens, "tok_per_s": round(tokens / wall, 1), "buckets": table}


def gpu_gaps(eng, reqs) -> dict:
    """The async race with an event recorded on the stream before and after each step's device work.
    An event is reached when the stream gets to it: `end(t) -> start(t+1)` is the time the GPU had
    nothing queued (it waited for the host), `start(t) -> end(t)` the step's device time."""
    import torch

    marks: list[tuple[int, bool, object, object]] = []
    orig_launch, orig_upload = eng.launch, eng._upload
    start = []

    def upload(**arrays):  # a step's first device work: the start event goes right before it
        a = torch.cuda.Event(enable_timing=True)
        a.record()
        start.append(a)
        return orig_upload(**arrays)

    def launch(out):
        start.clear()
        r = orig_launch(out)
        b = torch.cuda.Event(enable_timing=True)
        b.record()
        marks.append((len(out.scheduled), all(s.num_tokens == 1 for s in out.scheduled), start[0], b))
        return r

    eng.launch, eng._upload = launch, upload
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    wall = time.perf_counter() - t0
    eng.launch, eng._upload = orig_launch, orig_upload
    torch.cuda.synchronize()
    agg: dict[str, dict] = {}
    for i, (n, decode, a, b) in enumerate(marks):
        key = ("decode " + _bucket(n)) if decode else "prefill/mixed"
        g = agg.setdefault(key, {"steps": 0, "busy_ms": 0.0, "idle_before_ms": 0.0})
        g["steps"] += 1
        g["busy_ms"] += a.elapsed_time(b)
        if i:
            g["idle_before_ms"] += marks[i - 1][3].elapsed_time(a)
    busy = sum(g["busy_ms"] for g in agg.values()) / 1e3
    idle = sum(g["idle_before_ms"] for g in agg.values()) / 1e3
    tokens = sum(len(v) for v in outs.values())
    return {"wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1), "gpu_busy_s": round(busy, 3),
            "gpu_idle_between_steps_s": round(idle, 3),
            "buckets": {k: {"steps": g["steps"], "busy_ms_per_step": round(g["busy_ms"] / g["steps"], 3),
                            "idle_ms_per_step": round(g["idle_before_ms"] / g["steps"], 3)}
                        for k, g in sorted(agg.items())}}


def host_cost(eng, batch: int = 256, ctx: int = 900) -> dict:
    """Host time of one eager decode forward's launches: at batch 1 (the GPU keeps up, so the wall time
    per forward is the host's) and, by cProfile, where it goes at `batch`."""
    import cProfile
    import pstats

    import torch

    res = {}
    for b in (1, batch):
        ids, pos, slots, bt, cu, seq_lens, _ = _decode_inputs(eng, b, ctx)
        d = eng._upload(ids=ids, pos=pos, slots=slots, bt=bt, cu=cu, seq_lens=seq_lens)
        args = (d["ids"], d["pos"], d["slots"], d["bt"], d["cu"], d["seq_lens"], 1, eng.caches, eng.attn_fn)
        eng.model.forward(*args)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            eng.model.forward(*args)
        host = (time.perf_counter() - t) / 20
        torch.cuda.synchronize()
        res[f"batch_{b}_host_ms_per_forward"] = round(host * 1e3, 3)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        eng.model.forward(*args)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]  # by own time
    res["top_own_time"] = [{"fn": f"{k[0].rsplit('/', 2)[-1]}:{k[1]}:{k[2]}", "calls_per_forward": v[1] / 5,
                            "own_us_per_forward": round(v[2] / 5 * 1e6, 1), "cum_us_per_forward": round(v[3] / 5 * 1e6, 1)}
                           for k, v in top]
    return res


def _decode_inputs(eng, batch: int, ctx: int):
    """Decode inputs for `batch` sequences of `ctx` tokens over distinct blocks of the engine's cache."""
    import numpy as np

    bs = eng.cfg.block_size
    width = math.ceil(ctx / bs)
    rng = np.random.default_rng(0)
    blocks = 1 + rng.permutation(eng.cfg.num_blocks - 1)[: batch * width].astype(np.int32)
    bt = blocks.reshape(batch, width)
    pos = np.full(batch, ctx - 1, np.int64)
    slots = bt[:, -1].astype(np.int64) * bs + (ctx - 1) % bs
    ids = rng.integers(0, 10000, batch).astype(np.int64)
    seq_lens = np.full(batch, ctx, np.int32)
    cu = np.arange(batch + 1, dtype=np.int32)
    return ids, pos, slots, bt, cu, seq_lens, width


def _cuda_ms(fn, reps: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def shape_profile(eng, upstream_attn=None) -> list[dict]:
    """GPU time of a decode forward (graph replay when captured) and of one attention call, per shape."""
    import torch

    from reimpl.triton_attn import paged_attention

    rows = []
    kc, vc = eng.caches[0]
    nh, hd = eng.model.num_heads, eng.model.head_dim
    for batch, ctx in SHAPES:
        ids, pos, slots, bt, cu, seq_lens, width = _decode_inputs(eng, batch, ctx)
        d = eng._upload(ids=ids, pos=pos, slots=slots, bt=bt, cu=cu, seq_lens=seq_lens)
        g = eng._graph_size(batch) if eng.graphs else None
        if g is not None:
            fwd = lambda: eng._replay(g, d, batch, width)  # noqa: E731
        else:
            fwd = lambda: eng.model.forward(d["ids"], d["pos"], d["slots"], d["bt"], d["cu"], d["seq_lens"], 1,  # noqa: E731
                                            eng.caches, eng.attn_fn)
        q = torch.randn(batch, nh, hd, device="cuda", dtype=kc.dtype)
        out = torch.empty_like(q)
        attn = lambda: paged_attention(q, kc, vc, d["bt"], d["cu"], d["seq_lens"], max_seqlen_q=1, out=out)  # noqa: E731
        kv_bytes = 2 * batch * ctx * eng.model.num_kv_heads * hd * kc.element_size()
        row = {"batch": batch, "ctx": ctx, "forward_ms": round(_cuda_ms(fwd), 4), "graph": g is not None,
               "attn_ms": round(_cuda_ms(attn, 50), 4)}
        row["attn_TBps"] = round(kv_bytes / row["attn_ms"] / 1e9, 2)
        row["attn_all_layers_ms"] = round(row["attn_ms"] * eng.model.num_layers, 3)
        if upstream_attn is not None:
            out_up = torch.empty_like(q)
            up = lambda: upstream_attn(q=q, k=kc, v=vc, out=out_up, cu_seqlens_q=d["cu"], max_seqlen_q=1,  # noqa: E731
                                       seqused_k=d["seq_lens"], max_seqlen_k=ctx, softmax_scale=hd ** -0.5,
                                       causal=True, window_size=(-1, -1), block_table=d["bt"], softcap=0,
                                       q_descale=None, k_descale=None, v_descale=None)
            row["upstream_attn_ms"] = round(_cuda_ms(up, 50), 4)
            row["upstream_attn_TBps"] = round(kv_bytes / row["upstream_attn_ms"] / 1e9, 2)
            row["max_abs_vs_upstream"] = float((out.float() - out_up.float()).abs().max())
        rows.append(row)
        print("SHAPE " + json.dumps(row), flush=True)
    return rows


def kernel_profile(eng, batch: int = 256, ctx: int = 900) -> list[dict]:
    """The CUDA kernels of one eager decode forward, by total time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids, pos, slots, bt, cu, seq_lens, _ = _decode_inputs(eng, batch, ctx)
    d = eng._upload(ids=ids, pos=pos, slots=slots, bt=bt, cu=cu, seq_lens=seq_lens)
    args = (d["ids"], d["pos"], d["slots"], d["bt"], d["cu"], d["seq_lens"], 1, eng.caches, eng.attn_fn)
    eng.model.forward(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.model.forward(*args)
        torch.cuda.synchronize()
    per: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = per.setdefault(e.name[:90], [0, 0.0])
            a[0] += 1
            a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = [{"kernel": k, "calls_per_forward": c / 3, "us_per_forward": round(t / 3, 1)} for k, (c, t) in per.items()]
    rows.sort(key=lambda r: -r["us_per_forward"])
    return rows[:20]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("graphs", "eager"), default="graphs")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--vllm-src", help="tar.xz of upstream vLLM's Python sources: time its attention kernel too")
    ap.add_argument("--skip-race", action="store_true")
    ap.add_argument("--gaps", action="store_true", help="only the async race with the GPU's idle time between steps")
    ap.add_argument("--host", action="store_true", help="only the host's cost of launching an eager forward")
    a = ap.parse_args(argv)
    if a.gaps or a.host:
        eng, reqs, init_s = build_reimpl(a.mode, a.num_seqs)
        res = {"mode": a.mode, "num_seqs": a.num_seqs, "init_s": round(init_s, 1)}
        if a.gaps:
            res["gaps"] = gpu_gaps(eng, reqs)
        if a.host:
            res["host"] = host_cost(eng)
        print("PROFILE " + json.dumps(res), flush=True)
        if os.environ.get("OUT"):
            name = "_".join(k for k in ("gaps", "host") if getattr(a, k))
            Path(os.environ["OUT"], f"race_profile_{a.mode}_{name}.json").write_text(json.dumps(res, indent=1))
        return 0
    upstream_attn = None
    if a.vllm_src:
        from vllm_tour.bench.triton_attn_gpu import load_upstream

        upstream_attn = load_upstream(a.vllm_src)
    eng, reqs, init_s = build_reimpl(a.mode, a.num_seqs, async_scheduling=False)
    res = {"mode": a.mode, "num_seqs": a.num_seqs, "init_s": round(init_s, 1)}
    if not a.skip_race:
        res["race"] = phase_profile(eng, reqs)
        print("PHASES " + json.dumps(res["race"]), flush=True)
    res["shapes"] = shape_profile(eng, upstream_attn)
    res["kernels"] = kernel_profile(eng)
    print("PROFILE " + json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"race_profile_{a.mode}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
