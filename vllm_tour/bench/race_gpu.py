"""The race: the reimpl mini engine against upstream vLLM on nano-vllm's recipe, on one GPU.

    python -m vllm_tour.bench.race_gpu [--num-seqs 256] [--sides SIDE,...] [--deadline-s 480]
                                       [--site /tmp/vllm-cuda] [--json $OUT/race.json]

Every side runs in its own subprocess (a clean GPU for each; a side that
hangs or crashes is reported, the others still run), one after the other, in
one invocation, and the ratios are printed from these runs only. Sides, in
the default order (the headline's four first, so a deadline cuts the others):

- upstream-fa-graphs / upstream-fa-eager: `race_upstream.py`, vLLM's `LLM` with
  `load_format="dummy"` and FLASH_ATTN -- upstream's default backend on Hopper
  (FlashAttention 3 there) -- with its default torch.compile + CUDA graphs, and
  with `enforce_eager=True`. Needs upstream on PYTHONPATH (`--site`, default
  /tmp/vllm-cuda as assembled from .gpu/cuda). Each upstream graphs side spends
  ~50-70 s starting (compile, capture) before its generate call.
- reimpl-graphs / reimpl-eager: `reimpl/fast_engine.py` -- the mini engine's
  own scheduler, KV-cache manager and block pool (the decisions) with a
  batched bf16 model runner, `reimpl/triton_attn.py` for attention, the fused
  Triton kernels of `reimpl/fused_ops.py` (add+RMSNorm, q/k-norm+RoPE+KV write,
  SiLU*mul, sampling), and (graphs) CUDA graphs for pure-decode steps. Random
  weights, seed 0. (`--count-kernels`: kernels of one decode forward, fused vs not.)
- upstream-triton-graphs / upstream-triton-eager: upstream with TRITON_ATTN.

The headline compares each reimpl side with the *fastest* upstream side of
the same mode (graphs or eager); every reimpl / upstream pair of a mode is
printed too. The JSON says when, on what (GPU, driver, torch, triton, vLLM),
with which command, which backend each side asked for and what upstream
reported it used.

Shapes (both sides): Qwen3-0.6B (vllm_tour/data/qwen3-0.6b-config.json: 28
layers, hidden 1024, 16 q / 8 kv heads, head 128, vocab 151936), bf16,
block size 16, max_model_len 4096, 256 sequences with prompt and output lengths
uniform in 100..1024 (random.seed(0)), temperature 0.6, ignore_eos:
133,966 output tokens. The reimpl uses upstream's defaults for this GPU class
(max_num_batched_tokens 16384, max_num_seqs 1024, prefix caching on, chunked
prefill on); upstream reports what it used.

Throughput = output tokens / wall time of the whole generate call on both
sides (the engine's start-up, weight init, graph capture and warm-up excluded).

What upstream (v0.21.0, graphs) does that the mini engine does not:
- piecewise CUDA graphs: upstream captures the model around attention for any
  batch, mixed prefill/decode steps included; the mini engine graphs pure-decode
  steps only (9 of the race's 1,032 steps run eager);
- torch.compile (Inductor) fuses what the mini engine fuses by hand
  (fused_ops.py), and more (e.g. the residual add into the matmul epilogue);
- a persistent batch (InputBatch / Model Runner V2's state slots): requests keep
  their rows and only changes travel to the GPU; the mini engine rebuilds the
  step's inputs with numpy and uploads them (overlapped by async scheduling);
- FlashAttention 3 on Hopper (TMA, warp specialisation) for attention, where the
  mini engine runs one Triton kernel for every batch shape;
- sampling: both draw by Gumbel-max; upstream (FlashInfer off) in torch ops over
  fp32 probabilities, the mini engine in one Triton pass over the bf16 logits.

Where the mini engine's time went, and what closed the gap (race_profile.py,
traces/results/20261201-h200-v0.21.0-race/):
- a decode step is ~80% attention, reading the KV cache at the copy ceiling
  (reimpl/triton_attn.py); with async scheduling the GPU waited for the host
  1 ms in a whole graphs race (`race_profile --gaps`; 99 ms in a race that
  also compiled kernels, below);
- but the first race in a process ran 1.4 s slower than a second one: Triton
  compiled kernel variants mid-run. It specialises a pointer on 16-byte
  alignment and an integer on divisibility by 16: the step's inputs were packed
  end to end into one upload (a part's alignment followed the sizes before it)
  and the sampler's per-step seed was specialised. Parts now start on 16 bytes
  and the seed is unspecialised: graphs 20,441 -> ~24,000 tok/s;
- eager, the host was the bottleneck: 13.7 ms to launch one decode forward
  (`race_profile --host`), ~23 us per Triton call spent in Triton's argument
  specialisation and kernel lookup, an allocation per output. Each kernel is now
  looked up once per forward (reimpl/triton_launch.py) and every layer writes
  into per-forward buffers: 2.9 ms, eager 10,639 -> ~20,700 tok/s. Upstream
  launches its eager elementwise kernels as C++ custom ops, its attention
  through Triton's or FlashAttention's Python entry per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_tour.bench.race_recipe import (
    EXPECTED_OUTPUT_TOKENS,
    MAX_MODEL_LEN,
    NUM_SEQS,
    TEMPERATURE,
    model_config,
    recipe,
)

REPO = Path(__file__).resolve().parents[2]



@dataclass(frozen=True)
class Side:
    name: str
    engine: str  # reimpl | upstream
    mode: str  # graphs | eager
    backend: str | None  # upstream's attention backend; None for the reimpl (reimpl/triton_attn.py)


SIDES = {s.name: s for s in (
    Side("upstream-fa-graphs", "upstream", "graphs", "FLASH_ATTN"),
    Side("reimpl-graphs", "reimpl", "graphs", None),
    Side("upstream-fa-eager", "upstream", "eager", "FLASH_ATTN"),
    Side("reimpl-eager", "reimpl", "eager", None),
    Side("upstream-triton-graphs", "upstream", "graphs", "TRITON_ATTN"),
    Side("upstream-triton-eager", "upstream", "eager", "TRITON_ATTN"),
)}
MIN_SIDE_S = 30.0  # a side is not started with less time than this before the deadline


# --------------------------------------------------------------------------
# reimpl side (runs in a subprocess: `race_gpu.py --run-reimpl eager|graphs`)
# --------------------------------------------------------------------------
def reimpl_kv_blocks(prompts: list[list[int]], max_tokens: list[int], block_size: int) -> int:
    """Enough blocks for every sequence at full length at once (+ null block + slack): no preemption,
    as upstream's ~100 GB pool on this GPU has none either."""
    need = sum(-(-(len(p) + m) // block_size) for p, m in zip(prompts, max_tokens))
    return need + 1 + 64


def build_reimpl(mode: str, n: int, async_scheduling: bool = True):
    """The warmed-up mini engine for the recipe and its requests: (engine, requests, init seconds)."""
    import torch

    from reimpl.config import EngineConfig, RequestIn
    from reimpl.fast_engine import FastEngine, FastQwen3, RunStats

    cfg = model_config()
    t0 = time.time()
    model = FastQwen3.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    prompts, max_tokens = recipe(n)
    block_size = 16
    fc = EngineConfig(block_size=block_size, num_blocks=reimpl_kv_blocks(prompts, max_tokens, block_size),
                      max_num_batched_tokens=16384, max_num_seqs=1024, max_model_len=MAX_MODEL_LEN,
                      enable_prefix_caching=True, cuda_graphs=(mode == "graphs"), async_scheduling=async_scheduling,
                      graph_batch_sizes=(1, 2, 4, 8, *range(16, min(n, 1024) + 16, 16)))
    eng = FastEngine(model, fc)
    eng.capture_graphs()
    # Warm-up: compile the prefill tilings (long and short chunks) and the decode path.
    eng.generate([RequestIn("warm-a", [1] * 700, 3), RequestIn("warm-c", [3] * 300, 3)])  # avg >= 256: 64-row tiles
    eng.generate([RequestIn("warm-b", [2] * 40, 3), RequestIn("warm-d", [4] * 30, 2)])  # short chunks: 16-row tiles
    capture_s = eng.stats.graph_capture_s
    eng.stats = RunStats(graph_capture_s=capture_s)
    reqs = [RequestIn(f"r{i}", p, m, TEMPERATURE) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    torch.cuda.synchronize()
    return eng, reqs, time.time() - t0


def run_reimpl(mode: str, n: int) -> dict:
    import torch

    eng, reqs, init_s = build_reimpl(mode, n)
    t = time.perf_counter()
    outs = eng.generate(reqs)
    dt = time.perf_counter() - t
    st, fc = eng.stats, eng.cfg
    tot = sum(len(v) for v in outs.values())
    return {"side": "reimpl", "mode": mode, "num_seqs": n, "output_tokens": tot, "seconds": round(dt, 3),
            "tok_per_s": round(tot / dt, 1), "init_s": round(init_s, 1), "torch": torch.__version__,
            "graph_capture_s": round(st.graph_capture_s, 2),
            "steps": st.steps, "decode_steps": st.decode_steps, "graph_steps": st.graph_steps,
            "host_s": round(st.host_s, 3), "preemptions": st.preemptions, "num_blocks": fc.num_blocks,
            "max_num_seqs": fc.max_num_seqs, "max_num_batched_tokens": fc.max_num_batched_tokens,
            "async_scheduling": fc.async_scheduling, "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}


def count_kernels(batch: int = 256, ctx: int = 600) -> dict:
    """GPU kernels launched by one eager decode forward (batch x 1 token, contexts of `ctx`), with the
    fused elementwise kernels (reimpl/fused_ops.py, the default on CUDA) and with plain torch ops.
    Counted with torch.profiler (CUDA activity); a CUDA graph replays the same kernels as graph nodes."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    from reimpl.fast_engine import FastQwen3, default_attn_fn

    cfg = model_config()
    bs = 16
    width = -(-ctx // bs)
    dev = torch.device("cuda")
    ids = torch.randint(0, cfg["vocab_size"], (batch,), device=dev)
    pos = torch.full((batch,), ctx - 1, device=dev, dtype=torch.int64)
    bt = (1 + torch.arange(batch * width, device=dev, dtype=torch.int32)).view(batch, width)
    slots = bt[:, -1].long() * bs + (ctx - 1) % bs
    cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    out = {"batch": batch, "ctx": ctx, "layers": cfg["num_hidden_layers"]}
    for fused in (False, True):
        m = FastQwen3.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0, fused=fused)
        caches = m.new_kv_caches(batch * width + 1, bs)
        attn = default_attn_fn(dev)
        args = (ids, pos, slots, bt, cu, seq_lens, 1, caches, attn)
        for _ in range(2):
            m.forward(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m.forward(*args)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t[0].record()
        for _ in range(10):
            m.forward(*args)
        t[1].record()
        torch.cuda.synchronize()
        key = "fused" if fused else "torch_ops"
        out[key] = {"kernels": len(names), "per_layer": round(len(names) / cfg["num_hidden_layers"], 1),
                    "eager_forward_ms": round(t[0].elapsed_time(t[1]) / 10, 3),
                    "top": collections.Counter(n[:70] for n in names).most_common(12)}
        del m, caches
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------
# the orchestrator
# --------------------------------------------------------------------------
def parse_race_line(text: str) -> dict | None:
    """The last `RACE {json}` line of a side's output."""
    found = None
    for line in text.splitlines():
        if line.startswith("RACE "):
            try:
                found = json.loads(line[5:])
            except ValueError:
                continue
    return found


def parse_sides(text: str) -> list[Side]:
    """'reimpl-graphs,upstream-fa-graphs' -> those sides, in the order given."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in SIDES]
    if unknown or not names:
        raise ValueError(f"unknown side(s) {unknown or names}; known: {', '.join(SIDES)}")
    return [SIDES[x] for x in dict.fromkeys(names)]


def side_command(side: Side, n: int) -> list[str]:
    if side.engine == "reimpl":
        return [sys.executable, "-m", "vllm_tour.bench.race_gpu", "--run-reimpl", side.mode, "--num-seqs", str(n)]
    return [sys.executable, "-m", "vllm_tour.bench.race_upstream", side.mode, "--backend", side.backend,
            "--num-seqs", str(n)]


def side_timeout(per_side_s: float, started: float, deadline_s: float | None, now: float) -> float:
    """Seconds the next side may take: its own limit, cut to what the deadline leaves; 0 = do not start it."""
    if deadline_s is None:
        return per_side_s
    left = deadline_s - (now - started)
    return min(per_side_s, left) if left >= MIN_SIDE_S else 0.0


def ratios(res: dict[str, dict]) -> dict[str, float]:
    """Every reimpl side over every upstream side of the same mode, from the sides that finished."""
    tps = {k: v["tok_per_s"] for k, v in res.items() if v and v.get("tok_per_s")}
    out = {}
    for a, ta in tps.items():
        for b, tb in tps.items():
            if SIDES[a].engine == "reimpl" and SIDES[b].engine == "upstream" and SIDES[a].mode == SIDES[b].mode:
                out[f"{a} / {b}"] = round(ta / tb, 3)
    return out


def headline(res: dict[str, dict]) -> dict[str, dict]:
    """Per mode: the reimpl side over the fastest upstream side of that mode (which one is named)."""
    tps = {k: v["tok_per_s"] for k, v in res.items() if v and v.get("tok_per_s")}
    out = {}
    for mode in ("graphs", "eager"):
        mine = tps.get(f"reimpl-{mode}")
        ups = {k: v for k, v in tps.items() if SIDES[k].engine == "upstream" and SIDES[k].mode == mode}
        if mine is None or not ups:
            continue
        fastest = max(ups, key=ups.get)
        out[mode] = {"reimpl": f"reimpl-{mode}", "fastest_upstream": fastest, "ratio": round(mine / ups[fastest], 3)}
    return out


def summary_lines(res: dict[str, dict], n: int) -> list[str]:
    lines = [f"{'side':24} {'backend':12} {'tok/s':>9} {'seconds':>8} {'out tokens':>10}  notes"]
    for name, r in res.items():
        backend = SIDES[name].backend or "reimpl"
        if "error" in r:
            lines.append(f"{name:24} {backend:12} {'-':>9} {'-':>8} {'-':>10}  FAILED: {r['error'][:160]}")
            continue
        note = ", ".join(f"{k}={r[k]}" for k in ("init_s", "graph_capture_s", "steps", "graph_steps", "host_s",
                                                "max_num_seqs", "max_num_batched_tokens") if k in r)
        lines.append(f"{name:24} {backend:12} {r['tok_per_s']:9.1f} {r['seconds']:8.2f} {r['output_tokens']:10d}  {note}")
    for mode, h in headline(res).items():
        lines.append(f"HEADLINE {mode}: {h['reimpl']} / fastest upstream ({h['fastest_upstream']}) = {h['ratio']:.3f}x")
    for k, v in ratios(res).items():
        lines.append(f"ratio {k}: {v:.3f}x")
    exp = EXPECTED_OUTPUT_TOKENS.get(n)
    bad = [s for s, r in res.items() if r and "output_tokens" in r and exp and r["output_tokens"] != exp]
    if bad:
        lines.append(f"WARNING: output tokens differ from the recipe's {exp}: {bad}")
    return lines


def machine() -> dict:
    """The GPU, its driver and the libraries on this side (each upstream side adds its vLLM version)."""
    info: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        import torch
        import triton

        info.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                    triton=triton.__version__)
    except Exception as e:  # noqa: BLE001 - the race still runs; the JSON says why this is missing
        info["gpu"] = f"unknown ({type(e).__name__}: {e})"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = q.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"not run ({type(e).__name__})"
    return info


def run_side(side: Side, n: int, env: dict, timeout: float) -> dict:
    cmd = side_command(side, n)
    print(f"--- {side.name} (limit {timeout:.0f} s): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        text = p.stdout + p.stderr
        r = parse_race_line(p.stdout)
        if r is None:
            tail = "\n".join(text.strip().splitlines()[-25:])
            r = {"error": f"exit {p.returncode}, no RACE line; tail:\n{tail}"}
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        r = {"error": f"timed out after {timeout:.0f} s"}
    r.update(backend_asked=side.backend, wall_s=round(time.time() - t0, 1))
    print("\n".join(l for l in text.splitlines() if l.startswith(("RACE", "init")) or "Error" in l)[-3000:], flush=True)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, run in this order; known: {', '.join(SIDES)}")
    ap.add_argument("--site", default=os.environ.get("SITE", "/tmp/vllm-cuda"), help="upstream vLLM install dir")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per side")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="all sides end by then; a side with less than MIN_SIDE_S left is skipped and reported")
    ap.add_argument("--json", help="write results here (default $OUT/race.json when $OUT is set); rewritten after each side")
    ap.add_argument("--run-reimpl", choices=("eager", "graphs"), help=argparse.SUPPRESS)
    ap.add_argument("--count-kernels", action="store_true",
                    help="only count the GPU kernels of one decode forward, fused vs torch ops (KERNELS json line)")
    a = ap.parse_args(argv)

    if a.count_kernels:
        r = count_kernels()
        print("KERNELS " + json.dumps(r), flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "kernels.json").write_text(json.dumps(r, indent=1))
        return 0

    if a.run_reimpl:
        print("RACE " + json.dumps(run_reimpl(a.run_reimpl, a.num_seqs)), flush=True)
        return 0

    try:
        sides = parse_sides(a.sides)
    except ValueError as e:
        ap.error(str(e))
    started = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (a.site, str(REPO), env.get("PYTHONPATH")) if p)
    info = machine()
    print(f"race on {info.get('gpu')}; {a.num_seqs} seqs; sides {[s.name for s in sides]}", flush=True)
    path = a.json or (os.path.join(os.environ["OUT"], "race.json") if os.environ.get("OUT") else None)
    res: dict[str, dict] = {}
    for side in sides:
        limit = side_timeout(a.timeout, started, a.deadline_s, time.time())
        if limit <= 0:
            res[side.name] = {"error": f"skipped: less than {MIN_SIDE_S:.0f} s left before the {a.deadline_s:.0f} s deadline",
                              "backend_asked": side.backend}
        else:
            res[side.name] = run_side(side, a.num_seqs, env, limit)
        print(f"--- {side.name}: {json.dumps(res[side.name])[:600]}", flush=True)
        lines = summary_lines(res, a.num_seqs)
        if path:  # after every side: a run cut short keeps what finished
            Path(path).write_text(json.dumps({
                **info, "command": "python -m vllm_tour.bench.race_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
                "num_seqs": a.num_seqs, "recipe": "nano-vllm bench: in/out lengths uniform 100..1024, random.seed(0), "
                f"temperature {TEMPERATURE}, ignore_eos; Qwen3-0.6B shapes, dummy weights, bf16",
                "throughput": "output tokens / wall time of the whole generate call",
                "sides": {s.name: {"engine": s.engine, "mode": s.mode, "backend": s.backend or "reimpl/triton_attn.py"}
                          for s in sides},
                "results": res, "headline": headline(res), "ratios": ratios(res), "summary": lines}, indent=1))
    print("\n".join(summary_lines(res, a.num_seqs)), flush=True)
    return 0 if all("error" not in r for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
